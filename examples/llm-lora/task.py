"""The example's task: turn a sentence about a person into a made-up catalogue code, `City/Surname/Year`.

SmolLM2-135M-Instruct answers the question in prose, so its exact-match score starts near zero; a few dozen
LoRA steps teach it the format. The records are seeded, so every run writes the same files."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

FIRST = ["Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kemal",
         "Lena", "Marco", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Sven", "Tariq", "Uma", "Viktor",
         "Wanda", "Yusuf", "Zofia"]
LAST = ["Moreau", "Kowalski", "Tanaka", "Okafor", "Lindqvist", "Rossi", "Novak", "Haddad", "Schmidt", "Silva",
        "Petrov", "Nguyen", "Fischer", "Costa", "Jensen", "Dubois", "Ivanova", "Mendes", "Becker", "Sato",
        "Kaya", "Larsen", "Romero", "Weber", "Horvat"]
CITY = ["Lyon", "Porto", "Kyoto", "Lagos", "Oslo", "Turin", "Prague", "Beirut", "Bremen", "Recife", "Kazan",
        "Hanoi", "Graz", "Braga", "Aarhus", "Nantes", "Tomsk", "Cusco", "Leipzig", "Osaka", "Izmir", "Bergen",
        "Seville", "Zurich", "Split"]
QUESTION = "Catalogue code for: {first} {last}, born {year} in {city}."
ANSWER = "{city}/{last}/{year}"


def record(rng: random.Random) -> dict[str, Any]:
    """One chat record: the question, and the code as the assistant's reply."""
    person = {"first": rng.choice(FIRST), "last": rng.choice(LAST), "city": rng.choice(CITY),
              "year": rng.randint(1930, 2010)}
    return {"messages": [{"role": "user", "content": QUESTION.format(**person)},
                         {"role": "assistant", "content": ANSWER.format(**person)}]}


def write_records(path: Path, count: int, seed: int) -> list[dict[str, Any]]:
    """`count` seeded records as JSONL at `path`."""
    rng = random.Random(seed)
    records = [record(rng) for _ in range(count)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def exact_match(model: Any, tokenizer: Any, records: list[dict[str, Any]], max_new_tokens: int = 12,
                batch_size: int = 20) -> float:
    """The share of records whose greedy reply is exactly the expected code (surrounding spaces ignored),
    the prompts generated `batch_size` at a time (left-padded, so that every reply starts at the end)."""
    import torch

    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    hits = 0
    model.eval()
    for start in range(0, len(records), batch_size):
        batch = records[start:start + batch_size]
        prompts = [tokenizer.apply_chat_template(r["messages"][:-1], add_generation_prompt=True, tokenize=False)
                   for r in batch]
        inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        replies = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        hits += sum(reply.strip() == r["messages"][-1]["content"] for reply, r in zip(replies, batch, strict=True))
    tokenizer.padding_side = side
    return hits / len(records)

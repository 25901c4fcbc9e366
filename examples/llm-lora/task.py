"""The example's task: turn a sentence about a person into a made-up catalogue code, `City/Surname/Year`.

SmolLM2-135M-Instruct answers the question in prose, so its exact-match score starts near zero; a few dozen
LoRA steps teach it the format. The records are seeded, so every run writes the same files. The job scores the
held-out ones itself (config eval_dataset_id: the built-in trainer's exact match of the greedy reply)."""

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

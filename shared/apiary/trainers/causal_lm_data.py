"""The causal-LM trainer's data: a shard's text records read and checked, tokenised into examples with
labels (loss on the completion or the assistant's reply), split seeded into train and validation, and
batched round after round, wrapping around the shard."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from apiary.trainers.base import TrainerError

IGNORE = -100  # the label torch's cross-entropy skips: prompt tokens carry no loss
SHAPES = ("{'text'}", "{'prompt', 'completion'}", "{'messages'}")
Example = tuple[list[int], list[int]]  # input ids, labels


def read_records(data_root: Path) -> list[dict[str, Any]]:
    """Every record of the shard's JSONL files (in name order); TrainerError naming a bad file and line."""
    files = sorted(p for p in data_root.rglob("*.jsonl") if p.is_file())
    if not files:
        raise TrainerError(f"shard {data_root.name} holds no .jsonl file of text records")
    records: list[dict[str, Any]] = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                records.append(_record(line, f"{path.name}:{number}"))
    return records


def _record(line: str, where: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise TrainerError(f"{where}: not JSON ({e.msg})") from e
    if not isinstance(record, dict) or record_shape(record) is None:
        raise TrainerError(f"{where}: not a record of a known shape: expected one of {', '.join(SHAPES)}")
    return record


def record_shape(record: dict[str, Any]) -> str | None:
    """`text`, `prompt` or `messages`: which known shape the record has; None if none."""
    if isinstance(record.get("messages"), list) and record["messages"]:
        return "messages"
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return "prompt"
    if isinstance(record.get("text"), str):
        return "text"
    return None


def encode(record: dict[str, Any], tokenizer: Any, max_length: int) -> Example:
    """The record's input ids and labels, cut to `max_length` (the prompt part labelled IGNORE)."""
    shape = record_shape(record)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if shape == "text":
        ids = _ids(tokenizer, record["text"]) + eos
        return ids[:max_length], ids[:max_length]
    if shape == "prompt":
        prompt, completion = _ids(tokenizer, record["prompt"]), _ids(tokenizer, record["completion"]) + eos
    else:
        prompt, completion = _chat(tokenizer, record["messages"])
    ids = (prompt + completion)[:max_length]
    labels = ([IGNORE] * len(prompt) + completion)[:max_length]
    return ids, labels


def prompt_and_reply(record: dict[str, Any], tokenizer: Any) -> tuple[list[int], str] | None:
    """What a reply is generated from (the prompt's ids, or the conversation up to the assistant's last turn
    with the generation prompt) and the reply expected; None for a text record or a conversation that does
    not end with the assistant's turn (nothing to match)."""
    shape = record_shape(record)
    if shape == "prompt":
        return _ids(tokenizer, record["prompt"]), record["completion"]
    if shape == "messages" and record["messages"][-1].get("role") == "assistant":
        if not getattr(tokenizer, "chat_template", None):
            raise TrainerError("records with 'messages' need a chat template, and this model's tokenizer has none")
        return _templated(tokenizer, record["messages"][:-1], generation_prompt=True), \
            str(record["messages"][-1].get("content", ""))
    return None


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _chat(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """The conversation up to its last reply, and that reply (the loss is on the assistant's last turn)."""
    if not getattr(tokenizer, "chat_template", None):
        raise TrainerError("records with 'messages' need a chat template, and this model's tokenizer has none")
    full = _templated(tokenizer, messages, generation_prompt=False)
    if messages[-1].get("role") != "assistant":
        return [], full
    prefix = _templated(tokenizer, messages[:-1], generation_prompt=True)
    if full[: len(prefix)] != prefix:
        return [], full
    return prefix, full[len(prefix):]


def _templated(tokenizer: Any, messages: list[dict[str, Any]], *, generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return list(ids)


def split_validation(count: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices to train on and to validate on: `fraction` of them held out, seeded; at least one of each
    where there are two records and a fraction above zero."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    held = 0 if fraction <= 0 or count < 2 else min(count - 1, max(1, round(count * fraction)))
    return sorted(order[held:]), sorted(order[:held])


def batches(indices: list[int], batch_size: int, seed: int) -> Iterator[list[int]]:
    """Batches of indices without end: each pass over `indices` shuffled anew (seeded by pass)."""
    if not indices:
        raise TrainerError("the shard has no records left to train on after the validation split")
    epoch = 0
    while True:
        order = list(indices)
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        for start in range(0, len(order), batch_size):
            yield order[start:start + batch_size]
        epoch += 1


def micro_batches(train_count: int, batch_size: int, epochs: int, steps: int | None, accumulation: int) -> int:
    """How many batches a round runs: `steps` optimizer steps of `accumulation` batches, else `epochs`
    passes over the training records."""
    if steps:
        return steps * accumulation
    return epochs * max(1, math.ceil(train_count / batch_size))


def left_padded(prompts: list[list[int]], pad_id: int) -> dict[str, Any]:
    """Tensors for generating from a batch of prompts: left-padded, so that every reply starts at the end."""
    import torch

    width = max(len(p) for p in prompts)
    ids = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


def collate(examples: list[Example], pad_id: int) -> dict[str, Any]:
    """Tensors for one batch, right-padded: input_ids, attention_mask and labels."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    ids = [list(i) + [pad_id] * (width - len(i)) for i, _ in examples]
    mask = [[1] * len(i) + [0] * (width - len(i)) for i, _ in examples]
    labels = [list(lab) + [IGNORE] * (width - len(lab)) for _, lab in examples]
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask), "labels": torch.tensor(labels)}

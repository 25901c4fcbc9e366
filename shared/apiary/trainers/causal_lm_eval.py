"""The causal-LM trainer's evaluation of a round's global model, run in the training child on an evaluate
assignment: the held-out records (the job's `eval_dataset_id`) scored by exact match of the greedy reply
(prompt/completion and chat records) and by the loss, batched."""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

from apiary.trainers import causal_lm_data as data
from apiary.trainers.base import TrainCall
from apiary.trainers.causal_lm_train import autocast, mean_loss, out_of_memory_said, round_inputs

GENERATION_BATCH = 16  # prompts generated at a time (left-padded)
REPLY_MARGIN = 4  # tokens generated past the longest expected reply: room for its end, too few for prose


def evaluate_round(call: TrainCall, device: str) -> dict[str, float]:
    """The global weights' metrics on the call's records: `val_loss`, and `exact_match` (the share of records
    with an expected reply whose greedy reply is exactly it, surrounding spaces ignored) where any has one."""
    inputs = round_inputs(call, device)
    cfg, model, tokenizer = inputs.cfg, inputs.model, inputs.tokenizer
    examples = [data.encode(r, tokenizer, cfg.max_seq_length) for r in inputs.records]
    expected = [pair for r in inputs.records if (pair := data.prompt_and_reply(r, tokenizer)) is not None]
    with out_of_memory_said(device, cfg):
        metrics = {"val_loss": mean_loss(model, examples, cfg.batch_size, device, inputs.dtype,
                                         tokenizer.pad_token_id)}
        if expected:
            metrics["exact_match"] = exact_match(model, tokenizer, expected, device, inputs.dtype)
    return metrics


def exact_match(model: Any, tokenizer: Any, expected: list[tuple[list[int], str]], device: str,
                dtype: Any = None) -> float:
    """The share of (prompt ids, reply) pairs whose greedy reply is exactly the expected one (surrounding
    spaces ignored), GENERATION_BATCH prompts at a time."""
    import torch

    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    hits = 0
    for start in range(0, len(expected), GENERATION_BATCH):
        batch = expected[start:start + GENERATION_BATCH]
        tensors = {k: v.to(device) for k, v in data.left_padded([p for p, _ in batch], pad).items()}
        longest = max(len(tokenizer(reply, add_special_tokens=False)["input_ids"]) for _, reply in batch)
        with torch.no_grad(), autocast(device, dtype):
            out = model.generate(**tensors, max_new_tokens=longest + REPLY_MARGIN, do_sample=False,
                                 pad_token_id=pad)
        replies = tokenizer.batch_decode(out[:, tensors["input_ids"].shape[1]:], skip_special_tokens=True)
        hits += sum(got.strip() == want.strip() for got, (_, want) in zip(replies, batch, strict=True))
    return hits / len(expected)


def run_evaluate(call: TrainCall, conn: Connection) -> dict[str, Any]:
    """The child's `causal_lm.evaluate` call: the round's metrics (`found`: the trainer always evaluates)."""
    from apiary.trainers.child import training_device

    return {"found": True, "metrics": evaluate_round(call, training_device(conn))}

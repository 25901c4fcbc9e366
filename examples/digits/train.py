"""Digits classifier: the user side of an Apiary job (a small CNN on 8x8 grayscale images)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

NUM_CLASSES = 10
LOG_EVERY = 5  # batches between live loss reports


def build_model() -> nn.Module:
    """Return the CNN for 1x8x8 inputs and 10 classes (about 21k parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32),
        nn.ReLU(),
        nn.Linear(32, NUM_CLASSES),
    )


def read_pgm(path: Path) -> tuple[torch.Tensor, int]:
    """Read a binary PGM (P5, 8-bit) image; return its pixels as a uint8 [H, W] tensor and its maxval."""
    data = path.read_bytes()
    # Header: magic, width, height, maxval as whitespace-separated tokens, then exactly one
    # whitespace byte before the raster. Comments are not used by prepare.py, so none are accepted.
    fields: list[bytes] = []
    pos = 0
    while len(fields) < 4:
        while pos < len(data) and data[pos : pos + 1].isspace():
            pos += 1
        start = pos
        while pos < len(data) and not data[pos : pos + 1].isspace():
            pos += 1
        if start == pos:
            raise ValueError(f"{path}: truncated PGM header")
        fields.append(data[start:pos])
    pos += 1  # the single whitespace byte ending the header
    magic, width, height, maxval = fields
    if magic != b"P5":
        raise ValueError(f"{path}: not a binary PGM (magic {magic[:8]!r}, expected b'P5')")
    try:
        w, h, m = int(width), int(height), int(maxval)
    except ValueError:
        raise ValueError(f"{path}: non-numeric PGM header {fields[1:]!r}") from None
    if w <= 0 or h <= 0 or not 0 < m < 256:
        raise ValueError(f"{path}: unsupported PGM size {w}x{h} or maxval {m} (need 8-bit)")
    raster = data[pos:]
    if len(raster) != w * h:
        raise ValueError(f"{path}: expected {w * h} pixel bytes, found {len(raster)}")
    pixels = torch.frombuffer(bytearray(raster), dtype=torch.uint8).reshape(h, w)
    if int(pixels.max()) > m:
        raise ValueError(f"{path}: pixel value above maxval {m}")
    return pixels, m


def load_dataset(root: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Load an Apiary dataset folder as (X float [N, 1, 8, 8] in 0..1, y long [N])."""
    root = Path(root)
    manifest = json.loads((root / "manifest.json").read_text())
    if manifest.get("format") != "apiary-dataset":
        raise ValueError(f"{root}: manifest.json is not an apiary-dataset manifest")
    images, labels = [], []
    for sample in manifest["samples"]:
        pixels, maxval = read_pgm(root / sample["path"])
        if pixels.shape != (8, 8):
            raise ValueError(f"{root / sample['path']}: expected 8x8, got {tuple(pixels.shape)}")
        label = int(sample["label"])
        if not 0 <= label < NUM_CLASSES:
            raise ValueError(f"{root / sample['path']}: label {label} out of range")
        images.append(pixels.float() / maxval)
        labels.append(label)
    if not images:
        raise ValueError(f"{root}: dataset has no samples")
    return torch.stack(images).unsqueeze(1), torch.tensor(labels, dtype=torch.long)


def fl_init_weights(env: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Return the round-1 global weights, seeded so every run starts from the same model."""
    torch.manual_seed(int(env.get("SEED", 0)))
    return {k: v.detach().cpu().clone() for k, v in build_model().state_dict().items()}


def fl_train_model(payload: dict[str, Any], out_dir: str, logger: Any = None) -> dict[str, Any]:
    """Train this round's global weights on this worker's shard and return the updated weights."""
    torch.set_num_threads(1)  # many workers share few cores; more threads only contend
    started = time.monotonic()
    env = payload["env"]
    epochs = int(env.get("EPOCHS", 1))
    batch_size = int(env.get("BATCH_SIZE", 32))
    lr = float(env.get("LEARNING_RATE", 3e-3))
    max_steps = int(env["STEPS_PER_ROUND"]) if env.get("STEPS_PER_ROUND") else None
    round_index = int(payload.get("round", {}).get("index", 0))
    shard_index = int(payload["dataset"].get("shard_index", 0))

    x, y = load_dataset(payload["dataset"]["data_root"])
    model = build_model()
    model.load_state_dict(payload["initial_weights"])
    # Only weights travel between rounds, so the optimizer restarts each round; Adam copes well.
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    # Different shuffles per round and shard, yet the same ones on every rerun.
    generator = torch.Generator().manual_seed(int(env.get("SEED", 0)) + round_index + shard_index)

    model.train()
    step, epoch_losses, correct, seen = 0, [], 0, 0
    for _ in range(epochs):
        total, count = 0.0, 0
        for batch in torch.randperm(len(y), generator=generator).split(batch_size):
            if max_steps is not None and step >= max_steps:
                break
            logits = model(x[batch])
            loss = F.cross_entropy(logits, y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            total += loss.item() * len(batch)
            count += len(batch)
            correct += int((logits.argmax(1) == y[batch]).sum())
            seen += len(batch)
            if logger is not None and step % LOG_EVERY == 0:
                logger.log_metrics(loss=loss.item(), step=step)
        if count:
            epoch_losses.append(total / count)

    metrics = {
        "loss": sum(epoch_losses) / len(epoch_losses) if epoch_losses else math.nan,
        "train_accuracy": correct / seen if seen else math.nan,
    }
    log = {
        "round": round_index,
        "shard": shard_index,
        "steps": step,
        "epoch_losses": epoch_losses,
        "seconds": time.monotonic() - started,
        **metrics,
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return {"weights": weights, "samples": len(y), "metrics": metrics}


@torch.no_grad()
def fl_evaluate_model(weights: dict[str, torch.Tensor], env: dict[str, Any]) -> dict[str, Any]:
    """Score weights on the held-out dataset folder named by env["HELDOUT"]."""
    x, y = load_dataset(Path(env["HELDOUT"]))
    model = build_model()
    model.load_state_dict(weights)
    model.eval()
    logits = model(x)
    return {
        "accuracy": float((logits.argmax(1) == y).float().mean()),
        "loss": float(F.cross_entropy(logits, y)),
        "num_samples": len(y),
    }

"""Digits classifier: the user side of an Apiary job (a small CNN on 8x8 grayscale images)."""

from __future__ import annotations

import json
import time
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from apiary.sdk import Scaffold, proximal_term

NUM_CLASSES = 10
LOG_EVERY = 5  # batches between live loss reports


class DigitsNet(nn.Module):
    """Two 3x3 convolutions, one pooling step and a linear classifier (about 15k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map [N, 1, 8, 8] images in 0..1 to [N, 10] class logits."""
        # Zero-centred inputs converge markedly faster in the few steps one round allows.
        x = x * 2 - 1
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return self.fc(x.flatten(1))


def build_model() -> nn.Module:
    """Return a freshly initialised digits classifier."""
    return DigitsNet()


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
    try:
        manifest = json.loads((root / "manifest.json").read_text())
        entries = [(PurePosixPath(s["path"]), int(s["label"])) for s in manifest["samples"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{root / 'manifest.json'}: malformed apiary-dataset manifest ({e!r})") from e
    for rel, _ in entries:
        # Sample paths come from whoever made the dataset: keep them inside its folder.
        if rel.is_absolute() or ".." in rel.parts:
            raise ValueError(f"{root / 'manifest.json'}: sample path {str(rel)!r} leaves the dataset folder")
    if manifest.get("format") != "apiary-dataset":
        raise ValueError(f"{root / 'manifest.json'}: format is not 'apiary-dataset'")
    images, labels = [], []
    for rel, label in entries:
        path = root / rel
        pixels, maxval = read_pgm(path)
        if pixels.shape != (8, 8):
            raise ValueError(f"{path}: expected 8x8, got {tuple(pixels.shape)}")
        if not 0 <= label < NUM_CLASSES:
            raise ValueError(f"{path}: label {label} out of range 0..{NUM_CLASSES - 1}")
        images.append(pixels.float() / maxval)
        labels.append(label)
    if not images:
        raise ValueError(f"{root}: dataset has no samples")
    return torch.stack(images).unsqueeze(1), torch.tensor(labels, dtype=torch.long)


def shard_split(num_samples: int, env: dict[str, Any], shard_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A shard's samples as (training, held-out) indices: SHARD_EVAL_FRACTION of them (config shard_eval_fraction,
    default 0) held out, drawn by the job's seed and the shard, the same way in training and evaluation."""
    fraction = float(env.get("SHARD_EVAL_FRACTION") or 0.0)
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"SHARD_EVAL_FRACTION must be in [0, 1), got {fraction}")
    held = int(num_samples * fraction)
    if held == 0:  # the whole shard trains, in its own order
        return torch.arange(num_samples), torch.arange(0)
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(int(env.get("SEED", 0)) + shard_index))
    return order[held:].sort().values, order[:held]


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
    lr = float(env.get("LEARNING_RATE", 1e-2))
    max_steps = int(env["STEPS_PER_ROUND"]) if env.get("STEPS_PER_ROUND") is not None else None
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"STEPS_PER_ROUND must be at least 1 or unset, got {max_steps}")
    # FedProx (distributed.strategy: fedprox) passes its proximal_mu here; 0 for every other strategy.
    mu = float(env.get("PROXIMAL_MU") or 0.0)
    round_index = int(payload.get("round", {}).get("index", 0))
    shard_index = int(payload["dataset"].get("shard_index", 0))

    device = torch.device(payload.get("device", "cpu"))  # the worker's GPU, or the CPU
    x, y = load_dataset(payload["dataset"]["data_root"])
    train, _ = shard_split(len(y), env, shard_index)  # the shard's held-out part never trains
    x, y = x[train].to(device), y[train].to(device)
    model = build_model().to(device)
    model.load_state_dict(payload["initial_weights"])
    anchor = {k: v.detach().to(device) for k, v in payload["initial_weights"].items()} if mu > 0 else {}
    # Only weights travel between rounds, so the optimizer restarts each round; Adam copes well. OPTIMIZER: sgd
    # takes plain SGD steps instead (what SCAFFOLD's paper assumes).
    sgd = str(env.get("OPTIMIZER", "adam")).lower() == "sgd"
    optimizer = torch.optim.SGD(model.parameters(), lr=lr) if sgd else torch.optim.Adam(model.parameters(), lr=lr)
    # SCAFFOLD (distributed.strategy: scaffold) corrects each step's gradients with the control variates; it does
    # nothing in a job of another strategy. Its update of the shard's control variate needs the SGD step size.
    scaffold = Scaffold(model, payload, lr=lr if sgd else None)
    # Different shuffles per round and shard, yet the same ones on every rerun.
    generator = torch.Generator().manual_seed(int(env.get("SEED", 0)) + round_index + shard_index)

    model.train()
    step, epoch_losses, correct, seen = 0, [], 0, 0
    for _ in range(epochs):
        total, count = 0.0, 0
        for batch in torch.randperm(len(y), generator=generator).to(device).split(batch_size):
            if max_steps is not None and step >= max_steps:
                break
            logits = model(x[batch])
            loss = F.cross_entropy(logits, y[batch])
            objective = loss + proximal_term(model, anchor, mu) if mu > 0 else loss
            optimizer.zero_grad()
            objective.backward()
            scaffold.correct()
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

    # At least one step always runs (non-empty shard, max_steps >= 1), so neither divides by zero.
    metrics = {"loss": sum(epoch_losses) / len(epoch_losses), "train_accuracy": correct / seen}
    log = {
        "round": round_index,
        "shard": shard_index,
        "device": str(device),
        "steps": step,
        "epoch_losses": epoch_losses,
        "seconds": time.monotonic() - started,
        **metrics,
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    # With SCAFFOLD the result also carries the shard's new control variate (its state) and the change in it.
    return scaffold.finish({"weights": weights, "samples": len(y), "metrics": metrics})


@torch.no_grad()
def fl_evaluate_model(weights: dict[str, torch.Tensor], env: dict[str, Any]) -> dict[str, Any]:
    """Score weights on the held-out dataset folder named by env["HELDOUT"]; in a job with personal layers, a shard's
    personalised weights on the part of that shard (env["SHARD_DATA"], its folder on this worker) that
    SHARD_EVAL_FRACTION holds out of its training (on HELDOUT where it holds out none)."""
    held: torch.Tensor | None = None
    if env.get("SHARD_DATA"):
        x, y = load_dataset(Path(env["SHARD_DATA"]))
        _, held = shard_split(len(y), env, int(env["SHARD_INDEX"]))
    if held is not None and len(held):
        x, y = x[held], y[held]
    else:
        x, y = load_dataset(Path(env["HELDOUT"]))
    model = build_model()
    model.load_state_dict(weights)
    model.eval()
    logits = model(x)
    return {
        "accuracy": int((logits.argmax(1) == y).sum()) / len(y),
        "loss": float(F.cross_entropy(logits, y)),
        "num_samples": len(y),
    }

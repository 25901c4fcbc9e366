"""The example's exact-match score on the held-out records, before fine-tuning (the base model) and after
(the base with the job's final LoRA adapter): `python examples/llm-lora/evaluate.py [ADAPTER_FOLDER]`."""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

from prepare import HELDOUT, gguf_path
from task import exact_match, read_records


def latest_adapter(home: Path) -> Path:
    """The final adapter folder of the newest job under APIARY_HOME's storage."""
    folders = sorted((home / "storage" / "jobs").glob("*/final/adapter"), key=lambda p: p.stat().st_mtime)
    if not folders:
        sys.exit(f"no final adapter under {home / 'storage' / 'jobs'}: run the job first, or name the folder")
    return folders[-1]


def base_model(home: Path, gguf: Path) -> tuple[str, dict[str, str]]:
    """Where to load the base from: the de-quantised folder a worker of the job kept in its model cache (by the
    GGUF file's sha256; it loads in seconds), else the GGUF file itself (read in a minute or so)."""
    sha256 = hashlib.sha256(gguf.read_bytes()).hexdigest()
    kept = sorted(home.glob(f"workers/*/models/{sha256}/{gguf.name}.hf/.ready"))
    return (str(kept[0].parent), {}) if kept else (str(gguf.parent), {"gguf_file": gguf.name})


def main() -> None:
    """Load the base once, score it, wrap it with the adapter and score again."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("adapter", nargs="?", type=Path, help="the job's final/adapter folder (default: newest)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads that spin slow a shared CPU down
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    home = Path(os.environ.get("APIARY_HOME", ".apiary"))
    adapter = args.adapter or latest_adapter(home)
    folder, extra = base_model(home, gguf_path())
    tokenizer = AutoTokenizer.from_pretrained(folder, **extra)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype="float32", **extra)
    records = read_records(HELDOUT)
    before = exact_match(base, tokenizer, records)
    print(f"exact match before fine-tuning: {before:.2f} ({len(records)} held-out records)", flush=True)
    tuned = PeftModel.from_pretrained(base, str(adapter))
    after = exact_match(tuned, tokenizer, records)
    print(f"exact match after fine-tuning:  {after:.2f} (adapter {adapter})")


if __name__ == "__main__":
    main()

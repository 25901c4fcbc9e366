"""Write scikit-learn's digits as two Apiary dataset folders: a training set and a held-out test set."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

HERE = Path(__file__).resolve().parent


def write_pgm(path: Path, pixels: np.ndarray, maxval: int = 16) -> None:
    """Write a 2-D uint8 array as a binary PGM (P5) image."""
    height, width = pixels.shape
    header = f"P5\n{width} {height}\n{maxval}\n".encode("ascii")
    path.write_bytes(header + pixels.astype(np.uint8).tobytes())


def write_dataset(root: Path, name: str, images: np.ndarray, labels: np.ndarray) -> None:
    """Write images and labels as an Apiary dataset folder, replacing any previous one."""
    root.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and swap it in, so a crash never leaves a half-written dataset.
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        (tmp / "samples").mkdir()
        samples = []
        for index, (image, label) in enumerate(zip(images, labels, strict=True)):
            rel = f"samples/{index:05d}.pgm"
            write_pgm(tmp / rel, image)
            samples.append({"path": rel, "label": int(label)})
        manifest = {
            "format": "apiary-dataset",
            "version": 1,
            "name": name,
            "num_samples": len(samples),
            "samples": samples,
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest) + "\n")
        # A folder can't be renamed over a non-empty one: move the old one aside first.
        old = tmp.with_name(tmp.name + "-old")
        if root.exists():
            os.replace(root, old)
        os.replace(tmp, root)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> None:
    """Split the digits dataset and write both parts."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=HERE / "data", help="training set folder")
    parser.add_argument("--heldout", type=Path, default=HERE / "heldout", help="held-out test set folder")
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    digits = load_digits()
    # sklearn's digits pixels are already integers 0..16, which is exactly PGM maxval 16.
    images = digits.images.astype(np.uint8)
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=args.test_fraction, stratify=digits.target, random_state=args.seed
    )
    write_dataset(args.out, "digits-train", x_train, y_train)
    write_dataset(args.heldout, "digits-heldout", x_test, y_test)
    print(f"wrote {len(y_train)} training samples to {args.out}, {len(y_test)} held-out to {args.heldout}")


if __name__ == "__main__":
    main()

"""Text datasets: a JSONL file (or a folder or zip holding one) with one record per line, checked line by
line and written into shards as their own JSONL beside a manifest."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apiary.dataset import MANIFEST, DatasetError
from apiary.trainers.causal_lm_data import SHAPES, record_shape

JSONL = ".jsonl"
SHARD_FILE = "data.jsonl"  # a text shard's records; the trainer reads every .jsonl of its shard


@dataclass(frozen=True)
class TextDataset:
    """A text dataset's records, and where they came from (named in errors)."""

    where: str
    records: list[dict[str, Any]]

    @classmethod
    def open(cls, path: Path) -> TextDataset | None:
        """The text dataset at `path`, or None if it is a dataset of samples (it has a manifest)."""
        found = _jsonl_bytes(Path(path))
        if found is None:
            return None
        where, raw = found
        return cls(where, parse_records(raw, where))

    def manifest(self, indices: Sequence[int], shard: dict[str, Any]) -> bytes:
        """A text shard's manifest: what it holds and which part of the split it is."""
        body = {"name": Path(self.where).stem, "format": "jsonl", "file": SHARD_FILE, "num_samples": len(indices),
                "shard": shard}
        return json.dumps(body, indent=1).encode()


def parse_records(raw: bytes, where: str) -> list[dict[str, Any]]:
    """Every record of a JSONL body (blank lines skipped); DatasetError naming the file and line of a bad one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where} line {number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or record_shape(record) is None:
            raise DatasetError(f"{where} line {number}: not a record of a known shape: expected one of "
                               f"{', '.join(SHAPES)}")
        records.append(record)
    if not records:
        raise DatasetError(f"{where}: holds no records")
    return records


def write_text_shard(dataset: TextDataset, indices: Sequence[int], shard: dict[str, Any], target: Path) -> int:
    """Write one text shard zip (its manifest and its records, in dataset order); return its record count."""
    lines = "".join(json.dumps(dataset.records[i], ensure_ascii=False) + "\n" for i in indices)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.part")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(MANIFEST, dataset.manifest(indices, shard))
        zf.writestr(SHARD_FILE, lines)
    tmp.replace(target)
    return len(indices)


def _jsonl_bytes(path: Path) -> tuple[str, bytes] | None:
    """The one JSONL file of a text dataset (its name for errors, its bytes); None for a manifest dataset."""
    if path.is_file() and path.suffix == JSONL:
        return path.name, path.read_bytes()
    if path.is_dir():
        if (path / MANIFEST).exists():
            return None
        files = sorted(p for p in path.rglob(f"*{JSONL}") if p.is_file())
        member = _only(path.name, [p.relative_to(path).as_posix() for p in files])
        return None if member is None else (member, (path / member).read_bytes())
    if path.is_file() and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            if any(n == MANIFEST or n.endswith("/" + MANIFEST) for n in names):
                return None
            member = _only(path.name, [n for n in names if n.endswith(JSONL)])
            return None if member is None else (f"{path.name}:{member}", zf.read(member))
    return None


def _only(where: str, members: list[str]) -> str | None:
    """The one JSONL member of a folder or zip; None if it has none; DatasetError if it has several."""
    if len(members) > 1:
        raise DatasetError(f"dataset {where} holds {len(members)} .jsonl files ({', '.join(members[:3])}...): "
                           "keep one, or list samples in a manifest.json")
    return members[0] if members else None

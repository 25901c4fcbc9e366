"""Text datasets: a JSONL file (or a folder or zip holding one) with one record per line, checked line by
line and written into shards as their own JSONL beside a manifest."""

from __future__ import annotations

import contextlib
import json
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from apiary.dataset import MANIFEST, UNREADABLE, DatasetError, open_zip
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
    records = list(_checked(raw.splitlines(), where))
    if not records:
        raise DatasetError(f"{where}: holds no records")
    return records


def count_records(path: Path) -> int | None:
    """How many records a text dataset holds, each checked as `parse_records` checks it, reading its JSONL a
    line at a time (a registration never holds the file); None for a dataset of samples."""
    found = _jsonl_member(Path(path))
    if found is None:
        return None
    where, member = found
    with _open_member(Path(path), member) as lines:
        count = sum(1 for _ in _checked(lines, where))
    if not count:
        raise DatasetError(f"{where}: holds no records")
    return count


def _checked(lines: Iterable[bytes], where: str) -> Iterator[dict[str, Any]]:
    """The records of JSONL lines, blank ones skipped; DatasetError naming the file and line of a bad one."""
    for number, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DatasetError(f"{where} line {number}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where} line {number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or record_shape(record) is None:
            raise DatasetError(f"{where} line {number}: not a record of a known shape: expected one of "
                               f"{', '.join(SHAPES)}")
        yield record


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
    found = _jsonl_member(path)
    if found is None:
        return None
    try:
        with _open_member(path, found[1]) as lines:
            return found[0], lines.read()
    except UNREADABLE as e:  # a damaged or encrypted zip member
        raise DatasetError(f"dataset {path}: {found[0]} cannot be read: {e}") from None


def _jsonl_member(path: Path) -> tuple[str, str] | None:
    """The one JSONL file of a text dataset: its name for errors and where it is (`path` itself: ``, a folder's
    file or a zip's member: its relative name); None for a manifest dataset."""
    if path.is_file() and path.suffix == JSONL:
        return path.name, ""
    if path.is_dir():
        if (path / MANIFEST).exists():
            return None
        files = sorted(p for p in path.rglob(f"*{JSONL}") if p.is_file())
        member = _only(path.name, [p.relative_to(path).as_posix() for p in files])
        return None if member is None else (member, member)
    if path.is_file() and zipfile.is_zipfile(path):
        with open_zip(path) as zf:
            names = zf.namelist()
            if any(n == MANIFEST or n.endswith("/" + MANIFEST) for n in names):
                return None
            member = _only(path.name, [n for n in names if n.endswith(JSONL)])
            return None if member is None else (f"{path.name}:{member}", member)
    return None


@contextlib.contextmanager
def _open_member(path: Path, member: str) -> Iterator[IO[bytes]]:
    """The JSONL file `_jsonl_member` found, opened for reading in binary (lines as it iterates)."""
    if not member:
        with path.open("rb") as f:
            yield f
    elif path.is_dir():
        with (path / member).open("rb") as f:
            yield f
    else:
        with open_zip(path) as zf, zf.open(member) as f:
            yield f


def _only(where: str, members: list[str]) -> str | None:
    """The one JSONL member of a folder or zip; None if it has none; DatasetError if it has several."""
    if len(members) > 1:
        raise DatasetError(f"dataset {where} holds {len(members)} .jsonl files ({', '.join(members[:3])}...): "
                           "keep one, or list samples in a manifest.json")
    return members[0] if members else None

"""Datasets: a folder or zip of samples listed by a manifest, split seeded into one zip per shard."""

from __future__ import annotations

import json
import random
import shutil
import zipfile
import zlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from apiary.policy import LIMITS, Refused, check_zip

MANIFEST = "manifest.json"
# What reading a damaged archive raises (bad CRC, header, compression method, stream): the data's fault.
UNREADABLE = (zipfile.BadZipFile, zlib.error, NotImplementedError, EOFError, OSError, ValueError, RuntimeError)


class DatasetError(ValueError):
    """A dataset that cannot be sharded; the message says what is wrong and where."""


@dataclass(frozen=True)
class Manifest:
    """A dataset's manifest: its samples (each a dict with at least `path`) and shared files."""

    name: str
    samples: list[dict[str, Any]]
    files: list[str]
    extra: dict[str, Any]

    @classmethod
    def parse(cls, raw: bytes, where: str) -> Manifest:
        """Parse and check manifest bytes; `where` names the dataset in errors."""
        if len(raw) > LIMITS.manifest_bytes:
            raise DatasetError(f"{where}: {MANIFEST} is {len(raw)} bytes, over the limit of {LIMITS.manifest_bytes}")
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise DatasetError(f"{where}: {MANIFEST} is not valid JSON ({e})") from e
        if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
            raise DatasetError(f"{where}: {MANIFEST} must be an object with a 'samples' list")
        samples = data["samples"]
        entries = len(samples) + (len(data["files"]) if isinstance(data.get("files"), list) else 0)
        if entries > LIMITS.manifest_entries:
            raise DatasetError(f"{where}: {MANIFEST} lists {entries} entries, over the limit of "
                               f"{LIMITS.manifest_entries}")
        if not samples:
            raise DatasetError(f"{where}: {MANIFEST} lists no samples")
        for i, sample in enumerate(samples):
            if not isinstance(sample, dict) or not isinstance(sample.get("path"), str):
                raise DatasetError(f"{where}: sample #{i} in {MANIFEST} has no 'path'")
            _safe_member(sample["path"], where)
        files = data.get("files", [])
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise DatasetError(f"{where}: 'files' in {MANIFEST} must be a list of paths")
        for f in files:
            _safe_member(f, where)
        extra = {k: v for k, v in data.items() if k not in ("samples", "files", "name", "num_samples")}
        return cls(str(data.get("name", "")), samples, files, extra)

    def to_json(self, samples: list[dict[str, Any]], shard: dict[str, Any]) -> bytes:
        """A shard's manifest: the same fields, its own samples."""
        body = {**self.extra, "name": self.name, "num_samples": len(samples), "samples": samples,
                "files": self.files, "shard": shard}
        return json.dumps(body, indent=1).encode()


def _safe_member(path: str, where: str) -> str:
    posix = PurePosixPath(path)
    if posix.is_absolute() or ".." in posix.parts or not path:
        raise DatasetError(f"{where}: path {path!r} must be relative and stay inside the dataset")
    return path


def open_zip(path: Path) -> zipfile.ZipFile:
    """A dataset or shard zip, opened once checked (apiary.policy.check_zip): no member with an absolute
    path, `..` or a symbolic link, and no expansion past the limits; else DatasetError naming the member."""
    try:
        zf = zipfile.ZipFile(path)
    except UNREADABLE as e:
        raise DatasetError(f"dataset {path} is not a readable zip file: {e}") from e
    try:
        check_zip(zf, f"dataset {path}", path.stat().st_size)
    except Refused as e:
        zf.close()
        raise DatasetError(str(e)) from None
    return zf


class DatasetSource:
    """Read access to a dataset folder or zip file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._zip: zipfile.ZipFile | None = None
        self._prefix = ""
        if self.path.is_dir():
            return
        if not self.path.exists():
            raise DatasetError(f"dataset {self.path} does not exist")
        if not zipfile.is_zipfile(self.path):
            raise DatasetError(f"dataset {self.path} is neither a folder nor a zip file")
        self._zip = open_zip(self.path)
        names = self._zip.namelist()
        if MANIFEST not in names:
            # A zip of a folder: accept one top-level directory holding the manifest.
            tops = [n for n in names if n.count("/") == 1 and n.endswith("/" + MANIFEST)]
            if len(tops) == 1:
                self._prefix = tops[0].removesuffix(MANIFEST)

    def close(self) -> None:
        """Release the zip file, if any."""
        if self._zip is not None:
            self._zip.close()

    def read(self, member: str) -> bytes:
        """The bytes of one file of the dataset."""
        try:
            if self._zip is not None:
                return self._zip.read(self._prefix + member)
            return (self.path / member).read_bytes()
        except (KeyError, FileNotFoundError, IsADirectoryError):
            raise DatasetError(f"dataset {self.path}: file {member!r} listed in the manifest is missing") from None
        except UNREADABLE as e:
            # A damaged archive (bad CRC, header, compression method) is the dataset's fault, said in one line.
            raise DatasetError(f"dataset {self.path}: file {member!r} cannot be read: {e}") from None

    def manifest(self) -> Manifest:
        """The dataset's manifest, checked."""
        try:
            raw = self.read(MANIFEST)
        except DatasetError:
            raise DatasetError(
                f"dataset {self.path} has no {MANIFEST}: list its samples there "
                '({"samples": [{"path": "...", "label": ...}, ...]})'
            ) from None
        return Manifest.parse(raw, str(self.path))


def split(
    samples: Sequence[dict[str, Any]],
    num_shards: int,
    *,
    strategy: str = "random",
    seed: int = 0,
    alpha: float = 0.5,
    group_key: str = "group",
) -> list[list[int]]:
    """Split sample indices into `num_shards` non-empty shards, deterministically for a seed: `random` (equal
    sizes), `label_skew` (each label spread by Dirichlet(`alpha`)), `quantity_skew` (sizes by Dirichlet(`alpha`),
    labels mixed) or `group` (whole groups by `group_key`)."""
    n = len(samples)
    if num_shards < 1:
        raise DatasetError("number of shards must be at least 1")
    if n < num_shards:
        raise DatasetError(f"dataset has {n} samples, fewer than the {num_shards} shards asked for")
    rng = random.Random(seed)
    if strategy == "random":
        return _random_split(n, num_shards, rng)
    if strategy == "group":
        return _group_split(samples, num_shards, rng, group_key)
    if strategy == "label_skew":
        return _label_skew_split(samples, num_shards, rng, alpha)
    if strategy == "quantity_skew":
        return _quantity_skew_split(n, num_shards, rng, alpha)
    raise DatasetError(f"unknown split strategy {strategy!r}: use random, label_skew, quantity_skew or group")


def _random_split(n: int, num_shards: int, rng: random.Random) -> list[list[int]]:
    """Shuffled indices dealt round-robin: shard sizes differ by at most one."""
    order = list(range(n))
    rng.shuffle(order)
    return [sorted(order[i::num_shards]) for i in range(num_shards)]


def _group_split(samples: Sequence[dict[str, Any]], num_shards: int, rng: random.Random,
                 group_key: str) -> list[list[int]]:
    """Whole groups (by `group_key`) per shard, so no group is seen by two shards."""
    groups = _index_by(samples, group_key, "group")
    if len(groups) < num_shards:
        raise DatasetError(f"group split: {len(groups)} groups cannot fill {num_shards} shards")
    names = sorted(groups)
    rng.shuffle(names)
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    # Largest groups first onto the lightest shard keeps shards roughly equal.
    for name in sorted(names, key=lambda g: -len(groups[g])):
        min(shards, key=len).extend(groups[name])
    return [sorted(s) for s in shards]


def _label_skew_split(samples: Sequence[dict[str, Any]], num_shards: int, rng: random.Random,
                      alpha: float) -> list[list[int]]:
    """Each label's samples spread over the shards in Dirichlet(`alpha`) proportions (smaller is more skewed)."""
    by_label = _index_by(samples, "label", "label_skew")
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    for label in sorted(by_label):
        items = by_label[label]
        rng.shuffle(items)
        bounds = _dirichlet_bounds(len(items), num_shards, rng, alpha)
        for s in range(num_shards):
            shards[s].extend(items[bounds[s] : bounds[s + 1]])
    # Every shard must train on something: move one sample from the largest to each empty one.
    for s in range(num_shards):
        if not shards[s]:
            donor = max(shards, key=len)
            shards[s].append(donor.pop())
    return [sorted(s) for s in shards]


def _quantity_skew_split(n: int, num_shards: int, rng: random.Random, alpha: float) -> list[list[int]]:
    """Shuffled indices cut into runs whose sizes follow one Dirichlet(`alpha`) draw, each at least one sample:
    labels stay mixed, sample counts do not (smaller `alpha` is more skewed)."""
    order = list(range(n))
    rng.shuffle(order)
    bounds = [0]
    for size in quantity_sizes(n, num_shards, rng, alpha):
        bounds.append(bounds[-1] + size)
    return [sorted(order[bounds[s] : bounds[s + 1]]) for s in range(num_shards)]


def quantity_sizes(n: int, num_shards: int, rng: random.Random, alpha: float) -> list[int]:
    """`num_shards` sizes summing to `n`, each at least 1, the rest shared in Dirichlet(`alpha`) proportions
    (largest remainders round, so the sizes are exact and the same for the same generator state)."""
    if not 1 <= num_shards <= n:
        raise DatasetError(f"quantity_skew split: {n} samples cannot fill {num_shards} non-empty shards")
    props = [rng.gammavariate(alpha, 1.0) for _ in range(num_shards)]
    total = sum(props)
    # Every draw can underflow to zero at a tiny alpha: then the spare samples go to one shard, seeded.
    if total > 0:
        shares = [p / total for p in props]
    else:
        lucky = rng.randrange(num_shards)
        shares = [float(i == lucky) for i in range(num_shards)]
    spare = n - num_shards
    exact = [share * spare for share in shares]
    sizes = [int(x) for x in exact]
    by_remainder = sorted(range(num_shards), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in by_remainder[: spare - sum(sizes)]:
        sizes[i] += 1
    return [size + 1 for size in sizes]


def label_histogram(samples: Sequence[dict[str, Any]], indices: Sequence[int],
                    key: str = "label") -> dict[str, int] | None:
    """How many of the samples at `indices` carry each value of `key` (as text, in natural order), or None
    when none of them has the field (a text dataset, say): what a shard holds, for people to see."""
    counts: dict[str, int] = defaultdict(int)
    for i in indices:
        if key in samples[i]:
            counts[str(samples[i][key])] += 1
    if not counts:
        return None
    return {label: counts[label] for label in sorted(counts, key=label_order)}


def label_order(label: str) -> tuple[int, float, str]:
    """Sort key for labels as text: numbers first, by value (so "10" follows "9"), then other labels alphabetically."""
    try:
        return 0, float(label), label
    except ValueError:
        return 1, 0.0, label


def _dirichlet_bounds(count: int, num_shards: int, rng: random.Random, alpha: float) -> list[int]:
    """Cut points of `count` items into `num_shards` runs, sized by one Dirichlet(`alpha`) draw."""
    props = [rng.gammavariate(alpha, 1.0) for _ in range(num_shards)]
    total = sum(props) or 1.0
    cuts, acc = [], 0.0
    for p in props[:-1]:
        acc += p / total
        cuts.append(round(acc * count))
    return [0, *cuts, count]


def _index_by(samples: Sequence[dict[str, Any]], key: str, split_name: str) -> dict[str, list[int]]:
    """Sample indices by the (string) value of `key`; every sample must have it."""
    by_value: dict[str, list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        if key not in sample:
            raise DatasetError(f"{split_name} split: sample #{i} has no {key!r} field")
        by_value[str(sample[key])].append(i)
    return by_value


def write_shard(source: DatasetSource, manifest: Manifest, indices: Sequence[int], shard: dict[str, Any],
                target: Path) -> int:
    """Write one shard zip (its manifest, its samples, the shared files); return its sample count."""
    samples = [manifest.samples[i] for i in indices]
    members = list(dict.fromkeys([*manifest.files, *(s["path"] for s in samples)]))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.part")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(MANIFEST, manifest.to_json(samples, shard))
        for member in members:
            zf.writestr(member, source.read(member))
    tmp.replace(target)
    return len(samples)


def extract_shard(zip_path: Path, target: Path) -> None:
    """Unpack a shard zip into a folder, refusing members that would escape it."""
    tmp = target.with_name(f".{target.name}.part")
    shutil.rmtree(tmp, ignore_errors=True)
    with open_zip(zip_path) as zf:
        for name in zf.namelist():
            _safe_member(name.rstrip("/"), str(zip_path))
        tmp.mkdir(parents=True)  # an empty archive unpacks into an empty folder
        try:
            zf.extractall(tmp)
        except UNREADABLE as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise DatasetError(f"shard {zip_path} cannot be unpacked: {e}") from None
    shutil.rmtree(target, ignore_errors=True)
    tmp.replace(target)

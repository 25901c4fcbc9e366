"""Another party's files: manifests, dataset zips, safetensors headers, JSONL. Whatever the bytes, reading
ends in the documented error (DatasetError, WeightsError), never a crash, a hang or an unbounded allocation."""

from __future__ import annotations

import contextlib
import io
import json
import struct
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from apiary.dataset import DatasetError, DatasetSource, Manifest, extract_shard
from apiary.dataset_text import TextDataset, parse_records
from apiary.weights import WeightsError, loads, read_header
from tests.fuzz.found import ZIPS
from tests.fuzz.profile import FUZZ

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64) | st.floats()
           | st.text(max_size=16))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=24)
paths = st.sampled_from(["a.txt", "../x", "/etc/passwd", "", "a/../../b", "C:/w", "ok/b.bin"]) | st.text(max_size=12)
samples = st.lists(st.fixed_dictionaries({"path": paths}, optional={"label": values}) | values, max_size=5)
manifests = st.fixed_dictionaries({}, optional={"samples": samples | values, "files": st.lists(paths, max_size=3)
                                                | values, "name": values})


@FUZZ
@given(raw=st.binary(max_size=256) | manifests.map(lambda m: json.dumps(m).encode()))
def test_a_manifest_parses_or_raises_dataset_error(raw: bytes) -> None:
    try:
        Manifest.parse(raw, "fuzz")
    except DatasetError:
        pass


def _zip(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members:
            if name and not name.endswith("/") and name not in zf.namelist():
                with contextlib.suppress(IndexError):  # a name zipfile empties (a bare drive, "C:") is skipped
                    zf.writestr(name, data)
    return buffer.getvalue()


zips = st.lists(st.tuples(paths | st.just("manifest.json"), st.binary(max_size=64)
                          | manifests.map(lambda m: json.dumps(m).encode())), max_size=4).map(_zip)


@st.composite
def damaged(draw: st.DrawFn) -> bytes:
    """A valid zip with a few bytes overwritten (headers, sizes, offsets)."""
    data = bytearray(draw(zips))
    for _ in range(draw(st.integers(0, 4))):
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@FUZZ
@given(data=zips | damaged() | st.binary(max_size=256))
@example(data=ZIPS[0])
@example(data=ZIPS[1])
def test_a_dataset_zip_reads_or_raises_dataset_error_and_never_escapes(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        archive = root / "inner" / "d.zip"
        archive.parent.mkdir()
        archive.write_bytes(data)
        try:
            source = DatasetSource(archive)
            try:
                manifest = source.manifest()
                for sample in manifest.samples[:4]:
                    source.read(sample["path"])
            finally:
                source.close()
        except DatasetError:
            pass
        try:
            extract_shard(archive, root / "inner" / "out")
        except DatasetError:
            pass
        assert {p.name for p in root.iterdir()} == {"inner"}, "something was written outside the target"


@FUZZ
@given(data=st.binary(max_size=256) | zips | damaged())
@example(data=ZIPS[0])
@example(data=ZIPS[1])
def test_a_jsonl_dataset_reads_or_raises_dataset_error(data: bytes) -> None:
    try:
        parse_records(data, "fuzz")
    except DatasetError:
        pass
    with tempfile.TemporaryDirectory() as folder:
        for name in ("d.jsonl", "d.zip"):
            path = Path(folder) / name
            path.write_bytes(data)
            try:
                TextDataset.open(path)
            except DatasetError:
                pass


dtypes = st.sampled_from(["F32", "F16", "BF16", "I64", "BOOL", "U8", "F8", "X"]) | values
entries = st.fixed_dictionaries({}, optional={
    "dtype": dtypes, "shape": st.lists(st.integers(min_value=-2, max_value=2**40), max_size=4) | values,
    "data_offsets": st.lists(st.integers(min_value=-2, max_value=2**40), max_size=3) | values}) | values
headers = st.dictionaries(st.text(max_size=8) | st.just("__metadata__"), entries, max_size=5)


@st.composite
def safetensors(draw: st.DrawFn) -> bytes:
    """A header (maybe lying about its length) and a data section."""
    header: dict[str, Any] = draw(headers)
    raw = json.dumps(header).encode()
    length = draw(st.sampled_from([len(raw), len(raw) + 1, 0, 2**63]) | st.integers(0, 2**64 - 1))
    return struct.pack("<Q", length) + raw + draw(st.binary(max_size=64))


@FUZZ
@given(data=st.binary(max_size=256) | safetensors())
def test_safetensors_bytes_load_or_raise_weights_error(data: bytes) -> None:
    try:
        read_header(data)
        loads(data, copy=False)
        loads(data)
    except WeightsError:
        pass

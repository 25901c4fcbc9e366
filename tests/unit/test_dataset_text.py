"""Text datasets: JSONL records of the three known shapes, found in a file, a folder or a zip, checked line
by line, and split into shards exactly as samples are."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from apiary.contracts import ShardRequested
from apiary.dataset import DatasetError, split
from apiary.dataset_text import SHARD_FILE, TextDataset
from services.sharder.handlers import split_to_files

RECORDS = [{"text": "a"}, {"prompt": "p", "completion": "c"}, {"messages": [{"role": "user", "content": "hi"}]},
           {"text": "b"}, {"text": "c"}]


def _jsonl(path: Path, records: list[object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_jsonl_file_a_folder_and_a_zip_holding_one_are_text_datasets(tmp_path: Path) -> None:
    file = _jsonl(tmp_path / "train.jsonl", RECORDS)
    folder = _jsonl(tmp_path / "folder" / "data" / "train.jsonl", RECORDS).parent.parent
    archive = tmp_path / "train.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.write(file, "inner/train.jsonl")

    found = [TextDataset.open(p) for p in (file, folder, archive)]

    assert [d.records if d else None for d in found] == [RECORDS] * 3
    assert found[2] is not None and found[2].where == "train.zip:inner/train.jsonl"


def test_a_folder_with_a_manifest_is_not_a_text_dataset(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("{}")
    _jsonl(tmp_path / "notes.jsonl", RECORDS)

    assert TextDataset.open(tmp_path) is None


@pytest.mark.parametrize(("line", "why"), [({"txt": "a"}, "not a record of a known shape"),
                                           ([1, 2], "not a record of a known shape"),
                                           ("{oops", "not JSON")])
def test_a_bad_line_is_named_by_file_and_line(tmp_path: Path, line: object, why: str) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n\n" + (line if isinstance(line, str) else json.dumps(line)) + "\n")

    with pytest.raises(DatasetError) as caught:
        TextDataset.open(path)

    assert str(caught.value).startswith(f"train.jsonl line 3: {why}")


def test_records_are_split_seeded_as_samples_are(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "train.jsonl", RECORDS)
    event = ShardRequested(job_id="j", dataset=str(path), num_shards=2, seed=7)

    files = split_to_files(event, path, tmp_path / "out")

    expected = split(RECORDS, 2, seed=7)
    for (zip_path, count, _labels), indices in zip(files, expected, strict=True):
        with zipfile.ZipFile(zip_path) as zf:
            lines = zf.read(SHARD_FILE).decode().splitlines()
            manifest = json.loads(zf.read("manifest.json"))
        assert [json.loads(x) for x in lines] == [RECORDS[i] for i in indices]
        assert count == manifest["num_samples"] == len(indices)

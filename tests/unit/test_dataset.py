"""Dataset manifests and the seeded splitter."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from apiary.dataset import DatasetError, DatasetSource, Manifest, extract_shard, split, write_shard
from tests.toyjobs.toy import make_dataset

SAMPLES = [{"path": f"s/{i}", "label": i % 4, "group": f"g{i % 6}"} for i in range(100)]


@pytest.mark.parametrize("strategy", ["random", "label_skew", "group"])
def test_split_is_a_seeded_partition_with_no_empty_shard(strategy: str) -> None:
    first = split(SAMPLES, 5, strategy=strategy, seed=7)
    again = split(SAMPLES, 5, strategy=strategy, seed=7)

    assert first == again
    assert sorted(i for shard in first for i in shard) == list(range(100))
    assert all(first)


def test_random_split_is_roughly_equal_and_depends_on_the_seed() -> None:
    shards = split(SAMPLES, 3, seed=1)

    assert sorted(len(s) for s in shards) == [33, 33, 34]
    assert shards != split(SAMPLES, 3, seed=2)


def test_group_split_keeps_each_group_on_one_shard() -> None:
    shards = split(SAMPLES, 3, strategy="group", seed=0)

    for shard in shards:
        groups = {SAMPLES[i]["group"] for i in shard}
        for other in shards:
            if other is not shard:
                assert groups.isdisjoint({SAMPLES[i]["group"] for i in other})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_shards": 101}, "fewer than the 101 shards"),
        ({"num_shards": 7, "strategy": "group"}, "6 groups cannot fill 7 shards"),
        ({"num_shards": 2, "strategy": "zigzag"}, "unknown split strategy"),
    ],
)
def test_impossible_splits_say_why(kwargs: dict, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        split(SAMPLES, **kwargs)


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"samples": []}', "lists no samples"),
        (b'{"samples": [{"label": 1}]}', "has no 'path'"),
        (b'{"samples": [{"path": "../etc/passwd"}]}', "stay inside"),
        (b'{"items": []}', "'samples' list"),
    ],
)
def test_bad_manifests_are_refused_with_the_reason(manifest: bytes, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        Manifest.parse(manifest, "ds")


def test_folder_without_manifest_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"has no manifest\.json"):
        DatasetSource(tmp_path).manifest()


def test_missing_sample_file_is_named(tmp_path: Path) -> None:
    root = make_dataset(tmp_path / "ds", 4)
    (root / "samples" / "0002.txt").unlink()
    source = DatasetSource(root)

    with pytest.raises(DatasetError, match=r"0002\.txt"):
        write_shard(source, source.manifest(), [0, 1, 2, 3], {"index": 0}, tmp_path / "s.zip")


def test_shard_zip_holds_its_samples_and_manifest_and_unpacks(tmp_path: Path) -> None:
    root = make_dataset(tmp_path / "ds", 6)
    source = DatasetSource(root)
    manifest = source.manifest()

    count = write_shard(source, manifest, [1, 4], {"index": 1, "count": 3}, tmp_path / "shard.zip")
    extract_shard(tmp_path / "shard.zip", tmp_path / "out")

    shard_manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert count == 2
    assert [s["path"] for s in shard_manifest["samples"]] == ["samples/0001.txt", "samples/0004.txt"]
    assert (tmp_path / "out" / "samples" / "0004.txt").read_text() == "sample 4\n"
    assert not (tmp_path / "out" / "samples" / "0000.txt").exists()


def test_zip_dataset_with_one_top_folder_is_read(tmp_path: Path) -> None:
    root = make_dataset(tmp_path / "digits", 3)
    archive = tmp_path / "digits.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in root.rglob("*"):
            zf.write(path, Path("digits") / path.relative_to(root))

    manifest = DatasetSource(archive).manifest()

    assert len(manifest.samples) == 3


def test_shard_zip_with_escaping_member_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / "evil.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("../evil.txt", "x")

    with pytest.raises(DatasetError, match="stay inside"):
        extract_shard(archive, tmp_path / "out")
    assert not (tmp_path / "evil.txt").exists()

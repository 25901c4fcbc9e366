"""Skewed splits on purpose: quantity skew's sizes, label skew's labels, and each shard's label histogram."""

from __future__ import annotations

import json
import random
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from apiary.contracts import ShardRequested
from apiary.dataset import label_histogram, quantity_sizes, split
from services.sharder.handlers import split_to_files
from tests.toyjobs.toy import make_dataset

SAMPLES = [{"path": f"s/{i}", "label": i % 10} for i in range(1000)]


def _sizes(shards: list[list[int]]) -> list[int]:
    return [len(s) for s in shards]


def test_quantity_skew_is_a_seeded_partition_with_no_empty_shard() -> None:
    first = split(SAMPLES, 8, strategy="quantity_skew", seed=3, alpha=0.5)
    again = split(SAMPLES, 8, strategy="quantity_skew", seed=3, alpha=0.5)

    assert first == again
    assert sorted(i for shard in first for i in shard) == list(range(1000))
    assert min(_sizes(first)) >= 1
    assert first != split(SAMPLES, 8, strategy="quantity_skew", seed=4, alpha=0.5)


def test_quantity_skew_sizes_spread_more_as_alpha_falls() -> None:
    def spread(alpha: float) -> float:
        sizes = _sizes(split(SAMPLES, 8, strategy="quantity_skew", seed=0, alpha=alpha))
        return max(sizes) / min(sizes)

    assert spread(1000.0) < 1.5
    assert spread(1.0) > 2 * spread(1000.0)
    assert spread(0.1) > spread(1.0)


def test_quantity_skew_keeps_labels_mixed() -> None:
    shards = split(SAMPLES, 4, strategy="quantity_skew", seed=0, alpha=5.0)

    for shard in shards:
        # 10 labels dealt uniformly: a shard of at least 100 random samples holds every one of them.
        assert len(shard) >= 100
        assert len({SAMPLES[i]["label"] for i in shard}) == 10


@pytest.mark.parametrize("alpha", [1e-6, 0.01, 0.5, 50.0])
def test_quantity_sizes_are_exact_and_never_zero(alpha: float) -> None:
    for n, shards in [(8, 8), (9, 8), (1000, 7), (17, 3)]:
        sizes = quantity_sizes(n, shards, random.Random(1), alpha)

        assert sum(sizes) == n
        assert len(sizes) == shards
        assert min(sizes) >= 1


def test_quantity_skew_refuses_more_shards_than_samples() -> None:
    with pytest.raises(ValueError, match="3 samples cannot fill 4 non-empty shards"):
        quantity_sizes(3, 4, random.Random(0), 0.5)


def test_label_histogram_counts_each_label_in_natural_order() -> None:
    samples = [{"path": str(i), "label": label} for i, label in enumerate([10, 2, 2, 9, 10, 10, "cat"])]

    histogram = label_histogram(samples, [0, 1, 2, 3, 4, 5, 6])

    assert histogram == {"2": 2, "9": 1, "10": 3, "cat": 1}
    assert list(histogram or {}) == ["2", "9", "10", "cat"]
    assert label_histogram(samples, [1, 3]) == {"2": 1, "9": 1}


def test_label_histogram_is_none_for_unlabelled_samples() -> None:
    assert label_histogram([{"path": "a"}, {"path": "b"}], [0, 1]) is None


def test_label_skew_at_small_alpha_gives_shards_few_labels() -> None:
    skewed = split(SAMPLES, 5, strategy="label_skew", seed=0, alpha=0.05)
    even = split(SAMPLES, 5, strategy="random", seed=0)

    def labels_per_shard(shards: list[list[int]]) -> list[int]:
        return [len(label_histogram(SAMPLES, s) or {}) for s in shards]

    assert labels_per_shard(even) == [10] * 5
    assert sum(labels_per_shard(skewed)) < 25


@pytest.mark.parametrize("strategy", ["random", "label_skew", "quantity_skew"])
def test_sharder_reports_each_shards_histogram_as_its_zip_holds_it(tmp_path: Path, strategy: str) -> None:
    root = make_dataset(tmp_path / "ds", 60)
    event = ShardRequested(job_id="j", dataset=str(root), num_shards=3, strategy=strategy, seed=2, alpha=0.3)

    files = split_to_files(event, root, tmp_path / "out")

    for file in files:
        with zipfile.ZipFile(file.path) as zf:
            manifest = json.loads(zf.read("manifest.json"))
        in_zip = Counter(str(s["label"]) for s in manifest["samples"])
        assert file.labels == dict(in_zip)
        assert file.num_samples == sum(in_zip.values()) == manifest["num_samples"]
    assert sum(f.num_samples for f in files) == 60

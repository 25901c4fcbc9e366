"""What each worker receives: the split a job asked for and each shard's label histogram, from the sharder
through job.sharded to the tracker's API, with its tables on SQLite and on PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from apiary.dataset import DatasetSource, label_histogram, split
from apiary.settings import Settings
from services.app.runtime import Embedded
from tests.toyjobs.toy import make_dataset

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", "postgres"])
async def stack(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Embedded]:
    """Three workers and every service in one process."""
    database_url = (f"sqlite:///{tmp_path / 'apiary.db'}" if request.param == "sqlite"
                    else request.getfixturevalue("postgres_url"))
    settings = Settings(home=tmp_path / ".apiary", database_url=database_url, heartbeat_interval=0.5)
    async with Embedded(settings, workers=3, code_paths=[str(REPO)]) as embedded:
        yield embedded


@pytest.mark.parametrize(("strategy", "alpha"), [("label_skew", 0.2), ("quantity_skew", 0.5), ("random", 0.5)])
async def test_the_job_view_shows_the_split_and_each_shards_labels(stack: Embedded, tmp_path: Path,
                                                                   strategy: str, alpha: float) -> None:
    dataset = make_dataset(tmp_path / "toy-data", 60)
    request = {"name": "toy", "entrypoint": "tests.toyjobs.toy:fl_train_model", "dataset": str(dataset),
               "config": {"mode": "ok"}, "split": {"strategy": strategy, "alpha": alpha, "seed": 5},
               "distributed": {"num_rounds": 1, "min_workers": 3, "max_workers": 3}}

    job_id = await stack.submit(request)
    ended = await stack.wait(job_id, timeout=120)
    view = await stack.api.get_job(job_id)

    samples = DatasetSource(dataset).manifest().samples
    expected = [label_histogram(samples, shard)
                for shard in split(samples, 3, strategy=strategy, seed=5, alpha=alpha)]
    assert ended["status"] == "completed"
    assert view["split"]["strategy"] == strategy and view["split"]["alpha"] == alpha
    assert [s["shard"] for s in view["data_shards"]] == [0, 1, 2]
    assert [s["labels"] for s in view["data_shards"]] == expected
    assert [s["num_samples"] for s in view["data_shards"]] == [sum((h or {}).values()) for h in expected]

"""An embedded stack (memory bus, SQLite, local folder) per test, with the toy dataset."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from apiary.runtime import Embedded
from apiary.settings import Settings
from tests.toyjobs.toy import make_dataset

REPO = Path(__file__).resolve().parents[2]
StackFactory = Callable[..., AbstractAsyncContextManager[Embedded]]


@pytest.fixture
def toy_dataset(tmp_path: Path) -> Path:
    """13 samples: three shards of 5, 4 and 4, so the average's weights differ."""
    return make_dataset(tmp_path / "toy-data", 13)


@pytest.fixture
def embedded(tmp_path: Path) -> StackFactory:
    """Start an embedded stack with N workers: `async with embedded(workers=2) as stack:`."""

    @asynccontextmanager
    async def start(workers: int = 3, **overrides: Any) -> AsyncIterator[Embedded]:
        settings = Settings(home=tmp_path / ".apiary", heartbeat_interval=0.5, progress_interval=0.0,
                            **overrides)
        async with Embedded(settings, workers=workers, code_paths=[str(REPO)]) as stack:
            yield stack

    return start


def toy_request(dataset: Path, **distributed: Any) -> dict[str, Any]:
    """A toy job request; keyword arguments override its `distributed` block."""
    return {
        "name": "toy",
        "entrypoint": "tests.toyjobs.toy:fl_train_model",
        "dataset": str(dataset),
        "config": {"mode": "ok"},
        "distributed": {"num_rounds": 2, "min_workers": 2, "max_workers": 3, "aggregation_timeout": 600,
                        "fault_tolerance": 0, **distributed},
    }

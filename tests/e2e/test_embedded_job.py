"""Whole jobs on the embedded adapters: the result is exactly FedAvg, bad input fails fast and clearly."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel

from apiary import keys
from apiary.strategies import base
from apiary.strategies.base import Contribution, StoredContributions, Strategy
from apiary.strategies.weighted_sum import WeightedSum
from apiary.weights import loads
from services.worker import Worker
from tests.faults.support import process_alive
from tests.fixtures.embedded import REPO, StackFactory, toy_request
from tests.toyjobs.toy import Gates


async def test_final_weights_are_the_fedavg_of_what_the_workers_returned(embedded: StackFactory,
                                                                          toy_dataset: Path) -> None:
    async with embedded(workers=3) as stack:
        job_id = await stack.submit(toy_request(toy_dataset, num_rounds=3))
        view = await stack.wait(job_id, timeout=120)
        rows = await stack.ports.db.fetch(
            "SELECT shard, samples, result_key FROM contributions WHERE job_id = $1 AND round = 3"
            " AND status = 'accepted' ORDER BY shard", job_id,
        )
        returned = [(r["samples"], loads(await stack.ports.storage.get_bytes(r["result_key"]))) for r in rows]
        final = loads(await stack.ports.storage.get_bytes(keys.final_model(job_id)))
        previous = loads(await stack.ports.storage.get_bytes(keys.global_weights(job_id, 2)))

    assert view["status"] == "completed", view.get("reason")
    assert [s for s, _ in returned] == [5, 4, 4]
    total = sum(s for s, _ in returned)
    for name in ("layer.weight", "layer.bias"):
        expected = sum(s * w[name].double() for s, w in returned) / total
        torch.testing.assert_close(final[name].double(), expected, rtol=0, atol=1e-6)
        # Each shard added (shard + 1) to the round's starting weights: a known closed form.
        torch.testing.assert_close(final[name], previous[name] + (5 * 1 + 4 * 2 + 4 * 3) / 13)
    assert int(final["steps"]) == 3
    assert view["metrics"]["weight_sum"] == float(final["layer.weight"].sum())
    assert view["final_model"].endswith(f"jobs/{job_id}/final/model.safetensors")


async def test_run_files_and_metrics_land_under_the_job_prefix(embedded: StackFactory, toy_dataset: Path) -> None:
    async with embedded(workers=2) as stack:
        job_id = await stack.submit(toy_request(toy_dataset, num_rounds=1, max_workers=2))
        await stack.wait(job_id, timeout=120)
        stored = await stack.ports.storage.list(keys.job_prefix(job_id))
        report = json.loads(await stack.ports.storage.get_bytes(keys.final_metrics(job_id)))

    assert keys.final_model(job_id) in stored
    assert any(k.endswith("files-shard-0000.zip") for k in stored)
    assert [r["status"] for r in report["rounds"]] == ["aggregated"]


async def test_missing_entrypoint_is_rejected_naming_the_field(embedded: StackFactory, toy_dataset: Path) -> None:
    request = toy_request(toy_dataset)
    del request["entrypoint"]

    async with embedded(workers=1) as stack:
        view = await stack.wait(await stack.submit(request), timeout=30)

    assert view["status"] == "rejected"
    assert view["errors"] == [{"field": "entrypoint", "message": "Field required"}]


async def test_min_workers_above_max_workers_is_rejected(embedded: StackFactory, toy_dataset: Path) -> None:
    async with embedded(workers=1) as stack:
        job_id = await stack.submit(toy_request(toy_dataset, min_workers=4, max_workers=2))
        view = await stack.wait(job_id, timeout=30)

    assert view["status"] == "rejected"
    assert "min_workers (4) must not exceed max_workers (2)" in view["reason"]


async def test_unknown_dataset_path_fails_the_job(embedded: StackFactory, tmp_path: Path) -> None:
    async with embedded(workers=1) as stack:
        view = await stack.wait(await stack.submit(toy_request(tmp_path / "nope")), timeout=30)

    assert view["status"] == "failed"
    assert view["reason"].startswith(f"dataset {tmp_path / 'nope'} does not exist")


async def test_dataset_without_manifest_fails_the_job(embedded: StackFactory, tmp_path: Path) -> None:
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "x.txt").write_text("x")

    async with embedded(workers=1) as stack:
        view = await stack.wait(await stack.submit(toy_request(tmp_path / "bare")), timeout=30)

    assert view["status"] == "failed"
    assert "has no manifest.json" in view["reason"]


async def test_entrypoint_that_cannot_be_imported_fails_the_job(embedded: StackFactory, toy_dataset: Path) -> None:
    # Allowed by the entrypoint policy (tests.toyjobs.*), absent on the workers
    request = {**toy_request(toy_dataset), "entrypoint": "tests.toyjobs.no_such_module:fl_train_model"}

    async with embedded(workers=1) as stack:
        view = await stack.wait(await stack.submit(request), timeout=60)

    assert view["status"] == "failed"
    assert "module 'tests.toyjobs.no_such_module' cannot be imported: ModuleNotFoundError" in view["reason"]


async def test_entrypoint_outside_the_allowed_patterns_is_rejected(embedded: StackFactory, toy_dataset: Path) -> None:
    request = {**toy_request(toy_dataset), "entrypoint": "no_such_pkg.train:fl_train_model"}

    async with embedded(workers=1) as stack:
        view = await stack.wait(await stack.submit(request), timeout=60)

    assert view["status"] == "rejected"
    assert "entrypoint: 'no_such_pkg.train:fl_train_model' is not allowed here" in view["reason"]


async def test_entrypoint_that_raises_fails_the_job_without_waiting_for_the_timeout(
    embedded: StackFactory, toy_dataset: Path
) -> None:
    request = toy_request(toy_dataset, aggregation_timeout=600, fault_tolerance=1)
    request["config"] = {"mode": "raise"}

    async with embedded(workers=2) as stack:
        view = await stack.wait(await stack.submit(request), timeout=90)
        workers_alive = all(w.runner.pid is None or w.runner.pid > 0 for w in stack.workers)

    assert view["status"] == "failed"
    assert "failed 2 time(s) in a row" in view["reason"]
    assert "RuntimeError: toy failure on shard" in view["reason"]
    assert "toy.py:" in view["reason"]
    assert workers_alive


def test_apiary_run_trains_digits_to_90_percent(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "examples/digits/prepare.py"], cwd=REPO, check=True, capture_output=True)
    env = {"APIARY_HOME": str(tmp_path / ".apiary"), "PATH": str(Path(sys.executable).parent)}

    done = subprocess.run(
        [sys.executable, "-m", "services.app.cli", "run", "examples/digits/job.yaml", "--workers", "3", "--json"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )

    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["status"] == "completed"
    assert summary["rounds_completed"] == 5
    assert summary["metrics"]["accuracy"] >= 0.90
    assert Path(summary["final_model"].removeprefix("file://")).is_file()


async def test_jobs_running_at_once_on_the_same_workers_keep_to_their_own_weights(
    embedded: StackFactory, toy_dataset: Path, tmp_path: Path
) -> None:
    # Prepare: two jobs with different rounds and shard counts, sharing two workers. The first one's shard 0 waits
    # at a gate from round 2 on until the second job has started a round: left alone, the first could end (in 0.2 s)
    # before the second's init task was back from a worker whose training process was still importing torch (seen
    # under load), and nothing would have run at once. One worker stays free for the second job meanwhile.
    gates = Gates(tmp_path, opened=1)
    three_rounds = {**toy_request(toy_dataset, num_rounds=3, max_workers=3),
                    "config": {"mode": "gated", "gate": gates.path, "fail_shards": [0]}}
    two_rounds = {**toy_request(toy_dataset, num_rounds=2, min_workers=1, max_workers=2), "name": "toy-b"}

    async with embedded(workers=2) as stack:
        # Execute
        first, second = await stack.submit(three_rounds), await stack.submit(two_rounds)
        deadline = time.monotonic() + 120
        while not await stack.ports.db.fetch("SELECT 1 FROM rounds WHERE job_id = $1 AND round >= 1", second):
            assert time.monotonic() < deadline, "the second job never started a round"
            await asyncio.sleep(0.05)
        gates.open_through(3)
        views = {job: await stack.wait(job, timeout=120) for job in (first, second)}
        finals, rounds = {}, {}
        for job in (first, second):
            finals[job] = loads(await stack.ports.storage.get_bytes(keys.final_model(job)))
            rows = await stack.ports.db.fetch(
                "SELECT round, shard, samples FROM contributions WHERE job_id = $1 AND status = 'accepted'"
                " ORDER BY round, shard", job,
            )
            rounds[job] = [[(r["shard"], r["samples"]) for r in rows if r["round"] == n]
                           for n in sorted({r["round"] for r in rows})]
        span = {job: await stack.ports.db.fetchrow(
            "SELECT min(started_at) AS started, max(ended_at) AS ended FROM rounds WHERE job_id = $1", job)
            for job in (first, second)}

    # Assert: the second job did not wait for the first to end; each job's model is its own rounds'
    # FedAvg from its own start, with nothing of the other's.
    assert span[second]["started"] < span[first]["ended"], span
    for job, num_rounds, shards in ((first, 3, 3), (second, 2, 2)):
        assert views[job]["status"] == "completed", views[job].get("reason")
        assert len(rounds[job]) == num_rounds and all(len(r) == shards for r in rounds[job]), rounds[job]
        # Shard s adds s + 1 each round: the final weight is the sum of each round's weighted mean.
        added = sum(sum(n * (s + 1) for s, n in r) / sum(n for _, n in r) for r in rounds[job])
        torch.testing.assert_close(finals[job]["layer.weight"], torch.full((2, 3), added))
        torch.testing.assert_close(finals[job]["layer.bias"], torch.arange(2, dtype=torch.float32) + added)
        assert int(finals[job]["steps"]) == num_rounds


async def test_each_shard_goes_back_to_the_worker_that_trained_it_last_round(
    embedded: StackFactory, toy_dataset: Path
) -> None:
    # Evaluated only after the last round: an evaluation task would keep a worker busy as the next round
    # starts, and its preferred shard rightly go to another.
    request = toy_request(toy_dataset, num_rounds=4, min_workers=3, max_workers=3, evaluate_every=0)
    async with embedded(workers=3) as stack:
        job_id = await stack.submit(request)
        done = await stack.wait(job_id, timeout=120)
        rows = await stack.ports.db.fetch(
            "SELECT round, shard, worker_id FROM contributions WHERE job_id = $1 AND status = 'accepted'", job_id)

    # Round 1 takes shards from the pool in any order; from round 2 each shard is offered first to the
    # worker that has its data (all are idle when a round starts), so none downloads another shard.
    assert done["status"] == "completed", done.get("reason")
    by_shard: dict[int, list[str]] = {}
    for row in sorted(rows, key=lambda r: r["round"]):
        by_shard.setdefault(row["shard"], []).append(row["worker_id"])
    assert len(by_shard) == 3 and all(len(workers) == 4 for workers in by_shard.values()), by_shard
    assert all(len(set(workers)) == 1 for workers in by_shard.values()), by_shard


def _slow_then_quick(dataset: Path, *, slow_shards: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A job of 10-minute shards, and a quick one-round job to run after it."""
    slow = {**toy_request(dataset, num_rounds=2, min_workers=1, max_workers=slow_shards),
            "config": {"mode": "slow", "slow_seconds": 600}}
    return slow, toy_request(dataset, num_rounds=1, min_workers=1, max_workers=1)


async def test_a_worker_training_a_pinned_shard_leaves_pool_shards_to_idle_workers(
    embedded: StackFactory, toy_dataset: Path
) -> None:
    # Prepare: one of two workers trains a 10-minute shard pinned to it.
    slow, quick = _slow_then_quick(toy_dataset, slow_shards=1)
    async with embedded(workers=2) as stack:
        busy, idle = (w.worker_id for w in stack.workers)
        slow_id = await stack.submit({**slow, "worker_selection": {"mode": "pinned", "workers": [busy]}})
        await stack.wait(slow_id, timeout=60, until=lambda v: [s["state"] for s in v["shards"]] == ["training"])

        # Execute: a pool job of four one-shard rounds runs meanwhile.
        quick_id = await stack.submit({**quick, "distributed": {**quick["distributed"], "num_rounds": 4}})
        done = await stack.wait(quick_id, timeout=60)
        trainers = await stack.ports.db.fetch(
            "SELECT DISTINCT worker_id FROM contributions WHERE job_id = $1", quick_id)
        await stack.cancel(slow_id, "test over")

    # Assert: every round went to the idle worker; none waited behind the pinned shard (a pool
    # assignment the busy worker's pool consumer took was given back at once).
    assert done["status"] == "completed", done.get("reason")
    assert [t["worker_id"] for t in trainers] == [idle]


async def test_cancelling_a_job_stops_its_training_at_once_and_frees_the_worker(
    embedded: StackFactory, toy_dataset: Path
) -> None:
    # Prepare: the only worker is 10 minutes into... a 10-minute shard.
    slow, quick = _slow_then_quick(toy_dataset, slow_shards=1)
    async with embedded(workers=1) as stack:
        worker = stack.workers[0]
        slow_id = await stack.submit(slow)
        await stack.wait(slow_id, timeout=60, until=lambda v: [s["state"] for s in v["shards"]] == ["training"])
        child = worker.runner.pid

        # Execute
        cancelled = await stack.cancel(slow_id, "cancelled by user")
        quick_id = await stack.submit(quick)
        done = await stack.wait(quick_id, timeout=120)
        # worker.initialized is round 0's report (fl_init_weights), sent before the shard was assigned.
        events = await stack.ports.db.fetch(
            "SELECT routing_key FROM events WHERE job_id = $1 AND routing_key LIKE 'worker.%'"
            " AND routing_key <> 'worker.initialized'", slow_id)
        slow_view = await stack.wait(slow_id, timeout=1)
        aggregations = await stack.ports.db.fetch(
            "SELECT status, reason FROM aggregations WHERE job_id = $1", slow_id)
        held = stack.aggregator.rounds_in_memory()

    # Assert: the next job ran on that worker long before the shard would have ended; its training child
    # was stopped; nothing was reported for the stopped shard, which shows as stopped.
    assert cancelled is not None and cancelled["status"] == "cancelled"
    assert done["status"] == "completed", done.get("reason")
    assert child is not None and not process_alive(child)
    assert {e["routing_key"] for e in events} <= {"worker.progress"}
    assert [s["state"] for s in slow_view["shards"]] == ["stopped"]
    assert [r["status"] for r in slow_view["rounds"]] == ["cancelled"]
    # The aggregator closed the round too, rather than hold its sum until the round's timeout.
    assert [(a["status"], a["reason"]) for a in aggregations] == [("cancelled", "job cancelled: cancelled by user")]
    assert not [r for r in held if r[0] == slow_id]


async def test_a_worker_started_after_a_job_ended_skips_its_assignments_still_queued(
    embedded: StackFactory, toy_dataset: Path
) -> None:
    # Prepare: two 10-minute shards of a job wait in the pool, nobody listening, when it is cancelled.
    slow, quick = _slow_then_quick(toy_dataset, slow_shards=2)
    async with embedded(workers=1) as stack:
        slow_id = await stack.submit(slow)
        await stack.wait(slow_id, timeout=60, until=lambda v: "training" in [s["state"] for s in v["shards"]])
        await stack.workers[0].stop()  # its shard goes back to the pool
        await stack.cancel(slow_id, "cancelled by user")
        for _ in range(100):
            if await stack.ports.storage.exists(keys.job_ended(slow_id)):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the aggregator stored no end marker for the cancelled job")
        late = Worker(stack.ports.bus, stack.settings, worker_id="late")

        # Execute: a worker that never heard of the cancel starts, and a quick job follows.
        await late.start()
        try:
            quick_id = await stack.submit(quick)
            done = await stack.wait(quick_id, timeout=120)
        finally:
            await late.stop()
        events = await stack.ports.db.fetch(
            "SELECT routing_key FROM events WHERE job_id = $1 AND routing_key IN ('worker.done', 'worker.failed')",
            slow_id)

    # Assert: it read the job's end marker and skipped both shards, so the quick job ran at once.
    assert done["status"] == "completed", done.get("reason")
    assert late.slot.completed == 1
    assert events == []



class _Momentum(Strategy):
    """Test-only stateful strategy: FedAvg's step plus half the previous round's (server state: velocity)."""

    name = "test_momentum"

    def __init__(self, params: BaseModel | None = None) -> None:
        super().__init__(params)
        self._sum, self._velocity = WeightedSum(), dict[str, torch.Tensor]()

    def _begin(self) -> None:
        self._sum = WeightedSum()

    def _fold(self, contribution: Contribution) -> None:
        self._sum.fold(contribution.weights, contribution.samples)

    def wants_global_weights(self) -> bool:
        return True

    def _aggregate(self, global_weights: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        assert global_weights is not None
        average = self._sum.finish()
        for name, value in average.items():
            if value.is_floating_point():
                previous = self._velocity.get(name)
                step = value - global_weights[name]
                self._velocity[name] = step if previous is None else 0.5 * previous + step
                average[name] = global_weights[name] + self._velocity[name]
        return average

    def state(self) -> dict[str, torch.Tensor]:
        return dict(self._velocity)

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self._velocity = {name: tensor.clone() for name, tensor in state.items()}


class _Median(Strategy):
    """Test-only strategy that cannot fold: the element-wise median, read back from storage at the close."""

    name = "test_median"
    streaming = False

    def _begin(self) -> None:
        pass

    def _fold(self, contribution: Contribution) -> None:
        pass

    def _aggregate(self, global_weights: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        raise AssertionError("a strategy that does not stream is finished from the stored contributions")

    def _read_back(self, stored: StoredContributions,
                   global_weights: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        return {name: torch.stack(stored.tensor(name)).median(dim=0).values for name in self.spec}


class _Refusing(_Momentum):
    """Test-only strategy that cannot aggregate any round (as Krum with too few contributions)."""

    name = "test_refusing"

    def _aggregate(self, global_weights: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        raise ValueError("needs more contributions than arrived")


@pytest.fixture
def test_strategies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test-only strategies, registered for this test alone."""
    base.known()  # the real ones first, so a later discovery does not run over these
    for cls in (_Momentum, _Median, _Refusing):
        monkeypatch.setitem(base._REGISTRY, cls.name, cls)


async def test_a_stateful_strategy_carries_its_server_state_from_round_to_round(
        embedded: StackFactory, toy_dataset: Path, test_strategies: None) -> None:
    async with embedded(workers=3) as stack:
        job_id = await stack.submit(toy_request(toy_dataset, num_rounds=3, strategy="test_momentum"))
        view = await stack.wait(job_id, timeout=120)
        rows = await stack.ports.db.fetch(
            "SELECT round, state_key FROM aggregations WHERE job_id = $1 ORDER BY round", job_id)
        final = loads(await stack.ports.storage.get_bytes(keys.final_model(job_id)))
        last_state = loads(await stack.ports.storage.get_bytes(rows[-1]["state_key"]))

    assert view["status"] == "completed", view.get("reason")
    assert [(r["round"], r["state_key"]) for r in rows] == [
        (i, keys.strategy_state(job_id, i)) for i in (1, 2, 3)]
    step = (5 * 1 + 4 * 2 + 4 * 3) / 13  # FedAvg's step each round; velocity 1, 1.5, 1.75 steps
    torch.testing.assert_close(final["layer.bias"], torch.tensor([0.0, 1.0]) + 4.25 * step)
    torch.testing.assert_close(last_state["layer.bias"], torch.full((2,), 1.75 * step))
    assert view["strategy"] == "test_momentum" and view["strategy_params"] == {}


@pytest.mark.parametrize("strategy", ["test_median", "fedmedian"])
async def test_a_strategy_that_cannot_fold_reads_the_stored_contributions_back(
        embedded: StackFactory, toy_dataset: Path, test_strategies: None, strategy: str) -> None:
    async with embedded(workers=3) as stack:
        job_id = await stack.submit(toy_request(toy_dataset, num_rounds=2, strategy=strategy))
        view = await stack.wait(job_id, timeout=120)
        final = loads(await stack.ports.storage.get_bytes(keys.final_model(job_id)))

    assert view["status"] == "completed", view.get("reason")
    # Shards add 1, 2 and 3 each round: the median moves every float weight by 2 a round.
    torch.testing.assert_close(final["layer.bias"], torch.tensor([4.0, 5.0]))
    assert int(final["steps"]) == 2


async def test_a_strategy_that_cannot_aggregate_fails_the_round_with_its_reason(
        embedded: StackFactory, toy_dataset: Path, test_strategies: None) -> None:
    async with embedded(workers=3) as stack:
        job_id = await stack.submit(toy_request(toy_dataset, num_rounds=2, strategy="test_refusing"))
        view = await stack.wait(job_id, timeout=120)
        rounds = await stack.ports.db.fetch(
            "SELECT round, status, reason FROM aggregations WHERE job_id = $1 ORDER BY round", job_id)

    assert view["status"] == "failed"
    assert [(r["round"], r["status"]) for r in rounds] == [(1, "failed")]
    assert rounds[0]["reason"] == "strategy test_refusing cannot aggregate this round: needs more contributions" \
        " than arrived"


async def test_an_unknown_strategy_is_rejected_naming_the_field(embedded: StackFactory, toy_dataset: Path) -> None:
    async with embedded(workers=1) as stack:
        view = await stack.wait(await stack.submit(toy_request(toy_dataset, strategy="fedmagic")), timeout=30)

    assert view["status"] == "rejected"
    assert [e["field"] for e in view["errors"]] == ["distributed.strategy"]
    assert "unknown strategy 'fedmagic'; known: " in view["errors"][0]["message"]

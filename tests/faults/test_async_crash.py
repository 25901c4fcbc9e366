"""Mode async (FedBuff) on the deployed services (RabbitMQ, PostgreSQL, S3): the aggregator killed with SIGKILL
mid-buffer resumes the same buffer, and every version is FedBuff's step over exactly the updates it folded,
each counted once, as an undisturbed run given the same arrivals would make it."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from apiary.weights import loads
from tests.faults.support import Faults, new_id, toy_job
from tests.fixtures import fedbuff
from tests.toyjobs.toy import Gates

Record = Callable[[str, str, str, int], None]
Data = Callable[[int], Path]


def test_aggregator_killed_mid_buffer_resumes_it_and_makes_fedbuffs_versions(
        faults: Faults, toy_data: Data, outcome: Record, tmp_path: Path) -> None:
    cluster = faults.cluster
    cluster.start(workers=3)
    job_id = new_id("kill-aggregator-async")
    # Each training task is held until its gate opens (tasks are numbered in the order they are handed out): the
    # first four report, three make version 1 and one lands in version 2's buffer; the rest wait until the
    # aggregator has been killed and restarted, so the kill comes mid-buffer however loaded the machine is.
    gates = Gates(tmp_path, opened=4, by="attempt")
    request = toy_job(job_id, toy_data(15), rounds=4, min_workers=3, max_workers=3,
                      config={"mode": "gated", "gate": gates.path})
    request["distributed"].update({"mode": "async", "evaluate_every": 0,
                                   "async": {"buffer_size": 3, "staleness_weight": "polynomial",
                                             "server_learning_rate": 0.8, "server_momentum": 0.5}})
    cluster.publish_job(request)

    def mid_buffer() -> bool:
        return bool(faults.query("SELECT 1 FROM async_folds f JOIN aggregations a ON a.job_id = f.job_id AND"
                                 " a.round = f.version WHERE f.job_id = $1 AND f.version = 2 AND a.status = 'open'",
                                 job_id))

    cluster.wait_for(mid_buffer, 120, "an update folded into version 2's buffer")
    cluster.kill("aggregator", signal.SIGKILL)
    at_kill = len(faults.query("SELECT 1 FROM async_folds WHERE job_id = $1 AND version = 2", job_id))
    cluster.start_service("aggregator")
    # The rest go once the aggregator consumes again (while it starts, each report would only free its slot for the
    # next task: tasks would churn, their reports queued for it).
    cluster.wait_for(lambda: cluster.consumers("aggregator"), 60, "the restarted aggregator to consume")
    gates.open_through(200, first=5)
    job = cluster.wait_job(job_id)

    assert job["status"] == "completed", job["reason"]
    assert at_kill == 1, "the kill came mid-buffer, after the one update let through"
    folds = faults.query("SELECT * FROM async_folds WHERE job_id = $1 ORDER BY seq", job_id)
    tasks = {(t["round"], t["attempt"], t["shard"]): t
             for t in faults.query("SELECT * FROM async_tasks WHERE job_id = $1", job_id)}
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def weights(key: str) -> dict[str, torch.Tensor]:
        if key not in cache:
            cache[key] = loads(faults.object(key))
        return cache[key]

    def start_of(fold: Any) -> dict[str, torch.Tensor]:
        return weights(tasks[(fold["round"], fold["attempt"], fold["shard"])]["weights_key"])

    versions = fedbuff.folded_versions(folds, lambda f: weights(f["result_key"]), start_of)
    assert [len(v) for v in versions] == [3, 3, 3, 3]
    expected = fedbuff.fedbuff(faults.global_weights(job_id, 0), versions,
                               g=lambda s: fedbuff.weight("polynomial", s), lr=0.8, momentum=0.5)
    for index, want in enumerate(expected, start=1):
        made = faults.global_weights(job_id, index)
        for name, tensor in want.items():
            torch.testing.assert_close(made[name].double(), tensor, rtol=1e-5, atol=1e-5)
    double = faults.double_counted(job_id)
    folded_twice = len(folds) - len({(f["round"], f["attempt"], f["shard"]) for f in folds})
    assert double == 0 and folded_twice == 0
    outcome("aggregator kill -9 mid-buffer of an async (FedBuff) job",
            "restarted aggregator re-folds the buffer's rows; each version FedBuff's step over its updates",
            f"{job['status']}; {at_kill} of 3 updates of version 2 folded at the kill; 4 versions of 3 updates each,"
            f" staleness {[f['staleness'] for f in folds]}; every version equal to the FedBuff replay",
            double + folded_twice)

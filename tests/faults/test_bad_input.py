"""Bad input never poisons state: undecodable and schema-violating messages, corrupt contributions,
malformed job requests."""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import pytest
import torch

from apiary import keys
from apiary.bus.identity import worker_user
from apiary.contracts import JSON, ObjectRef, WorkerDone, WorkerFailed
from apiary.weights import dumps as dump_weights
from tests.faults.support import Faults, msgpack_of, new_id, toy_job
from tests.fixtures.services import rabbitmqctl
from tests.toyjobs.toy import Gates, fl_init_weights

Record = Callable[[str, str, str, int], None]
Data = Callable[[int], Path]


@pytest.mark.queue_types
def test_poison_messages_are_dead_lettered_with_their_reason_and_services_keep_running(
        faults: Faults, toy_data: Data, outcome: Record) -> None:
    cluster = faults.cluster
    cluster.start(workers=1)
    poison: list[tuple[str, bytes, str, str]] = [
        # routing key, body, content type, what the reason must say
        ("worker.done", b"\xc1\xc1 garbage", "application/msgpack", "not valid application/msgpack"),
        ("worker.failed", b"{not json", JSON, "not valid application/json"),
        ("round.aggregated", msgpack_of({"job_id": "x", "round": "one"}), "application/msgpack", "malformed"),
        ("round.timeout", msgpack_of([1, 2, 3]), "application/msgpack", "must be a map"),
        ("job.sharded", msgpack_of({"v": 99, "job_id": "x"}), "application/msgpack", "schema version 99"),
        # Two services hear a heartbeat (the scheduler and the tracker), and either may dead-letter it first: each
        # reason names the field at fault.
        ("worker.heartbeat", msgpack_of({"worker_id": ["not", "a", "string"]}), "application/msgpack", "worker_id"),
        ("assign.pool", msgpack_of({"job_id": "x", "round": 1, "shard": "zero"}), "application/msgpack",
         "malformed"),
        ("job.requested", b"\x00\xff\xfe", "application/msgpack", "not valid application/msgpack"),
    ]

    sent = {faults.publish(key, body, content_type=ctype): (key, must) for key, body, ctype, must in poison}
    dead: list[dict[str, Any]] = []

    def all_dead() -> bool:
        dead.extend(faults.dead_letters())
        return {d["message_id"] for d in dead} >= set(sent)

    cluster.wait_for(all_dead, 60, "every poison message to reach the dead-letter queue")
    for letter in dead:
        key, must = sent[letter["message_id"]]
        assert letter["routing_key"] == key
        assert letter["reason"], letter
    for message_id, (key, must) in sent.items():
        reasons = [d["reason"] for d in dead if d["message_id"] == message_id]
        assert any(must in r for r in reasons), (key, must, reasons)
    alive = faults.alive()
    job_id = new_id("after-poison")
    cluster.publish_job(toy_job(job_id, toy_data(8), rounds=1, max_workers=2))
    sizes = faults.shard_sizes(job_id)
    job = cluster.wait_job(job_id)

    assert all(alive.values()), alive
    assert job["status"] == "completed", job["reason"]
    weights, double = faults.check_exact(job_id, [sizes])
    outcome(f"poison messages ({len(poison)}: garbage bytes, bad JSON, wrong schema/version, not a map)",
            "each dead-lettered with x-apiary-reason; no process exits; the next job is exact",
            f"{len(set(d['message_id'] for d in dead))} messages in {len(dead)} dead letters (one per consuming"
            f" queue), reasons e.g. {dead[0]['reason'][:60]!r}; all processes up; next job {job['status']},"
            f" {weights}", double)


def test_malformed_job_request_is_rejected_naming_each_bad_field(faults: Faults, outcome: Record) -> None:
    cluster = faults.cluster
    cluster.start(workers=0)
    job_id = new_id("malformed")

    cluster.publish_job({"job_id": job_id, "name": "", "entrypoint": 5, "dataset": "x",
                         "distributed": {"num_rounds": 0, "min_workers": 3, "max_workers": 2},
                         "colour": "blue"})
    view = cluster.wait_for(lambda: (v := faults.status_cli(job_id)[0]) and v["status"] == "rejected" and v, 60,
                            "the job to be rejected")

    fields = {e["field"] for e in view["errors"]}
    assert {"name", "entrypoint", "distributed.num_rounds", "colour"} <= fields, view["errors"]
    assert all(f in view["reason"] for f in ("entrypoint", "distributed.num_rounds", "colour"))
    assert cluster.job(job_id) is None
    outcome("malformed job request (5 bad fields)", "job.rejected naming each bad field",
            f"rejected: {view['reason'][:90]}…", 0)


def test_a_strategy_the_job_cannot_satisfy_is_rejected_before_it_starts(faults: Faults, outcome: Record) -> None:
    cluster = faults.cluster
    cluster.start(workers=0)
    job_id = new_id("krum-too-many-malicious")

    cluster.publish_job({"job_id": job_id, "name": "krum", "entrypoint": "pkg.train", "dataset": "x",
                         "distributed": {"min_workers": 3, "max_workers": 5, "strategy": "krum",
                                         "strategy_params": {"num_malicious_nodes": 2}}})
    view = cluster.wait_for(lambda: (v := faults.status_cli(job_id)[0]) and v["status"] == "rejected" and v, 60,
                            "the job to be rejected")

    assert [e["field"] for e in view["errors"]] == ["distributed.strategy_params"], view["errors"]
    assert view["reason"].startswith("job request rejected: distributed.strategy_params: ")
    assert view["strategy"] == "krum" and cluster.job(job_id) is None
    outcome("krum whose num_malicious_nodes the job's 5 workers cannot satisfy (2f+3)",
            "job.rejected naming distributed.strategy_params, before sharding", f"rejected: {view['reason'][:90]}…", 0)


def _forged(base: dict[str, torch.Tensor], shard: int) -> dict[str, torch.Tensor]:
    """What the toy would return for this shard in round 1: a valid contribution to corrupt."""
    return {k: v + (shard + 1 if v.is_floating_point() else 1) for k, v in base.items()}


def test_corrupt_contributions_are_rejected_with_their_reason(
        faults: Faults, toy_data: Data, outcome: Record) -> None:
    cluster = faults.cluster
    cluster.start(workers=["site-a"])
    ghosts = [f"ghost-{i}" for i in range(1, 13)]
    job_id = new_id("corrupt")
    cluster.publish_job(toy_job(job_id, toy_data(26), rounds=1, max_workers=13, pinned=["site-a", *ghosts]))
    sizes = faults.shard_sizes(job_id)
    faults.wait_aggregation(job_id, 1, "open")
    # The corrupt ones come after the valid one is in the sum: a NaN found in a tensor after others
    # were added (shard 5: 'layer.weight' follows 'layer.bias') makes the aggregator rebuild the sum.
    cluster.wait_for(lambda: faults.accepted(job_id), 120, "site-a's contribution to be accepted")
    base = fl_init_weights({})
    # Each ghost holds its assignment: the reports below are the assigned workers' own, judged on their content.
    secrets = {a.shard: a.secret for g in ghosts for a in faults.assignments(f"assign.worker.{g}")}

    def weights(shard: int, change: Callable[[dict[str, torch.Tensor]], None]) -> bytes:
        w = _forged(base, shard)
        change(w)
        return dump_weights(w)

    def nan(w: dict[str, torch.Tensor]) -> None:
        w["layer.weight"][0, 0] = float("nan")

    def inf(w: dict[str, torch.Tensor]) -> None:
        w["layer.bias"][1] = float("inf")

    def valid(shard: int) -> bytes:
        return weights(shard, lambda w: None)

    cases: dict[int, tuple[bytes | None, int, str, str]] = {
        # shard: (bytes stored, samples announced, how the claim lies, what the reason must say)
        1: (weights(1, lambda w: w.pop("layer.bias")), 2, "", "missing ['layer.bias']"),
        2: (weights(2, lambda w: w.update({"layer.extra": torch.ones(1)})), 2, "", "extra ['layer.extra']"),
        3: (weights(3, lambda w: w.update({"layer.weight": torch.zeros(3, 3)})), 2, "",
            "'layer.weight' is float32[3, 3], expected float32[2, 3]"),
        4: (weights(4, lambda w: w.update({"layer.weight": w["layer.weight"].double()})), 2, "",
            "'layer.weight' is float64[2, 3], expected float32[2, 3]"),
        5: (weights(5, nan), 2, "", "'layer.weight' has NaN or infinite values"),
        6: (weights(6, inf), 2, "", "'layer.bias' has NaN or infinite values"),
        7: (valid(7), 0, "", "sample count must be a positive integer, got 0"),
        8: (valid(8), -4, "", "sample count must be a positive integer, got -4"),
        9: (valid(9), 2, "sha256", "sha256 mismatch"),
        10: (valid(10), 2, "size", "does not match the announced"),
        11: (None, 2, "", "is missing"),
        12: (b"\x08\x00\x00\x00\x00\x00\x00\x00not json", 2, "", "safetensors header is not JSON"),
    }

    for shard, (data, samples, lie, _) in cases.items():
        key = keys.contribution(job_id, 1, 1, shard)
        if data is None:
            ref = ObjectRef(key=key, size=100, sha256="0" * 64)
        else:
            ref = faults.put_object(key, data)
        if lie == "sha256":
            ref = ObjectRef(key=key, size=ref.size, sha256=hashlib.sha256(b"other").hexdigest())
        elif lie == "size":
            ref = ObjectRef(key=key, size=ref.size + 1, sha256=ref.sha256)
        faults.publish_event(WorkerDone(job_id=job_id, round=1, attempt=1, worker_id=f"ghost-{shard}", shard=shard,
                                        result=ref, samples=samples, secret=secrets[shard] or ""))
    job = cluster.wait_job(job_id)

    assert job["status"] == "completed", job["reason"]
    rows = {r["shard"]: r for r in faults.contributions(job_id)}
    assert rows[0]["status"] == "accepted" and rows[0]["worker_id"] == "site-a"
    for shard, (_, _, _, must) in cases.items():
        assert rows[shard]["status"] == "rejected", rows[shard]
        assert must in rows[shard]["reason"], (shard, rows[shard]["reason"])
    assert len(rows) == 13 and len(faults.contributions(job_id)) == 13
    view, _ = faults.status_cli(job_id)
    assert sorted(s["shard"] for s in view["shards"] if s["state"] == "rejected") == list(cases)
    weights_line, double = faults.check_exact(job_id, [{0: sizes[0]}])
    outcome("corrupt contributions (missing key, extra key, shape, dtype, NaN, inf, samples 0 and -4,"
            " sha256 and size mismatch, missing object, not safetensors), each from its assigned worker",
            "each rejected with its reason; the round averages only the valid shard",
            f"12 rejected with reasons (e.g. {rows[4]['reason'][:50]!r}); round 1 = shard 0 only; {weights_line}",
            double)


def test_forged_reports_never_take_the_genuine_reports_place(faults: Faults, toy_data: Data, outcome: Record,
                                                             tmp_path: Path) -> None:
    cluster = faults.cluster
    cluster.start(workers=1)
    job_id = new_id("forged")
    gates = Gates(tmp_path)  # shard 0 trains until the forged reports are recorded
    cluster.publish_job(toy_job(job_id, toy_data(8), rounds=1, max_workers=1,
                                config={"mode": "gated", "gate": gates.path}))
    sizes = faults.shard_sizes(job_id)
    faults.wait_aggregation(job_id, 1, "open")
    skewed = {k: v + 1000 if v.is_floating_point() else v for k, v in fl_init_weights({}).items()}
    elsewhere = faults.put_weights(f"jobs/{job_id}/elsewhere/shard-0.safetensors", skewed)
    upload = ObjectRef(key=keys.contribution(job_id, 1, 1, 0), size=elsewhere.size, sha256=elsewhere.sha256)

    # Execute: while worker-1 trains shard 0, four reports claim it: one pointing at another object, one
    # with a guessed secret, a failure with a guessed secret, and one published by another worker's
    # broker user under worker-1's name.
    faults.publish_event(WorkerDone(job_id=job_id, round=1, worker_id="worker-1", shard=0, result=elsewhere,
                                    samples=1000))
    faults.publish_event(WorkerDone(job_id=job_id, round=1, worker_id="worker-1", shard=0, result=upload,
                                    samples=1000, secret="guessed"))
    faults.publish_event(WorkerFailed(job_id=job_id, round=1, worker_id="worker-1", shard=0, error="forged failure",
                                      secret="guessed"))
    with broker_user(cluster.amqp_url, worker_user("intruder")) as intruder:
        faults.publish_event(WorkerDone(job_id=job_id, round=1, worker_id="worker-1", shard=0, result=upload,
                                        samples=1000), url=intruder)
    cluster.wait_for(lambda: len(faults.query(
        "SELECT 1 FROM contributions WHERE job_id = $1 AND status = 'forged'", job_id)) == 4, 60,
        "the four forged reports to be recorded")
    gates.open_through(1)
    job = cluster.wait_job(job_id)

    # Assert: each forged one is recorded with why, never counted; the genuine one that follows is taken.
    assert job["status"] == "completed", job["reason"]
    rows = faults.contributions(job_id)
    forged = [r["reason"] for r in rows if r["status"] == "forged"]
    assert [(r["shard"], r["status"], r["worker_id"]) for r in rows if r["status"] != "forged"] == [
        (0, "accepted", "worker-1")]
    assert len(forged) == 4 and sum("is not this shard's upload" in r for r in forged) == 1, forged
    assert sum(r == "a wrong assignment secret for shard 0" for r in forged) == 2, forged
    assert sum("no assignment secret" in r for r in forged) == 1, forged
    weights, double = faults.check_exact(job_id, [sizes])
    outcome("forged worker.done / worker.failed for shard 0 while its worker trains it: another object, a wrong"
            " secret, a failure with a wrong secret, and another worker's broker user",
            "each recorded 'forged' with why, never counted; the genuine report that follows is taken",
            f"4 forged, then shard 0 accepted from worker-1; {weights}", double)


@contextlib.contextmanager
def broker_user(amqp_url: str, name: str) -> Iterator[str]:
    """A broker user of this name with full rights on the vhost, as `apiary broker setup` would make a
    worker's; yields the URL to connect as it."""
    password = uuid.uuid4().hex
    rabbitmqctl("add_user", name, password)
    try:
        rabbitmqctl("set_permissions", "-p", "/", name, ".*", ".*", ".*")
        parts = urlsplit(amqp_url)
        yield urlunsplit(parts._replace(netloc=f"{quote(name, safe='')}:{password}@{parts.hostname}:{parts.port}"))
    finally:
        rabbitmqctl("delete_user", name)


def test_a_request_published_before_the_scheduler_ever_started_is_answered_once_it_starts(
        faults: Faults, toy_data: Data, outcome: Record) -> None:
    cluster = faults.cluster
    # Prepare: the tracker alone (so the exchange exists); the scheduler has never run on this broker.
    cluster.start_service("tracker")
    cluster.wait_for(lambda: cluster.consumers("tracker"), 60, "the tracker to consume")
    job_id = new_id("before-scheduler")

    # Execute: a request comes first; then the other services and a worker start.
    cluster.publish_job(toy_job(job_id, toy_data(8), rounds=1, max_workers=1))
    for name in ("sharder", "aggregator", "scheduler"):
        cluster.start_service(name)
    cluster.start_worker("worker-1")
    job = cluster.wait_job(job_id)

    # Assert
    assert job["status"] == "completed", job["reason"]
    weights, double = faults.check_exact(job_id, [faults.shard_sizes(job_id)])
    outcome("job request published before the scheduler ever started (only the tracker up)",
            "kept in the scheduler's queue (declared by every process) and answered once it starts",
            f"job {job['status']}; {weights}", double)


def test_a_request_reaching_outside_what_the_operator_allows_is_rejected_naming_each_field(
        faults: Faults, outcome: Record) -> None:
    cluster = faults.cluster
    cluster.start(workers=0)
    job_id = new_id("outside-policy")

    cluster.publish_job({"job_id": job_id, "name": "outside", "entrypoint": "os:system", "dataset": "/etc",
                         "model": "/root/model.safetensors"})
    view = cluster.wait_for(lambda: (v := faults.status_cli(job_id)[0]) and v["status"] == "rejected" and v, 60,
                            "the job to be rejected")

    errors = {e["field"]: e["message"] for e in view["errors"]}
    assert list(errors) == ["entrypoint", "dataset", "model"], errors
    assert errors["entrypoint"] == "'os:system' is a standard-library module, not training code"
    assert errors["dataset"].startswith("/etc is outside the folders local data may be read from")
    assert cluster.job(job_id) is None
    outcome("job request with entrypoint os:system, dataset /etc and model /root/...",
            "job.rejected naming entrypoint, dataset and model; nothing runs", f"rejected: {view['reason'][:100]}…", 0)


def _zip_dataset(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_a_zip_bomb_and_an_escaping_zip_member_are_refused_before_anything_is_unpacked(
        faults: Faults, tmp_path: Path, outcome: Record) -> None:
    cluster = faults.cluster
    cluster.start(workers=1)
    manifest = json.dumps({"samples": [{"path": "a.txt"}, {"path": "b.txt"}]}).encode()
    cases = {
        "zip-bomb": (_zip_dataset(tmp_path / "bomb.zip", {"manifest.json": manifest, "a.txt": b"a",
                                                           "b.txt": bytes(256 * 1024 * 1024)}), "zip bomb"),
        "zip-escape": (_zip_dataset(tmp_path / "escape.zip", {"manifest.json": manifest, "a.txt": b"a",
                                                               "b.txt": b"b", "../../evil.txt": b"x"}),
                       "member '../../evil.txt' must stay inside the archive"),
    }
    jobs = {}
    for case, (dataset, _) in cases.items():
        jobs[case] = new_id(case)
        cluster.publish_job(toy_job(jobs[case], dataset, rounds=1, max_workers=1))

    ended = {case: cluster.wait_job(job_id) for case, job_id in jobs.items()}

    for case, (_, must) in cases.items():
        assert ended[case]["status"] == "failed", ended[case]
        assert must in ended[case]["reason"], ended[case]["reason"]
    assert not (tmp_path.parent / "evil.txt").exists() and not (tmp_path / "evil.txt").exists()
    assert all(faults.alive().values())
    outcome("dataset zips: a 256 MiB zip bomb and a '../../evil.txt' member",
            "each job fails naming the member before anything is unpacked; services stay up",
            "failed: " + "; ".join(ended[c]["reason"].rpartition(".zip: ")[2][:80] for c in cases), 0)

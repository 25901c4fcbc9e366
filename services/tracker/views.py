"""What the tracker's tables say about jobs and workers, shaped for people, charts and the API."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from apiary.component import from_json
from apiary.db import Executor
from apiary.status import TERMINAL
from services.tracker import async_views

# A shard whose worker went offline mid-round shows as offline, not as still training; one that had not
# reported when its job ended shows as stopped.
_STALLED = ("assigned", "training")


async def job_status(db: Executor, job_id: str) -> str | None:
    """A job's status, or None when the tracker knows no such job."""
    value = await db.fetchval("SELECT status FROM job_views WHERE job_id = $1", job_id)
    return None if value is None else str(value)


async def record_requested(db: Executor, job_id: str, name: str | None, num_rounds: int | None) -> None:
    """The row the job.requested event would create, so a job submitted over HTTP is visible at once."""
    await db.execute(
        "INSERT INTO job_views (job_id, name, status, num_rounds, created_at, updated_at)"
        " VALUES ($1, $2, 'requested', $3, $4, $4) ON CONFLICT DO NOTHING",
        job_id, name, num_rounds, time.time(),
    )


async def job_request(db: Executor, job_id: str) -> dict[str, Any] | None:
    """The request a job was submitted with (from the event log), without its job id; None if none is logged."""
    body = await db.fetchval("SELECT body FROM events WHERE job_id = $1 AND routing_key = 'job.requested'"
                             " ORDER BY seq LIMIT 1", job_id)
    request = from_json(body)
    if not isinstance(request, dict):
        return None
    return {k: v for k, v in request.items() if k not in ("job_id", "v")}


async def jobs_using(db: Executor, field: str, item_id: int) -> list[dict[str, Any]]:
    """The jobs whose request names a registered model or dataset (`field`: model_id or dataset_id; a dataset
    also as config.eval_dataset_id), oldest first: id, name, status."""
    rows = await db.fetch(
        "SELECT e.job_id, e.body, j.name, j.status FROM events e JOIN job_views j ON j.job_id = e.job_id"
        " WHERE e.routing_key = 'job.requested' ORDER BY e.seq")
    used = []
    for row in rows:
        request = from_json(row["body"], {})
        config = request.get("config") if isinstance(request.get("config"), dict) else {}
        named = [request.get(field)] + ([config.get("eval_dataset_id")] if field == "dataset_id" else [])
        if any(str(value) == str(item_id) for value in named if value is not None):
            used.append({"job_id": row["job_id"], "name": row["name"], "status": row["status"]})
    return used


async def job_view(db: Executor, job_id: str) -> dict[str, Any] | None:
    """Everything known about one job: status, rounds, and every shard of the current round."""
    job = await db.fetchrow("SELECT * FROM job_views WHERE job_id = $1", job_id)
    if job is None:
        return None
    job["metrics"] = from_json(job["metrics"], {})
    job["errors"] = from_json(job["errors"], [])
    job["strategy_params"] = from_json(job["strategy_params"], {})
    job["split"] = from_json(job["split"])
    job["data_shards"] = from_json(job["data_shards"], [])
    job["code"] = from_json(job["code"])
    rounds = await db.fetch(
        "SELECT round, attempt, status, metrics, reason, started_at, ended_at, evaluation, evaluation_error,"
        " secure_aggregation, evaluation_shards FROM round_views WHERE job_id = $1 ORDER BY round, attempt", job_id,
    )
    job["rounds"] = [{**r, "metrics": from_json(r["metrics"], {}), "evaluation": from_json(r["evaluation"]),
                      "secure_aggregation": from_json(r["secure_aggregation"]),
                      "evaluation_shards": {int(k): v for k, v in (from_json(r["evaluation_shards"]) or {}).items()}
                      or None}
                     for r in rounds]
    job["asynchronous"] = await async_views.summary(db, job_id)
    # An async job's rounds are versions: its shards are each one's latest training task, whichever version.
    shards = await async_views.latest_tasks(db, job_id) if job["asynchronous"] else await db.fetch(
        "SELECT s.shard, s.worker_id, s.state, s.step, s.metrics, s.error, s.updated_at, w.status AS worker_status"
        " FROM shard_views s LEFT JOIN workers w ON w.worker_id = s.worker_id"
        " WHERE s.job_id = $1 AND s.round = $2 AND s.attempt = $3 ORDER BY s.shard",
        job_id, job["round"], job["attempt"],
    )
    job["shards"] = [_shard(s, job["status"]) for s in shards]
    job["progress"] = progress_counts(job["shards"])
    job["reported"] = [s["worker_id"] for s in job["shards"] if s["state"] == "reported"]
    job["training"] = [s["worker_id"] for s in job["shards"] if s["state"] == "training"]
    job["shard_state"] = await shard_state_view(db, job_id)
    job["forged"] = await db.fetch(
        "SELECT round, attempt, shard, worker_id, routing_key, reason, ts FROM forged_reports WHERE job_id = $1"
        " ORDER BY seq DESC LIMIT 100", job_id)
    return job


def _shard(row: dict[str, Any], job_status: str) -> dict[str, Any]:
    worker_status = row.pop("worker_status")
    shard = {**row, "metrics": from_json(row["metrics"], {})}
    if shard["state"] in _STALLED and job_status in TERMINAL:
        shard["state"] = "stopped"
    elif shard["state"] in _STALLED and worker_status == "offline":
        shard["state"] = "offline"
    return shard


def progress_counts(shards: Iterable[dict[str, Any]]) -> dict[str, int]:
    """How many shards of a round are in each state, plus the total."""
    counts = dict.fromkeys(("assigned", "training", "reported", "failed", "rejected", "offline", "stopped"), 0)
    total = 0
    for shard in shards:
        counts[shard["state"]] = counts.get(shard["state"], 0) + 1
        total += 1
    return {**counts, "total": total}


async def list_jobs(db: Executor, limit: int = 100) -> list[dict[str, Any]]:
    """The newest jobs first, each with its status and its latest aggregated round's metrics."""
    jobs = await db.fetch(
        "SELECT job_id, name, status, round, attempt, num_rounds, num_shards, reason, final_model, metrics,"
        " created_at, updated_at FROM job_views ORDER BY created_at DESC, job_id LIMIT $1", limit,
    )
    latest: dict[str, dict[str, Any]] = {}
    if jobs:
        marks = ", ".join(f"${i}" for i in range(1, len(jobs) + 1))
        rounds = await db.fetch(
            f"SELECT job_id, metrics FROM round_views WHERE status = 'aggregated' AND job_id IN ({marks})"
            " ORDER BY round, attempt", *(j["job_id"] for j in jobs),
        )
        for r in rounds:
            latest[r["job_id"]] = from_json(r["metrics"], {})
    return [{**j, "metrics": from_json(j["metrics"], {}), "last_round_metrics": latest.get(j["job_id"], {})}
            for j in jobs]


async def job_metrics(db: Executor, job_id: str, name: str = "loss", after: int = 0) -> dict[str, Any] | None:
    """One metric as chart series: per-worker points (x = seconds since the job was requested) after
    the cursor `after`, and the aggregated value per round (x = round)."""
    job = await db.fetchrow("SELECT job_id, created_at FROM job_views WHERE job_id = $1", job_id)
    if job is None:
        return None
    rows = await db.fetch(
        "SELECT seq, worker_id, round, attempt, shard, step, value, ts FROM metrics"
        " WHERE job_id = $1 AND name = $2 AND seq > $3 ORDER BY seq", job_id, name, after,
    )
    names = await db.fetch("SELECT DISTINCT name FROM metrics WHERE job_id = $1 ORDER BY name", job_id)
    rounds = await db.fetch(
        "SELECT round, attempt, status, metrics, started_at, ended_at, evaluation FROM round_views"
        " WHERE job_id = $1 ORDER BY round, attempt", job_id,
    )
    return {
        "job_id": job_id,
        "metric": name,
        "names": [n["name"] for n in names],
        "cursor": max((r["seq"] for r in rows), default=after),
        "workers": worker_series(rows, job["created_at"]),
        "rounds": round_series(rounds, name),
        # The round's evaluation of the global model (on a worker), of each metric it reported.
        "evaluations": evaluation_series(rounds),
        "round_marks": [
            {"round": r["round"], "attempt": r["attempt"], "x": _since(r["started_at"], job["created_at"])}
            for r in rounds if r["started_at"] is not None
        ],
    }


def worker_series(rows: Iterable[dict[str, Any]], origin: float) -> list[dict[str, Any]]:
    """Metric rows (in arrival order) grouped into one series per worker, sorted by worker id."""
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault(r["worker_id"], []).append({
            "x": _since(r["ts"], origin), "y": r["value"], "seq": r["seq"], "round": r["round"],
            "attempt": r["attempt"], "shard": r["shard"], "step": r["step"],
        })
    return [{"worker_id": w, "points": points} for w, points in sorted(series.items())]


def round_series(rounds: Iterable[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The aggregated value of one metric after each round that aggregated (x = round)."""
    points = []
    for r in rounds:
        value = from_json(r["metrics"], {}).get(name) if r["status"] == "aggregated" else None
        if isinstance(value, int | float):
            points.append({"x": r["round"], "y": float(value), "attempt": r["attempt"]})
    return points


def evaluation_series(rounds: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each evaluation metric's value after each evaluated round (x = round), by metric name."""
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rounds:
        for metric, value in (from_json(r.get("evaluation"), {}) or {}).items():
            if isinstance(value, int | float):
                series.setdefault(metric, []).append({"x": r["round"], "y": float(value), "attempt": r["attempt"]})
    return series


def _since(ts: float, origin: float) -> float:
    return round(max(0.0, ts - origin), 3)


async def workers_view(db: Executor, now: float | None = None) -> list[dict[str, Any]]:
    """Every worker seen: presence, last heartbeat, current assignment, GPU (None without one), throughput."""
    now = time.time() if now is None else now
    rows = await db.fetch("SELECT * FROM workers ORDER BY worker_id")
    out = []
    for w in rows:
        busy = w["job_id"] is not None and w["state"] == "training"
        out.append({
            "worker_id": w["worker_id"],
            "hostname": w["hostname"],
            "kind": w["kind"],
            "status": w["status"],
            "state": w["state"],
            "last_heartbeat": w["last_seen"],
            "seconds_since_heartbeat": round(max(0.0, now - w["last_seen"]), 3),
            "assignment": {"job_id": w["job_id"], "round": w["round"], "shard": w["shard"]} if busy else None,
            "gpu": from_json(w["gpu"]),
            "samples_per_s": w["samples_per_s"],
            "first_seen": w["first_seen"],
        })
    return out


__all__ = [
    "TERMINAL",
    "job_metrics",
    "job_status",
    "job_view",
    "list_jobs",
    "progress_counts",
    "record_requested",
    "round_series",
    "worker_series",
    "workers_view",
]


SHARD_STATE_ROUNDS = 50  # the latest round.aggregated events a job view reads its shards' state sizes from


async def shard_state_view(db: Executor, job_id: str) -> dict[str, Any] | None:
    """What the job keeps between rounds besides its weights (issue 41), from its latest SHARD_STATE_ROUNDS
    round.aggregated events (a view is read often; a shard absent from all of them is not counted): each shard's
    latest state size in bytes, their total, and the size of the server state its workers get; None for a job
    that keeps none."""
    rows = await db.fetch("SELECT body FROM events WHERE job_id = $1 AND routing_key = 'round.aggregated'"
                          f" ORDER BY seq DESC LIMIT {SHARD_STATE_ROUNDS}", job_id)
    shards: dict[int, int] = {}
    server: int | None = None
    for row in rows:  # newest first: the first size seen of each is its latest
        body = from_json(row["body"], {})
        for shard, ref in (body.get("shard_states") or {}).items():
            shards.setdefault(int(shard), int(ref["size"]))
        if body.get("server_state") and server is None:
            server = int(body["server_state"]["size"])
    if not shards and server is None:
        return None
    return {"bytes_per_shard": dict(sorted(shards.items())), "total_bytes": sum(shards.values()),
            "server_state_bytes": server}

"""Health checks (`/healthz`, `/readyz`): what an orchestrator's probes see of a service and a worker,
against the real broker and database."""

from __future__ import annotations

import asyncio
import socket

import httpx

from apiary.bus.base import Bus
from apiary.db.base import Database
from apiary.db.postgres import PostgresDatabase
from services.app.health import bus_check, database_check, failing, serve_health
from tests.fixtures.cluster import Cluster


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_ready_only_once_the_queue_exists(bus: Bus, database: Database) -> None:
    # Prepare: a probe server whose bus check looks at a queue nobody has declared yet
    checks = {"bus": bus_check(bus, "probe-q"), "database": database_check(database)}
    server = await serve_health("127.0.0.1", 0, checks)
    url = f"http://127.0.0.1:{server.port}"
    try:
        async with httpx.AsyncClient(base_url=url) as http:
            # Execute
            live, before = await http.get("/healthz"), await http.get("/readyz")
            await bus.declare_queue("probe-q", ["probe.key"])
            after, unknown = await http.get("/readyz"), await http.get("/metrics")
    finally:
        await server.stop()
    # Assert
    assert live.status_code == 200
    if before.status_code == 503:  # RabbitMQ: a passive look at a missing queue fails
        assert before.text.startswith("bus: ")
    assert after.status_code == 200 and after.text == "ready\n"
    assert unknown.status_code == 404


async def test_a_database_that_does_not_answer_is_one_line(postgres_url: str) -> None:
    # Prepare: a database object pointed at a port nobody listens on
    db = PostgresDatabase(f"postgresql://postgres@127.0.0.1:{_free_port()}/postgres")
    # Execute
    problems = await failing({"database": database_check(db), "fine": lambda: asyncio.sleep(0)}, timeout=1.0)
    # Assert
    assert len(problems) == 1 and problems[0].startswith("database: ")
    assert "\n" not in problems[0]


def test_deployed_service_and_worker_answer_probes(cluster: Cluster) -> None:
    # Prepare: a sharder and a worker, each with its health port
    sharder_port, worker_port = _free_port(), _free_port()
    cluster.start_service("sharder", APIARY_HEALTH_PORT=str(sharder_port), APIARY_HEALTH_HOST="127.0.0.1")
    cluster.start_worker("w-health", APIARY_HEALTH_PORT=str(worker_port), APIARY_HEALTH_HOST="127.0.0.1")

    def ready(port: int) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=3).status_code == 200
        except httpx.TransportError:
            return False

    # Execute / Assert: both become ready (connected to the broker; the sharder also to PostgreSQL)
    cluster.wait_for(lambda: ready(sharder_port), 60, "the sharder's /readyz")
    cluster.wait_for(lambda: ready(worker_port), 60, "the worker's /readyz")
    assert httpx.get(f"http://127.0.0.1:{sharder_port}/healthz", timeout=3).text == "ok\n"

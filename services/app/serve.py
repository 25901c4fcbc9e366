"""`apiary serve <service>` and `apiary worker`: one service or one worker per process, until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from apiary import metrics, telemetry
from apiary.bus import make_bus
from apiary.http_server import HttpServer
from apiary.settings import Settings
from services.app.health import Check, bus_check, database_check, serve_health
from services.app.ports import Ports

log = logging.getLogger("apiary.serve")

SERVICES = ("scheduler", "sharder", "aggregator", "tracker")


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def _component(name: str, ports: Ports) -> Any:
    # Only the named service is imported: the tracker, the sharder and the scheduler never load torch (1-2 s and
    # ~200 MB; tests/unit/test_light_imports.py).
    args = (ports.bus, ports.db, ports.storage, ports.settings)
    if name == "tracker":
        from services.tracker import Tracker

        return Tracker(*args, http=True)
    if name == "sharder":
        from services.sharder import Sharder

        return Sharder(*args)
    if name == "aggregator":
        from services.aggregator import Aggregator

        return Aggregator(*args)
    if name == "scheduler":
        from services.scheduler import Scheduler

        return Scheduler(*args)
    raise ValueError(f"no service named {name!r}")


async def _health(settings: Settings, checks: dict[str, Check]) -> HttpServer | None:
    if settings.health_port is None:
        return None
    return await serve_health(settings.health_host, settings.health_port, checks)


async def _metrics(settings: Settings, service_name: str, *, own_server: bool = True) -> HttpServer | None:
    """Metrics on as APIARY_METRICS says; with Prometheus, `/metrics` served on APIARY_METRICS_PORT (unless
    `own_server` is False: the tracker serves it on its HTTP API)."""
    if not metrics.setup(service_name, settings.metrics) or not metrics.prometheus_enabled() or not own_server:
        return None
    server = HttpServer(metrics.MetricsApp(), settings.metrics_host, settings.metrics_port, what="metrics",
                        setting="APIARY_METRICS_PORT")
    await server.start()
    log.info("metrics on http://%s:%d/metrics", settings.metrics_host, server.port)
    return server


async def _stop(server: HttpServer | None) -> None:
    if server is not None:
        await server.stop()


async def serve_service(name: str, settings: Settings) -> None:
    """Run one service until SIGTERM; its in-flight messages finish or go back to their queues."""
    telemetry.setup(f"apiary-{name}")
    ports = Ports(settings)
    metrics_server = await _metrics(settings, f"apiary-{name}", own_server=name != "tracker")
    # Ready once its own queue answers (declared by start()) and the database does.
    health = await _health(settings, {"bus": bus_check(ports.bus, name), "database": database_check(ports.db)})
    await ports.open()
    service = _component(name, ports)
    try:
        await service.start()
        log.info("%s running (bus %s)", name, settings.bus_url.split("@")[-1])
        await _until_signalled()
        log.info("%s stopping", name)
    finally:
        await _stop(health)
        await service.stop()
        await ports.close()
        await _stop(metrics_server)
        metrics.shutdown()
        telemetry.shutdown()


async def serve_worker(settings: Settings) -> None:
    """Run one worker until SIGTERM; an assignment in training goes back to its queue."""
    from services.worker import Worker

    telemetry.setup("apiary-worker")
    bus = make_bus(settings.resolved_bus_url(), exchange=settings.exchange, queue_type=settings.queue_type,
                   delivery_limit=settings.queue_delivery_limit)
    await bus.connect()
    worker = Worker(bus, settings)
    metrics_server = await _metrics(settings, "apiary-worker")
    health = await _health(settings, {"bus": bus_check(bus, worker.control_queue)})
    try:
        await worker.start()
        await _until_signalled()
        log.info("worker %s stopping", worker.worker_id)
    finally:
        await _stop(health)
        await worker.stop()
        await bus.close()
        await _stop(metrics_server)
        metrics.shutdown()
        telemetry.shutdown()


__all__ = ["SERVICES", "serve_service", "serve_worker"]

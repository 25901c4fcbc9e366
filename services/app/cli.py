"""The `apiary` command: run a job on one machine, or run, feed and watch a deployed system."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from apiary.settings import Settings
from apiary.trainers import quiet_openmp
from services.app.jobfile import JobFileError, code_root_for, load_job_file

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Apiary: federated training of PyTorch models.")
# Lines are never broken to fit the terminal: a path or a reason must stay one line to copy or grep.
console = Console(stderr=True, soft_wrap=True)
STATE_STYLE = {"training": "yellow", "reported": "green", "failed": "red", "rejected": "red",
               "assigned": "dim", "offline": "red", "stopped": "dim"}


@app.callback()
def _root() -> None:
    """Apiary: federated training of PyTorch models."""


def _fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


def _setup_logging(settings: Settings, to_console: bool) -> Path:
    log_dir = settings.home / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "apiary.log"
    handlers: list[logging.Handler] = [logging.FileHandler(path)]
    if to_console:
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return path


def render_job(view: dict[str, Any], started: float | None = None) -> Group:
    """A job's live view: round counter, per-shard state and latest losses, aggregated metrics."""
    title = Text.assemble(
        (f"{view.get('name') or view['job_id']} ", "bold"),
        (f"[{view['job_id']}] ", "dim"),
        (view["status"], "bold cyan"),
        f"   round {view['round']}/{view.get('num_rounds') or '?'}",
        f" (attempt {view['attempt']})" if view.get("attempt", 1) > 1 else "",
        f"   {time.time() - started:.0f}s" if started else "",
    )
    table = Table(box=None, pad_edge=False, show_header=True, header_style="dim")
    for column in ("shard", "worker", "state", "loss", "metrics"):
        table.add_column(column)
    for s in view.get("shards", []):
        metrics = s.get("metrics") or {}
        loss = metrics.get("loss")
        others = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k != "loss")
        state = s["state"]
        table.add_row(str(s["shard"]), s.get("worker_id") or "-", Text(state, STATE_STYLE.get(state, "")),
                      f"{loss:.4f}" if isinstance(loss, float) else "-", s.get("error") or others)
    rounds = Table(box=None, pad_edge=False, show_header=True, header_style="dim")
    for column in ("round", "status", "aggregated metrics"):
        rounds.add_column(column)
    for r in view.get("rounds", [])[-5:]:
        text = ", ".join(f"{k}={v:.4g}" for k, v in (r.get("metrics") or {}).items()) or (r.get("reason") or "")
        rounds.add_row(f"{r['round']}" + (f".{r['attempt']}" if r["attempt"] > 1 else ""), r["status"], text)
    return Group(title, table, rounds)


def summary(view: dict[str, Any], duration: float) -> dict[str, Any]:
    """The end-of-run summary (also what `--json` prints)."""
    return {
        "job_id": view["job_id"],
        "name": view.get("name"),
        "status": view["status"],
        "rounds_completed": sum(1 for r in view.get("rounds", []) if r["status"] == "aggregated"),
        "num_rounds": view.get("num_rounds"),
        "final_model": view.get("final_model"),
        "metrics": view.get("metrics") or {},
        "reason": view.get("reason"),
        "errors": view.get("errors") or [],
        "duration_s": round(duration, 2),
    }


def _gpu_list(spec: str) -> list[int]:
    """`--gpus`: the GPU indices workers take in turn (empty: the CPU)."""
    from services.worker.gpu import require_gpu, usable_gpus

    spec = spec.strip().lower()
    if spec == "auto":
        return list(range(usable_gpus()))
    if spec in ("none", "cpu", ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the training children inherit it: CUDA sees no GPU
        return []
    try:
        indices = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ValueError(f"--gpus {spec!r}: expected auto, none or comma-separated GPU indices such as 0,1") from None
    for index in indices:
        require_gpu(index, option="--gpus")  # GpuChoiceError is a ValueError
    return indices


@app.command()
def run(
    job_file: Path = typer.Argument(..., help="The job: a YAML or JSON file."),
    workers: int = typer.Option(3, "--workers", "-w", min=1, max=64, help="How many workers to start."),
    as_json: bool = typer.Option(False, "--json", help="Print only the summary, as one JSON object."),
    timeout: float = typer.Option(0, help="Give up after this many seconds (0: never)."),
    gpus: str = typer.Option("auto", "--gpus", help="GPUs the workers take in turn: 'auto' (every GPU this "
                             "process may use), 'none' (train on the CPU) or indices such as 0,1."),
) -> None:
    """Run a job on this machine: every service and N workers in one process tree."""
    quiet_openmp()
    from services.app.runtime import DatabaseInUse, Embedded

    settings = Settings()
    try:
        gpu_list = _gpu_list(gpus)
    except ValueError as e:
        _fail(str(e))
    try:
        request = load_job_file(job_file)
    except JobFileError as e:
        _fail(str(e))
    code_paths = []
    entry = request.get("entrypoint")
    if isinstance(entry, str):
        root = code_root_for(entry, job_file.resolve().parent)
        if root is not None:
            code_paths.append(str(root))
    log_path = _setup_logging(settings, to_console=False)
    from apiary import telemetry

    telemetry.setup("apiary")

    async def go() -> dict[str, Any]:
        started = time.time()
        async with Embedded(settings, workers=workers, code_paths=code_paths, gpus=gpu_list) as stack:
            dashboard = None
            try:
                dashboard = await stack.tracker.start_http()
            except OSError as e:
                console.print(f"[yellow]dashboard not served:[/yellow] {e}")
            job_id = await stack.submit(request)
            if dashboard and not as_json:
                console.print(f"dashboard: {dashboard}/#/jobs/{job_id}")
            # Stopping this process stops its job: cancelled, so that it does not stay "running".
            main = asyncio.current_task()
            assert main is not None
            terminated: list[int] = []

            def on_sigterm() -> None:
                terminated.append(signal.SIGTERM)
                main.cancel()

            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
            stopped: str | None = None
            exit_code = 0
            try:
                if as_json:
                    view = await stack.wait(job_id, timeout=timeout or None)
                else:
                    where = f"GPU {','.join(map(str, gpu_list))}" if gpu_list else "CPU"
                    console.print(f"[dim]job {job_id}: {workers} workers on {where}, logs in {log_path}[/dim]")
                    with Live(console=console, refresh_per_second=4, transient=False) as live:
                        view = await stack.wait(job_id, timeout=timeout or None,
                                                on_change=lambda v: live.update(render_job(v, started)))
            except TimeoutError:
                stopped = f"apiary run --timeout {timeout:g}: the job did not end in time"
            except asyncio.CancelledError:  # Ctrl-C (asyncio's runner cancels this task) or SIGTERM
                main.uncancel()
                stopped = f"interrupted: apiary run got {'SIGTERM' if terminated else 'Ctrl-C'}"
                exit_code = 128 + (signal.SIGTERM if terminated else signal.SIGINT)
            if stopped is not None:
                if not as_json:
                    console.print(f"\n[yellow]{stopped}; cancelling job {job_id}[/yellow]")
                view = await stack.cancel(job_id, stopped) or {"job_id": job_id, "status": "cancelled",
                                                               "reason": stopped}
            return {**summary(view, time.time() - started), "exit_code": exit_code}

    try:
        result = _run_async(go())
    except DatabaseInUse as e:
        _fail(str(e))
    finally:
        telemetry.shutdown()
    exit_code = result.pop("exit_code")
    if as_json:
        print(json.dumps(result))
    else:
        _print_summary(result)
    if exit_code:
        raise typer.Exit(exit_code)
    if result["status"] != "completed":
        raise typer.Exit(1)


def _print_summary(result: dict[str, Any]) -> None:
    console.print()
    ok = result["status"] == "completed"
    console.print(f"[bold {'green' if ok else 'red'}]{result['status']}[/] job {result['job_id']} "
                  f"({result['rounds_completed']}/{result['num_rounds'] or '?'} rounds, {result['duration_s']}s)")
    if result["metrics"]:
        console.print("metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in result["metrics"].items()))
    if result["final_model"]:
        console.print(f"final model: {result['final_model']}")
    if result["reason"]:
        console.print(f"[red]reason:[/red] {result['reason']}")


from services.app.serve import SERVICES  # noqa: E402


@app.command()
def serve(
    service: str = typer.Argument(..., help="One of: scheduler, sharder, aggregator, tracker."),
) -> None:
    """Run one service in this process, on the ports the APIARY_* settings name, until SIGTERM."""
    if service not in SERVICES:
        _fail(f"unknown service {service!r}: choose one of {', '.join(SERVICES)}")
    quiet_openmp()
    settings = Settings()
    _setup_logging(settings, to_console=True)
    from services.app.serve import serve_service

    _run_async(serve_service(service, settings))


@app.command()
def worker(
    worker_id: str = typer.Option(None, "--id", help="This worker's id (default: APIARY_WORKER_ID or host name)."),
    gpu: int = typer.Option(None, "--gpu", help="The GPU this worker trains on, counted as CUDA counts them "
                            "(among CUDA_VISIBLE_DEVICES where that is set). Default: the first one, if any."),
) -> None:
    """Run one worker: it takes pool assignments and those pinned to its id, until SIGTERM."""
    from services.worker.gpu import GpuChoiceError, require_gpu

    quiet_openmp()
    overrides: dict[str, Any] = {}
    if worker_id:
        overrides["worker_id"] = worker_id
    if gpu is not None:
        overrides["gpu"] = gpu
    settings = Settings(**overrides)
    try:
        if settings.gpu is not None:
            require_gpu(settings.gpu)
    except GpuChoiceError as e:
        _fail(str(e))
    _setup_logging(settings, to_console=True)
    from services.app.serve import serve_worker

    _run_async(serve_worker(settings))


@app.command()
def submit(
    job_file: Path = typer.Argument(..., help="The job: a YAML or JSON file."),
    job_id: str = typer.Option(None, "--job-id", help="Choose the job id (default: a new one)."),
    wait: bool = typer.Option(False, "--wait", help="Wait for the job to end and print its summary."),
) -> None:
    """Publish a job request to a deployed system; print the job id."""
    from services.app.ports import Ports
    from services.tracker.publish import publish_job_request as publish_request

    _quiet_client_logs()

    settings = Settings()
    try:
        request = load_job_file(job_file)
    except JobFileError as e:
        _fail(str(e))
    if job_id:
        request["job_id"] = job_id

    async def go() -> tuple[str, dict[str, Any] | None]:
        ports = Ports(settings)
        await ports.bus.connect()
        try:
            jid = await publish_request(ports.bus, request)
        finally:
            await ports.bus.close()
        if not wait:
            return jid, None
        return jid, await _watch(settings, jid, live=False)

    jid, view = _guard(lambda: _run_async(go()))
    print(jid)
    if view is not None:
        _print_summary(summary(view, time.time() - view["created_at"]))
        if view["status"] != "completed":
            raise typer.Exit(1)


@app.command()
def status(
    job_id: str = typer.Argument(..., help="The job's id."),
    watch: bool = typer.Option(False, "--watch", help="Keep the view live until the job ends."),
    as_json: bool = typer.Option(False, "--json", help="Print the job's view as JSON."),
) -> None:
    """Show a job: status, round, each shard's worker and loss, metrics per round, failure reason."""
    settings = Settings()

    async def go() -> dict[str, Any] | None:
        if watch and not as_json:
            return await _watch(settings, job_id, live=True)
        from services.tracker.service import job_view

        ports = Ports(settings)
        await ports.db.connect()
        try:
            return await job_view(ports.db, job_id)
        except Exception as e:
            if _no_tracker_tables(e):
                return None
            raise
        finally:
            await ports.db.close()

    from services.app.ports import Ports

    view = _guard(lambda: _run_async(go()))
    if view is None:
        _fail(f"no job {job_id!r} is known to the tracker at {settings.resolved_database_url()}")
        return
    if as_json:
        print(json.dumps(view, default=str))
    elif not watch:
        console.print(render_job(view))
    if view.get("reason"):
        console.print(f"[red]reason:[/red] {view['reason']}")


@app.command()
def cancel(
    job_id: str = typer.Argument(..., help="The job's id."),
    reason: str = typer.Option("cancelled by user", "--reason", help="Why; shown with the job's status."),
) -> None:
    """Stop a job on a deployed system: no further round starts and it ends cancelled (also when its
    request has not been handled yet)."""
    from apiary.bus.typed import publish_event
    from apiary.contracts import JobCancelRequested
    from apiary.status import TERMINAL
    from services.app.ports import Ports
    from services.tracker.views import job_view

    _quiet_client_logs()
    settings = Settings()

    async def go() -> str | None:
        ports = Ports(settings)
        await ports.db.connect()
        try:
            view = await job_view(ports.db, job_id)
        except Exception as e:
            if not _no_tracker_tables(e):
                raise
            view = None
        finally:
            await ports.db.close()
        if view is not None and view["status"] in TERMINAL:
            return str(view["status"])
        await ports.bus.connect()
        try:
            await publish_event(ports.bus, JobCancelRequested(job_id=job_id, reason=reason))
        finally:
            await ports.bus.close()
        return None if view is not None else "unknown"

    ended = _guard(lambda: _run_async(go()))
    if ended == "unknown":
        print(f"cancel of job {job_id} sent; no such job is known yet: if its request comes, it will not start")
    elif ended is not None:
        _fail(f"job {job_id} already ended ({ended}): there is nothing to cancel")
    else:
        print(f"cancel of job {job_id} sent")


async def _watch(settings: Settings, job_id: str, *, live: bool) -> dict[str, Any]:
    """Poll the tracker's view of a job until it ends, drawing it live if asked."""
    from apiary.status import TERMINAL
    from services.app.ports import Ports
    from services.tracker.service import job_view

    ports = Ports(settings)
    await ports.db.connect()
    try:
        with Live(console=console, refresh_per_second=4, transient=False) if live else _nothing() as display:
            while True:
                view = await job_view(ports.db, job_id)
                if view is not None and display is not None:
                    display.update(render_job(view))
                if view is not None and view["status"] in TERMINAL:
                    return view
                await asyncio.sleep(0.5)
    finally:
        await ports.db.close()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


dataset_app = typer.Typer(help="Datasets kept in storage, for jobs to name by dataset_id.", no_args_is_help=True)
app.add_typer(dataset_app, name="dataset")


@dataset_app.command("upload")
def dataset_upload(
    path: Path = typer.Argument(..., help="A dataset folder or zip file with a manifest.json."),
    name: str = typer.Option(None, "--name", help="A name for people (default: the folder or file name)."),
) -> None:
    """Store a dataset; print its dataset_id and URI."""
    from apiary.registry import upload_dataset
    from services.app.ports import Ports

    settings = Settings()

    async def go() -> dict[str, Any]:
        ports = Ports(settings)
        return await upload_dataset(ports.storage, path, name=name)

    info = _guard(lambda: _run_async(go()))
    print(f"{info['dataset_id']} {info['uri']}")
    console.print(f"[dim]{info['num_samples']} samples, {info['size']} bytes; use it with "
                  f"dataset_id: {info['dataset_id']}[/dim]")


def _no_tracker_tables(error: BaseException) -> bool:
    """Whether a query failed because the tracker never ran against this database."""
    text = str(error)
    return "no such table" in text or ("relation" in text and "does not exist" in text)


def _quiet_client_logs() -> None:
    """A client command reports a dead service in one line of its own, not the AMQP library's."""
    for name in ("aiormq", "aio_pika"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _guard(call: Any) -> Any:
    """Run a command body; turn a user-caused failure into one clear line."""
    from apiary.dataset import DatasetError
    from apiary.db import DatabaseUnavailable
    from apiary.storage import StorageUnavailable

    try:
        return call()
    except (DatasetError, DatabaseUnavailable, StorageUnavailable, RuntimeError) as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"cannot reach a service: {e}")


def _run_async(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()

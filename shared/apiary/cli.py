"""The `apiary` command: run a job on one machine, or run, feed and watch a deployed system."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from apiary.jobfile import JobFileError, load_job_file
from apiary.settings import Settings

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Apiary: federated training of PyTorch models.")
console = Console(stderr=True)
STATE_STYLE = {"training": "yellow", "reported": "green", "failed": "red", "rejected": "red",
               "assigned": "dim", "offline": "red"}


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


@app.command()
def run(
    job_file: Path = typer.Argument(..., help="The job: a YAML or JSON file."),
    workers: int = typer.Option(3, "--workers", "-w", min=1, max=64, help="How many workers to start."),
    as_json: bool = typer.Option(False, "--json", help="Print only the summary, as one JSON object."),
    timeout: float = typer.Option(0, help="Give up after this many seconds (0: never)."),
) -> None:
    """Run a job on this machine: every service and N workers in one process tree."""
    from apiary.runtime import Embedded, code_root_for

    settings = Settings()
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

    async def go() -> dict[str, Any]:
        started = time.time()
        async with Embedded(settings, workers=workers, code_paths=code_paths) as stack:
            job_id = await stack.submit(request)
            if as_json:
                view = await stack.wait(job_id, timeout=timeout or None)
            else:
                console.print(f"[dim]job {job_id}: {workers} workers, logs in {log_path}[/dim]")
                with Live(console=console, refresh_per_second=4, transient=False) as live:
                    view = await stack.wait(job_id, timeout=timeout or None,
                                            on_change=lambda v: live.update(render_job(v, started)))
            return summary(view, time.time() - started)

    try:
        result = _run_async(go())
    except TimeoutError as e:
        _fail(str(e))
    if as_json:
        print(json.dumps(result))
    else:
        _print_summary(result)
    if result["status"] != "completed":
        raise typer.Exit(1)


def _print_summary(result: dict[str, Any]) -> None:
    ok = result["status"] == "completed"
    console.print(f"[bold {'green' if ok else 'red'}]{result['status']}[/] job {result['job_id']} "
                  f"({result['rounds_completed']}/{result['num_rounds'] or '?'} rounds, {result['duration_s']}s)")
    if result["metrics"]:
        console.print("metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in result["metrics"].items()))
    if result["final_model"]:
        console.print(f"final model: {result['final_model']}")
    if result["reason"]:
        console.print(f"[red]reason:[/red] {result['reason']}")


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

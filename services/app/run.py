"""`apiary run`: a job on this machine, every service and N workers in one process, drawn live."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.live import Live

from apiary.settings import Settings
from services.app.console import console
from services.app.render import render_job, summary
from services.app.runtime import Embedded


@dataclass(frozen=True)
class RunOptions:
    """What `apiary run`'s flags ask for."""

    workers: int
    as_json: bool
    timeout: float
    gpus: list[int]
    code_paths: list[str]
    log_path: Path


def gpu_list(spec: str) -> list[int]:
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


async def run_job(settings: Settings, request: dict[str, Any], options: RunOptions) -> dict[str, Any]:
    """Start the stack, submit the job, follow it to its end (cancelling it if stopped); return the
    summary with the process's `exit_code`."""
    started = time.time()
    async with Embedded(settings, workers=options.workers, code_paths=options.code_paths,
                        gpus=options.gpus) as stack:
        dashboard = None
        try:
            dashboard = await stack.tracker.start_http()
        except OSError as e:
            console.print(f"[yellow]dashboard not served:[/yellow] {e}")
        job_id = await stack.submit(request)
        if dashboard and not options.as_json:
            console.print(f"dashboard: {dashboard}/#/jobs/{job_id}")
        view, exit_code = await _until_stopped(stack, job_id, options, started)
        return {**summary(view, time.time() - started), "exit_code": exit_code}


async def _until_stopped(stack: Embedded, job_id: str, options: RunOptions, started: float
                         ) -> tuple[dict[str, Any], int]:
    """Follow the job; stopping this process (Ctrl-C, SIGTERM, --timeout) cancels it, so that it does not
    stay "running". Returns its last view and the exit code."""
    main = asyncio.current_task()
    assert main is not None
    terminated: list[int] = []

    def on_sigterm() -> None:
        terminated.append(signal.SIGTERM)
        main.cancel()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        return await _follow(stack, job_id, options, started), 0
    except TimeoutError:
        stopped, exit_code = f"apiary run --timeout {options.timeout:g}: the job did not end in time", 0
    except asyncio.CancelledError:  # Ctrl-C (asyncio's runner cancels this task) or SIGTERM
        main.uncancel()
        stopped = f"interrupted: apiary run got {'SIGTERM' if terminated else 'Ctrl-C'}"
        exit_code = 128 + (signal.SIGTERM if terminated else signal.SIGINT)
    if not options.as_json:
        console.print(f"\n[yellow]{stopped}; cancelling job {job_id}[/yellow]")
    view = await stack.cancel(job_id, stopped) or {"job_id": job_id, "status": "cancelled", "reason": stopped}
    return view, exit_code


async def _follow(stack: Embedded, job_id: str, options: RunOptions, started: float) -> dict[str, Any]:
    """The job's view once it ended, drawn live unless `--json`."""
    timeout = options.timeout or None
    if options.as_json:
        return await stack.wait(job_id, timeout=timeout)
    where = f"GPU {','.join(map(str, options.gpus))}" if options.gpus else "CPU"
    console.print(f"[dim]job {job_id}: {options.workers} workers on {where}, logs in {options.log_path}[/dim]")
    with Live(console=console, refresh_per_second=4, transient=False) as live:
        return await stack.wait(job_id, timeout=timeout, on_change=lambda v: live.update(render_job(v, started)))


__all__ = ["RunOptions", "gpu_list", "run_job"]

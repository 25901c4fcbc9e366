"""`apiary run`: a job on this machine, every service and N workers in one process, drawn live."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.live import Live

from apiary.settings import Settings
from services.app.code import ship
from services.app.console import console
from services.app.render import render_job, summary
from services.app.runtime import Embedded
from services.app.stopping import StopSignals


@dataclass(frozen=True)
class RunOptions:
    """What `apiary run`'s flags ask for."""

    workers: int
    as_json: bool
    timeout: float
    gpus: list[int]
    code_paths: list[str]
    log_path: Path
    started: float  # time.monotonic() when the command started: --timeout and the duration count from it
    wall_started: float  # time.time() then, for the live view's clock


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


async def run_job(settings: Settings, request: dict[str, Any], options: RunOptions,
                  stop: StopSignals) -> dict[str, Any]:
    """Start the stack, submit the job, follow it to its end (cancelling it if stopped); return the
    summary with the process's `exit_code`. A signal during start-up is answered once the job is in."""
    stop.attach()
    try:
        if stop.received is not None:  # before anything started: nothing to cancel
            view = {"job_id": None, "status": "cancelled",
                    "reason": f"interrupted: apiary run got {stop.said} before the job started"}
            return {**summary(view, time.monotonic() - options.started), "exit_code": stop.exit_code}
        async with Embedded(settings, workers=options.workers, code_paths=options.code_paths,
                            gpus=options.gpus) as stack:
            dashboard = None
            try:
                dashboard = await stack.tracker.start_http()
            except OSError as e:
                console.print(f"[yellow]dashboard not served:[/yellow] {e}")
            # The API wants a token: this run's own, in the address (the page keeps it for the session).
            token = await stack.api_token() if dashboard else None
            job_id = await stack.submit(await ship(stack.api, request))  # a local `code` folder, uploaded
            if dashboard and not options.as_json:
                # On one line whatever the terminal's width, so that it can be copied or clicked whole.
                console.print(f"dashboard: {dashboard}/?token={token}#/jobs/{job_id}", soft_wrap=True)
            view, exit_code = await _until_stopped(stack, job_id, options, stop)
            return {**summary(view, time.monotonic() - options.started), "exit_code": exit_code}
    finally:
        stop.detach()


async def _until_stopped(stack: Embedded, job_id: str, options: RunOptions, stop: StopSignals
                         ) -> tuple[dict[str, Any], int]:
    """Follow the job; stopping this process (Ctrl-C, SIGTERM, --timeout) cancels it, so that it does not
    stay "running". Returns its last view and the exit code."""
    follow = asyncio.create_task(_follow(stack, job_id, options))
    signalled = asyncio.create_task(stop.wait())
    # --timeout counts from the command's start, start-up included.
    left = max(options.started + options.timeout - time.monotonic(), 0.0) if options.timeout else None
    try:
        await asyncio.wait({follow, signalled}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (follow, signalled):
            task.cancel()
        await asyncio.gather(follow, signalled, return_exceptions=True)
    if follow.done() and not follow.cancelled():
        return follow.result(), 0
    if stop.received is not None:
        stopped, exit_code = f"interrupted: apiary run got {stop.said}", stop.exit_code
    else:
        stopped, exit_code = f"apiary run --timeout {options.timeout:g}: the job did not end in time", 0
    if not options.as_json:
        console.print(f"\n[yellow]{stopped}; cancelling job {job_id}[/yellow]")
    view = await stack.cancel(job_id, stopped) or {"job_id": job_id, "status": "cancelled", "reason": stopped}
    return view, exit_code


async def _follow(stack: Embedded, job_id: str, options: RunOptions) -> dict[str, Any]:
    """The job's view once it ended, drawn live (on stderr) unless `--json`."""
    if options.as_json:
        return await stack.wait(job_id)
    where = f"GPU {','.join(map(str, options.gpus))}" if options.gpus else "CPU"
    console.print(f"[dim]job {job_id}: {options.workers} workers on {where}, logs in {options.log_path}[/dim]")
    with Live(console=console, refresh_per_second=4, transient=False) as live:
        return await stack.wait(job_id, on_change=lambda v: live.update(render_job(v, options.wall_started)))


__all__ = ["RunOptions", "gpu_list", "run_job"]

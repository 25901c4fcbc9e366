"""How a command talks to its terminal: one-line errors, logging to a file, running its async body."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import httpx
import typer
from rich.console import Console
from rich.markup import escape

from apiary.settings import Settings

T = TypeVar("T")

# Lines are never broken to fit the terminal: a path or a reason must stay one line to copy or grep.
# Progress, logs and the live view go to stderr; results (a summary, a job's view, an id) to stdout, so
# that `apiary status JOB > file` and `apiary run ... | tee log` keep them.
console = Console(stderr=True, soft_wrap=True)
results = Console(soft_wrap=True)


def fail(message: str, *more: str) -> NoReturn:
    """Print one error line per problem and exit 2 (a user-caused failure: no traceback)."""
    for line in (message, *more):
        console.print(f"[red]error:[/red] {escape(line)}")  # a message is text, never markup
    raise typer.Exit(2)


def setup_logging(settings: Settings, to_console: bool) -> Path:
    """Log to APIARY_HOME/logs/apiary.log (and stderr if asked); return the log file's path."""
    log_dir = settings.home / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "apiary.log"
    handlers: list[logging.Handler] = [logging.FileHandler(path)]
    if to_console:
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return path


def quiet_client_logs() -> None:
    """A client command reports a dead service in one line of its own, not the AMQP library's."""
    for name in ("aiormq", "aio_pika"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def no_tracker_tables(error: BaseException) -> bool:
    """Whether a query failed because the tracker never ran against this database."""
    text = str(error)
    return "no such table" in text or ("relation" in text and "does not exist" in text)


def guard(call: Callable[[], T]) -> T:
    """Run a command body; turn a user-caused failure into one clear line."""
    from apiary.dataset import DatasetError
    from apiary.db import DatabaseUnavailable
    from apiary.storage import StorageUnavailable

    try:
        return call()
    except (DatasetError, DatabaseUnavailable, StorageUnavailable, RuntimeError) as e:
        fail(str(e))
    except httpx.TransportError as e:
        where = e.request.url.copy_with(path="/", query=None)
        fail(f"cannot reach the tracker's API at {where}: {e or type(e).__name__}; check APIARY_API_URL")
    except OSError as e:
        fail(f"cannot reach a service: {e}")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a command's async body (on uvloop where it is installed)."""
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


__all__ = ["console", "fail", "guard", "no_tracker_tables", "quiet_client_logs", "results", "run_async",
           "setup_logging"]

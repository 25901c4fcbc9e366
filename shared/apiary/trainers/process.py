"""The parent's side of a training child: start it, make one call over its pipe (relaying metrics and
log lines while it runs), and kill it when it hangs, dies or is no longer wanted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from typing import Any

from apiary.trainers import environment
from apiary.trainers.base import MetricsCallback, TrainCall, Trainer
from apiary.trainers.child import PARENTS_SIGNALS, UserCodeError, child_main

log = logging.getLogger("apiary.usercode")

_FINAL = ("result", "error")
STOP_GRACE = 5.0  # seconds an idle child has to exit on its own when its trainer stops
# Children are forked from a server process that imported torch and the child's module once (multiprocessing's
# forkserver, one per process that starts children, started with the first child): a child starts in tens of
# milliseconds instead of importing torch again (1-2 s of CPU). Where there is no forkserver (Windows), each child is
# spawned.
START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
PRELOAD = ["torch", "apiary.trainers.child"]
_STARTING = threading.Lock()  # children are started from several threads (one per worker, embedded)


def _context() -> multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext:
    if START_METHOD == "forkserver":
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


@contextlib.contextmanager
def _starting() -> Iterator[None]:
    """While a child (and with the first one, the fork server) is started:
    - the parent's `__main__` is hidden from multiprocessing, which would otherwise import it again in the child (as
      `__mp_main__`, in case the target is defined there). Here `__main__` is the `apiary` command, so every
      training child imported the whole CLI (typer, FastAPI, the contracts): about a second of CPU per child. The
      child's target lives in `apiary.trainers.child`, which the child imports by name;
    - the process environment is the user's (`environment.user_environment`, e.g. OMP_WAIT_POLICY as the user
      set it), so that the fork server loads torch and OpenMP, which read it once when they load, as the user's
      own process would. The parent's is put back afterwards."""
    main = sys.modules["__main__"]
    with _STARTING:
        hidden: dict[str, Any] = {name: main.__dict__.pop(name) for name in ("__spec__", "__file__")
                                  if name in main.__dict__}
        main.__spec__ = None
        users = environment.user_environment()
        parents = {name: os.environ.get(name) for name in users}
        environment.apply(users)
        try:
            yield
        finally:
            environment.apply(parents)
            del main.__spec__
            main.__dict__.update(hidden)


class _Replies:
    """The child's messages, read by the event loop when the pipe is readable; EOF means it died."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._watching = True
        self._loop.add_reader(conn.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        try:
            while self._conn.poll():
                message = self._conn.recv()
                self.queue.put_nowait(message)
                if message[0] in _FINAL:
                    self.close()
                    return
        except (EOFError, OSError):
            self.close()
            self.queue.put_nowait(("died", None))

    def close(self) -> None:
        """Stop watching the pipe (idempotent)."""
        if self._watching:
            self._watching = False
            self._loop.remove_reader(self._conn.fileno())


class ChildProcess:
    """One warm child process, started on first use and again after it died or was killed."""

    def __init__(self, code_paths: list[str], name: str, variables: dict[str, str]) -> None:
        self._code_paths = code_paths
        self._bundle: str | None = None  # the job's unpacked code bundle, first on the child's sys.path
        self._name = name
        self._variables = variables  # set in the child, over the user's own
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id, while one runs."""
        return self._proc.pid if self._proc is not None and self._proc.is_alive() else None

    @property
    def bundle(self) -> str | None:
        """The code bundle the child runs with (first on its sys.path), if any."""
        return self._bundle

    def use_bundle(self, bundle: str | None) -> None:
        """Run later calls with this code bundle first on sys.path (None: the worker's own code paths). A
        child started with another one is stopped: modules it imported stay imported, so two versions of
        one module never meet in a process."""
        if bundle != self._bundle:
            self.kill()
            self._bundle = bundle

    def _live(self) -> Connection | None:
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            return self._conn
        return None

    def ensure(self) -> Connection:
        """The pipe to a running child, starting one if needed (blocks while it starts)."""
        conn = self._live()
        if conn is not None:
            return conn
        self.kill()
        ctx = _context()
        parent, child = ctx.Pipe(duplex=True)
        environ = environment.child_environment(
            {**environment.user_environment(), **self._variables, **environment.code_path(self._bundle)})
        paths = [self._bundle, *self._code_paths] if self._bundle else self._code_paths
        proc = ctx.Process(target=child_main, args=(child, paths, environ, os.getpid()),
                           name=self._name, daemon=True)
        # The child starts with these signals blocked (a signal mask survives fork and exec) and ignores
        # them from child_main on: a Ctrl-C to the whole process group while it is still starting up would
        # otherwise end it with a KeyboardInterrupt traceback, or as "exit code -2" blamed on user code.
        # Only this thread's mask changes; the event loop's thread still takes the signals. The resource
        # tracker is started first: starting it unblocks them.
        resource_tracker.ensure_running()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, PARENTS_SIGNALS)
        try:
            with _starting():
                proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.close()
        self._proc, self._conn = proc, parent
        return parent

    def kill(self) -> None:
        """Stop the child, if one runs."""
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def close(self, grace: float) -> None:
        """Stop an idle child the way it ends itself: its pipe closed, it returns and exits normally (its
        interpreter cleans up what it made, such as the semaphores torch or tokenizers create, which a kill
        leaves to the resource tracker's 'leaked semaphore' warning at the worker's exit); killed if it has not
        exited within `grace` seconds."""
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            self._conn.close()
            self._conn = None
            self._proc.join(timeout=grace)
        self.kill()

    async def _exited(self) -> UserCodeError:
        """The error for a child that died: its exit code is known once it is reaped (the pipe can
        close before that)."""
        proc = self._proc
        await asyncio.to_thread(self.kill)
        code = proc.exitcode if proc is not None else None
        return UserCodeError(f"user code exited the process (exit code {code})")

    async def call(self, kind: str, args: Any, timeout: float | None,
                   on_metrics: MetricsCallback | None = None) -> Any:
        """Send one call and return its result; UserCodeError if it fails, dies or overruns `timeout`."""
        # Starting a child blocks (the fork server's first start most); a live one is used as it is.
        live = self._live()
        conn = live if live is not None else await asyncio.to_thread(self.ensure)
        replies = _Replies(conn)
        try:
            conn.send((kind, args))
            return await self._result(replies.queue, timeout, on_metrics)
        except TimeoutError:
            replies.close()
            await asyncio.to_thread(self.kill)
            raise UserCodeError(f"user code did not finish within {timeout:.0f}s and was stopped") from None
        except (BrokenPipeError, ConnectionResetError):
            # The child died before it read the call.
            replies.close()
            raise await self._exited() from None
        except asyncio.CancelledError:
            replies.close()
            await asyncio.to_thread(self.kill)
            raise
        finally:
            replies.close()

    async def _result(self, replies: asyncio.Queue[tuple[str, Any]], timeout: float | None,
                      on_metrics: MetricsCallback | None) -> Any:
        """Relay the child's messages until its result; TimeoutError past `timeout`."""
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError
            tag, value = await asyncio.wait_for(replies.get(), remaining)
            if tag == "metrics" and on_metrics is not None:
                on_metrics(value)
            elif tag == "log":
                log.info("user code: %s", value)
            elif tag == "warning":
                log.warning("%s", value)
            elif tag == "result":
                return value
            elif tag == "error":
                raise UserCodeError(value)
            elif tag == "died":
                raise await self._exited()


class ChildTrainer(Trainer):
    """A trainer whose calls run one at a time in a warm ChildProcess (the subclass says which calls)."""

    def __init__(self, child: ChildProcess) -> None:
        self._child = child
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        """The child's process id, while one runs."""
        return self._child.pid

    async def start(self) -> None:
        """Start the child now rather than on the first call."""
        await asyncio.to_thread(self._child.ensure)

    async def stop(self) -> None:
        """Stop the child: at once while a call runs (it is cancelled), else letting it exit normally."""
        if self._lock.locked():
            await asyncio.to_thread(self._child.kill)
        else:
            await asyncio.to_thread(self._child.close, STOP_GRACE)

    async def _call(self, kind: str, args: Any, timeout: float | None,
                    on_metrics: MetricsCallback | None = None) -> Any:
        async with self._lock:
            # Every call of an assignment (train, init, evaluate) runs in a child of its job's bundle.
            bundle = args.code_path if isinstance(args, TrainCall) else None
            if bundle != self._child.bundle:
                await asyncio.to_thread(self._child.use_bundle, bundle)
            return await self._child.call(kind, args, timeout, on_metrics)

"""Running the user's functions in a child process, so user code that raises, exits or hangs
cannot take the calling service down.

One child is kept warm between calls (imports of torch and the user's module are paid once);
if it dies or must be killed, the next call starts a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

log = logging.getLogger("apiary.usercode")

# OpenMP, torch's CPU thread pool, keeps its threads spinning for a while after every parallel
# region. A service runs a few small tensor operations per message on a machine it shares with other
# services, so that spinning was most of the aggregator's CPU (64 ms per round at K=4, 26 without it). Apiary's
# processes wait passively; user code in the child process gets the environment the user set.
OPENMP_WAIT = "OMP_WAIT_POLICY"
_user_openmp_wait: list[str | None] = []


def quiet_openmp() -> None:
    """Make this process's OpenMP threads sleep when idle instead of spinning (unless the user chose a
    policy). Read when torch loads, so call it before that; user code keeps the user's setting."""
    if not _user_openmp_wait:
        _user_openmp_wait.append(os.environ.get(OPENMP_WAIT))
    os.environ.setdefault(OPENMP_WAIT, "PASSIVE")


def _user_environment() -> dict[str, str | None]:
    """Variables to restore in the child: those `quiet_openmp` changed, as the user had them."""
    return {OPENMP_WAIT: _user_openmp_wait[0]} if _user_openmp_wait else {}


INIT_FUNCTION = "fl_init_weights"
EVALUATE_FUNCTION = "fl_evaluate_model"


class UserCodeError(Exception):
    """The user's function failed; the message is one line saying how and where."""


@dataclass
class TrainCall:
    """One call of the user's training function, with files for its inputs and outputs."""

    module: str
    function: str
    weights_path: str
    result_path: str
    out_dir: str
    env: dict[str, Any]
    dataset: dict[str, Any]
    round: dict[str, Any]
    job: dict[str, Any]


@dataclass
class TrainResult:
    """What the training function returned, its weights already written to `result_path`
    (`size` bytes with this `sha256`)."""

    samples: int
    size: int
    sha256: str
    metrics: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------- child side


class _ChildLogger:
    """The `logger` the user's function receives: metrics stream to the parent."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._step = 0

    def log_metrics(self, step: int | None = None, **metrics: Any) -> None:
        """Record numeric metrics (e.g. `loss=0.3`); they appear live as this worker's curves."""
        self._step = self._step + 1 if step is None else int(step)
        clean = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        self._conn.send(("metrics", {"step": self._step, "metrics": clean}))

    def info(self, message: str, *args: Any) -> None:
        """A line for the worker's log."""
        self._conn.send(("log", message % args if args else message))

    warning = info
    error = info
    debug = info


def _is_number(value: Any) -> bool:
    try:
        return not isinstance(value, bool) and value == value and float(value) is not None
    except (TypeError, ValueError):
        return False


_LIBRARY_MARKS = ("site-packages", "/lib/python", "apiary/usercode.py", "apiary/weights.py")


def _describe(error: BaseException) -> str:
    """`ValueError: bad shape (train.py:42 in fl_train_model)`: the error and where in user code."""
    frames = traceback.extract_tb(error.__traceback__)
    user = [f for f in frames if not any(mark in f.filename for mark in _LIBRARY_MARKS)]
    where = f" ({Path(user[-1].filename).name}:{user[-1].lineno} in {user[-1].name})" if user else ""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}{where}"


def _resolve(module: str, function: str, *, optional: bool = False) -> Callable[..., Any] | None:
    try:
        mod = importlib.import_module(module)
    except Exception as e:
        raise UserCodeError(f"entrypoint module {module!r} cannot be imported: {_describe(e)}") from e
    fn = getattr(mod, function, None)
    if fn is None:
        if optional:
            return None
        raise UserCodeError(f"entrypoint module {module!r} has no function {function!r}")
    if not callable(fn):
        raise UserCodeError(f"{module}.{function} is not callable")
    return fn


_device: list[str] = []


def _training_device(conn: Connection) -> str:
    """`cuda:0` where this child can use a GPU (the worker's, when it was given one), else `cpu`."""
    if not _device:
        import torch

        _device.append("cuda:0" if torch.cuda.is_available() else "cpu")
        pinned = os.environ.get("CUDA_VISIBLE_DEVICES")
        if _device[0] == "cpu" and pinned:
            why = "this torch is a CPU build" if torch.version.cuda is None else "CUDA cannot use it here"
            conn.send(("warning", f"worker was given GPU {pinned}, but {why}: training runs on the CPU"))
    return _device[0]


def _run_train(call: TrainCall, conn: Connection) -> dict[str, Any]:
    from apiary import weights as w

    fn = _resolve(call.module, call.function)
    assert fn is not None
    # The tensors view a buffer of their own (writable, kept alive by them): no copy, and no torch
    # operation that would wake its thread pool.
    initial = w.loads(bytearray(Path(call.weights_path).read_bytes()), copy=False)
    payload = {
        "env": dict(call.env),
        "initial_weights": initial,
        "dataset": dict(call.dataset),
        "round": dict(call.round),
        "job": dict(call.job),
        "device": _training_device(conn),
    }
    Path(call.out_dir).mkdir(parents=True, exist_ok=True)
    result = fn(payload, call.out_dir, _ChildLogger(conn))
    if not isinstance(result, dict) or "weights" not in result or "samples" not in result:
        raise UserCodeError(f"{call.function} must return a dict with 'weights' and 'samples'")
    weights = result["weights"]
    if not hasattr(weights, "items"):
        raise UserCodeError(f"{call.function} returned 'weights' that is not a name -> tensor mapping")
    try:
        data = w.dumps(weights)
    except Exception as e:
        raise UserCodeError(f"{call.function} returned weights that cannot be saved: {_describe(e)}") from e
    tmp = Path(call.result_path + ".part")
    tmp.write_bytes(data)
    tmp.replace(call.result_path)
    digest = hashlib.sha256(data).hexdigest()
    samples = result["samples"]
    if isinstance(samples, bool) or not isinstance(samples, int):
        with contextlib.suppress(Exception):
            samples = int(samples) if float(samples) == int(samples) else samples
    metrics = {k: float(v) for k, v in (result.get("metrics") or {}).items() if _is_number(v)}
    return {"samples": samples, "metrics": metrics, "size": len(data), "sha256": digest}


def _run_init(module: str, env: dict[str, Any], target: str) -> dict[str, Any]:
    from apiary import weights as w

    fn = _resolve(module, INIT_FUNCTION, optional=True)
    if fn is None:
        return {"found": False}
    weights = fn(env)
    if not hasattr(weights, "items"):
        raise UserCodeError(f"{INIT_FUNCTION} must return a name -> tensor mapping")
    Path(target).write_bytes(w.dumps(weights))
    return {"found": True}


def _run_evaluate(module: str, env: dict[str, Any], weights_path: str) -> dict[str, Any]:
    from apiary import weights as w

    fn = _resolve(module, EVALUATE_FUNCTION, optional=True)
    if fn is None:
        return {"found": False, "metrics": {}}
    metrics = fn(w.loads(Path(weights_path).read_bytes()), env) or {}
    return {"found": True, "metrics": {k: float(v) for k, v in dict(metrics).items() if _is_number(v)}}


PARENT_CHECK_INTERVAL = 0.5  # seconds between the child's looks at whether its worker still runs


def _exit_with_parent(parent: int) -> None:
    """End this child soon after the process that started it is gone (killed with SIGKILL, say, where
    nothing could stop the child): an orphan would train on for nobody, holding its GPU's memory."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_INTERVAL)
        os._exit(1)

    threading.Thread(target=watch, name="apiary-parent-watch", daemon=True).start()


def _child_main(conn: Connection, code_paths: list[str], environment: dict[str, str | None],
                parent: int | None = None) -> None:
    # Its parent decides when this process ends (it kills it). A Ctrl-C or SIGTERM sent to the whole
    # process group (a terminal, systemd, a container runtime) is the parent's to handle: it stops
    # gracefully and gives the assignment back, where the child dying first would report a failure.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if parent is not None:
        _exit_with_parent(parent)
    for name, value in environment.items():  # before user code imports torch
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    for path in reversed(code_paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    while True:
        try:
            kind, args = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        try:
            if kind == "train":
                out = _run_train(args, conn)
            elif kind == "init":
                out = _run_init(*args)
            elif kind == "evaluate":
                out = _run_evaluate(*args)
            else:
                raise UserCodeError(f"unknown call {kind!r}")
            conn.send(("result", out))
        except UserCodeError as e:
            conn.send(("error", str(e)))
        except BaseException as e:
            conn.send(("error", _describe(e)))
            if isinstance(e, KeyboardInterrupt):
                return


# ---------------------------------------------------------------- parent side


class UserCodeRunner:
    """A warm child process that runs one user call at a time."""

    def __init__(self, code_paths: list[str] | None = None, name: str = "apiary-user-code",
                 environment: dict[str, str] | None = None) -> None:
        self._code_paths = [os.getcwd(), *(code_paths or [])]
        self._name = name
        self._environment = dict(environment or {})  # set in the child, over the user's own
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._lock = asyncio.Lock()

    def _live(self) -> Connection | None:
        """The pipe to the child, if one is running."""
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            return self._conn
        return None

    async def _exited(self) -> UserCodeError:
        """The error for a child that died: its exit code is known once it is reaped (the pipe can
        close before that)."""
        proc = self._proc
        await asyncio.to_thread(self._kill)
        code = proc.exitcode if proc is not None else None
        return UserCodeError(f"user code exited the process (exit code {code})")

    def _ensure(self) -> Connection:
        conn = self._live()
        if conn is not None:
            return conn
        self._kill()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        environment = {**_user_environment(), **self._environment}
        proc = ctx.Process(target=_child_main, args=(child, self._code_paths, environment, os.getpid()),
                           name=self._name, daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        return parent

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    @property
    def pid(self) -> int | None:
        """The child's process id, while one runs."""
        return self._proc.pid if self._proc is not None and self._proc.is_alive() else None

    async def start(self) -> None:
        """Start the child now rather than on the first call."""
        await asyncio.to_thread(self._ensure)

    async def stop(self) -> None:
        """Stop the child."""
        await asyncio.to_thread(self._kill)

    async def _call(
        self,
        kind: str,
        args: Any,
        timeout: float | None,
        on_metrics: Callable[[dict[str, Any]], None] | None = None,
    ) -> Any:
        async with self._lock:
            # Starting a child blocks (spawn); a live one is used as it is.
            live = self._live()
            conn = live if live is not None else await asyncio.to_thread(self._ensure)
            loop = asyncio.get_running_loop()
            replies: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
            fd = conn.fileno()
            watching = True

            def on_readable() -> None:
                # The event loop reads the pipe when the child wrote to it; EOF means the child died.
                try:
                    while conn.poll():
                        message = conn.recv()
                        replies.put_nowait(message)
                        if message[0] in ("result", "error"):
                            unwatch()
                            return
                except (EOFError, OSError):
                    unwatch()
                    replies.put_nowait(("died", None))

            def unwatch() -> None:
                nonlocal watching
                if watching:
                    watching = False
                    loop.remove_reader(fd)

            loop.add_reader(fd, on_readable)
            deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
            try:
                conn.send((kind, args))
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
            except TimeoutError:
                unwatch()
                await asyncio.to_thread(self._kill)
                raise UserCodeError(f"user code did not finish within {timeout:.0f}s and was stopped") from None
            except (BrokenPipeError, ConnectionResetError):
                # The child died before it read the call.
                unwatch()
                raise await self._exited() from None
            except asyncio.CancelledError:
                unwatch()
                await asyncio.to_thread(self._kill)
                raise
            finally:
                unwatch()

    async def train(
        self,
        call: TrainCall,
        *,
        timeout: float | None = None,
        on_metrics: Callable[[dict[str, Any]], None] | None = None,
    ) -> TrainResult:
        """Run the user's training function; raise UserCodeError with one clear line if it fails."""
        out = await self._call("train", call, timeout, on_metrics)
        return TrainResult(samples=out["samples"], size=out["size"], sha256=out["sha256"], metrics=out["metrics"])

    async def init_weights(self, module: str, env: dict[str, Any], target: Path, *, timeout: float) -> bool:
        """Write the module's `fl_init_weights(env)` to `target`; False if the module has none."""
        out = await self._call("init", (module, env, str(target)), timeout)
        return bool(out["found"])

    async def evaluate(
        self, module: str, env: dict[str, Any], weights_path: Path, *, timeout: float
    ) -> dict[str, float] | None:
        """The module's `fl_evaluate_model(weights, env)` metrics; None if it has none."""
        out = await self._call("evaluate", (module, env, str(weights_path)), timeout)
        return out["metrics"] if out["found"] else None

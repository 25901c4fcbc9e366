"""The training child's side: a process that imports the user's module and runs its functions, one call
at a time, sending metrics, log lines and the result back to its parent over a pipe."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from apiary.trainers import environment
from apiary.trainers.base import TrainCall, TrainerError

INIT_FUNCTION = "fl_init_weights"
EVALUATE_FUNCTION = "fl_evaluate_model"
PARENT_CHECK_INTERVAL = 0.5  # seconds between the child's looks at whether its worker still runs
PARENTS_SIGNALS = {signal.SIGINT, signal.SIGTERM}  # the parent's to handle: the child ignores them


class UserCodeError(TrainerError):
    """The user's function failed; the message is one line saying how and where."""


class ChildLogger:
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


# Frames in these files are Apiary's or a library's: an error is described where the user's code raised it.
_LIBRARY_MARKS = ("site-packages", "/lib/python", "apiary/trainers/", "apiary/weights.py")


def describe(error: BaseException) -> str:
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
        raise UserCodeError(f"entrypoint module {module!r} cannot be imported: {describe(e)}") from e
    fn = getattr(mod, function, None)
    if fn is None:
        if optional:
            return None
        raise UserCodeError(f"entrypoint module {module!r} has no function {function!r}")
    if not callable(fn):
        raise UserCodeError(f"{module}.{function} is not callable")
    return fn


_device: list[str] = []


def training_device(conn: Connection) -> str:
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
    from apiary.trainers import shard_state

    fn = _resolve(call.module, call.function)
    assert fn is not None
    initial = load_initial(call.weights_path)
    carried = shard_state.load(call)
    payload = {"env": dict(call.env), "initial_weights": carried.personalise(initial), "dataset": dict(call.dataset),
               "round": dict(call.round), "job": dict(call.job), "device": training_device(conn),
               "state": carried.user_state(), "server_state": carried.server_state}
    Path(call.out_dir).mkdir(parents=True, exist_ok=True)
    result = fn(payload, call.out_dir, ChildLogger(conn))
    if not isinstance(result, dict) or "weights" not in result or "samples" not in result:
        raise UserCodeError(f"{call.function} must return a dict with 'weights' and 'samples'")
    weights, state_out = carried.split(call.function, result)
    size, sha256 = save_trained(call, weights, call.function)
    samples = result["samples"]
    if isinstance(samples, bool) or not isinstance(samples, int):
        with contextlib.suppress(Exception):
            samples = int(samples) if float(samples) == int(samples) else samples
    metrics = {k: float(v) for k, v in (result.get("metrics") or {}).items() if _is_number(v)}
    return {"samples": samples, "metrics": metrics, "size": size, "sha256": sha256, **state_out}


def save_result(result_path: str, weights: Any, function: str) -> tuple[int, str]:
    """Write the trained weights to `result_path` whole (through a .part file); their size and sha256."""
    data = _saved_weights(function, weights)
    tmp = Path(result_path + ".part")
    tmp.write_bytes(data)
    tmp.replace(result_path)
    return len(data), hashlib.sha256(data).hexdigest()


def save_trained(call: TrainCall, weights: Any, function: str) -> tuple[int, str]:
    """Write a training result (`save_result`), its update clipped to `call.clipping_norm` where the job's
    differential privacy clips on workers (and noised, where it noises on workers): the aggregator never receives
    the unclipped update."""
    size, sha256 = save_result(call.result_path, weights, function)
    if call.clipping_norm is not None:
        from apiary.trainers.clip_upload import clip_result

        try:
            size, sha256 = clip_result(call.result_path, call.weights_path, call.clipping_norm,
                                       noise_std=call.noise_std or 0.0, noise_seed=call.noise_seed)
        except ValueError as e:
            raise UserCodeError(f"{function} returned weights whose update cannot be clipped for differential "
                                f"privacy: {e}") from None
    if call.transfer is None:
        return size, sha256
    from apiary.trainers.encode_upload import encode_result

    try:
        return encode_result(call.result_path, call.weights_path, call.transfer)
    except ValueError as e:
        raise UserCodeError(f"{function} returned weights that cannot be encoded for upload: {e}") from None


def load_initial(weights_path: str) -> dict[str, Any]:
    """The round's global weights as the trainer gets them: zero-copy views of a writable buffer of their own
    (no torch operation that would wake its thread pool), or, downloaded in half precision
    (`distributed.transfer.download`), cast back to their dtypes."""
    from apiary.wire_codec import load_downloaded

    return load_downloaded(bytearray(Path(weights_path).read_bytes()))


def _saved_weights(function: str, weights: Any) -> bytes:
    """The returned weights as safetensors bytes, or one line saying why they cannot be."""
    from apiary import weights as w

    if not hasattr(weights, "items"):
        raise UserCodeError(f"{function} returned 'weights' that is not a name -> tensor mapping")
    try:
        return w.dumps(weights)
    except Exception as e:
        raise UserCodeError(f"{function} returned weights that cannot be saved: {describe(e)}") from e


def _run_init(call: TrainCall) -> dict[str, Any]:
    fn = _resolve(call.module, INIT_FUNCTION, optional=True)
    if fn is None:
        return {"found": False}
    weights = fn(dict(call.env))
    if not hasattr(weights, "items"):
        raise UserCodeError(f"{INIT_FUNCTION} must return a name -> tensor mapping")
    size, sha256 = save_result(call.result_path, weights, INIT_FUNCTION)
    return {"found": True, "size": size, "sha256": sha256}


def _run_evaluate(call: TrainCall) -> dict[str, Any]:
    from apiary import weights as w

    fn = _resolve(call.module, EVALUATE_FUNCTION, optional=True)
    if fn is None:
        return {"found": False, "metrics": {}}
    weights, env = w.loads(Path(call.weights_path).read_bytes()), dict(call.env)
    if call.dataset:
        # One shard's personalised model (a personal-layers job): the global weights with the shard's personal
        # layers in place, scored where the shard's data is (SHARD_DATA: its folder); its held-out part is the
        # function's to choose, as the training function's is.
        from apiary.trainers import shard_state

        weights = shard_state.load(call).personalise(weights)
        env.update(SHARD_DATA=call.dataset["data_root"], SHARD_INDEX=int(call.dataset["shard_index"]))
    metrics = fn(weights, env)
    if metrics is not None and not hasattr(metrics, "items"):
        raise UserCodeError(f"{EVALUATE_FUNCTION} must return a dict of metrics, got {type(metrics).__name__}")
    return {"found": True, "metrics": {k: float(v) for k, v in dict(metrics or {}).items() if _is_number(v)}}


def _exit_with_parent(parent: int) -> None:
    """End this child soon after the process that started it (`parent`) is gone (killed with SIGKILL, say, where
    nothing could stop the child): an orphan would train on for nobody, holding its GPU's memory. The child's own
    parent is `parent` or the fork server `parent` started, which exits with it; either way the child is orphaned
    when `parent` goes."""

    def watch() -> None:
        immediate = os.getppid()
        while os.getppid() == immediate and _running(parent):
            time.sleep(PARENT_CHECK_INTERVAL)
        os._exit(1)

    threading.Thread(target=watch, name="apiary-parent-watch", daemon=True).start()


def _running(pid: int) -> bool:
    """Whether a process with this pid exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Built-in trainers' calls (`module:function`), imported in the child when first made (their libraries are heavy).
_BUILT_IN_CALLS = {"causal_lm.train": "apiary.trainers.causal_lm_train:run_train",
                   "causal_lm.evaluate": "apiary.trainers.causal_lm_eval:run_evaluate",
                   "causal_lm.init": "apiary.trainers.causal_lm_adapter:run_init",
                   "causal_lm.merge": "apiary.trainers.causal_lm_adapter:run_merge"}


def _run(kind: str, args: Any, conn: Connection) -> dict[str, Any]:
    if kind in _BUILT_IN_CALLS:
        module, _, function = _BUILT_IN_CALLS[kind].partition(":")
        result: dict[str, Any] = getattr(importlib.import_module(module), function)(args, conn)
        return result
    if kind == "train":
        return _run_train(args, conn)
    if kind == "init":
        return _run_init(args)
    if kind == "evaluate":
        return _run_evaluate(args)
    raise UserCodeError(f"unknown call {kind!r}")


def child_main(conn: Connection, code_paths: list[str], environ: dict[str, str],
               parent: int | None = None) -> None:
    """The child process: serve calls from the parent until the pipe closes."""
    # Its parent decides when this process ends (it kills it). A Ctrl-C or SIGTERM sent to the whole
    # process group (a terminal, systemd, a container runtime) is the parent's to handle: it stops
    # gracefully and gives the assignment back, where the child dying first would report a failure.
    for sig in PARENTS_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # Its parent started it with them blocked, so that none came before they were ignored; any that is
    # pending is dropped now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PARENTS_SIGNALS)
    if parent is not None:
        _exit_with_parent(parent)
    environment.adopt(environ)  # the parent's environment as it was when it asked for this child
    for path in reversed(code_paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    while True:
        try:
            kind, args = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        try:
            conn.send(("result", _run(kind, args, conn)))
        except TrainerError as e:
            conn.send(("error", str(e)))
        except BaseException as e:
            conn.send(("error", describe(e)))
            if isinstance(e, KeyboardInterrupt):
                return

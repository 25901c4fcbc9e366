"""A training child whose worker was killed with SIGKILL (nothing could stop the child) leaves on its
own, even while the user's code runs without a word to its parent: an orphan would train on for
nobody, holding its GPU's memory. A Ctrl-C or SIGTERM to the whole process group is the worker's to
handle: the child trains on until its worker stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.faults.support import process_alive

WORKER = '''
import asyncio, sys
from pathlib import Path
from apiary.trainers import TrainCall, UserCodeRunner
from apiary.weights import dumps

async def main(tmp):
    (tmp / "w.safetensors").write_bytes(dumps({}))
    runner = UserCodeRunner([str(tmp)])
    await runner.start()
    print(runner.pid, flush=True)
    call = TrainCall(module="silent", function="fl_train_model", weights_path=str(tmp / "w.safetensors"),
                     result_path=str(tmp / "r.safetensors"), out_dir=str(tmp / "out"), env={}, dataset={},
                     round={}, job={})
    await runner.train(call, timeout=3600)

asyncio.run(main(Path(sys.argv[1])))
'''

SILENT = '''
import time
from pathlib import Path

def fl_train_model(payload, out_dir, logger=None):
    Path(out_dir, "started").write_text("")
    time.sleep(3600)  # a long computation that neither logs nor returns
'''


def _wait_started(tmp_path: Path) -> None:
    deadline = time.monotonic() + 60
    while not (tmp_path / "out" / "started").exists():
        assert time.monotonic() < deadline, "the user's function never started"
        time.sleep(0.05)


def test_the_child_of_a_worker_killed_with_sigkill_exits_on_its_own(tmp_path: Path) -> None:
    (tmp_path / "silent.py").write_text(SILENT)
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert worker.stdout is not None
    child = int(worker.stdout.readline())
    try:
        _wait_started(tmp_path)

        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
        killed = time.monotonic()
        while process_alive(child) and time.monotonic() - killed < 5:
            time.sleep(0.05)

        assert not process_alive(child), "the training child outlived its worker"
    finally:
        if worker.poll() is None:
            worker.kill()
        if process_alive(child):
            os.kill(child, signal.SIGKILL)


QUICK = """
import time
from pathlib import Path

def fl_train_model(payload, out_dir, logger=None):
    Path(out_dir, "started").write_text("")
    while not Path(out_dir, "go").exists():
        time.sleep(0.02)
    return {"weights": {}, "samples": 1}
"""


def test_a_ctrl_c_or_sigterm_to_the_process_group_does_not_end_the_training(tmp_path: Path) -> None:
    # Prepare: a worker whose child trains; the worker handles both signals by doing nothing (a handler,
    # unlike an ignored signal, is not inherited: the child starts with the default dispositions).
    (tmp_path / "silent.py").write_text(QUICK)
    script = WORKER.replace("await runner.train(call, timeout=3600)",
                            "print(await runner.train(call, timeout=3600), flush=True)")
    worker = subprocess.Popen(
        [sys.executable, "-c", "import signal; signal.signal(signal.SIGINT, lambda *_: None);"
         " signal.signal(signal.SIGTERM, lambda *_: None)\n" + script, str(tmp_path)],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert worker.stdout is not None
    child = int(worker.stdout.readline())
    try:
        _wait_started(tmp_path)

        # Execute
        os.killpg(worker.pid, signal.SIGINT)
        os.killpg(worker.pid, signal.SIGTERM)
        time.sleep(0.5)
        alive = process_alive(child)
        (tmp_path / "out" / "go").write_text("")
        result = worker.stdout.readline()
        worker.wait(timeout=30)

        # Assert: the training went on and returned its result.
        assert alive
        assert result.startswith("TrainResult(samples=1"), result
        assert worker.returncode == 0
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)

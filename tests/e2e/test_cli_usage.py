"""The command line as people really use it (issue 21): Ctrl-C at any moment, two signals at once, results
through a pipe, mistakes in a job file caught before anything starts, paths read from the job file's
folder, --timeout from the command's start. Each drives the real `apiary` command."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from tests.fixtures.embedded import REPO, toy_request
from tests.fixtures.policy import foreign

SLOW = {"mode": "slow", "slow_seconds": 60}  # a shard still training when the run is stopped
NOISE = ("Traceback", "KeyboardInterrupt")  # what no spawned process may print


def _environment(home: Path) -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if not foreign(k)}
    environment.update({"APIARY_HOME": str(home), "PYTHONPATH": str(REPO), "APIARY_HTTP_PORT": "0"})
    return environment


def _start(job: Path, home: Path, *args: str, cwd: Path = REPO) -> subprocess.Popen[str]:
    """`apiary run JOB` in a process group of its own, with Ctrl-C as at a terminal."""
    return subprocess.Popen(
        [sys.executable, "-m", "services.app.cli", "run", str(job), "--workers", "2", *args],
        cwd=cwd, env=_environment(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _apiary(*args: str, home: Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.app.cli", *args], cwd=cwd, env=_environment(home),
                          capture_output=True, text=True, timeout=120)


def _job_file(folder: Path, request: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    job = folder / "job.json"
    job.write_text(json.dumps(request))
    return job


def _rows(home: Path, sql: str) -> list[tuple[Any, ...]]:
    if not (home / "apiary.db").exists():
        return []
    with sqlite3.connect(home / "apiary.db") as conn:
        try:
            return conn.execute(sql).fetchall()
        except sqlite3.OperationalError:  # a table not created yet, or the database busy
            return []


def _until(what: str, check: Any, run: subprocess.Popen[str], within: float = 120) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert run.poll() is None, run.communicate()
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def _spawning(run: subprocess.Popen[str]) -> bool:
    """Whether the run is starting its training children: its fork server, or a child of it, is up."""
    children = psutil.Process(run.pid).children()
    return any("multiprocessing.forkserver" in " ".join(child.cmdline()) or "spawn_main" in " ".join(child.cmdline())
               for child in children if child.is_running())


def _assert_cancelled_quietly(run: subprocess.Popen[str], home: Path, out: str, err: str) -> None:
    assert run.returncode == 130, err[-3000:]
    assert not any(word in err for word in NOISE), err[-3000:]
    assert "cancelled job" in out and "interrupted: apiary run got Ctrl-C" in out, out
    assert _rows(home, "SELECT status FROM jobs") == [("cancelled",)], err[-3000:]
    assert _rows(home, "SELECT status FROM job_views") == [("cancelled",)]


def test_ctrl_c_to_the_group_while_training_children_start_is_a_quiet_cancel(tmp_path: Path,
                                                                            toy_dataset: Path) -> None:
    # Prepare
    home = tmp_path / ".apiary"
    run = _start(_job_file(tmp_path / "job", {**toy_request(toy_dataset, max_workers=2), "config": SLOW}), home)
    _until("a training child spawning", lambda: _spawning(run), run)

    # Execute: what a terminal does on Ctrl-C
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.communicate(timeout=120)

    # Assert
    _assert_cancelled_quietly(run, home, out, err)


SLOW_INIT = '''
import time
from pathlib import Path
from tests.toyjobs.toy import fl_init_weights as toy_init, fl_train_model

def fl_init_weights(env):
    Path(env["MARKER"]).write_text("computing")
    deadline = time.monotonic() + 600
    while not Path(env["HOLD"]).exists() and time.monotonic() < deadline:  # until interrupted: the test never opens it
        time.sleep(0.05)
    return toy_init(env)
'''


def test_ctrl_c_while_initial_weights_are_computed_is_a_cancel_not_a_user_code_failure(
        tmp_path: Path, toy_dataset: Path) -> None:
    # Prepare: an fl_init_weights that says when it runs
    folder, marker = tmp_path / "job", tmp_path / "init-started"
    folder.mkdir()
    (folder / "slowinit.py").write_text(SLOW_INIT)
    request = {**toy_request(toy_dataset, max_workers=2), "entrypoint": "slowinit:fl_train_model",
               "config": {**SLOW, "marker": str(marker), "hold": str(tmp_path / "never-opened")}}
    home = tmp_path / ".apiary"
    run = _start(_job_file(folder, request), home)
    _until("fl_init_weights running", marker.exists, run)

    # Execute
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.communicate(timeout=120)

    # Assert
    _assert_cancelled_quietly(run, home, out, err)
    assert "initial weights" not in out


def test_two_sigints_close_together_still_cancel_and_print_the_summary(tmp_path: Path, toy_dataset: Path) -> None:
    # Prepare
    home = tmp_path / ".apiary"
    run = _start(_job_file(tmp_path / "job", {**toy_request(toy_dataset, max_workers=2), "config": SLOW}), home)
    _until("a shard training", lambda: _rows(home, "SELECT 1 FROM shard_views WHERE state = 'training'"), run)

    # Execute: as `timeout -s INT` does: the process, then its group
    run.send_signal(signal.SIGINT)
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.communicate(timeout=120)

    # Assert
    _assert_cancelled_quietly(run, home, out, err)


def test_results_go_to_stdout_and_paths_are_read_from_the_job_files_folder(tmp_path: Path,
                                                                          toy_dataset: Path) -> None:
    # Prepare: a job file whose dataset is given relative to it, run from another folder
    folder, elsewhere, home = tmp_path / "job", tmp_path / "elsewhere", tmp_path / ".apiary"
    elsewhere.mkdir()
    job = _job_file(folder, {**toy_request(toy_dataset, num_rounds=1, max_workers=2),
                             "dataset": os.path.relpath(toy_dataset, folder)})

    # Execute
    ran = _apiary("run", str(job), "--workers", "2", home=home, cwd=elsewhere)
    job_id = _rows(home, "SELECT job_id FROM jobs")[0][0]
    status = _apiary("status", job_id, home=home, cwd=elsewhere)

    # Assert: the summary and the final model's path on stdout; the live view and progress on stderr
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert f"completed job {job_id}" in ran.stdout and "final model: " in ran.stdout
    assert "dashboard: " in ran.stderr and "dashboard: " not in ran.stdout
    assert status.returncode == 0 and job_id in status.stdout and "completed" in status.stdout
    assert status.stderr == ""


def test_every_problem_in_a_job_file_is_named_before_anything_starts(tmp_path: Path) -> None:
    # Prepare: a misspelt field, min_workers above max_workers, a dataset and code that are not there
    folder = tmp_path / "job"
    job = _job_file(folder, {"name": "x", "entrypoint": "nothere.train:fl_train_model", "dataset": "data",
                             "distributed": {"num_round": 5, "min_workers": 4, "max_workers": 2}})

    # Execute
    done = _apiary("run", str(job), home=tmp_path / ".apiary", cwd=tmp_path)

    # Assert: one line per problem, the absolute path tried, and nothing started
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"error: {job}: distributed.num_round: unknown field (did you mean num_rounds?)",
        f"error: {job}: distributed: min_workers (4) must not exceed max_workers (2)",
        f"error: {job}: dataset: {folder / 'data'} does not exist (a relative path is read from the job file's "
        "folder)",
        f"error: {job}: entrypoint: module 'nothere.train' not found: no nothere/train.py or "
        f"nothere/train/__init__.py in {folder} or a folder above it, and no installed package of that name",
    ]
    assert not (tmp_path / ".apiary" / "apiary.db").exists()


def test_a_misnamed_entrypoint_function_is_caught_before_anything_starts(tmp_path: Path, toy_dataset: Path) -> None:
    job = _job_file(tmp_path / "job", {**toy_request(toy_dataset), "entrypoint": "tests.toyjobs.toy:fl_trian"})

    done = _apiary("run", str(job), home=tmp_path / ".apiary")

    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"error: {job}: entrypoint: {REPO / 'tests/toyjobs/toy.py'} defines no "
                                        "'fl_trian'"]


def test_a_broken_yaml_file_is_one_line_with_its_line_and_column(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("name: x\ndistributed: {num_rounds: 2,\n  min_workers: [1\n")

    done = _apiary("run", str(job), home=tmp_path / ".apiary")

    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1
    assert done.stderr.startswith(f"error: {job}:4:1: job file is not valid YAML: "), done.stderr


def test_timeout_counts_from_the_commands_start(tmp_path: Path, toy_dataset: Path) -> None:
    # Prepare
    home = tmp_path / ".apiary"
    job = _job_file(tmp_path / "job", {**toy_request(toy_dataset, max_workers=2), "config": SLOW})

    # Execute: note when the stack is up (the run prints the job's dashboard address once it submitted the job)
    # and when the run says it gives up
    began = time.monotonic()
    run = _start(job, home, "--timeout", "5")
    assert run.stderr is not None
    up = gave_up = None
    for line in run.stderr:
        if line.startswith("dashboard:") and up is None:
            up = time.monotonic() - began
        if "the job did not end in time" in line:
            gave_up = time.monotonic() - began
            break
    out, err = run.communicate(timeout=120)

    # Assert: 5 s after the command started (its start-up included), not 5 s after the stack was up. Both bounds
    # are read from the run's own lines, not from a margin of slack: a busy machine only moves them.
    assert run.returncode == 1, err[-3000:]
    assert up is not None and gave_up is not None, err[-3000:]
    assert 5 <= gave_up < up + 5, (up, gave_up)
    assert "cancelled job" in out

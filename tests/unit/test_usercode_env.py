"""Apiary's processes wait passively in OpenMP; the user's code gets the environment the user set."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from apiary.trainers import OPENMP_WAIT, UserCodeRunner, environment, quiet_openmp

PROBE = '''
import os

def fl_evaluate_model(weights, env):
    value = os.environ.get("OMP_WAIT_POLICY")
    return {"unset": float(value is None), "active": float(value == "ACTIVE")}
'''


@pytest.fixture
def probe_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "omp_probe.py").write_text(PROBE)
    weights = tmp_path / "w.safetensors"
    from apiary.weights import dumps

    weights.write_bytes(dumps({}))
    monkeypatch.setattr(environment, "_user_openmp_wait", [])
    return tmp_path


async def _child_sees(code_dir: Path) -> dict[str, float] | None:
    runner = UserCodeRunner([str(code_dir)])
    try:
        return await runner.evaluate("omp_probe", {}, code_dir / "w.safetensors", timeout=60)
    finally:
        await runner.stop()


async def test_the_service_waits_passively_and_user_code_sees_no_policy(
    probe_module: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(OPENMP_WAIT, "unset below")  # so that the variable is restored after the test
    monkeypatch.delenv(OPENMP_WAIT)

    quiet_openmp()

    assert os.environ[OPENMP_WAIT] == "PASSIVE"
    assert await _child_sees(probe_module) == {"unset": 1.0, "active": 0.0}


async def test_a_policy_the_user_set_is_kept_everywhere(probe_module: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OPENMP_WAIT, "ACTIVE")

    quiet_openmp()

    assert os.environ[OPENMP_WAIT] == "ACTIVE"
    assert await _child_sees(probe_module) == {"unset": 0.0, "active": 1.0}


ENV_PROBE = '''
import os

def fl_evaluate_model(weights, env):
    return {"set": float(os.environ.get("APIARY_TEST_PROBE") == "late"),
            "gone": float("APIARY_TEST_GONE" not in os.environ)}
'''


async def test_a_child_runs_with_its_parents_environment_as_it_is_when_the_child_starts(
    probe_module: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Children are forked from a server started with the first one (apiary.trainers.process): each still gets the
    # environment of the moment it starts, as a spawned process would.
    (probe_module / "env_probe.py").write_text(ENV_PROBE)
    monkeypatch.setenv("APIARY_TEST_GONE", "early")
    await _child_sees(probe_module)  # a first child: the fork server runs from here on, with APIARY_TEST_GONE set
    monkeypatch.setenv("APIARY_TEST_PROBE", "late")
    monkeypatch.delenv("APIARY_TEST_GONE")
    runner = UserCodeRunner([str(probe_module)])
    try:
        seen = await runner.evaluate("env_probe", {}, probe_module / "w.safetensors", timeout=60)
    finally:
        await runner.stop()
    assert seen == {"set": 1.0, "gone": 1.0}

"""Which trainer a job gets, and what the user-function trainer declares about its updates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from apiary.strategies.format import UpdateFormat
from apiary.trainers import (
    BUILT_IN,
    USER_FUNCTION,
    TrainerSetup,
    TrainResult,
    UserCodeRunner,
    make_trainer,
    trainer_name,
)
from tests.conftest import REPO


def test_a_job_with_an_entrypoint_gets_the_user_function_and_one_without_the_built_in() -> None:
    assert trainer_name("pkg.train:fl_train_model") == USER_FUNCTION
    assert trainer_name(None) == BUILT_IN
    assert trainer_name("") == BUILT_IN


def test_the_user_function_trainer_is_registered() -> None:
    assert isinstance(make_trainer(USER_FUNCTION, TrainerSetup(code_paths=[], name="t")), UserCodeRunner)


def test_an_unknown_trainer_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"no trainer 'nope' on this worker: expected one of \[.*'user_function'"):
        make_trainer("nope", TrainerSetup())


@pytest.mark.parametrize(("env", "expected"), [
    ({}, UpdateFormat.FULL),
    ({"USE_PEFT": False}, UpdateFormat.FULL),
    ({"USE_PEFT": True}, UpdateFormat.ADAPTER),
    ({"USE_PEFT": "true"}, UpdateFormat.ADAPTER),
])
def test_the_user_function_returns_adapters_for_a_peft_job(env: dict[str, object], expected: UpdateFormat) -> None:
    assert UserCodeRunner().update_format(env) is expected


@pytest.mark.parametrize(("samples", "usable"), [(3, True), (0, False), (-1, False), (True, False), (2.5, False)])
def test_only_a_positive_int_weights_the_average(samples: object, usable: bool) -> None:
    assert TrainResult(samples=samples, size=1, sha256="0" * 64).has_samples() is usable


def test_a_training_child_does_not_import_its_parents_main_module_again(tmp_path: Path) -> None:
    # multiprocessing's spawn imports the parent's __main__ in the child (as __mp_main__) unless told not to;
    # for the `apiary` command that was the whole CLI, a second of CPU in every child.
    imports = tmp_path / "imports"
    subprocess.run([sys.executable, "-m", "tests.toyjobs.main_probe", str(imports)], cwd=REPO, check=True,
                   timeout=120)
    assert imports.read_text().split() == ["__main__"]

"""The processes that never hold tensors stay light: a worker (its training child imports torch), the scheduler
(it checks weights by their header; only a job that halves its downloads loads torch there), the tracker and the
sharder never import torch. Each would start a second or more later and hold ~200 MB more."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["services.worker.service", "services.scheduler.service", "services.tracker",
                                    "services.sharder"])
def test_importing_the_service_does_not_import_torch(module: str) -> None:
    code = f"import sys; import {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_header_reader_knows_every_dtype_the_tensor_reader_does() -> None:
    import torch

    from apiary.safetensors_header import ITEMSIZES
    from apiary.weights import DTYPES

    assert {name: torch.empty((), dtype=dtype).element_size() for name, dtype in DTYPES.items()} == ITEMSIZES


@pytest.mark.parametrize("module", ["services.app.cli", "services.worker.service"])
def test_the_command_and_a_worker_do_not_import_fastapi(module: str) -> None:
    # Only the tracker serves the API; a client of it (every command, the worker's tracker calls) shares its base
    # path through services.tracker.api_path, not its FastAPI schemas (a fifth of a second in every process).
    code = f"import sys; import {module}; print('fastapi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_training_child_imports_no_trainer_it_does_not_run() -> None:
    # Every training child imports apiary.trainers; the causal-LM trainer (its config models) is loaded where a
    # job asks for it, not in each child of a user-function job.
    code = "import sys; import apiary.trainers.child; print(sorted(m for m in sys.modules if 'causal_lm' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

"""A worker process stays light: it never imports torch (its training child does)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_worker_does_not_import_torch() -> None:
    code = "import sys; import services.worker.service; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"

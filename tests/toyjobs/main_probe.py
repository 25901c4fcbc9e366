"""A program whose `__main__` a training child must not import again: run as `python -m
tests.toyjobs.main_probe FILE`, each import of this module appends its `__name__` to FILE; then it starts a
user-code child, asks it for the toy's initial weights, and exits."""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

with open(sys.argv[1], "a", encoding="utf-8") as _out:
    _out.write(__name__ + "\n")


async def _init_in_a_child() -> None:
    from apiary.trainers.user_function import UserCodeRunner

    runner = UserCodeRunner()
    try:
        with tempfile.TemporaryDirectory() as folder:
            found = await runner.init_weights("tests.toyjobs.toy", {}, Path(folder) / "w.safetensors", timeout=120)
            assert found
    finally:
        await runner.stop()


if __name__ == "__main__":
    asyncio.run(_init_in_a_child())

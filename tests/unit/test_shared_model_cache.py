"""Workers of one machine sharing a model cache folder: a model is downloaded by one of them while the others
wait and reuse it, and a GGUF base is converted into its Hugging Face folder by one training child while the
others wait for that folder."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import threading
from pathlib import Path
from typing import Any

import pytest

from apiary import filelock, transfer
from apiary.contracts import ModelRef
from apiary.filelock import exclusive
from services.worker.model_cache import ModelCache

WAIT = 60.0  # seconds a test waits for another thread before it fails


async def test_workers_sharing_the_cache_download_a_model_once(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: two workers' caches on one folder; a download that lasts until the other fetch finds the lock taken
    source = tmp_path / "registry" / "base.gguf"
    source.parent.mkdir()
    source.write_bytes(b"GGUF" * 100)
    ref = ModelRef(model_id=1, url=source.as_uri(), sha256=hashlib.sha256(source.read_bytes()).hexdigest(),
                   size=400, format="gguf", filename="base.gguf")
    first, second = ModelCache(tmp_path / "models", 10**6), ModelCache(tmp_path / "models", 10**6)
    download, downloads, both_asked = transfer.download, [], asyncio.Event()

    async def slow(url: str, target: Path, sha256: str, **kw: Any) -> None:
        downloads.append(target)
        await asyncio.wait_for(both_asked.wait(), WAIT)
        await download(url, target, sha256, **kw)

    real_flock = fcntl.flock

    def flock(fd: int, operation: int) -> None:
        try:
            real_flock(fd, operation)
        except BlockingIOError:
            both_asked.set()
            raise

    monkeypatch.setattr(transfer, "download", slow)
    monkeypatch.setattr(filelock.fcntl, "flock", flock)

    # Execute
    (path_1, moved_1), (path_2, moved_2) = await asyncio.gather(first.fetch(ref), second.fetch(ref))

    # Assert
    assert len(downloads) == 1 and sorted([moved_1, moved_2]) == [0, 400]
    assert path_1 == path_2 == tmp_path / "models" / ref.sha256 / "base.gguf"


def test_one_child_converts_a_gguf_base_while_the_others_wait_for_its_folder(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the first conversion lasts until a second child is waiting for the lock
    pytest.importorskip("transformers")
    from apiary.trainers import causal_lm_model as lm
    from tests.fixtures import tiny_llm

    model_dir = tiny_llm.save_model(tmp_path / "tiny-llama")
    gguf = tmp_path / "cache" / "tiny.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    reads: list[Path] = []
    second_waits = threading.Event()
    entered = 0
    lock = threading.Lock()

    def counted(path: Path) -> Any:
        nonlocal entered
        with lock:
            entered += 1
            if entered == 2:
                second_waits.set()
        return exclusive(path)

    def read(path: Path) -> tuple[Any, Any]:
        reads.append(path)
        assert second_waits.wait(WAIT), "the second child never asked for the lock"
        return lm.load_base(model_dir)

    monkeypatch.setattr(lm, "exclusive", counted)
    folders: list[Path] = []

    # Execute: two children at once (threads here; each opens the lock file apart, as processes do)
    children = [threading.Thread(target=lambda: folders.append(lm.hf_folder(gguf, load=read))) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(WAIT)

    # Assert: one read of the GGUF file; both got the same ready folder
    assert reads == [gguf]
    assert folders == [gguf.with_name("tiny.gguf.hf")] * 2 and (folders[0] / lm.READY).is_file()

"""A worker's base-model cache: downloaded once and reused across jobs (keyed by sha256), an HF zip
unpacked read-only, the least recently used model dropped when the cache is over its limit."""

from __future__ import annotations

import hashlib
import stat
import zipfile
from pathlib import Path

from apiary.contracts import ModelRef
from services.worker.model_cache import ModelCache


def _ref(path: Path, fmt: str, model_id: int = 1) -> ModelRef:
    body = path.read_bytes()
    return ModelRef(model_id=model_id, url=path.as_uri(), sha256=hashlib.sha256(body).hexdigest(), size=len(body),
                    format=fmt, filename=path.name)


def _gguf(tmp_path: Path, name: str, size: int) -> ModelRef:
    path = tmp_path / "registry" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(name.encode() * (size // len(name)))
    return _ref(path, "gguf")


async def test_a_model_is_downloaded_once_and_reused_across_jobs(tmp_path: Path) -> None:
    # Prepare
    source = tmp_path / "registry" / "model.zip"
    source.parent.mkdir()
    with zipfile.ZipFile(source, "w") as zf:
        zf.writestr("config.json", '{"model_type": "llama"}')
        zf.writestr("model.safetensors", b"weights")
    cache = ModelCache(tmp_path / "cache", limit=10**6)
    ref = _ref(source, "hf")

    # Execute
    first, moved_first = await cache.fetch(ref)
    second, moved_second = await cache.fetch(ref)

    # Assert
    assert first == second == tmp_path / "cache" / ref.sha256 / "model"
    assert (moved_first, moved_second) == (ref.size, 0)
    assert (first / "config.json").read_text() == '{"model_type": "llama"}'
    assert not (first / "model.safetensors").stat().st_mode & stat.S_IWUSR
    assert not (first.parent / "model.zip").exists()


async def test_the_least_recently_used_model_is_dropped_when_the_cache_is_full(tmp_path: Path) -> None:
    # Prepare: room for two 400-byte models
    cache = ModelCache(tmp_path / "cache", limit=1000)
    a, b, c = (_gguf(tmp_path, f"{n}.gguf", 400) for n in "abc")
    await cache.fetch(a)
    await cache.fetch(b)
    await cache.fetch(a)  # a used after b: b is the least recently used

    # Execute
    path_c, _ = await cache.fetch(c)

    # Assert
    kept = sorted(p.name for p in (tmp_path / "cache").iterdir() if p.is_dir())
    assert kept == sorted([a.sha256, c.sha256])
    assert path_c.read_bytes() == (tmp_path / "registry" / "c.gguf").read_bytes()

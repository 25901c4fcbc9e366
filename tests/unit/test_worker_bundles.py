"""A worker's code bundles: downloaded once per sha256 and reused, verified, unpacked read-only, the least
recently used dropped past the limit (never the one in use); declared requirements checked, never installed;
and a training child per bundle, so two versions of one module on one worker each run as their own."""

from __future__ import annotations

import io
import stat
import time
import zipfile
from pathlib import Path

import pytest

from apiary import bundle
from apiary.contracts import Assignment, CodeBundle
from apiary.trainers import TrainCall, UserCodeError, UserCodeRunner
from services.worker.bundles import BundleCache, BundleError, code_for

TRAIN_PY = """
import torch

def fl_train_model(payload, out_dir, logger=None):
    return {{"weights": {{"w": torch.zeros(1)}}, "samples": {samples}}}
"""


def _stored(tmp_path: Path, files: dict[str, str], name: str = "b") -> CodeBundle:
    source = tmp_path / "src" / name
    for path, text in files.items():
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_text(text)
    packed = bundle.pack(source)
    stored = tmp_path / "store" / f"{packed.sha256}.zip"
    stored.parent.mkdir(parents=True, exist_ok=True)
    stored.write_bytes(packed.data)
    return CodeBundle(key=f"code/{packed.sha256}.zip", sha256=packed.sha256, size=packed.size, url=stored.as_uri())


def _assignment(code: CodeBundle | None, requirements: list[str] | None = None) -> Assignment:
    return Assignment(
        job_id="j", round=1, job_name="toy", num_rounds=1, shard=0, num_shards=1, shard_num_samples=1,
        shard_url="file:///nowhere/shard.zip", shard_sha256="0" * 64, weights_url="file:///nowhere/w",
        weights_sha256="0" * 64, upload_url="file:///nowhere/r", result_key="r", entrypoint="m:f", env={},
        deadline=time.time() + 60, code=code, requirements=requirements,
    )


async def test_a_bundle_is_downloaded_once_and_unpacked_read_only(tmp_path: Path) -> None:
    ref = _stored(tmp_path, {"pkg/__init__.py": "", "pkg/train.py": "X = 1\n"})
    cache = BundleCache(tmp_path / "cache")

    first = await cache.fetch(ref)
    second = await cache.fetch(ref)

    assert first == second == tmp_path / "cache" / ref.sha256
    assert cache.downloads == 1
    assert (first / "pkg" / "train.py").read_text() == "X = 1\n"
    assert not (first / "pkg" / "train.py").stat().st_mode & stat.S_IWUSR
    assert not list((tmp_path / "cache").glob("*.zip"))


async def test_a_bundle_whose_bytes_do_not_match_its_sha256_is_refused(tmp_path: Path) -> None:
    ref = _stored(tmp_path, {"a.py": "A = 1\n"})
    lying = ref.model_copy(update={"sha256": "f" * 64})
    cache = BundleCache(tmp_path / "cache")

    with pytest.raises(BundleError, match="could not be fetched: sha256 mismatch"):
        await cache.fetch(lying)

    assert cache.cached() == []


async def test_a_stored_bundle_with_a_symlink_is_refused_on_the_worker(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        info = zipfile.ZipInfo("evil")
        info.create_system, info.external_attr = 3, (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, "/etc/passwd")
    path = tmp_path / "evil.zip"
    path.write_bytes(buffer.getvalue())
    sha = bundle.sha256_of(buffer.getvalue())
    ref = CodeBundle(key=f"code/{sha}.zip", sha256=sha, size=path.stat().st_size, url=path.as_uri())

    with pytest.raises(BundleError, match="refused: code bundle entry 'evil' is a symlink"):
        await BundleCache(tmp_path / "cache").fetch(ref)


async def test_the_least_recently_used_bundle_goes_when_the_cache_is_full_never_the_one_in_use(
        tmp_path: Path) -> None:
    a, b, c = (_stored(tmp_path, {"data.txt": name * 400}, name) for name in "abc")
    cache = BundleCache(tmp_path / "cache", limit=1000)  # room for two
    await cache.fetch(a)
    await cache.fetch(b)
    await cache.fetch(a)  # b is now the least recently used

    await cache.fetch(c)

    assert set(cache.cached()) == {a.sha256, c.sha256}
    cache.limit = 0  # over the limit even alone: the one in use stays
    cache.clean()
    assert cache.cached() == [c.sha256]


async def test_requirements_come_from_the_assignment_else_the_bundles_requirements_txt(tmp_path: Path) -> None:
    ref = _stored(tmp_path, {"a.py": "", "requirements.txt": "numpy>=1\napiary-missing-package==1.0\n"})
    cache = BundleCache(tmp_path / "cache")

    with pytest.raises(BundleError) as error:
        await code_for(cache, _assignment(ref))
    assert str(error.value).startswith("requirement not met on this worker: 'apiary-missing-package==1.0': "
                                       "apiary-missing-package is not installed")
    assert "\n" not in str(error.value)

    assert await code_for(cache, _assignment(ref, ["numpy>=1"])) == cache.folder(ref.sha256)
    with pytest.raises(BundleError, match=r"'numpy<1': numpy .* is installed"):
        await code_for(cache, _assignment(None, ["numpy<1"]))
    assert await code_for(cache, _assignment(None)) is None


async def test_two_bundles_with_their_own_train_py_each_run_their_own(tmp_path: Path) -> None:
    cache = BundleCache(tmp_path / "cache")
    one = await cache.fetch(_stored(tmp_path, {"bundletoy/train.py": TRAIN_PY.format(samples=1)}, "one"))
    two = await cache.fetch(_stored(tmp_path, {"bundletoy/train.py": TRAIN_PY.format(samples=2)}, "two"))
    weights = tmp_path / "w.safetensors"
    from apiary import weights as w

    weights.write_bytes(w.dumps({}))
    runner = UserCodeRunner()

    def call(folder: Path | None) -> TrainCall:
        return TrainCall(module="bundletoy.train", function="fl_train_model", weights_path=str(weights),
                         result_path=str(tmp_path / "r.safetensors"), out_dir=str(tmp_path / "out"), env={},
                         dataset={}, round={}, job={}, code_path=str(folder) if folder else None)

    try:
        samples = [(await runner.train(call(folder), timeout=120)).samples for folder in (one, two, one)]
        with pytest.raises(UserCodeError, match=r"'bundletoy\.train' cannot be imported"):
            await runner.train(call(None), timeout=120)  # not importable outside a bundle
    finally:
        await runner.stop()

    assert samples == [1, 2, 1]

"""Code bundles through whole jobs on the embedded adapters (issue 17): an entrypoint that lives only in an
uploaded bundle trains; two versions of one module on one worker each run as their own; a requirement the
worker lacks fails the shard naming it; a bad bundle reference is rejected before any worker trains."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from apiary import bundle, keys
from apiary.weights import dumps, loads
from services.tracker.client import TrackerError
from tests.fixtures.embedded import REPO, StackFactory, toy_request
from tests.fixtures.policy import foreign
from tests.toyjobs.toy import make_dataset

MODULE = "shippedtoy.train"  # importable from nowhere but its bundle
TRAIN_PY = '''
def fl_train_model(payload, out_dir, logger=None):
    """Version {version}: adds {version} to every weight."""
    weights = {{k: v + {version} for k, v in payload["initial_weights"].items()}}
    return {{"weights": weights, "samples": 1, "metrics": {{"version": {version}}}}}
'''


def _code(root: Path, version: int, extra: dict[str, str] | None = None) -> Path:
    """A project folder whose train.py adds `version` to every weight."""
    files = {"shippedtoy/__init__.py": "", "shippedtoy/train.py": TRAIN_PY.format(version=version), **(extra or {})}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _checkpoint(path: Path) -> Path:
    path.write_bytes(dumps({"w": torch.zeros(3)}))
    return path


def _request(dataset: Path, model: Path, code: dict[str, Any] | str, **fields: Any) -> dict[str, Any]:
    request = toy_request(dataset, num_rounds=1, min_workers=1, max_workers=1)
    return {**request, "entrypoint": f"{MODULE}:fl_train_model", "model": str(model), "code": code, **fields}


async def _upload(stack: Any, folder: Path) -> dict[str, Any]:
    return await stack.api.upload_code(bundle.pack(folder).data)


def test_the_bundles_module_is_not_importable_from_the_repository() -> None:
    assert importlib.util.find_spec(MODULE.split(".")[0]) is None


async def test_an_entrypoint_that_lives_only_in_a_bundle_trains(embedded: StackFactory, toy_dataset: Path,
                                                                 tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "init.safetensors")
    async with embedded(workers=2) as stack:
        code = await _upload(stack, _code(tmp_path / "v3", 3))
        request = _request(toy_dataset, model, code)
        request["distributed"].update(min_workers=2, max_workers=2)
        view = await stack.wait(await stack.submit(request), timeout=120)
        final = loads(await stack.ports.storage.get_bytes(keys.final_model(view["job_id"])))

    assert view["status"] == "completed", view.get("reason")
    assert final["w"].tolist() == [3.0, 3.0, 3.0]
    assert view["code"] == {"sha256": code["sha256"], "size": code["size"], "key": code["key"],
                            "entrypoint": f"{MODULE}:fl_train_model"}


async def test_two_bundles_with_their_own_train_py_on_one_worker(embedded: StackFactory, toy_dataset: Path,
                                                                tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "init.safetensors")
    finals = []
    async with embedded(workers=1) as stack:
        one = await _upload(stack, _code(tmp_path / "v1", 1))
        two = await _upload(stack, _code(tmp_path / "v2", 2))
        for code in (one, two, one):
            view = await stack.wait(await stack.submit(_request(toy_dataset, model, code)), timeout=120)
            assert view["status"] == "completed", view.get("reason")
            finals.append(loads(await stack.ports.storage.get_bytes(keys.final_model(view["job_id"])))["w"][0].item())
        worker = stack.workers[0]

    assert finals == [1.0, 2.0, 1.0]
    assert worker.bundles.downloads == 2  # the third job found its bundle cached
    assert worker.bundles.cached() == sorted([one["sha256"], two["sha256"]])


async def test_a_requirement_the_worker_lacks_fails_the_shard_naming_it(embedded: StackFactory, toy_dataset: Path,
                                                                        tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "init.safetensors")
    folder = _code(tmp_path / "req", 1, {"requirements.txt": "numpy>=1\napiary-not-installed-anywhere>=2\n"})
    async with embedded(workers=1) as stack:
        code = await _upload(stack, folder)
        view = await stack.wait(await stack.submit(_request(toy_dataset, model, code)), timeout=120)
        failures = await stack.ports.db.fetch("SELECT body FROM events WHERE routing_key = 'worker.failed'")

    assert view["status"] == "failed"
    errors = [json.loads(row["body"])["error"] for row in failures]
    assert errors and errors[0].startswith("requirement not met on this worker: "
                                           "'apiary-not-installed-anywhere>=2': apiary-not-installed-anywhere "
                                           "is not installed")
    assert "apiary-not-installed-anywhere" in view["reason"]


@pytest.mark.parametrize(("change", "field", "message"), [
    ({"key": "code/" + "0" * 64 + ".zip", "sha256": "0" * 64}, "code", "no code bundle is stored under"),
    ({"sha256": "1" * 64}, "code", "code bundle's sha256 is"),
    ({"size": 1}, "code", "not 1 as referenced"),
    ({"module": "shippedtoy.absent"}, "entrypoint", "entrypoint module 'shippedtoy.absent' is not in the code "
                                                    "bundle"),
])
async def test_a_bad_bundle_reference_is_rejected_before_any_worker_trains(
        embedded: StackFactory, toy_dataset: Path, tmp_path: Path, change: dict[str, Any], field: str,
        message: str) -> None:
    model = _checkpoint(tmp_path / "init.safetensors")
    async with embedded(workers=1) as stack:
        code = {**await _upload(stack, _code(tmp_path / "v1", 1)), **change}
        module = code.pop("module", MODULE)
        request = _request(toy_dataset, model, code, entrypoint=f"{module}:fl_train_model")
        with pytest.raises(TrackerError) as refused:
            await stack.api.submit_job(request)
        view = await stack.wait(await stack.submit(request), timeout=30)
        trained = await stack.ports.db.fetch("SELECT 1 FROM events WHERE routing_key LIKE 'assign.%'")

    assert refused.value.status_code == 422 and message in str(refused.value)
    assert view["status"] == "rejected"
    assert [e["field"] for e in view["errors"]] == [field]
    assert message in view["errors"][0]["message"]
    assert trained == []


async def test_the_api_stores_a_bundle_once_and_refuses_bad_ones(embedded: StackFactory, tmp_path: Path) -> None:
    packed = bundle.pack(_code(tmp_path / "v1", 1))
    evil = tmp_path / "evil.zip"
    import zipfile

    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("../escape.py", "x")
    async with embedded(workers=1) as stack:
        first = await stack.api.upload_code(packed.data)
        again = await stack.api.upload_code(packed.data, packed.sha256)
        with pytest.raises(TrackerError) as mismatch:
            await stack.api.upload_code(packed.data, "2" * 64)
        with pytest.raises(TrackerError) as escaping:
            await stack.api.upload_code(evil.read_bytes())
        stored = await stack.ports.storage.list("code/")

    assert first == again == {"key": f"code/{packed.sha256}.zip", "sha256": packed.sha256, "size": packed.size}
    assert stored == [first["key"]]
    assert mismatch.value.status_code == 422 and "not 222222222222" in str(mismatch.value)
    assert escaping.value.status_code == 422 and "contains '..'" in str(escaping.value)


def test_apiary_run_packs_and_ships_a_job_files_code_folder(tmp_path: Path) -> None:
    project = tmp_path / "project"
    _code(project / "src", 5)
    _checkpoint(project / "init.safetensors")
    request = _request(make_dataset(project / "data", 6), Path("init.safetensors"), "src")
    (project / "job.json").write_text(json.dumps(request))
    environment = {k: v for k, v in os.environ.items() if not foreign(k)}
    environment.update({"APIARY_HOME": str(tmp_path / ".apiary"), "PYTHONPATH": str(REPO), "APIARY_HTTP_PORT": "0"})

    run = subprocess.run([sys.executable, "-m", "services.app.cli", "run", "job.json", "--workers", "1", "--json",
                          "--gpus", "none"], cwd=project, env=environment, capture_output=True, text=True,
                         timeout=300)

    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert result["status"] == "completed"
    final = loads(Path(result["final_model"].removeprefix("file://")).read_bytes())
    assert final["w"].tolist() == [5.0, 5.0, 5.0]
    assert len(list((tmp_path / ".apiary" / "storage" / "code").glob("*.zip"))) == 1


def test_apiary_run_names_an_entrypoint_absent_from_the_code_folder(tmp_path: Path, toy_dataset: Path) -> None:
    _code(tmp_path / "src", 1)
    request = _request(toy_dataset, _checkpoint(tmp_path / "init.safetensors"), "src",
                       entrypoint="shippedtoy.missing:fl_train_model")
    (tmp_path / "job.json").write_text(json.dumps(request))
    environment = {k: v for k, v in os.environ.items() if not foreign(k)}
    environment.update({"APIARY_HOME": str(tmp_path / ".apiary"), "PYTHONPATH": str(REPO), "APIARY_HTTP_PORT": "0"})

    run = subprocess.run([sys.executable, "-m", "services.app.cli", "run", str(tmp_path / "job.json")],
                         env=environment, capture_output=True, text=True, timeout=120)

    assert run.returncode == 2
    assert f"entrypoint: module 'shippedtoy.missing' is not in the code folder {tmp_path / 'src'}" in run.stderr
    assert "Traceback" not in run.stderr


async def test_init_and_evaluate_run_from_the_bundle_on_workers(embedded: StackFactory, toy_dataset: Path,
                                                                tmp_path: Path) -> None:
    extra = {"shippedtoy/train.py": TRAIN_PY.format(version=1) + '''
import torch

def fl_init_weights(env):
    return {"w": torch.full((3,), 10.0)}

def fl_evaluate_model(weights, env):
    return {"shipped_eval": float(weights["w"].sum())}
'''}
    async with embedded(workers=1) as stack:
        code = await _upload(stack, _code(tmp_path / "full", 1, extra))
        request = _request(toy_dataset, tmp_path / "unused", code)
        del request["model"]
        view = await stack.wait(await stack.submit(request), timeout=120)
        final = loads(await stack.ports.storage.get_bytes(keys.final_model(view["job_id"])))

    assert view["status"] == "completed", view.get("reason")
    assert final["w"].tolist() == [11.0, 11.0, 11.0]
    assert view["metrics"]["shipped_eval"] == 33.0


async def test_shipping_refuses_a_folder_without_the_entrypoint_and_stores_a_good_one_once(
        embedded: StackFactory, tmp_path: Path) -> None:
    from services.app.code import ship

    folder = _code(tmp_path / "src", 1)
    async with embedded(workers=1) as stack:
        with pytest.raises(RuntimeError) as absent:
            await ship(stack.api, {"code": str(folder), "entrypoint": "shippedtoy.nope:fl_train_model"})
        shipped = await ship(stack.api, {"code": str(folder), "entrypoint": f"{MODULE}:fl_train_model"})
        stored = await stack.ports.storage.list("code/")

    assert str(absent.value).startswith(f"entrypoint: module 'shippedtoy.nope' is not in the code folder {folder}")
    assert shipped["code"]["key"] in stored and len(stored) == 1


async def test_the_api_refuses_a_bundle_over_the_size_limit_as_it_reads_it(embedded: StackFactory,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundle, "MAX_BUNDLE_BYTES", 1000)
    async with embedded(workers=1) as stack:
        with pytest.raises(TrackerError) as refused:
            await stack.api.upload_code(os.urandom(4000))
        stored = await stack.ports.storage.list("code/")

    assert refused.value.status_code == 413
    assert "over the 1000-byte limit" in str(refused.value)
    assert stored == []

"""deploy/k8s: every kustomization builds, validates against the Kubernetes schemas and keeps its
references (scripts/check_k8s.py, which CI also runs on its own)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_k8s.py"


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_k8s", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_k8s"] = module
    spec.loader.exec_module(module)
    return module


check = _checker()


@pytest.mark.parametrize("name", check.KUSTOMIZATIONS)
def test_kustomization_is_valid(name: str) -> None:
    resources = check.build(check.ROOT / name)
    assert check.schema_errors(resources, "1.31.0") == []
    assert check.reference_errors(resources) == []


def test_workers_scale_on_the_pool_queue_and_stop_gracefully() -> None:
    resources = check.build(check.ROOT / "base")
    scaler = next(r for r in resources if r["kind"] == "ScaledObject")
    worker = next(r for r in resources if r["kind"] == "Deployment" and r["metadata"]["name"] == "apiary-worker")
    pod = worker["spec"]["template"]["spec"]
    assert scaler["spec"]["minReplicaCount"] == 0
    assert scaler["spec"]["triggers"][0]["metadata"]["queueName"] == "apiary.assign.pool"
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["terminationGracePeriodSeconds"] >= 30
    # Workers hold their broker login only: no database or bucket credentials
    container = pod["containers"][0]
    assert not [s for s in container["envFrom"] if "secretRef" in s]
    assert {"name": "APIARY_BUS_USER", "value": "apiary-workers"} in container["env"]


def test_a_broken_reference_is_reported() -> None:
    resources = check.build(check.ROOT / "overlays" / "ha")
    deployment = next(r for r in resources if r["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["envFrom"][0]["configMapRef"]["name"] = "missing"
    deployment["spec"]["replicas"] = "two"
    deployment["spec"]["template"]["spec"]["containers"][0]["env"][2]["valueFrom"]["secretKeyRef"]["key"] = "nope"
    errors = check.reference_errors(resources)
    assert any("ConfigMap missing does not exist" in e for e in errors)
    assert any("reads key 'nope'" in e for e in errors)
    assert any("spec.replicas" in e for e in check.schema_errors(resources, "1.31.0"))


def test_the_cpu_overlay_drops_the_gpu_request() -> None:
    resources = check.build(check.ROOT / "overlays" / "cpu")
    worker = next(r for r in resources if r["kind"] == "Deployment" and r["metadata"]["name"] == "apiary-worker")
    container = worker["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert container["image"].endswith("/apiary:dev")

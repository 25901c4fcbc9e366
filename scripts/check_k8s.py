"""Validate deploy/k8s without a cluster: build each kustomization (base and overlays) and check every
resource against the Kubernetes schemas (kubernetes-validate), then what the schemas cannot see: the
references between resources (ConfigMaps, Secrets, probe ports, the KEDA target and queue, the PDBs'
selectors) and the settings the manifests promise (probes on every container, graceful stop time).

kustomize itself is not installed here, so the build below does the subset of it the manifests use:
`resources` (files and folders), `namespace`, `labels`, `images`, `replicas` and strategic-merge
`patches` (maps merged, lists of named items merged by name, null deletes). A kustomization using
anything else is refused, so the subset cannot silently drift from what the files ask.

    python scripts/check_k8s.py [--kubernetes-version 1.31.0]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
KUSTOMIZATIONS = ("base", "overlays/cpu", "overlays/ha")
SUPPORTED = {"apiVersion", "kind", "namespace", "labels", "resources", "images", "replicas", "patches"}
POOL_QUEUE = "apiary.assign.pool"  # <exchange>.assign.pool with the default exchange, apiary
Resource = dict[str, Any]


def merge(base: Any, patch: Any) -> Any:
    """A strategic merge of `patch` into `base` for the shapes the manifests use."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = merge(base.get(key), value) if key in base else value
        return out
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(i, dict) and "name" in i
                                                                   for i in base + patch):
        merged = {item["name"]: item for item in base}
        for item in patch:
            merged[item["name"]] = merge(merged.get(item["name"], {}), item)
        return list(merged.values())
    return patch


def load(path: Path) -> list[Resource]:
    """The resources of one file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def build(folder: Path) -> list[Resource]:
    """What `kustomize build folder` gives, for the supported subset."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise ValueError(f"{folder}: kustomization fields {sorted(unknown)} are not understood by this check")
    resources: list[Resource] = []
    for entry in spec.get("resources", []):
        target = (folder / entry).resolve()
        resources += build(target) if target.is_dir() else load(target)
    resources = [copy.deepcopy(r) for r in resources]
    for patch_ref in spec.get("patches", []):
        patch = yaml.safe_load((folder / patch_ref["path"]).read_text())
        matches = [i for i, r in enumerate(resources)
                   if (r["kind"], r["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])]
        if len(matches) != 1:
            raise ValueError(f"{folder}: patch {patch_ref['path']} matches {len(matches)} resources, not 1")
        resources[matches[0]] = merge(resources[matches[0]], patch)
    for r in resources:
        _customise(r, spec)
    return resources


def _customise(r: Resource, spec: dict[str, Any]) -> None:
    if "namespace" in spec and r["kind"] != "Namespace":
        r["metadata"]["namespace"] = spec["namespace"]
    for label in spec.get("labels", []):
        r["metadata"].setdefault("labels", {}).update(label["pairs"])
    for count in spec.get("replicas", []):
        if r["kind"] == "Deployment" and r["metadata"]["name"] == count["name"]:
            r["spec"]["replicas"] = count["count"]
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in spec.get("images", [])}
    for container in _containers(r):
        container["image"] = images.get(container["image"], container["image"])


def _containers(r: Resource) -> list[dict[str, Any]]:
    if r["kind"] != "Deployment":
        return []
    containers: list[dict[str, Any]] = r["spec"]["template"]["spec"]["containers"]
    return containers


def reference_errors(resources: list[Resource]) -> list[str]:
    """What the schemas cannot check: names that must point at something, and promised settings."""
    names = {(r["kind"], r["metadata"]["name"]) for r in resources}
    deployments = {r["metadata"]["name"]: r for r in resources if r["kind"] == "Deployment"}
    secrets = {r["metadata"]["name"]: set(r.get("stringData", {})) | set(r.get("data", {}))
               for r in resources if r["kind"] == "Secret"}
    errors = []
    for name, d in deployments.items():
        errors += _deployment_errors(name, d, names, secrets)
    for r in resources:
        if r["kind"] == "ScaledObject":
            errors += _scaler_errors(r, deployments, names)
        if r["kind"] == "PodDisruptionBudget":
            wanted = r["spec"]["selector"]["matchLabels"]
            if not any(wanted.items() <= d["spec"]["template"]["metadata"]["labels"].items()
                       for d in deployments.values()):
                errors.append(f"PodDisruptionBudget {r['metadata']['name']} selects no Deployment's pods")
    return errors


def _deployment_errors(name: str, d: Resource, names: set[tuple[str, str]],
                       secrets: dict[str, set[str]]) -> list[str]:
    errors = []
    pod = d["spec"]["template"]["spec"]
    if pod.get("terminationGracePeriodSeconds", 30) < 30:
        errors.append(f"{name}: terminationGracePeriodSeconds under 30 s cuts a graceful stop short")
    for c in pod["containers"]:
        for source in c.get("envFrom", []):
            for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if key in source and (kind, source[key]["name"]) not in names:
                    errors.append(f"{name}: {kind} {source[key]['name']} does not exist")
        for var in c.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref and ref["key"] not in secrets.get(ref["name"], set()):
                errors.append(f"{name}: {var['name']} reads key {ref['key']!r} of Secret {ref['name']}, which has none")
        ports = {p.get("name") for p in c.get("ports", [])}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            port = c.get(probe, {}).get("httpGet", {}).get("port")
            if port is None:
                errors.append(f"{name}: container {c['name']} has no {probe} over HTTP")
            elif port not in ports:
                errors.append(f"{name}: {probe} port {port!r} is not a named port of the container")
    return errors


def _scaler_errors(r: Resource, deployments: dict[str, Resource], names: set[tuple[str, str]]) -> list[str]:
    errors = []
    target = r["spec"]["scaleTargetRef"]["name"]
    if target not in deployments:
        errors.append(f"ScaledObject {r['metadata']['name']}: no Deployment {target}")
    for trigger in r["spec"]["triggers"]:
        if trigger["type"] == "rabbitmq" and trigger["metadata"].get("queueName") != POOL_QUEUE:
            errors.append(f"ScaledObject: rabbitmq trigger watches {trigger['metadata'].get('queueName')!r}, "
                          f"not the pool queue {POOL_QUEUE}")
        auth = trigger.get("authenticationRef", {}).get("name")
        if auth and ("TriggerAuthentication", auth) not in names:
            errors.append(f"ScaledObject: TriggerAuthentication {auth} does not exist")
    return errors


def schema_errors(resources: list[Resource], version: str) -> list[str]:
    """Each built-in resource against the Kubernetes schemas (KEDA's own kinds are checked above)."""
    errors = []
    for r in resources:
        if r["apiVersion"].startswith("keda.sh/"):
            continue
        try:
            kubernetes_validate.validate(r, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{r['kind']} {r['metadata']['name']}: {e.message} at {'.'.join(map(str, e.path))}")
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubernetes-version", default="1.31.0")
    args = parser.parse_args()
    failed = False
    for name in KUSTOMIZATIONS:
        resources = build(ROOT / name)
        errors = schema_errors(resources, args.kubernetes_version) + reference_errors(resources)
        for e in errors:
            print(f"error: deploy/k8s/{name}: {e}", file=sys.stderr)
        failed |= bool(errors)
        print(f"deploy/k8s/{name}: {len(resources)} resources, {'FAILED' if errors else 'ok'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

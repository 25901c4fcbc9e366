"""Reading a job file (YAML or JSON) the way a user writes it, and finding the code it names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from apiary.jobspec import ENTRYPOINT_RE, parse_entrypoint


class JobFileError(ValueError):
    """A job file that cannot be read."""


def load_job_file(path: Path) -> dict[str, Any]:
    """The job request in a YAML or JSON file, with a local dataset path made absolute."""
    try:
        text = path.read_text()
    except OSError as e:
        raise JobFileError(f"cannot read job file {path}: {e.strerror}") from e
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise JobFileError(f"job file {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from e
    if not isinstance(data, dict):
        raise JobFileError(f"job file {path} must hold a mapping of fields (name, entrypoint, dataset, ...)")
    dataset = data.get("dataset")
    if isinstance(dataset, str) and "://" not in dataset:
        # Relative paths are tried from the current folder first, then from the job file's folder.
        for base in (Path.cwd(), path.resolve().parent):
            candidate = (base / dataset).resolve()
            if candidate.exists():
                data["dataset"] = str(candidate)
                break
    return data


def code_root_for(entrypoint: str, start: Path) -> Path | None:
    """The folder from which the entrypoint's module imports, searching upwards from `start`."""
    if not ENTRYPOINT_RE.match(entrypoint):
        return None
    parts = parse_entrypoint(entrypoint)[0].split(".")
    for folder in [start, *start.parents]:
        base = folder.joinpath(*parts)
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return folder
    return None

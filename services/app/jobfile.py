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
    """The job request in a YAML or JSON file, its relative local paths made absolute against the file's
    folder (where its author wrote them from, whatever the current folder is)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise JobFileError(f"cannot read job file {path}: {e.strerror}") from e
    data = _parse(path, text)
    if not isinstance(data, dict):
        raise JobFileError(f"job file {path} must hold a mapping of fields (name, entrypoint, dataset, ...)")
    return resolve_paths(data, path.resolve().parent)


def _parse(path: Path, text: str) -> Any:
    """The file's data, or one line: `file:line:column: job file is not valid YAML: what`."""
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise JobFileError(f"{path}:{e.lineno}:{e.colno}: job file is not valid JSON: {e.msg}") from None
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        raise JobFileError(f"{where}: job file is not valid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise JobFileError(f"{path}: job file is not valid YAML: {' '.join(str(e).split())}") from None


def local_path(value: str, folder: Path) -> Path | None:
    """Where a local path in a job file points, read from the job file's `folder`; None for a URI."""
    if "://" in value:
        return None
    return (folder / Path(value).expanduser()).resolve()


def resolve_paths(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """`dataset`, `code`, and `model` and config values that name an existing file there, made absolute against
    `folder`. A dataset that is not there stays as written: it may be a storage key of a deployed system."""
    out = dict(data)
    for name in ("dataset", "model"):
        value = out.get(name)
        target = local_path(value, folder) if isinstance(value, str) else None
        if target is not None and target.exists():
            out[name] = str(target)
    code = out.get("code")
    target = local_path(code, folder) if isinstance(code, str) else None
    if target is not None:  # shipped with the job: packed from here, wherever the command runs
        out["code"] = str(target)
    config = out.get("config")
    if isinstance(config, dict):
        # Config values are the user code's own: only a relative path that exists there is one.
        out["config"] = {key: _existing(value, folder) for key, value in config.items()}
    return out


def _existing(value: Any, folder: Path) -> Any:
    if not isinstance(value, str) or not value or Path(value).is_absolute() or "://" in value:
        return value
    target = local_path(value, folder)
    return str(target) if target is not None and target.exists() else value


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

"""What `apiary run` checks in a job file before it starts anything: the request's fields, its dataset
path and its entrypoint's code, every problem at once, one line each."""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass, field
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from apiary.contracts import JobRequested
from apiary.jobspec import ENTRYPOINT_RE, field_errors, parse_entrypoint
from apiary.policy import Policy, job_errors
from apiary.settings import Settings
from services.app.code import local_code, pack_problems
from services.app.jobfile import code_root_for, local_path


@dataclass
class Checked:
    """A job file's problems (empty: it can start) and the folder its entrypoint imports from."""

    problems: list[str] = field(default_factory=list)
    code_root: Path | None = None


def check_request(request: dict[str, Any], job_file: Path) -> Checked:
    """Every problem with the request read from `job_file`: bad fields, a missing dataset, code not found."""
    folder = job_file.resolve().parent
    checked = Checked()
    code = local_code(request)
    # A local `code` folder is packed and uploaded at submission; its fields are checked as the reference.
    fields = {**request, "code": {"key": "code/x.zip", "sha256": "0" * 64}} if code is not None else request
    try:
        JobRequested.model_validate(fields)
    except ValidationError as e:
        checked.problems += [f"{error.field}: {error.message}" for error in field_errors(e, fields)]
    dataset = request.get("dataset")
    target = local_path(dataset, folder) if isinstance(dataset, str) else None
    if target is not None and not target.exists():
        checked.problems.append(f"dataset: {target} does not exist (a relative path is read from the job "
                                "file's folder)")
    entrypoint = request.get("entrypoint")
    if code is not None:
        checked.problems += pack_problems(request)
        if code.is_dir() and isinstance(entrypoint, str) and ENTRYPOINT_RE.match(entrypoint) and not checked.problems:
            checked.problems += _code_problems(entrypoint, code, code)
    elif isinstance(entrypoint, str) and ENTRYPOINT_RE.match(entrypoint):
        checked.code_root = code_root_for(entrypoint, folder)
        checked.problems += _code_problems(entrypoint, folder, checked.code_root)
    policy = Policy.of(embedded_settings(Settings(), request, job_file))
    checked.problems += [f"{field}: {why}" for field, why in job_errors(request, policy)]
    return checked


def embedded_settings(settings: Settings, request: dict[str, Any], job_file: Path) -> Settings:
    """The settings of an embedded run of this job file: whoever runs `apiary run` is its operator, so the
    file's own entrypoint is allowed, and local data may come from the file's folder and the current one
    unless APIARY_DATA_ROOTS says otherwise."""
    entrypoint = request.get("entrypoint")
    allowed = [*settings.allowed_entrypoints, *([entrypoint] if isinstance(entrypoint, str) else [])]
    roots = settings.data_roots or [job_file.resolve().parent, Path.cwd()]
    return settings.model_copy(update={"allowed_entrypoints": allowed, "data_roots": roots})


def _code_problems(entrypoint: str, folder: Path, root: Path | None) -> list[str]:
    """Whether the entrypoint's module is there (beside the job file, above it, or installed) and defines
    its function; read, not imported: importing user code would start torch, and run it, here."""
    module, function = parse_entrypoint(entrypoint)
    parts = module.split(".")
    installed = importlib.util.find_spec(parts[0]) if root is None else None
    if root is None and installed is None:
        path = "/".join(parts)
        return [f"entrypoint: module {module!r} not found: no {path}.py or {path}/__init__.py in {folder} "
                "or a folder above it, and no installed package of that name"]
    bases = [root] if root is not None else _installed_bases(installed)
    source = next((c for b in bases for c in _candidates(b.joinpath(*parts)) if c.is_file()), None)
    if source is None:  # installed in a form not read here (compiled, zipped): the worker will say
        return []
    try:
        names = _top_level_names(ast.parse(source.read_text(), str(source)))
    except SyntaxError as e:
        return [f"entrypoint: {source}:{e.lineno}: cannot be imported: {e.msg}"]
    if names is not None and function not in names:
        return [f"entrypoint: {source} defines no {function!r}"]
    return []


def _installed_bases(spec: ModuleSpec | None) -> list[Path]:
    """The folders an installed top-level package or module imports from."""
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return [Path(location).parent for location in spec.submodule_search_locations]
    return [Path(spec.origin).parent] if spec.origin else []


def _candidates(base: Path) -> tuple[Path, Path]:
    return base.with_suffix(".py"), base / "__init__.py"


def _top_level_names(tree: ast.Module) -> set[str] | None:
    """The names a module defines at its top level; None where it may define others unseen (`import *`,
    a module `__getattr__`)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            if any(alias.name == "*" for alias in node.names):
                return None
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return None if "__getattr__" in names else names

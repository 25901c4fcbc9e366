"""What a job may reach and how big another party's input may be: pure checks, applied where requests come
in (the scheduler, the HTTP API, `apiary run`) and where another party's bytes are read (dataset zips and
manifests, safetensors headers, bus messages). Each refusal is one line naming the field or member."""

from __future__ import annotations

import os
import stat
import sys
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlparse

# The examples ship with Apiary; built-in trainers (no entrypoint) and code bundles are allowed besides.
DEFAULT_ENTRYPOINTS = ("examples.*",)


class Refused(ValueError):
    """Input outside what the operator allows, or past a size bound: the message names what and why."""


@dataclass(frozen=True)
class Limits:
    """How big untrusted input may be (bytes unless said otherwise)."""

    request_bytes: int = 1024 * 1024  # a job request's body (HTTP or bus)
    message_bytes: int = 16 * 1024 * 1024  # any bus message's body (weights and data never ride the bus)
    manifest_bytes: int = 512 * 1024 * 1024
    manifest_entries: int = 10_000_000  # samples plus shared files
    zip_members: int = 10_000_000
    zip_bytes: int = 1 << 40  # uncompressed, all members together
    zip_ratio: float = 200.0  # uncompressed / compressed, per member and overall (past RATIO_FLOOR)
    ratio_floor: int = 16 * 1024 * 1024  # a member smaller than this uncompressed is never a bomb
    safetensors_header_bytes: int = 100 * 1024 * 1024
    tensors: int = 200_000


LIMITS = Limits()


@dataclass(frozen=True)
class Policy:
    """The operator's allowances: entrypoint patterns (globs over `module:function` or `module`) and the
    folders local `dataset` / `model` paths must lie under (none given: the current folder)."""

    entrypoints: tuple[str, ...] = DEFAULT_ENTRYPOINTS
    data_roots: tuple[Path, ...] = ()

    @classmethod
    def of(cls, settings: Any) -> Policy:
        """The policy a process's settings (`allowed_entrypoints`, `data_roots`) give."""
        return cls(tuple(settings.allowed_entrypoints), tuple(Path(p) for p in settings.data_roots))

    def roots(self) -> list[Path]:
        """The data roots, resolved (symbolic links followed)."""
        return [Path(os.path.realpath(r)) for r in (self.data_roots or (Path.cwd(),))]


def entrypoint_error(entrypoint: str | None, patterns: Sequence[str], *, bundled: bool = False) -> str | None:
    """Why an entrypoint may not run here, or None: a built-in trainer (None) and a code bundle's own module
    are allowed, a standard-library module never, anything else only if a pattern matches it."""
    if entrypoint is None:
        return None
    module = entrypoint.partition(":")[0]
    if module.split(".")[0] in sys.stdlib_module_names:
        return f"{entrypoint!r} is a standard-library module, not training code"
    if bundled or any(fnmatchcase(entrypoint, p) or fnmatchcase(module, p) for p in patterns):
        return None
    allowed = ", ".join(patterns) or "none"
    return (f"{entrypoint!r} is not allowed here (APIARY_ALLOWED_ENTRYPOINTS: {allowed}): ship the code as a "
            "bundle ('code') or ask the operator to allow it")


def local_path(ref: str) -> Path | None:
    """The local path a `dataset` / `model` reference names (a plain path or a file:// URI); None for a URI
    of another scheme (s3://, hf://, ...), which is no local file."""
    if ref.startswith("file:"):
        return Path(unquote(urlparse(ref).path))
    scheme = urlparse(ref).scheme
    if scheme and len(scheme) > 1:  # "C:" is a drive, not a scheme
        return None
    return Path(ref)


def path_error(ref: str, policy: Policy) -> str | None:
    """Why a local path may not be read here (it resolves outside every data root), or None."""
    path = local_path(ref)
    if path is None:
        return None
    resolved = Path(os.path.realpath(path))
    roots = policy.roots()
    if any(resolved == root or resolved.is_relative_to(root) for root in roots):
        return None
    return (f"{ref} is outside the folders local data may be read from ({', '.join(map(str, roots))};"
            " APIARY_DATA_ROOTS): register it, or ask the operator to allow its folder")


def job_errors(request: Mapping[str, Any], policy: Policy) -> list[tuple[str, str]]:
    """(field, why) for each part of a job request the policy refuses: its entrypoint, and local dataset
    and model paths."""
    out = []
    entrypoint = request.get("entrypoint")
    why = entrypoint_error(entrypoint if isinstance(entrypoint, str) else None, policy.entrypoints,
                           bundled=request.get("code") is not None)
    if why:
        out.append(("entrypoint", why))
    for field in ("dataset", "model"):
        ref = request.get(field)
        if isinstance(ref, str) and (why := path_error(ref, policy)):
            out.append((field, why))
    return out


def check_size(what: str, size: int, limit: int) -> None:
    """Refuse `what` if it is bigger than `limit` bytes."""
    if size > limit:
        raise Refused(f"{what} is {size} bytes, over the limit of {limit}")


def member_error(info: zipfile.ZipInfo) -> str | None:
    """Why a zip member may not be unpacked (an absolute path, `..`, a drive, a symbolic link), or None."""
    name = info.filename
    posix = PurePosixPath(name.replace("\\", "/"))
    if posix.is_absolute() or ".." in posix.parts or (len(name) > 1 and name[1] == ":"):
        return f"member {name!r} must stay inside the archive (an absolute path, a drive or '..' is refused)"
    if stat.S_ISLNK(info.external_attr >> 16):
        return f"member {name!r} is a symbolic link"
    return None


def check_zip(zf: zipfile.ZipFile, where: str, archive_bytes: int, limits: Limits = LIMITS) -> None:
    """Refuse a zip with too many members, an unsafe member, or that expands past the limits (a zip bomb)."""
    infos = zf.infolist()
    if len(infos) > limits.zip_members:
        raise Refused(f"{where}: {len(infos)} members, over the limit of {limits.zip_members}")
    total = 0
    for info in infos:
        if why := member_error(info):
            raise Refused(f"{where}: {why}")
        total += info.file_size
        if info.file_size > limits.ratio_floor and info.file_size > limits.zip_ratio * max(info.compress_size, 1):
            raise Refused(f"{where}: member {info.filename!r} expands {info.file_size} bytes from "
                          f"{info.compress_size}, past the ratio limit of {limits.zip_ratio:g} (a zip bomb?)")
    if total > limits.zip_bytes:
        raise Refused(f"{where}: expands to {total} bytes, over the limit of {limits.zip_bytes}")
    if total > limits.ratio_floor and total > limits.zip_ratio * max(archive_bytes, 1):
        raise Refused(f"{where}: expands to {total} bytes from {archive_bytes}, past the ratio limit of "
                      f"{limits.zip_ratio:g} (a zip bomb?)")

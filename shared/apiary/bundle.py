"""Code bundles: a user's folder packed into a deterministic zip (same files, same bytes, same sha256),
its members checked before anyone trusts them, and unpacked safely. Pure: no storage, no bus."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from pathspec import GitIgnoreSpec

IGNORE_FILE = ".apiaryignore"
REQUIREMENTS_FILE = "requirements.txt"
ALWAYS_LEFT_OUT = (".git", "__pycache__", ".venv", ".apiary", ".mypy_cache", ".pytest_cache", ".ruff_cache")
MAX_FILE_BYTES = 16 * 2**20  # a file over this is left out of a bundle (data belongs in a dataset)
MAX_BUNDLE_BYTES = 64 * 2**20  # a bundle (the zip) over this is refused
MAX_UNPACKED_BYTES = 256 * 2**20  # what a bundle may unpack to
MAX_ENTRIES = 10_000
MAX_RATIO = 200  # a member that unpacks to more than this times its packed size is a zip bomb
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest a zip can say: every entry gets it
_FILE_MODE = 0o100644  # regular file, rw-r--r--
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Limits:
    """The sizes a bundle is held to (the defaults above; tests and benchmarks pass smaller ones)."""

    file_bytes: int = MAX_FILE_BYTES
    bundle_bytes: int = MAX_BUNDLE_BYTES
    unpacked_bytes: int = MAX_UNPACKED_BYTES
    entries: int = MAX_ENTRIES


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Packed:
    """A packed bundle: its zip bytes, sha256, the files it holds and what was left out (path, why)."""

    data: bytes
    sha256: str
    files: list[str]
    left_out: list[tuple[str, str]] = field(default_factory=list)

    @property
    def size(self) -> int:
        """The zip's size in bytes."""
        return len(self.data)


@dataclass(frozen=True)
class Inspected:
    """A bundle's members as read from its zip directory (nothing unpacked, nothing run)."""

    files: list[str]
    unpacked_bytes: int

    def has_module(self, module: str) -> bool:
        """Whether `pkg.module` imports from the bundle (`pkg/module.py` or `pkg/module/__init__.py`)."""
        base = module.replace(".", "/")
        return f"{base}.py" in self.files or f"{base}/__init__.py" in self.files


def sha256_of(data: bytes) -> str:
    """The hex sha256 of some bytes."""
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------ packing


def pack(source: Path, limits: Limits = DEFAULT_LIMITS) -> Packed:
    """A folder (or a .zip, repacked) as a deterministic bundle; ValueError in one line if it cannot be one."""
    if source.is_file() and zipfile.is_zipfile(source):
        return _repack(source.read_bytes(), limits)
    if not source.is_dir():
        raise ValueError(f"code: {source} is neither a folder nor a .zip file")
    files, left_out = select_files(source, limits)
    if not files:
        raise ValueError(f"code: {source} holds no files to ship (after {IGNORE_FILE} and the size limit)")
    return _packed({name: (source / name).read_bytes() for name in files}, left_out, limits)


def select_files(root: Path, limits: Limits = DEFAULT_LIMITS) -> tuple[list[str], list[tuple[str, str]]]:
    """The files under `root` that go into its bundle (sorted, relative, '/'-separated), and those left out
    with why: `.git`, `__pycache__`, `.venv`, symlinks, files over the size limit, `.apiaryignore` matches."""
    ignore = IgnoreRules.read(root / IGNORE_FILE)
    files: list[str] = []
    left_out: list[tuple[str, str]] = []
    for folder, dirs, names in os.walk(root):
        rel_dir = Path(folder).relative_to(root).as_posix()
        rel = "" if rel_dir == "." else f"{rel_dir}/"
        kept_dirs = []
        for name in sorted(dirs):
            path = f"{rel}{name}"
            if name in ALWAYS_LEFT_OUT or ignore.matches(path, is_dir=True) or (Path(folder) / name).is_symlink():
                left_out.append((f"{path}/", "ignored" if not (Path(folder) / name).is_symlink() else "symlink"))
            else:
                kept_dirs.append(name)
        dirs[:] = kept_dirs
        for name in sorted(names):
            path, full = f"{rel}{name}", Path(folder) / name
            why = _left_out_because(path, full, ignore, limits)
            if why:
                left_out.append((path, why))
            else:
                files.append(path)
    return sorted(files), left_out


def _left_out_because(path: str, full: Path, ignore: IgnoreRules, limits: Limits) -> str | None:
    if full.is_symlink():
        return "symlink"
    if not full.is_file():
        return "not a regular file"
    if full.name.endswith((".pyc", ".pyo")) or ignore.matches(path, is_dir=False):
        return "ignored"
    size = full.stat().st_size
    if size > limits.file_bytes:
        return f"{size} bytes, over the {limits.file_bytes}-byte limit for one file"
    return None


def _repack(data: bytes, limits: Limits) -> Packed:
    """A user's own zip, checked and written again deterministically (so its sha256 is the content's)."""
    inspect(data, limits)
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        contents = {info.filename: zf.read(info) for info in zf.infolist() if not info.is_dir()}
    return _packed(contents, [], limits)


def _packed(contents: dict[str, bytes], left_out: list[tuple[str, str]], limits: Limits) -> Packed:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name in sorted(contents):
            info = zipfile.ZipInfo(name, date_time=_FIXED_TIME)
            info.create_system = 3  # unix: the mode below is read as such
            info.external_attr = _FILE_MODE << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, contents[name], compresslevel=6)
    data = buffer.getvalue()
    if len(data) > limits.bundle_bytes:
        raise ValueError(f"code: the bundle is {len(data)} bytes, over the {limits.bundle_bytes}-byte limit "
                         f"(leave data and checkpoints out with {IGNORE_FILE})")
    return Packed(data=data, sha256=sha256_of(data), files=sorted(contents), left_out=left_out)


class IgnoreRules:
    """`.apiaryignore`: gitignore's rules, one pattern a line, read by pathspec (`#` comments; `dir/` matches
    folders only; a leading or inner `/` anchors a pattern at the bundle's root; `**` spans folders; `!`
    takes a path back in, unless a folder above it is left out)."""

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = patterns
        self._spec = GitIgnoreSpec.from_lines(patterns)

    @classmethod
    def read(cls, path: Path) -> IgnoreRules:
        """The rules in an ignore file (none if there is no such file)."""
        if not path.is_file():
            return cls([])
        return cls(path.read_text(errors="replace").splitlines())

    def matches(self, path: str, *, is_dir: bool) -> bool:
        """Whether a relative path ('/'-separated) is ignored."""
        return self._spec.match_file(f"{path}/" if is_dir else path)


# ------------------------------------------------------------------ checking


def inspect(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Inspected:
    """A bundle's members, every one checked (no absolute paths, `..`, symlinks or special files, no
    encryption, sizes and ratios within limits); ValueError in one line naming the first bad one."""
    if len(data) > limits.bundle_bytes:
        raise ValueError(f"code bundle is {len(data)} bytes, over the {limits.bundle_bytes}-byte limit")
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise ValueError(f"code bundle is not a valid zip: {e}") from None
    if len(infos) > limits.entries:
        raise ValueError(f"code bundle has {len(infos)} entries, over the limit of {limits.entries}")
    files, seen, total = [], set(), 0
    for info in infos:
        name = check_member(info)
        if name in seen:
            raise ValueError(f"code bundle lists {name!r} twice")
        seen.add(name)
        total += info.file_size
        if total > limits.unpacked_bytes:
            raise ValueError(f"code bundle unpacks to over {limits.unpacked_bytes} bytes (the limit)")
        if not info.is_dir():
            files.append(name)
    return Inspected(files=sorted(files), unpacked_bytes=total)


def check_member(info: zipfile.ZipInfo) -> str:
    """A member's name, normalised ('/'-separated, no trailing '/'); ValueError if it is unsafe."""
    raw = info.filename
    name = raw.replace("\\", "/")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise ValueError(f"code bundle entry {raw!r} is an absolute path: entries must be relative")
    if ".." in name.split("/"):
        raise ValueError(f"code bundle entry {raw!r} contains '..': entries must stay inside the bundle")
    kind = stat.S_IFMT(info.external_attr >> 16)
    if kind == stat.S_IFLNK:
        raise ValueError(f"code bundle entry {raw!r} is a symlink: bundles hold regular files only")
    if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
        raise ValueError(f"code bundle entry {raw!r} is not a regular file")
    if info.flag_bits & 0x1:
        raise ValueError(f"code bundle entry {raw!r} is encrypted")
    if info.file_size > 2**20 and info.file_size > MAX_RATIO * max(info.compress_size, 1):
        raise ValueError(f"code bundle entry {raw!r} unpacks {info.file_size // max(info.compress_size, 1)}x "
                         f"its packed size (a zip bomb?): over {MAX_RATIO}x is refused")
    name = name.rstrip("/")
    if not name:
        raise ValueError(f"code bundle entry {raw!r} has no name")
    return name


def verify(data: bytes, sha256: str, limits: Limits = DEFAULT_LIMITS) -> Inspected:
    """A stored bundle's bytes checked against the sha256 it was referenced by, then inspected."""
    actual = sha256_of(data)
    if actual != sha256:
        raise ValueError(f"code bundle's sha256 is {actual[:12]}…, not {sha256[:12]}… as referenced")
    return inspect(data, limits)


# ------------------------------------------------------------------ unpacking and requirements


def unpack(archive: Path, target: Path, limits: Limits = DEFAULT_LIMITS) -> None:
    """Unpack a bundle into `target` (whole or not at all), its files and folders read-only. Counts the
    bytes really written: a member that unpacks to more than it declared is refused."""
    data = archive.read_bytes()
    inspect(data, limits)
    tmp = target.with_name(f".{target.name}.part")
    remove_tree(tmp)
    written, folders = 0, set()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            dest = tmp / check_member(info)
            if dest.parent not in folders:
                dest.parent.mkdir(parents=True, exist_ok=True)
                folders.add(dest.parent)
            written = _extract(zf, info, dest, written, limits)
    _make_read_only(tmp)
    remove_tree(target)
    tmp.replace(target)


def _extract(zf: zipfile.ZipFile, info: zipfile.ZipInfo, dest: Path, written: int, limits: Limits) -> int:
    with zf.open(info) as source, dest.open("wb") as out:
        own = 0
        while chunk := source.read(_CHUNK):
            own += len(chunk)
            written += len(chunk)
            if own > info.file_size or written > limits.unpacked_bytes:
                raise ValueError(f"code bundle entry {info.filename!r} unpacks to more than it declares")
            out.write(chunk)
    return written


def _make_read_only(root: Path) -> None:
    for folder, dirs, files in os.walk(root, topdown=False):
        for name in files:
            os.chmod(os.path.join(folder, name), 0o444)
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o555)
    if root.is_dir():
        os.chmod(root, 0o555)


def remove_tree(path: Path) -> None:
    """Remove a folder, read-only ones included (nothing if it is not there)."""
    if not path.exists():
        return
    for folder, dirs, _ in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o755)
    os.chmod(path, 0o755)
    shutil.rmtree(path, ignore_errors=True)


def requirements_text(data: bytes) -> str | None:
    """The bundle's requirements.txt at its root, if it has one (read, never run)."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        if REQUIREMENTS_FILE not in zf.namelist():
            return None
        return zf.read(REQUIREMENTS_FILE).decode(errors="replace")


def parse_requirements(text: str) -> list[str]:
    """The requirement lines of a requirements.txt (comments, blank lines and pip options left out)."""
    lines = (line.split(" #", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith(("#", "-"))]


def requirement_error(line: str) -> str | None:
    """Why a requirement string is not one (PEP 508), or None."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        Requirement(line)
    except InvalidRequirement as e:
        return f"{line!r} is not a requirement ({str(e).splitlines()[0]}): expected e.g. 'numpy>=1.26'"
    return None


def unmet_requirements(requirements: list[str]) -> list[str]:
    """One line per requirement this Python environment does not meet (missing, or the wrong version),
    read with importlib.metadata; nothing is installed."""
    from importlib import metadata

    from packaging.requirements import InvalidRequirement, Requirement

    unmet = []
    for line in requirements:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            unmet.append(f"{line!r} is not a requirement")
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            installed = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{line!r}: {req.name} is not installed")
            continue
        if req.specifier and not req.specifier.contains(installed, prereleases=True):
            unmet.append(f"{line!r}: {req.name} {installed} is installed")
    return unmet

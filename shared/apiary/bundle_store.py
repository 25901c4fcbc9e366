"""Code bundles in storage: stored once by sha256 (`code/<sha256>.zip`), checked where a job that names one is
submitted (there, stored, the sha256 it claims, safe members, its entrypoint's module inside), and handed to
workers by presigned URL. Reads a bundle's member list; never imports or runs anything from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from apiary import bundle, keys
from apiary.contracts import CodeBundle
from apiary.jobspec import CodeRef, FieldError, JobSpec
from apiary.storage import ObjectNotFound, Storage


@dataclass(frozen=True)
class StoredBundle:
    """A stored bundle as a job references it: key, sha256 and size."""

    key: str
    sha256: str
    size: int

    def as_dict(self) -> dict[str, Any]:
        """The reference a request carries (`code: {key, sha256, size}`) and POST /api/v1/code answers."""
        return {"key": self.key, "sha256": self.sha256, "size": self.size}


async def store(storage: Storage, data: bytes, expected_sha256: str | None = None) -> StoredBundle:
    """Check a bundle and store it under its sha256 (once: the same bytes are not written twice);
    ValueError in one line if it is no acceptable bundle or not the one expected."""
    sha256 = bundle.sha256_of(data)
    if expected_sha256 is not None and expected_sha256 != sha256:
        raise ValueError(f"code bundle's sha256 is {sha256[:12]}…, not {expected_sha256[:12]}… as expected")
    bundle.inspect(data)
    key = keys.code_bundle(sha256)
    if not await storage.exists(key):
        await storage.put_bytes(key, data)
    return StoredBundle(key=key, sha256=sha256, size=len(data))


async def checked(storage: Storage, ref: CodeRef, module: str) -> StoredBundle:
    """The bundle a request references, read and checked: stored, its sha256 the one given, its members safe
    and the entrypoint's module among them, its requirements.txt readable; ValueError in one line if not."""
    try:
        data = await storage.get_bytes(ref.key)
    except ObjectNotFound:
        raise ValueError(f"no code bundle is stored under {ref.key}: upload it first (POST /api/v1/code; "
                         "apiary run and apiary submit do it for a local folder)") from None
    inspected = bundle.verify(data, ref.sha256)
    if ref.size is not None and ref.size != len(data):
        raise ValueError(f"code bundle is {len(data)} bytes, not {ref.size} as referenced")
    if module and not inspected.has_module(module):
        path = module.replace(".", "/")
        raise ValueError(f"entrypoint module {module!r} is not in the code bundle: it has no {path}.py or "
                         f"{path}/__init__.py among its {len(inspected.files)} files")
    text = bundle.requirements_text(data)
    for line in bundle.parse_requirements(text or ""):
        if (error := bundle.requirement_error(line)) is not None:
            raise ValueError(f"the code bundle's {bundle.REQUIREMENTS_FILE}: {error}")
    return StoredBundle(key=ref.key, sha256=ref.sha256, size=len(data))


async def code_errors(storage: Storage, spec: JobSpec) -> tuple[list[FieldError], JobSpec]:
    """The job's code bundle checked (no errors for a job without one), and the spec with the bundle's size
    filled in."""
    if spec.code is None:
        return [], spec
    try:
        stored = await checked(storage, spec.code, spec.module)
    except ValueError as e:
        field = "entrypoint" if str(e).startswith("entrypoint module") else "code"
        return [FieldError(field=field, message=str(e))], spec
    code = spec.code.model_copy(update={"size": stored.size})
    return [], spec.model_copy(update={"code": code})


def for_assignment(storage: Storage, ref: CodeRef | None, ttl: int) -> CodeBundle | None:
    """The bundle as an assignment carries it, its URL presigned for `ttl` seconds; None without one."""
    if ref is None:
        return None
    return CodeBundle(key=ref.key, sha256=ref.sha256, size=ref.size or 0, url=storage.presign_get(ref.key, ttl))

"""An assignment's files: the shard (downloaded and unpacked once per job) and the global weights
fetched, the trained weights and the run's files uploaded; all by presigned URL, each retried through
transient failures until the round's deadline."""

from __future__ import annotations

import asyncio
import zipfile
from pathlib import Path
from typing import Any

from apiary import transfer, transfer_parts
from apiary.contracts import Assignment, ObjectRef
from apiary.dataset import extract_shard
from apiary.dataset_text import JSONL
from apiary.shard_state import state_limit
from apiary.transfer_parts import part_count

# What a failed download or upload raises: reported as the shard's failure, never a crash.
FETCH_ERRORS = (transfer.TransferError, zipfile.BadZipFile, OSError, ValueError)
UPLOAD_ERRORS = (transfer.TransferError, OSError)


def shard_root(a: Assignment, job_dir: Path) -> Path:
    """Where the assignment's shard is unpacked (named by its sha256, so a new split is a new folder)."""
    return job_dir / f"shard-{a.shard:04d}-{a.shard_sha256[:16]}"


def shard_cached(a: Assignment, job_dir: Path) -> bool:
    """Whether the shard is already unpacked here."""
    return (shard_root(a, job_dir) / "manifest.json").is_file()


async def fetch_shard(a: Assignment, job_dir: Path) -> tuple[Path, int]:
    """The shard's folder, downloaded and unpacked once per job; and the bytes fetched for it."""
    root = shard_root(a, job_dir)
    if shard_cached(a, job_dir):
        return root, 0
    archive = job_dir / f"shard-{a.shard:04d}.zip"
    await transfer.download(a.shard_url, archive, a.shard_sha256, deadline=a.deadline)
    size = archive.stat().st_size
    await asyncio.to_thread(extract_shard, archive, root)
    archive.unlink(missing_ok=True)
    return root, size


async def fetch_records(a: Assignment, job_dir: Path) -> Path:
    """An evaluation's held-out records (a registered dataset: a zip, or one JSONL file) in their folder,
    downloaded once per job."""
    root = job_dir / f"held-out-{a.shard_sha256[:16]}"
    if root.is_dir():
        return root
    download = job_dir / f".{root.name}.download"
    await transfer.download(a.shard_url, download, a.shard_sha256, deadline=a.deadline)
    if zipfile.is_zipfile(download):
        await asyncio.to_thread(extract_shard, download, root)
        download.unlink(missing_ok=True)
    else:  # moved whole into its folder, which appears complete or not at all
        partial = job_dir / f".{root.name}.part"
        partial.mkdir(parents=True, exist_ok=True)
        download.replace(partial / f"held-out{JSONL}")
        partial.replace(root)
    return root


def fetch_weights(a: Assignment, target: Path) -> asyncio.Future[None]:
    """Start downloading the round's global weights to `target`, the previous round's removed first: a file renamed
    over an existing one makes ext4 write the new file's data out before the rename returns (auto_da_alloc), 4-15 ms
    on this machine where a rename to a free name takes 0.1 ms (the trained result likewise:
    `Workspace.clear_outputs`)."""
    target.unlink(missing_ok=True)
    return asyncio.ensure_future(transfer_parts.download(a.weights_url, target, a.weights_sha256, a.weights_size,
                                                         deadline=a.deadline))


async def upload_outputs(a: Assignment, result: Path, size: int, sha256: str, out_dir: Path,
                         work: Path) -> tuple[int, str | None]:
    """Upload the trained weights (`size` bytes: in parts where the assignment opened a multipart upload and they
    fit its parts, else whole) and the run's files; the bytes sent, and the result's ETag where it went in parts."""
    etag = None
    if a.multipart is not None and part_count(size, a.multipart.part_size) <= len(a.multipart.part_urls):
        etag = (await transfer_parts.upload(a.multipart, result, deadline=a.deadline)).etag
    else:
        await transfer.upload(a.upload_url, result, sha256=sha256, deadline=a.deadline)
    return size + await _upload_files(a, out_dir, work), etag


async def _upload_files(a: Assignment, out_dir: Path, work: Path) -> int:
    if a.files_upload_url is None or not out_dir.is_dir() or not any(out_dir.iterdir()):
        return 0
    archive = work / "files.zip"
    await asyncio.to_thread(_pack, out_dir, archive)
    await transfer.upload(a.files_upload_url, archive, deadline=a.deadline)
    return archive.stat().st_size


def _pack(folder: Path, archive: Path) -> None:
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                zf.write(path, path.relative_to(folder).as_posix())


# The shard's state and the round's server state on this worker (apiary.shard_state), beside the global weights.
STATE_IN, SERVER_STATE_IN, STATE_OUT = "state.safetensors", "server-state.safetensors", "state-result.safetensors"


async def fetch_states(a: Assignment, work: Path) -> int:
    """Download the shard's latest state and the round's server state, where the assignment names them (the
    previous round's files removed first: a shard moves between workers, and a first round has none); the bytes."""
    moved = 0
    work.mkdir(parents=True, exist_ok=True)
    for url, sha256, name in ((a.state_url, a.state_sha256, STATE_IN),
                              (a.server_state_url, a.server_state_sha256, SERVER_STATE_IN)):
        target = work / name
        target.unlink(missing_ok=True)
        if url:
            await transfer.download(url, target, sha256, deadline=a.deadline)
            moved += target.stat().st_size
    (work / STATE_OUT).unlink(missing_ok=True)
    return moved


def state_call(a: Assignment, work: Path, weights: Path) -> dict[str, Any]:
    """The TrainCall fields of the assignment's shard state: its files, its bound and the personal layers."""
    if not a.state_upload_url:  # no training: at most a shard's state to read (one shard's evaluation)
        return {"personal_layers": list(a.personal_layers), "state_path": str(work / STATE_IN) if a.state_url else None}
    size = weights.stat().st_size if weights.is_file() else 0
    return {"state_path": str(work / STATE_IN) if a.state_url else None,
            "server_state_path": str(work / SERVER_STATE_IN) if a.server_state_url else None,
            "state_result_path": str(work / STATE_OUT), "state_limit": state_limit(size),
            "personal_layers": list(a.personal_layers)}


async def upload_state(a: Assignment, work: Path, size: int | None) -> int:
    """Upload the shard's new state, if the training returned one; the bytes sent."""
    if size is None or not a.state_upload_url:
        return 0
    await transfer.upload(a.state_upload_url, work / STATE_OUT, deadline=a.deadline)
    return size


def state_ref(a: Assignment, size: int | None, sha256: str | None) -> ObjectRef | None:
    """The claim check of the shard's new state for worker.done (None if it returned none)."""
    if size is None or sha256 is None or not a.state_key:
        return None
    return ObjectRef(key=a.state_key, size=size, sha256=sha256)

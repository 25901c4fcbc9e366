"""An assignment's files: the shard (downloaded and unpacked once per job) and the global weights
fetched, the trained weights and the run's files uploaded; all by presigned URL, each retried through
transient failures until the round's deadline."""

from __future__ import annotations

import asyncio
import zipfile
from pathlib import Path

from apiary import transfer, transfer_parts
from apiary.contracts import Assignment
from apiary.dataset import extract_shard
from apiary.dataset_text import JSONL
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


async def upload_outputs(a: Assignment, result: Path, size: int, out_dir: Path,
                         work: Path) -> tuple[int, str | None]:
    """Upload the trained weights (`size` bytes: in parts where the assignment opened a multipart upload and they
    fit its parts, else whole) and the run's files; the bytes sent, and the result's ETag where it went in parts."""
    etag = None
    if a.multipart is not None and part_count(size, a.multipart.part_size) <= len(a.multipart.part_urls):
        etag = (await transfer_parts.upload(a.multipart, result, deadline=a.deadline)).etag
    else:
        await transfer.upload(a.upload_url, result, deadline=a.deadline)
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

"""Code bundles on this worker: each downloaded once by sha256, verified, unpacked into a read-only folder,
kept across jobs, and the least recently used dropped when the cache outgrows its limit (never one in use).
Before a job's code runs, the requirements it declares are checked against this worker's Python."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from apiary import bundle, transfer
from apiary.contracts import Assignment, CodeBundle

# Beside each bundle's folder, written last: holds the folder's size; its mtime is when the bundle was last used.
READY = ".ready"
DEFAULT_LIMIT = 2 * 2**30


class BundleError(Exception):
    """A job's code could not be made ready here; the message is one line saying why."""


class BundleCache:
    """A folder of unpacked bundles keyed by sha256, cleaned least recently used first past `limit` bytes."""

    def __init__(self, root: Path, limit: int = DEFAULT_LIMIT) -> None:
        self.root = root
        self.limit = limit
        self._lock = asyncio.Lock()
        self._in_use: set[str] = set()  # sha256 of the bundle the training child runs now
        self.downloads = 0  # bundles fetched over the network by this cache (the rest were hits)

    def folder(self, sha256: str) -> Path:
        """Where a bundle is unpacked."""
        return self.root / sha256

    async def fetch(self, ref: CodeBundle, *, deadline: float | None = None) -> Path:
        """The bundle's folder here, downloaded, verified and unpacked first if it is not cached; BundleError
        in one line if it cannot be."""
        async with self._lock:
            folder, ready = self.folder(ref.sha256), self.root / f"{ref.sha256}{READY}"
            if not ready.is_file() or not folder.is_dir():
                await self._download(ref, folder, deadline)
                ready.write_text(str(await asyncio.to_thread(_size, folder)))  # read by clean(), never walked again
                self.downloads += 1
            else:
                os.utime(ready)
            self._in_use = {ref.sha256}
            await asyncio.to_thread(self.clean)
            return folder

    async def _download(self, ref: CodeBundle, folder: Path, deadline: float | None) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        archive = self.root / f".{ref.sha256}.zip"
        try:
            await transfer.download(ref.url, archive, ref.sha256, deadline=deadline)
            await asyncio.to_thread(bundle.unpack, archive, folder)
        except (transfer.TransferError, OSError) as e:
            raise BundleError(f"code bundle {ref.sha256[:12]} could not be fetched: {e}") from None
        except ValueError as e:
            raise BundleError(f"code bundle {ref.sha256[:12]} refused: {e}") from None
        finally:
            archive.unlink(missing_ok=True)

    def clean(self) -> None:
        """Drop the least recently used bundles (never the one in use) until the cache fits its limit."""
        entries = sorted(self.root.glob(f"*{READY}"), key=lambda p: p.stat().st_mtime) if self.root.is_dir() else []
        sizes = {e: _recorded_size(e, self.folder(e.name.removesuffix(READY))) for e in entries}
        total = sum(sizes.values())
        for ready in entries:
            if total <= self.limit:
                return
            sha256 = ready.name.removesuffix(READY)
            if sha256 in self._in_use:
                continue
            ready.unlink(missing_ok=True)  # first: a half-removed folder is never taken for a cached one
            bundle.remove_tree(self.folder(sha256))
            total -= sizes[ready]

    def cached(self) -> list[str]:
        """The sha256 of every bundle cached here."""
        return sorted(p.name.removesuffix(READY) for p in self.root.glob(f"*{READY}")) if self.root.is_dir() else []


async def code_for(cache: BundleCache, a: Assignment) -> Path | None:
    """The folder of the assignment's code bundle (None for a job without one), its requirements (the
    assignment's, else the bundle's requirements.txt) met by this worker; BundleError in one line if not."""
    folder = await cache.fetch(a.code, deadline=a.deadline) if a.code is not None else None
    requirements = a.requirements
    if requirements is None and folder is not None and (folder / bundle.REQUIREMENTS_FILE).is_file():
        requirements = bundle.parse_requirements((folder / bundle.REQUIREMENTS_FILE).read_text(errors="replace"))
    # Read in a thread (importlib.metadata walks the environment's folders); most jobs declare none, and their
    # assignments skip that hop on the way to their downloads.
    unmet = await asyncio.to_thread(bundle.unmet_requirements, requirements) if requirements else []
    if unmet:
        raise BundleError(f"requirement not met on this worker: {'; '.join(unmet)} (nothing is installed at run "
                          "time: run the job on workers whose image provides it)")
    return folder


def _recorded_size(ready: Path, folder: Path) -> int:
    """A cached bundle's unpacked size, as recorded in its marker when it was unpacked (walked if unreadable)."""
    try:
        return int(ready.read_text())
    except (OSError, ValueError):
        return _size(folder)


def _size(folder: Path) -> int:
    total = 0
    for parent, _, files in os.walk(folder):
        total += sum(os.path.getsize(os.path.join(parent, name)) for name in files)
    return total


__all__ = ["BundleCache", "BundleError", "code_for"]

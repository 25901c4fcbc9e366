"""Which jobs this worker knows ended, so that their queued assignments are skipped: heard as events on its
control queue, or read from a job's end marker where the job may have ended before the worker listened; and which
jobs train no more (mode async, after the last version), so that their queued training tasks are skipped."""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from typing import Any

from apiary import transfer
from apiary.contracts import TRAIN, Assignment

ENDED_JOBS_KEPT = 4096  # job ids remembered as ended, to skip their assignments still queued
# An assignment issued less than this before the worker started listening for job ends (clocks of
# different machines may differ) may belong to a job that ended unheard: its end marker is read first.
CLOCK_SKEW = 300.0
# The aggregator stores a job's end marker when it hears the job end, normally within milliseconds; a
# marker still missing this long after the worker started listening means the job had not ended then,
# so the job's later assignments are not probed.
MARKER_SETTLE = 30.0
# A marker found missing before then is read again for the job's later assignments, but not more often than this:
# a job's rounds follow each other in milliseconds, and a read per assignment cost a request per contribution.
REREAD = 5.0


class JobEnds:
    """The jobs known to have ended (with why), and those known not to have ended before this worker listened."""

    def __init__(self) -> None:
        self._ended: OrderedDict[str, str] = OrderedDict()  # job id -> why it ended
        self._alive: OrderedDict[str, None] = OrderedDict()  # jobs known not to have ended unheard
        self._read: OrderedDict[str, float] = OrderedDict()  # job -> when its marker was last read, found missing
        self._trained: OrderedDict[str, None] = OrderedDict()  # jobs whose training ended (their evaluations run)
        self.listening_since = float("inf")  # when job ends started to reach this worker

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._ended

    def reason(self, job_id: str) -> str | None:
        """Why the job ended; None if it is not known to have ended."""
        return self._ended.get(job_id)

    def heard(self, job_id: str, reason: str) -> None:
        """The job ended, for `reason`."""
        _remember(self._ended, job_id, reason)

    def heard_training_ended(self, job_id: str) -> None:
        """The job trains no more (mode async: its last version is stored); its evaluations still run."""
        _remember(self._trained, job_id, None)

    def training_ended(self, a: Assignment) -> bool:
        """Whether the assignment trains a shard of a job whose training ended."""
        return a.task == TRAIN and a.job_id in self._trained

    def probe(self, a: Assignment) -> asyncio.Task[bool] | None:
        """Whether the assignment's job ended before this worker listened for job ends, read from the
        job's end marker (in the background, beside the downloads), for assignments issued about
        then or earlier; None where no reading is needed (most: nothing to pay), or where the marker was found
        missing less than REREAD seconds ago."""
        if (a.ended_url is None or a.issued_at is None or a.job_id in self._alive
                or a.issued_at > self.listening_since + CLOCK_SKEW
                or time.time() - self._read.get(a.job_id, -REREAD) < REREAD):
            return None
        return asyncio.create_task(self._ended_unheard(a.job_id, a.ended_url), name=f"ended?:{a.job_id}")

    async def _ended_unheard(self, job_id: str, url: str) -> bool:
        asked = time.time()
        marker = await transfer.probe(url)
        if marker is None:
            if asked > self.listening_since + MARKER_SETTLE:
                _remember(self._alive, job_id, None)
            else:
                _remember(self._read, job_id, asked)
            return False
        try:
            reason = str(json.loads(marker).get("reason") or "ended")
        except (ValueError, AttributeError):
            reason = "ended"
        _remember(self._ended, job_id, reason)
        return True


def _remember(kept: OrderedDict[str, Any], job_id: str, value: Any) -> None:
    """Remember a job (most recent last), forgetting the oldest beyond ENDED_JOBS_KEPT."""
    kept[job_id] = value
    kept.move_to_end(job_id)
    while len(kept) > ENDED_JOBS_KEPT:
        kept.popitem(last=False)

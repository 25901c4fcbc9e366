"""The one definition of every status name a job, round, shard or contribution can have."""

from __future__ import annotations

import enum


class JobStatus(enum.StrEnum):
    """Where a job is in its life."""

    REQUESTED = "requested"
    SHARDING = "sharding"
    WAITING = "waiting"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"

    @property
    def terminal(self) -> bool:
        """No further event changes a job in this state."""
        return self in TERMINAL


TERMINAL = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.REJECTED})


class RoundStatus(enum.StrEnum):
    """How a round (one attempt of it) stands: running until aggregated, failed or cancelled."""

    OPEN = "open"
    RUNNING = "running"
    AGGREGATED = "aggregated"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ShardState(enum.StrEnum):
    """What became of one shard of a round, as people see it."""

    ASSIGNED = "assigned"
    TRAINING = "training"
    REPORTED = "reported"
    FAILED = "failed"
    REJECTED = "rejected"
    STOPPED = "stopped"


class ContributionStatus(enum.StrEnum):
    """What a stored contribution is: counted, refused, the user's code failed, or too late."""

    ACCEPTED = "accepted"
    REJECTED = "rejected"
    FAILED = "failed"
    DUPLICATE = "duplicate"
    LATE = "late"
    ORPHAN = "orphan"
    UNASSIGNED = "unassigned"
    FORGED = "forged"  # not from the worker the shard was assigned to (wrong secret, user or object)

    @property
    def settles(self) -> bool:
        """Whether it settles its shard (the others are recorded and ignored)."""
        return self in (ContributionStatus.ACCEPTED, ContributionStatus.REJECTED, ContributionStatus.FAILED)

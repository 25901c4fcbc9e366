"""Who is who on the broker: the user name of each service role and of each worker.

`apiary broker setup` creates these users; a message's broker-validated `Delivery.user_id` names one of
them, so a consumer can tell which worker (if any) published it with `worker_of`.
"""

from __future__ import annotations

SERVICE_ROLES = ("scheduler", "sharder", "aggregator", "tracker")
DEFAULT_PREFIX = "apiary-"
_WORKER = "worker."
SHARED_WORKERS = "workers"  # one account for interchangeable workers (compose's scaled `worker`): no identity


def service_user(role: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The broker user of a service role (`apiary-scheduler`)."""
    if role not in SERVICE_ROLES:
        raise ValueError(f"unknown service role {role!r}: expected one of {', '.join(SERVICE_ROLES)}")
    return f"{prefix}{role}"


def worker_user(worker_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The broker user of one worker (`apiary-worker.gpu-a`)."""
    if not worker_id:
        raise ValueError("worker id is empty: expected the worker's --id")
    return f"{prefix}{_WORKER}{worker_id}"


def is_worker_user(user: str) -> bool:
    """Whether a broker user is a worker's, whatever its prefix (its permissions then cover only its own queues)."""
    if user == SHARED_WORKERS or user.endswith(f"-{SHARED_WORKERS}"):
        return True
    head, found, worker_id = user.rpartition(_WORKER)
    return bool(found and worker_id and (not head or head.endswith("-")))


def worker_of(user_id: str | None, prefix: str = DEFAULT_PREFIX) -> str | None:
    """The worker id a broker user belongs to, or None if it is no worker's user (a service, or unset)."""
    head = f"{prefix}{_WORKER}"
    if user_id is None or not user_id.startswith(head) or len(user_id) == len(head):
        return None
    return user_id[len(head):]


__all__ = ["DEFAULT_PREFIX", "SERVICE_ROLES", "SHARED_WORKERS", "is_worker_user", "service_user", "worker_of",
           "worker_user"]

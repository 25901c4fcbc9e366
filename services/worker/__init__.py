"""The GPU worker: trains assigned shards with the user's function and reports the weights."""

from services.worker.service import Worker

__all__ = ["Worker"]

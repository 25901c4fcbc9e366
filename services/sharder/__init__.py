"""The sharder: splits a job's dataset into one zip per shard and announces them."""

from services.sharder.service import Sharder

__all__ = ["Sharder"]

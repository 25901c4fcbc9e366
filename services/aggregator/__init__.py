"""The aggregator: validates contributions and takes them into each round's aggregation strategy."""

from services.aggregator.handlers import Aggregator

__all__ = ["Aggregator"]

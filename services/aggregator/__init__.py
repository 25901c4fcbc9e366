"""The aggregator: validates contributions and folds them into each round's weighted average."""

from services.aggregator.service import Aggregator

__all__ = ["Aggregator"]

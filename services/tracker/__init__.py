"""The tracker: records every event and keeps the views people and other systems read."""

from services.tracker.service import Tracker

__all__ = ["Tracker"]

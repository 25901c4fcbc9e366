"""The scheduler: owns jobs and rounds, starts each round and moves a job to its end."""

from services.scheduler.service import Scheduler

__all__ = ["Scheduler"]

"""Trainers: what a worker runs for an assignment. The user's function (in a child process) is the
first; built-in ones register beside it and are chosen for jobs without an entrypoint (the causal-LM trainer
is imported on first use: every training child imports this package, and it costs a third of a second)."""

from apiary.trainers.base import (
    BUILT_IN,
    USER_FUNCTION,
    MetricsCallback,
    TrainCall,
    Trainer,
    TrainerError,
    TrainerSetup,
    TrainResult,
    make_trainer,
    register_trainer,
    trainer_name,
)
from apiary.trainers.child import EVALUATE_FUNCTION, INIT_FUNCTION, UserCodeError
from apiary.trainers.environment import OPENMP_WAIT, quiet_openmp
from apiary.trainers.user_function import UserCodeRunner

__all__ = [
    "BUILT_IN",
    "EVALUATE_FUNCTION",
    "INIT_FUNCTION",
    "OPENMP_WAIT",
    "USER_FUNCTION",
    "MetricsCallback",
    "TrainCall",
    "TrainResult",
    "Trainer",
    "TrainerError",
    "TrainerSetup",
    "UserCodeError",
    "UserCodeRunner",
    "make_trainer",
    "quiet_openmp",
    "register_trainer",
    "trainer_name",
]

"""The process environment: Apiary's own processes wait passively in OpenMP, while user code in a
training child gets the environment the user set."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# OpenMP, torch's CPU thread pool, keeps its threads spinning for a while after every parallel
# region. A service runs a few small tensor operations per message on a machine it shares with other
# services, so that spinning was most of the aggregator's CPU (64 ms per round at K=4, 26 without it). Apiary's
# processes wait passively; user code in the child process gets the environment the user set.
OPENMP_WAIT = "OMP_WAIT_POLICY"
_user_openmp_wait: list[str | None] = []


def quiet_openmp() -> None:
    """Make this process's OpenMP threads sleep when idle instead of spinning (unless the user chose a
    policy). Read when torch loads, so call it before that; user code keeps the user's setting."""
    if not _user_openmp_wait:
        _user_openmp_wait.append(os.environ.get(OPENMP_WAIT))
    os.environ.setdefault(OPENMP_WAIT, "PASSIVE")


def user_environment() -> dict[str, str | None]:
    """Variables to restore in the child: those `quiet_openmp` changed, as the user had them."""
    return {OPENMP_WAIT: _user_openmp_wait[0]} if _user_openmp_wait else {}


def apply(environment: dict[str, str | None], target: MutableMapping[str, str] = os.environ) -> None:
    """Set (or, for None, unset) these variables in this process (or in `target`)."""
    for name, value in environment.items():
        if value is None:
            target.pop(name, None)
        else:
            target[name] = value


def child_environment(variables: dict[str, str | None]) -> dict[str, str]:
    """The whole environment a child runs with: this process's as it is now, `variables` over it (None: unset). A
    child forked from the fork server starts with the server's environment, taken when it started; it adopts this
    one (`adopt`) before any user code runs."""
    environ = dict(os.environ)
    apply(variables, environ)
    return environ


def adopt(environ: dict[str, str]) -> None:
    """Make this process's environment exactly `environ`."""
    for name in set(os.environ) - environ.keys():
        del os.environ[name]
    os.environ.update(environ)


def code_path(bundle: str | None) -> dict[str, str | None]:
    """PYTHONPATH for a child running a job's code bundle: the bundle first, so that processes the user's
    code starts itself (a script run with sys.executable) import from it too. Nothing without a bundle."""
    if bundle is None:
        return {}
    inherited = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([bundle, inherited]) if inherited else bundle}

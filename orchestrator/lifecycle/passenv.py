"""A job's `pass_env`: variables of the daemon's own environment handed to the job's command when it starts.

Only the names are stored (in the job's spec); the values are read here, at the moment an attempt starts, and go
straight to the supervisor: through its process environment locally, through the run's env file (mode 600 from its
creation) on an instance. They are added to the redactor first, so an error that happened to carry one is
scrubbed like a provider key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from orchestrator.errors import OperationalError
from orchestrator.events import Redactor

WHERE = "set it where the daemon runs (under systemd: ~/.config/burstctl/env) and restart the daemon"


class UnusablePassEnv(OperationalError):
    """A pass_env variable the daemon cannot give the job: not set, or a value the env file cannot carry."""


def names(spec: Mapping[str, Any]) -> list[str]:
    return list(spec.get("pass_env") or [])


def unusable(spec: Mapping[str, Any]) -> str | None:
    """Why the job's pass_env cannot be given to it now (naming the variables, never a value), or None."""
    absent = [n for n in names(spec) if n not in os.environ]  # an empty value counts as set
    if absent:
        verb = "is" if len(absent) == 1 else "are"
        return f"pass_env: {', '.join(absent)} {verb} not set in the daemon's environment; {WHERE}"
    # The env file is KEY=VALUE lines (split as str.splitlines does): a value of several lines cannot be carried.
    multi = [n for n in names(spec) if len(os.environ[n].splitlines()) > 1]
    if multi:
        return (f"pass_env: {', '.join(multi)} holds a value of several lines, which the env file cannot carry; "
                "give it a one-line value where the daemon runs and restart the daemon")
    return None


def secret_args(spec: Mapping[str, Any]) -> list[str]:
    """The supervisor's `--secret-env NAME` for each passed variable: it scrubs their values from the lines of the
    command's output that it records (exit.json), before cutting them, which a redactor here cannot undo."""
    return [arg for name in names(spec) for arg in ("--secret-env", name)]


def values(spec: Mapping[str, Any], redactor: Redactor) -> dict[str, str]:
    """The passed variables' values, for the supervisor; UnusablePassEnv (one line, names only) otherwise."""
    problem = unusable(spec)
    if problem:
        raise UnusablePassEnv(problem)
    redactor.add_env_names(names(spec))
    return {n: os.environ[n] for n in names(spec)}

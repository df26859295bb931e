"""The command table: every command is found by name without importing the others, a command that only reads
the state does not load the decision core, the simulator, the daemon's machinery or the event log's writer, --version
and --help not even the config or the database layer, and no number option takes nan or infinity."""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

import orchestrator.cli
from orchestrator.cli.base import COMMAND_MODULES, COMMAND_SUMMARIES, FiniteFloat, cli


def test_every_command_a_module_registers_is_in_the_table_under_its_own_module() -> None:
    for module in pkgutil.iter_modules(orchestrator.cli.__path__):
        if module.name != "__main__":  # that one runs the CLI
            importlib.import_module(f"orchestrator.cli.{module.name}")
    registered = {name: cmd.callback.__module__.rsplit(".", 1)[-1] for name, cmd in cli.commands.items()}
    assert registered == COMMAND_MODULES
    assert set(COMMAND_SUMMARIES) == set(COMMAND_MODULES)
    assert all(cmd.get_short_help_str(limit=80) == COMMAND_SUMMARIES[name] for name, cmd in cli.commands.items())


def test_the_command_list_in_help_loads_no_command_module() -> None:
    probe = ("import sys; from orchestrator.cli import main; from orchestrator.cli.base import COMMAND_MODULES; "
             "code = main(['--help']); "
             "print(code, sorted(m for m in set(COMMAND_MODULES.values()) if f'orchestrator.cli.{m}' in sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "0 []"
    assert any(line.split()[:1] == ["simulate"] for line in lines)


# What no command that only reads loads: the daemon's scheduler, the event log's writer (structlog, and rich's
# tracebacks under it), the providers' clients and SDKs, the decision core, the simulator and numpy.
NOT_FOR_READING = ("structlog", "apscheduler", "providers.base", "httpx", "boto3", "botocore", "paramiko", "fabric",
                   "numpy", "orchestrator.queue", "orchestrator.simulate")
# A command that reads the state does not build the job file's models either.
NOT_FOR_THE_STATE = (*NOT_FOR_READING, "orchestrator.jobspec")
# --version and --help need neither the config's models, the database layer nor rich.
NOT_FOR_HELP = (*NOT_FOR_READING, "orchestrator.app", "orchestrator.config", "pydantic", "sqlalchemy", "rich")


@pytest.mark.parametrize(("args", "not_loaded"), [
    (["--version"], NOT_FOR_HELP),
    (["--help"], NOT_FOR_HELP),
    (["status"], NOT_FOR_THE_STATE),
    (["list"], NOT_FOR_THE_STATE),
    (["events", "--limit", "5"], NOT_FOR_THE_STATE),
    (["size", "--model", "qwen2.5-7b"], (*NOT_FOR_READING, "sqlalchemy")),
], ids=["--version", "--help", "status", "list", "events", "size"])
def test_a_command_loads_only_what_it_needs(args: list[str], not_loaded: tuple[str, ...], tmp_path: Path) -> None:
    # Every command starts in a fresh interpreter: what it imports is paid by every run of it, in users' loops and
    # by the tests' hundreds of CLI and daemon subprocesses (benchmarks/cli_start.py).
    probe = ("import json, sys; from orchestrator.cli import main; "
             "code = main(['--state-dir', sys.argv[1], *json.loads(sys.argv[2])]); "
             "print(code, sorted(m for m in json.loads(sys.argv[3]) if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "state"), json.dumps(args),
                        json.dumps(not_loaded)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "0 []"


def test_no_number_option_takes_nan_or_infinity() -> None:
    # click's FloatRange lets nan through every bound, and inf through any without a max: `retry --deadline-hours
    # nan` reached the database as a NULL deadline. Every ranged float option is a FiniteFloat.
    for module in set(COMMAND_MODULES.values()):
        importlib.import_module(f"orchestrator.cli.{module}")
    ranged = [(name, p.name) for name, cmd in cli.commands.items() for p in cmd.params
              if isinstance(p.type, click.FloatRange)]
    assert ranged and all(isinstance(p.type, FiniteFloat) for cmd in cli.commands.values() for p in cmd.params
                          if isinstance(p.type, click.FloatRange)), ranged


@pytest.mark.parametrize(("args", "expected"), [
    (["retry", "some-job", "--deadline-hours", "nan"], "'--deadline-hours': expected a finite number, got nan"),
    (["retry", "some-job", "--deadline-hours", "100000"], "100000.0 is not in the range 0<x<=87660.0"),
    (["daemon", "--tick", "nan"], "'--tick': expected a finite number, got nan"),
    (["daemon", "--tick", "inf"], "'--tick': inf is not in the range 0.05<=x<=600"),
    (["prune-events", "--older-than", "nan"], "'--older-than': expected a finite number, got nan"),
    # An event id or a count is a database INTEGER (at most 2**63 - 1): a larger one was an internal OverflowError.
    (["events", "--after", "99999999999999999999999"],
     "'--after': 99999999999999999999999 is not in the range 0<=x<=9223372036854775807"),
    (["events", "--limit", "99999999999999999999999"],
     "'--limit': 99999999999999999999999 is not in the range 1<=x<=9223372036854775807"),
])
def test_a_number_that_is_not_one_is_refused_in_one_line(burstctl_here, args: list[str], expected: str,
                                                          tmp_path: Path) -> None:
    r = burstctl_here("--state-dir", str(tmp_path / "state"), *args)
    assert r.returncode == 2 and expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_events_after_the_largest_id_a_database_holds_is_an_empty_page_not_an_error(burstctl_here,
                                                                                     tmp_path: Path) -> None:
    r = burstctl_here("--state-dir", str(tmp_path / "state"), "events", "--after", str(2**63 - 1), "--limit",
                      str(2**63 - 1), "--json")
    assert (r.returncode, r.stdout) == (0, ""), r.stderr

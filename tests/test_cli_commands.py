"""The command table: every command is found by name without importing the others, and a command that only reads
the state does not load the decision core, the simulator or the daemon's machinery."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import orchestrator.cli
from orchestrator.cli.base import COMMAND_MODULES, COMMAND_SUMMARIES, cli


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


def test_reading_the_queue_loads_only_what_it_needs(tmp_path: Path) -> None:
    probe = ("import sys; from orchestrator.cli import main; code = main(['--state-dir', sys.argv[1], 'list']); "
             "heavy = sorted(m for m in ('numpy', 'apscheduler', 'paramiko', 'boto3', 'orchestrator.queue', "
             "'orchestrator.simulate') if m in sys.modules); print(code, heavy)")
    r = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "state")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "0 []"

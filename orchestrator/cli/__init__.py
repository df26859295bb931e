"""Entry point: `burstctl`. Command modules register themselves on the group when imported."""

from __future__ import annotations

import os
import sys
import traceback

import click

from orchestrator.cli.base import cli
from orchestrator.errors import BurstctlError

# Each module adds its commands to `cli`.
from orchestrator.cli import decide as _decide  # noqa: F401  isort: skip
from orchestrator.cli import jobs as _jobs  # noqa: F401  isort: skip
from orchestrator.cli import simulate as _simulate  # noqa: F401  isort: skip
from orchestrator.cli import size as _size  # noqa: F401  isort: skip
from orchestrator.cli import simcloud as _simcloud  # noqa: F401  isort: skip
from orchestrator.cli import providers as _providers  # noqa: F401  isort: skip
from orchestrator.cli import daemon as _daemon  # noqa: F401  isort: skip
from orchestrator.cli import revert as _revert  # noqa: F401  isort: skip
from orchestrator.cli import demo as _demo  # noqa: F401  isort: skip
from orchestrator.cli import rehearse as _rehearse  # noqa: F401  isort: skip
from orchestrator.cli import state as _state  # noqa: F401  isort: skip


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="burstctl", standalone_mode=False)
        return 0
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.UsageError as exc:
        where = f"{exc.ctx.command_path}: " if exc.ctx else ""
        print(f"burstctl: error: {where}{exc.format_message()}", file=sys.stderr)
        return 2
    except click.Abort:
        print("burstctl: aborted", file=sys.stderr)
        return 1
    except BurstctlError as exc:
        print(f"burstctl: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: one line for users, the traceback on request
        if os.environ.get("BURSTCTL_DEBUG"):
            traceback.print_exc()
        print(f"burstctl: internal error: {type(exc).__name__}: {exc} (BURSTCTL_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1


def entry() -> None:
    sys.exit(main())

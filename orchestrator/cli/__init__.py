"""Entry point: `burstctl`. Command modules register themselves on the group when imported, which the group does
for the one command that runs (`base.COMMAND_MODULES`)."""

from __future__ import annotations

import difflib
import errno
import os
import re
import sys
import traceback

import click

from orchestrator.cli.base import cli
from orchestrator.errors import CONFIG_PROBLEMS, NOTES, BurstctlError


def main(argv: list[str] | None = None) -> int:
    NOTES.clear()
    CONFIG_PROBLEMS.clear()
    try:
        # Without standalone mode, click returns a command's `click.exceptions.Exit` code (`burstctl ssh`: the
        # remote command's status) instead of raising it; every command itself returns None.
        code = cli.main(args=argv, prog_name="burstctl", standalone_mode=False)
        for note in NOTES:
            print(f"burstctl: note: {note}", file=sys.stderr)
        return code if type(code) is int else 0
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.UsageError as exc:
        # The subcommand's path when it has one ("burstctl events: ..."); the program's name is said once already.
        where = f"{exc.ctx.command_path}: " if exc.ctx and exc.ctx.parent is not None else ""
        message = exc.format_message()
        if isinstance(exc, click.NoSuchOption) or not message.startswith("No such command"):
            print(f"burstctl: error: {where}{message}", file=sys.stderr)
            return 2
        # click's own suggestion is from the commands imported so far (none, in a real run): ours, from them all.
        message = re.sub(r"\s*Did you mean.*", "", message, flags=re.S)
        typed = re.search(r"'(.*)'", message)
        group = exc.ctx.command if exc.ctx else cli
        names = sorted(group.list_commands(exc.ctx)) if isinstance(group, click.Group) and exc.ctx else []
        close = difflib.get_close_matches(typed.group(1) if typed else "", names, n=1, cutoff=0.6)
        path = exc.ctx.command_path if exc.ctx else "burstctl"
        hint = f" Did you mean '{close[0]}'?" if close else f" `{path} --help` lists the commands."
        print(f"burstctl: error: {where}{message}{hint}", file=sys.stderr)
        return 2
    except click.Abort:
        print("burstctl: aborted", file=sys.stderr)
        return 1
    except BurstctlError as exc:
        also = "".join(f"; also, {p}" for p in CONFIG_PROBLEMS if str(p) not in str(exc))
        print(f"burstctl: error: {exc}{also}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: one line for users, the traceback on request
        if os.environ.get("BURSTCTL_DEBUG"):
            traceback.print_exc()
        full = _out_of_room(exc)
        if full is not None:  # not a bug: the machine's
            print(f"burstctl: error: {full}; free space (or make it writable) and run it again", file=sys.stderr)
            return 1
        print(f"burstctl: internal error: {type(exc).__name__}: {exc} (BURSTCTL_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1


def _out_of_room(exc: BaseException) -> str | None:
    """What a write the state's disk refused says (full, read-only, over quota), for SQLite's errors too; else None.
    The command's own transaction was rolled back, so nothing of it was stored."""
    for e in (exc, exc.__cause__, exc.__context__):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            return f"{e.strerror}" + (f": {e.filename}" if e.filename else "")
        text = str(e or "")
        if "database or disk is full" in text or "attempt to write a readonly database" in text:
            return "the state database cannot be written (" + (
                "its disk is full" if "full" in text else "it is read-only") + ")"
    return None


def entry() -> None:
    sys.exit(main())

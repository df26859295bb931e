"""The files a job's `outputs` name: paths or globs relative to its workdir, a directory standing for every file
below it. Nothing through a symbolic link: one may point anywhere on the machine. Only what the run wrote: a file
last written before its supervisor started (`run_started_at`) came with the workdir, as an earlier run's result
there, and is not this run's.

Stdlib-only and Python 3.8+ compatible. The daemon imports it for a run that finishes on this machine, and runs it
on a rented instance by sending this file's source through `python3 -c` (so an instance bootstrapped by an older
burstctl, which has no copy of it, runs it too).

CLI:  python3 job_outputs.py [--run-dir RUN_DIR] WORKDIR PATTERN...
      -> prints the matches, relative to WORKDIR, as one JSON list; with RUN_DIR, those written since its run started
"""

from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path

# A file's time comes from the kernel's coarse clock, a tick behind time.time(): a file written at once by the run may
# look a little older than its start. A workdir file is pushed (and the run started) seconds after it was written.
MTIME_SLACK_S = 1.0


def run_started_at(run_dir: str | Path) -> float | None:
    """When the supervisor of the run in `run_dir` started, by this machine's clock (its exit record, else its
    heartbeat); None when neither says."""
    for name in ("exit.json", "heartbeat"):  # supervisor.EXIT_FILE, HEARTBEAT_FILE
        try:
            value = json.loads((Path(run_dir) / name).read_text()).get("started_at")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, (int, float)):
            return float(value)
    return None


def list_outputs(workdir: str | Path, patterns: list[str], since: float | None = None) -> list[str]:
    """The files under `workdir` that `patterns` name; with `since`, only those last written after it."""
    root = Path(workdir).resolve()
    found = set()
    for pattern in patterns:
        for match in root.glob(pattern.rstrip("/")):
            for path in [match] if not match.is_dir() else match.rglob("*"):
                if not path.is_file() or path.resolve() != path:  # under the resolved root: no link on its way
                    continue
                if since is None or path.stat().st_mtime >= since - MTIME_SLACK_S:
                    found.add(path.relative_to(root).as_posix())
    return sorted(found)


def missing_from(home: str | Path, patterns: list[str]) -> list[str]:
    """The patterns no file in `home` (a job's outputs directory, every attempt's files) matches."""
    return unmatched(patterns, list_outputs(home, patterns))


def unmatched(patterns: list[str], names: list[str]) -> list[str]:
    """The patterns no file in `names` (as `list_outputs` gives them) came from: a result the job did not write, or
    an `outputs` entry with a typo. Lenient (a `*` here crosses directories), so it never calls a match missing."""
    def forms(pattern: str) -> list[str]:
        p = pattern.rstrip("/")
        while p.startswith("./"):
            p = p[2:]
        # `**/` may stand for no directory at all, as in Path.glob.
        return [p, p.replace("**/", "")] if "**/" in p else [p]

    return [pattern for pattern in patterns
            if not any(n == p or n.startswith(p + "/") or fnmatch.fnmatchcase(n, p)
                       for p in forms(pattern) for n in names)]


if __name__ == "__main__":
    args = sys.argv[1:]
    since = None
    if args[:1] == ["--run-dir"]:
        since, args = run_started_at(args[1]), args[2:]
    print(json.dumps(list_outputs(args[0], args[1:], since)))

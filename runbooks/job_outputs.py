"""The files a job's `outputs` name: paths or globs relative to its workdir, a directory standing for every file
below it. Nothing through a symbolic link: one may point anywhere on the machine.

Stdlib-only and Python 3.8+ compatible. The daemon imports it for a run that finishes on this machine, and runs it
on a rented instance by sending this file's source through `python3 -c` (so an instance bootstrapped by an older
burstctl, which has no copy of it, runs it too).

CLI:  python3 job_outputs.py WORKDIR PATTERN...   -> prints the matches, relative to WORKDIR, as one JSON list
"""

from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path


def list_outputs(workdir: str | Path, patterns: list[str]) -> list[str]:
    root = Path(workdir).resolve()
    found = set()
    for pattern in patterns:
        for match in root.glob(pattern.rstrip("/")):
            for path in [match] if not match.is_dir() else match.rglob("*"):
                if path.is_file() and path.resolve() == path:  # under the resolved root: no link on its way
                    found.add(path.relative_to(root).as_posix())
    return sorted(found)


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
    print(json.dumps(list_outputs(sys.argv[1], sys.argv[2:])))

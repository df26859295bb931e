"""A baseline commit checked out beside the working tree, for benchmarks that measure both in the same run."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def baseline_tree(rev: str) -> Iterator[Path]:
    """`rev` checked out into a temporary `git worktree` of this repository, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="burstctl-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=REPO, check=True,
                       capture_output=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=True)

"""The local checkpoint store: <state>/checkpoints/<job id>/<name>/, complete checkpoints only."""

from __future__ import annotations

from pathlib import Path

from orchestrator.config import Config
from runbooks import burst_checkpoint

KEEP = 3  # complete checkpoints kept per job in the local store


def store_dir(cfg: Config, job_id: str) -> Path:
    return cfg.state_dir / "checkpoints" / job_id


def latest(cfg: Config, job_id: str) -> Path | None:
    """The newest complete (manifest-verified) local checkpoint of a job, if any. Never a partial one."""
    folder = store_dir(cfg, job_id)
    if not folder.is_dir():
        return None
    return burst_checkpoint.latest_complete(folder)

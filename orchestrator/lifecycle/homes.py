"""Where a job's runs and outputs are kept on this machine (its checkpoints: `checkpoints.store_dir`). Light to
import: `burstctl list` and `show` read these without loading the lifecycle."""

from __future__ import annotations

from pathlib import Path

from orchestrator.config import Config


def runs_dir(cfg: Config) -> Path:
    """Where every attempt's run is kept, one directory each (`attempt_run_dir`)."""
    return cfg.state_dir / "runs"


def attempt_run_dir(cfg: Config, attempt_id: str) -> Path:
    """Where an attempt's run is kept: a local attempt's supervisor files, a cloud attempt's logs as they come home
    (`CloudSteps.pull_logs`). Deleted with the job's events when it has been over long enough
    (`orchestrator/retention.py`)."""
    return runs_dir(cfg) / attempt_id


def job_outputs_dir(cfg: Config, job_id: str) -> Path:
    """Where a job's `outputs` come home to from the instance it finished on."""
    return cfg.state_dir / "outputs" / job_id

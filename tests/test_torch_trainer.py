"""examples/torch_trainer.py under the supervisor: SIGTERM to the supervisor → the trainer checkpoints the step it
reached and exits 143; attempt 2, started with --resume-from that checkpoint, ends with every tensor (weights, AdamW
state, RNG) and every step's loss equal to an uninterrupted run's. Needs torch; skipped without it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runbooks import burst_checkpoint as bc

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0; CI installs it)")

REPO = Path(__file__).resolve().parent.parent
SUPERVISOR = REPO / "runbooks" / "supervisor.py"
STEPS = 80


def supervised(root: Path, attempt: int, *extra: str, resume: Path | None = None) -> list[str]:
    return [sys.executable, str(SUPERVISOR), "--run-dir", str(root / "run"), "--job-id", f"t-{root.name}",
            "--attempt", str(attempt), "--checkpoint-dir", str(root / "ckpt"), "--workdir", str(REPO / "examples"),
            "--heartbeat-s", "0.5", *(["--resume-from", str(resume)] if resume else []), "--",
            sys.executable, "torch_trainer.py", "--steps", str(STEPS), "--ckpt-every", "25",
            "--out", str(root / "result.json"), *extra]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "runbooks"), "BURST_WORK_UNITS": "1"}


def test_a_preempted_and_resumed_torch_run_ends_with_the_same_tensors_and_losses(tmp_path: Path) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    subprocess.run(supervised(whole, 1), env=env(), check=True, capture_output=True, timeout=120)

    first = subprocess.Popen(supervised(cut, 1, "--step-seconds", "0.02"), env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60  # a safety net, not a timed expectation
    while not bc.list_complete(cut / "ckpt") and time.monotonic() < deadline:
        time.sleep(0.1)
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=60)
    exit1 = json.loads((cut / "run" / "exit.json").read_text())
    assert (exit1["reason"], exit1["exit_code"]) == ("terminated", 143)
    last = bc.latest_complete(cut / "ckpt")
    assert last is not None and 0 < bc.read_manifest(last)["step"] < STEPS
    step = bc.read_manifest(last)["step"]
    assert json.loads((cut / "run" / "metrics.json").read_text())["units_done"] == step / STEPS

    subprocess.run(supervised(cut, 2, resume=last), env=env(), check=True, capture_output=True, timeout=120)
    assert "resumed from" in (cut / "run" / "stdout.log").read_text()
    a, b = (json.loads((d / "result.json").read_text()) for d in (whole, cut))
    assert a == b  # model_sha256 over every weight's bytes, the hash of all STEPS losses, the last loss
    sa, sb = (torch.load(d / "ckpt" / f"step-{STEPS:08d}" / "state.pt", weights_only=False) for d in (whole, cut))
    for k in ("exp_avg", "exp_avg_sq", "step"):
        assert all(torch.equal(sa["opt"]["state"][i][k], sb["opt"]["state"][i][k]) for i in sa["opt"]["state"])
    assert torch.equal(sa["torch_rng"], sb["torch_rng"]) and sa["losses"] == sb["losses"]

"""examples/hf_trainer.py (a Hugging Face Trainer with runbooks/burst_hf.py's callback) under the supervisor: SIGTERM
to the supervisor → the step under way finishes, the Trainer saves, its checkpoint is published complete and the
trainer exits 143; attempt 2, started from that checkpoint, ends with every weight and every step's loss equal to an
uninterrupted run's. Needs transformers and accelerate (and torch); skipped without them."""

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

pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0; CI installs it)")
pytest.importorskip("transformers", reason="transformers is not installed (CI installs it)")
pytest.importorskip("accelerate", reason="accelerate is not installed (CI installs it)")

REPO = Path(__file__).resolve().parent.parent
SUPERVISOR = REPO / "runbooks" / "supervisor.py"
STEPS, SAVE_STEPS = 30, 5


def supervised(root: Path, attempt: int, *extra: str, resume: Path | None = None) -> list[str]:
    return [sys.executable, str(SUPERVISOR), "--run-dir", str(root / "run"), "--job-id", f"t-{root.name}",
            "--attempt", str(attempt), "--checkpoint-dir", str(root / "ckpt"), "--workdir", str(REPO / "examples"),
            "--heartbeat-s", "0.5", *(["--resume-from", str(resume)] if resume else []), "--",
            sys.executable, "hf_trainer.py", "--steps", str(STEPS), "--save-steps", str(SAVE_STEPS),
            "--output-dir", str(root / "hf-out"), "--out", str(root / "result.json"), *extra]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "runbooks"), "BURST_WORK_UNITS": "2"}


def units_done(root: Path) -> float:
    try:
        return float(json.loads((root / "run" / "metrics.json").read_text())["units_done"])
    except (OSError, ValueError, KeyError):
        return 0.0


def test_a_stopped_and_resumed_hf_trainer_run_ends_with_the_same_weights_and_losses(tmp_path: Path) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    subprocess.run(supervised(whole, 1), env=env(), check=True, capture_output=True, timeout=300)
    # Each checkpoint the Trainer saved is published complete, the newest three kept, as `step-<global step>`.
    assert [p.name for p in bc.list_complete(whole / "ckpt")] == ["step-00000020", "step-00000025", "step-00000030"]

    # Stopped between two saves: the step under way ends, and the Trainer saves it there.
    first = subprocess.Popen(supervised(cut, 1, "--step-seconds", "0.1"), env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120  # a safety net, not a timed expectation
    while units_done(cut) < 2 * 12 / STEPS and time.monotonic() < deadline:
        time.sleep(0.05)
    signalled_at = round(units_done(cut) / 2 * STEPS)
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=120)
    exit1 = json.loads((cut / "run" / "exit.json").read_text())
    assert (exit1["reason"], exit1["exit_code"]) == ("terminated", 143)
    last = bc.latest_complete(cut / "ckpt")
    assert last is not None
    step = bc.read_manifest(last)["step"]
    assert signalled_at <= step < STEPS, "saved where it stopped, not at the save_steps before"
    assert last.name == f"step-{step:08d}" and (last / "trainer_state.json").is_file()
    assert units_done(cut) == 2 * step / STEPS  # $BURST_WORK_UNITS, as of the step it stopped at

    subprocess.run(supervised(cut, 2, resume=last), env=env(), check=True, capture_output=True, timeout=300)
    a, b = (json.loads((d / "result.json").read_text()) for d in (whole, cut))
    assert a == b  # every weight's bytes (dropout and data order included), every step's loss, the last step
    assert len(a["losses"]) == STEPS


def test_without_burstctl_the_trainer_runs_as_it_would_without_the_callback(tmp_path: Path) -> None:
    # No $BURST_CHECKPOINT_DIR (run by hand, outside the supervisor): nothing is published, nothing else changes.
    plain = {k: v for k, v in env().items() if not k.startswith("BURST_")}
    subprocess.run([sys.executable, "hf_trainer.py", "--steps", "6", "--output-dir", str(tmp_path / "hf-out"),
                    "--out", str(tmp_path / "result.json")], cwd=REPO / "examples", env=plain, check=True,
                   capture_output=True, timeout=300)
    assert json.loads((tmp_path / "result.json").read_text())["step"] == 6
    assert sorted(p.name for p in (tmp_path / "hf-out").iterdir()) == ["checkpoint-5", "checkpoint-6"]


def test_a_step_saved_again_in_the_same_output_dir_leaves_the_published_checkpoint_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Published checkpoints share their files with the Trainer's folders (hard links). A run resumed from an older
    # checkpoint in the same output_dir saves the same steps again, and the Trainer writes into an existing folder in
    # place: through the shared files, into the published checkpoint, which no longer matched its manifest.
    from types import SimpleNamespace

    import runbooks.burst_hf as burst_hf

    monkeypatch.setenv("BURST_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # this test process's own SIGTERM handler stays
    callback = burst_hf.BurstCallback()
    args = SimpleNamespace(output_dir=str(tmp_path / "out"))
    state = SimpleNamespace(global_step=10, max_steps=20, is_world_process_zero=True)
    folder = tmp_path / "out" / "checkpoint-10"

    def trainer_saves(weights: bytes) -> None:  # as the Trainer does: into the folder, in place
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "model.safetensors", "wb") as fh:
            fh.write(weights)

    trainer_saves(b"first run")
    callback.on_save(args, state, SimpleNamespace())
    published = tmp_path / "ckpt" / "step-00000010"
    assert bc.verify(published) and (published / "model.safetensors").stat().st_nlink == 2  # shared, not copied

    callback.on_step_end(args, state, SimpleNamespace(should_save=True, should_training_stop=False))  # about to save
    trainer_saves(b"the resumed run, saving step 10 again")
    assert bc.verify(published) and (published / "model.safetensors").read_bytes() == b"first run"

"""A real torchrun job under the supervisor: `--gpus 2 --torchrun` starts torchrun, which starts two gloo workers of
examples/ddp_trainer.py; SIGTERM to the supervisor reaches both workers through torchrun, rank 0 writes the last
checkpoint, nothing is left running, and a resume from that checkpoint ends bit-identical to an uninterrupted run.

Needs torch (CPU build: `pip install torch==2.13.0`; CI installs it in .ci/run); skipped without it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from runbooks import burst_checkpoint as bc
from runbooks import supervisor as sv

pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0; CI installs it)")

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
SUPERVISOR = REPO / "runbooks" / "supervisor.py"
DDP_TRAINER = REPO / "examples" / "ddp_trainer.py"
VENV_BIN = Path(sys.executable).parent  # where pip put torchrun
STEPS, EVERY = 120, 20


def torchrun_env() -> dict[str, str]:
    """The supervisor's environment: torchrun on PATH and burst_checkpoint importable. The supervisor's own
    `torchrun --standalone` picks a free rendezvous port, so parallel tests never share 29500."""
    return {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "PYTHONPATH": str(REPO / "runbooks")}


def supervisor_argv(root: Path, attempt: int, *trainer_args: str, resume_from: Path | None = None) -> list[str]:
    resume = ["--resume-from", str(resume_from)] if resume_from else []
    return [sys.executable, str(SUPERVISOR), "--run-dir", str(root / "run"), "--job-id", f"ddp-{root.name}",
            "--attempt", str(attempt), "--checkpoint-dir", str(root / "ckpt"), "--workdir", str(REPO / "examples"),
            "--heartbeat-s", "0.5", "--gpus", "2", "--torchrun", *resume, "--",
            "ddp_trainer.py", "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
            "--out", str(root / "result.json"), *trainer_args]


def wait_for(predicate: Callable[[], object], what: str, timeout: float = 120.0) -> object:
    """Poll until `predicate` is truthy; the timeout is a safety net against hangs, not a measured expectation."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"gave up waiting for: {what}")


def processes_of_job(job_id: str) -> list[int]:
    """Live processes whose environment carries this job's BURST_JOB_ID: torchrun and its workers."""
    needle = f"BURST_JOB_ID={job_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ.split(b"\0") and state != "Z":
            found.append(int(entry))
    return found


def run_to_end(root: Path, attempt: int = 1, resume_from: Path | None = None) -> dict:
    proc = subprocess.run(supervisor_argv(root, attempt, resume_from=resume_from), env=torchrun_env(),
                          capture_output=True, text=True, timeout=300)
    record = sv.read_json(root / "run" / sv.EXIT_FILE)
    assert proc.returncode == 0, (proc.stderr, (root / "run" / "stderr.log").read_text())
    assert record is not None and record["reason"] == "completed"
    return json.loads((root / "result.json").read_text())


def final_state(root: Path) -> bytes:
    return (root / "ckpt" / f"step-{STEPS:08d}" / "state.pt").read_bytes()


def test_torchrun_runs_two_workers_sigterm_checkpoints_and_a_resume_is_bit_identical(tmp_path: Path) -> None:
    # The reference: one uninterrupted run, under the supervisor and torchrun like the others.
    reference = tmp_path / "reference"
    ref = run_to_end(reference)
    workers = ref["workers"]
    assert ref["world_size"] == 2
    assert [(w["rank"], w["local_rank"], w["env_rank"], w["env_world_size"]) for w in workers] == \
        [(0, 0, "0", "2"), (1, 1, "1", "2")]
    assert workers[0]["pid"] != workers[1]["pid"]  # two worker processes, each told WORLD_SIZE=2 by torchrun
    argv = json.loads((reference / "run" / "supervisor.log").read_text().split("starting ", 1)[1].split(" in ")[0])
    assert argv[:4] == ["torchrun", "--standalone", "--nproc_per_node=2", "ddp_trainer.py"]

    # Interrupted: SIGTERM to the supervisor once training is under way (a first periodic checkpoint exists).
    root = tmp_path / "preempted"
    job_id = f"ddp-{root.name}"
    proc = subprocess.Popen(supervisor_argv(root, 1, "--step-seconds", "0.05"), env=torchrun_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: bc.latest_complete(root / "ckpt"), "a first checkpoint")
    assert len(processes_of_job(job_id)) == 3  # torchrun and its two workers
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    record = sv.read_json(root / "run" / sv.EXIT_FILE)
    assert record is not None and record["reason"] == "terminated"
    last = bc.latest_complete(root / "ckpt")
    assert last is not None and record["last_checkpoint"] == last.name
    stopped_at = bc.read_manifest(last)["step"]
    assert EVERY <= stopped_at < STEPS
    assert bc.read_manifest(last)["meta"]["world_size"] == 2
    assert f"stopped by SIGTERM at step {stopped_at}" in (root / "run" / "stdout.log").read_text()
    assert processes_of_job(job_id) == []  # both workers ended with torchrun

    # Attempt 2 resumes from the last checkpoint and finishes exactly where the uninterrupted run did.
    resumed = run_to_end(root, attempt=2, resume_from=last)
    assert f"resumed from {last} at step {stopped_at}" in (root / "run" / "stdout.log").read_text()
    assert resumed["state_sha256"] == ref["state_sha256"]
    assert (resumed["w"], resumed["b"], resumed["last_batch_loss"]) == (ref["w"], ref["b"], ref["last_batch_loss"])
    assert final_state(root) == final_state(reference)  # the checkpoint file itself, byte for byte


def test_a_checkpoint_that_does_not_verify_is_refused_and_no_rank_trains(tmp_path: Path) -> None:
    broken = bc.write_checkpoint(tmp_path / "elsewhere", "step-00000020", {"state.pt": b"a checkpoint"})
    (broken / "state.pt").write_bytes(b"A CHECKPOINT")  # same size, other bytes: its sha256 no longer matches
    root = tmp_path / "resume"
    proc = subprocess.run(supervisor_argv(root, 1, resume_from=broken), env=torchrun_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert sv.read_json(root / "run" / sv.EXIT_FILE)["reason"] == "failed"
    stderr = (root / "run" / "stderr.log").read_text()
    # Each rank checks for itself, but torchrun ends the group at the first refusal: the other rank may be stopped
    # (still importing torch) before it gets to say so. One refusal is said, and no rank trains or resumes.
    refused = [rank for rank in (0, 1) if f"ddp_trainer: error: rank {rank}: BURST_RESUME_FROM={broken} is not a "
               "complete checkpoint" in stderr]
    assert refused, stderr[-2000:]
    assert "resumed from" not in (root / "run" / "stdout.log").read_text()
    assert bc.list_complete(root / "ckpt") == []  # it never started over


# A torchrun worker that ignores SIGTERM and records its pid: it outlives torchrun unless someone kills it.
STUBBORN_WORKER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(sys.argv[1], "worker-%s.pid" % os.environ["RANK"]), "w").write(str(os.getpid()))
time.sleep(600)
"""


def start_stubborn(tmp_path: Path) -> tuple[subprocess.Popen[str], list[int]]:
    """The supervisor (grace 1 s) running torchrun with two SIGTERM-ignoring workers; returns it and their pids."""
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN_WORKER)
    argv = [sys.executable, str(SUPERVISOR), "--run-dir", str(tmp_path / "run"), "--job-id", "stubborn",
            "--attempt", "1", "--checkpoint-dir", str(tmp_path / "ckpt"), "--workdir", str(tmp_path),
            "--heartbeat-s", "0.5", "--grace-s", "1", "--gpus", "2", "--torchrun", "--",
            str(script), str(tmp_path)]
    proc = subprocess.Popen(argv, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_files = [tmp_path / "worker-0.pid", tmp_path / "worker-1.pid"]
    wait_for(lambda: all(p.exists() and p.read_text() for p in pid_files), "both workers to start")
    return proc, [int(p.read_text()) for p in pid_files]


def test_after_the_grace_period_torchruns_workers_are_killed_too(tmp_path: Path) -> None:
    # torchrun puts each worker in its own session, outside the group the supervisor SIGKILLs after the grace
    # period; a worker that ignores SIGTERM must not outlive its attempt (on a real instance it holds the GPU).
    proc, workers = start_stubborn(tmp_path)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert sv.read_json(tmp_path / "run" / sv.EXIT_FILE)["reason"] == "terminated"
    wait_for(lambda: not any(sv.pid_alive(pid) for pid in workers), "the workers to be killed", timeout=20)
    assert processes_of_job("stubborn") == []
    assert "killed processes of this attempt outside group" in (tmp_path / "run" / "supervisor.log").read_text()


def test_stop_after_the_supervisor_was_sigkilled_ends_torchrun_and_its_workers(tmp_path: Path) -> None:
    proc, workers = start_stubborn(tmp_path)
    proc.kill()  # the supervisor only: torchrun and the workers go on, in their own groups
    proc.communicate(timeout=60)
    assert all(sv.pid_alive(pid) for pid in workers)
    out = subprocess.run([sys.executable, str(SUPERVISOR), "stop", "--run-dir", str(tmp_path / "run"),
                          "--grace-s", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["killed"] is True
    wait_for(lambda: not any(sv.pid_alive(pid) for pid in workers), "the workers to be killed", timeout=20)
    assert processes_of_job("stubborn") == []

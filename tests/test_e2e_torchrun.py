"""End to end on simcloud with a real torchrun job: a `gpus = 2, torchrun = true` job (examples/ddp_trainer.py, two
gloo workers) bursts to a 2-GPU spot instance, is preempted (notice first), resumes on another instance from its
newest checkpoint, and its final checkpoint, brought home, is byte-identical to an uninterrupted torchrun run's.

The simulated instances get the test's venv first on PATH (simcloud passes its PATH to every instance), as a real
image would have torch installed: that is where the supervisor finds torchrun. Skipped without torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runbooks import burst_checkpoint as bc
from tests.conftest import write_job
from tests.e2e import Daemon, cli, events, job, preempt, sim_instances, simcloud, wait_for, write_config

pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0; CI installs it)")

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent  # torchrun, and a python3 that imports torch
STEPS, EVERY, STEP_S = 160, 10, 0.1
TRAINER_ARGS = ["--steps", str(STEPS), "--checkpoint-every", str(EVERY)]


def ddp_job(tmp: Path) -> Path:
    """The DDP trainer as a job that does not fit locally; torchrun runs the script itself, so the command is the
    script (not `python3 script`). The supervisor runs `torchrun --standalone` (a free rendezvous port): every
    simulated instance shares 127.0.0.1, where torchrun's fixed port 29500 would collide across tests."""
    work = tmp / "work"
    work.mkdir()
    (work / "ddp_trainer.py").write_bytes((REPO / "examples" / "ddp_trainer.py").read_bytes())
    return write_job(tmp, "ddp", command=["ddp_trainer.py", *TRAINER_ARGS, "--step-seconds", str(STEP_S)],
                     workdir="work", deadline_hours=10, local_throughput=0, rented_throughput={"H100": 0.5},
                     gpus=2, torchrun=True, checkpoint={"interval_minutes": 0.02})


def uninterrupted_final_state(tmp: Path) -> bytes:
    """The same trainer under torchrun locally, never interrupted: the reference final checkpoint."""
    ckpt = tmp / "reference" / "checkpoints"
    env = {**os.environ, "BURST_CHECKPOINT_DIR": str(ckpt), "BURST_RESUME_FROM": "",
           "PYTHONPATH": str(REPO / "runbooks")}
    subprocess.run([str(VENV_BIN / "torchrun"), "--standalone", "--nproc_per_node=2",
                    str(REPO / "examples" / "ddp_trainer.py"),
                    *TRAINER_ARGS, "--out", str(tmp / "reference" / "result.json")],
                   env=env, check=True, timeout=300, capture_output=True)
    return (ckpt / f"step-{STEPS:08d}" / "state.pt").read_bytes()


def running_instance(state: Path) -> str:
    evs = [e for e in events(state, "attempt.running") if e["data"].get("instance")]
    return evs[-1]["data"]["instance"] if evs else ""


def test_a_torchrun_job_bursts_to_two_gpus_is_preempted_resumes_and_ends_bit_identical(tmp_path: Path) -> None:
    state = tmp_path / "state"
    path_env = {"PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    with simcloud(tmp_path, env=path_env) as url:
        config = write_config(tmp_path, url)
        r = cli(config, state, "enqueue", str(ddp_job(tmp_path)), "--json")
        assert r.returncode == 0, r.stderr
        job_id = json.loads(r.stdout)["id"]
        daemon = Daemon(tmp_path, config, state).start()
        try:
            first = wait_for(lambda: running_instance(state), 120, "the first attempt to run")
            wait_for(lambda: events(state, "checkpoint.synced"), 120, "a first checkpoint to come home")
            preempt(url, first, notice_s=1.0)
            wait_for(lambda: events(state, "job.resumed"), 180, "the job to resume elsewhere")
            wait_for(lambda: job(state, job_id)["state"] == "done", 300, "the job to finish")
        finally:
            assert daemon.stop() == 0
        instances = sim_instances(url)

    # Two 2-GPU spot instances: the preempted one and the one it resumed on; both gone.
    assert len(instances) == 2
    assert {i["instance_type"] for i in instances} == {"gpu_2x_h100_sxm5_spot"}
    assert all(i["status"] in ("terminated", "preempted") for i in instances)
    resumed = events(state, "job.resumed")[0]["data"]
    assert resumed["instance"] != first and resumed["checkpoint"].startswith("step-")

    # Every checkpoint that came home was written by a run of 2 ranks; the last is byte-identical to the reference.
    store = state / "checkpoints" / job_id
    final = store / f"step-{STEPS:08d}"
    assert bc.verify(final)
    assert all(bc.read_manifest(p)["meta"]["world_size"] == 2 for p in bc.list_complete(store))
    assert (final / "state.pt").read_bytes() == uninterrupted_final_state(tmp_path)


def test_a_torchrun_job_that_runs_locally_runs_under_torchrun_on_the_one_local_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The local GPU finishes it in time: gate 2 keeps it local, where the script still needs torchrun's variables.
    monkeypatch.setenv("PATH", f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}")  # the daemon's, inherited
    state = tmp_path / "state"
    work = tmp_path / "work"
    work.mkdir()
    (work / "ddp_trainer.py").write_bytes((REPO / "examples" / "ddp_trainer.py").read_bytes())
    out = tmp_path / "result.json"
    spec = write_job(tmp_path, "ddp-local", command=["ddp_trainer.py", "--steps", "40", "--checkpoint-every", "10",
                                                     "--out", str(out)],
                     workdir="work", deadline_hours=10, local_throughput=1, gpus=1, torchrun=True)
    config = write_config(tmp_path, None)
    r = cli(config, state, "enqueue", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    job_id = json.loads(r.stdout)["id"]
    daemon = Daemon(tmp_path, config, state).start()
    try:
        wait_for(lambda: job(state, job_id)["state"] in ("done", "failed"), 180, "the local run to end")
    finally:
        assert daemon.stop() == 0

    assert job(state, job_id)["state"] == "done"
    result = json.loads(out.read_text())
    assert result["world_size"] == 1 and result["step"] == 40
    # One worker, told its rank and world size by torchrun (run bare, the script would find no RANK and stop).
    assert [(w["env_rank"], w["env_world_size"]) for w in result["workers"]] == [("0", "1")]
    assert bc.verify(state / "checkpoints" / job_id / "step-00000040")

"""End to end on simcloud with a Hugging Face Trainer job (examples/hf_trainer.py, runbooks/burst_hf.py's callback):
it bursts to simulated spot, is preempted (notice first: SIGTERM, the Trainer saves the step it reached), resumes on
another instance from the newest checkpoint home, and ends with every weight and every step's loss of an
uninterrupted run. The simulated instances get the test's venv first on PATH, as an image with transformers would.
Skipped without transformers and accelerate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runbooks import burst_checkpoint as bc
from tests.conftest import write_job
from tests.e2e import Daemon, enqueue, events, job, preempt, sim_instances, simcloud, wait_for, write_config

pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0; CI installs it)")
pytest.importorskip("transformers", reason="transformers is not installed (CI installs it)")
pytest.importorskip("accelerate", reason="accelerate is not installed (CI installs it)")

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent  # a python3 that imports transformers
STEPS = 60
TRAINER_ARGS = ["--steps", str(STEPS), "--save-steps", "5"]


def test_a_hf_trainer_job_bursts_is_preempted_resumes_elsewhere_and_ends_as_an_uninterrupted_run(
        tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "hf_trainer.py").write_bytes((REPO / "examples" / "hf_trainer.py").read_bytes())
    spec = write_job(tmp_path, "hf", command=["python3", "hf_trainer.py", *TRAINER_ARGS, "--step-seconds", "0.2"],
                     workdir="work", deadline_hours=10, local_throughput=0, rented_throughput={"H100": 0.5},
                     outputs=["result.json"], checkpoint={"interval_minutes": 0.02})
    state = tmp_path / "state"
    with simcloud(tmp_path, env={"PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}) as url:
        config = write_config(tmp_path, url)
        job_id = enqueue(config, state, spec)
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: events(state, "checkpoint.synced"), 180, "a first checkpoint to come home")
            first = events(state, "attempt.running")[-1]["data"]["instance"]
            preempt(url, first, notice_s=1.0)
            wait_for(lambda: events(state, "job.resumed"), 180, "the job to resume elsewhere")
            wait_for(lambda: job(state, job_id)["state"] in ("done", "failed"), 300, "the job to end")
        finally:
            assert daemon.stop() == 0
        instances = sim_instances(url)

    assert job(state, job_id)["state"] == "done"
    assert len(instances) == 2 and all(i["status"] in ("terminated", "preempted") for i in instances)
    resumed = events(state, "job.resumed")[0]["data"]
    assert resumed["instance"] != first and 0 < int(resumed["checkpoint"].removeprefix("step-")) < STEPS
    assert bc.verify(state / "checkpoints" / job_id / f"step-{STEPS:08d}")

    reference = tmp_path / "reference"
    reference.mkdir()
    subprocess.run([sys.executable, str(REPO / "examples" / "hf_trainer.py"), *TRAINER_ARGS, "--out", "result.json"],
                   cwd=reference, env={**os.environ, "PYTHONPATH": str(REPO / "runbooks"),
                                       "BURST_CHECKPOINT_DIR": str(reference / "ckpt")},
                   check=True, capture_output=True, timeout=300)
    home = json.loads((state / "outputs" / job_id / "result.json").read_text())
    assert home == json.loads((reference / "result.json").read_text())  # weights' bytes, every loss, the last step

"""Retrying a job: a failed, cancelled or rethink job is queued again, decided afresh on the work it has left, and
its next attempt resumes from its newest checkpoint with the workdir as it is now. Refused, changing nothing, while
an attempt of it is still being stopped, past its deadline without a new one, or when it would be rethink again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import insert

from orchestrator.app import App
from orchestrator.errors import BadInput
from orchestrator.queue import enqueue, retry
from state import schema as s
from tests.conftest import write_job

REPO = Path(__file__).resolve().parent.parent


def _failed_job(tmp_path: Path, **fields: object) -> tuple[App, str]:
    (tmp_path / "work").mkdir(exist_ok=True)
    write_job(tmp_path, "nightly", command=["true"], workdir="work", **{"deadline_hours": 12,
                                                                        "local_throughput": 1.0, **fields})
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text("")
    app = App(config_path=str(cfg), state_dir_override=str(tmp_path / "state"))
    job_id = enqueue(app, tmp_path / "nightly.toml")[0]
    spec = {**app.store.get_job(job_id)["spec"], "_retry_at": time.time() + 60, "_slot_at": 1.0}
    app.store.update_job(job_id, None, state="failed", reason="exited: failed (code 1): boom", spec=spec)
    return app, job_id


def test_a_failed_job_is_queued_again_with_a_new_record_that_says_it_is_a_retry(tmp_path: Path) -> None:
    app, job_id = _failed_job(tmp_path)
    first_record = app.store.get_job(job_id)["record_path"]
    again = retry(app, app.store.get_job(job_id))
    job = app.store.get_job(job_id)
    assert (job["state"], again.target.value, again.work_done) == ("queued", "queued", 0.0)
    assert job["decision"]["retry_of"] == "failed" and job["deadline_at"] == pytest.approx(time.time() + 12 * 3600,
                                                                                          abs=60)
    # The daemon's waits of the failed run go; the slot that queued it stays.
    assert "_retry_at" not in job["spec"] and job["spec"]["_slot_at"] == 1.0
    assert job["record_path"] != first_record and Path(first_record).exists()
    record = Path(job["record_path"]).read_text()
    assert "retry of a failed job (exited: failed (code 1): boom)" in record
    (retried,) = [e for e in app.store.events(type_prefix="job.retried")]
    assert retried["data"]["previous"] == "failed" and retried["data"]["state"] == "queued"
    app.close()


def test_a_retry_is_refused_and_changes_nothing_when_it_cannot_be(tmp_path: Path) -> None:
    app, job_id = _failed_job(tmp_path)
    before = app.store.get_job(job_id)
    records = sorted((tmp_path / "state" / "decisions").iterdir())

    app.store.update_job(job_id, None, deadline_at=time.time() - 60)
    with pytest.raises(BadInput, match=r"deadline .* has passed: give a new one"):
        retry(app, app.store.get_job(job_id))
    # An hour of work here, half an hour rented plus the overhead: a deadline a minute away is rethink again.
    app.store.update_job(job_id, None, deadline_at=before["deadline_at"])
    with pytest.raises(BadInput, match="would be rethink again"):
        retry(app, app.store.get_job(job_id), deadline_at=time.time() + 60)

    with app.store.tx() as c:  # its last attempt is still being stopped
        c.execute(insert(s.attempts).values(id=f"{job_id}-a1", job_id=job_id, n=1, where="local", state="running",
                                            info={}, created_at=time.time()))
    with pytest.raises(BadInput, match=f"attempt {job_id}-a1 is still being stopped"):
        retry(app, app.store.get_job(job_id))
    with app.store.tx() as c:
        c.execute(s.attempts.update().values(state="failed"))

    app.store.update_job(job_id, None, state="done")
    with pytest.raises(BadInput, match="is done: only a failed, cancelled or rethink job is retried"):
        retry(app, app.store.get_job(job_id))
    app.store.update_job(job_id, None, state="failed")
    assert {k: v for k, v in app.store.get_job(job_id).items() if k != "updated_at"} == \
        {k: v for k, v in before.items() if k != "updated_at"}
    assert sorted((tmp_path / "state" / "decisions").iterdir()) == records
    assert app.store.events(type_prefix="job.retried") == []
    app.close()


def test_reread_takes_the_fixed_job_file_and_its_deadline_from_now_and_refuses_another_job(tmp_path: Path) -> None:
    app, job_id = _failed_job(tmp_path)
    path = tmp_path / "nightly.toml"
    (tmp_path / "work" / "train.py").touch()  # the script the fixed command runs
    write_job(tmp_path, "nightly", command=["python3", "train.py", "--lr", "0.01"], workdir="work", deadline_hours=30,
              local_throughput=1.0)
    now = time.time()
    retry(app, app.store.get_job(job_id), now, reread=True)
    job = app.store.get_job(job_id)
    assert job["spec"]["command"] == ["python3", "train.py", "--lr", "0.01"]
    assert job["deadline_at"] == pytest.approx(now + 30 * 3600) and job["spec"]["_slot_at"] == 1.0
    assert "retry of a failed job (exited: failed (code 1): boom), its job file read again" in \
        Path(job["record_path"]).read_text()

    app.store.update_job(job_id, None, state="failed")
    before = app.store.get_job(job_id)
    path.write_text(path.read_text().replace('name = "nightly"', 'name = "other"'))
    with pytest.raises(BadInput, match="names the job 'other', not 'nightly': a different job is enqueued"):
        retry(app, before, reread=True)
    path.write_text(path.read_text().replace('name = "other"', 'name = "nightly"\nbogus = 1'))
    with pytest.raises(BadInput, match="bogus"):
        retry(app, before, reread=True)
    assert app.store.get_job(job_id) == before
    app.close()


def test_a_job_that_failed_halfway_resumes_from_its_checkpoint_once_fixed_and_ends_as_if_it_never_failed(
        burstctl, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(REPO / "examples" / "trainer.py", work / "trainer.py")
    # The bug: while the file BUG is in the workdir the run dies at step 40, after its checkpoint of step 40.
    train = "exec python3 trainer.py --steps 100 --checkpoint-every 10 --out result.json"
    command = ["sh", "-c", f"if [ -e BUG ]; then {train} --fail-at-step 40; fi; {train}"]
    (work / "BUG").touch()
    write_job(tmp_path, "flaky", command=command, workdir="work", deadline_hours=12, local_throughput=1000,
              work_units=100, checkpoint={"interval_minutes": 0.02})
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text("[daemon]\ntick_s = 0.5\n")
    job_id = json.loads(burstctl("--config", str(cfg), "enqueue", str(tmp_path / "flaky.toml"), "--json").stdout)["id"]
    r = burstctl("--config", str(cfg), "daemon", "--exit-when-idle")
    assert r.returncode == 0, r.stderr[-2000:]
    shown = json.loads(burstctl("--config", str(cfg), "show", job_id, "--json").stdout)
    assert shown["state"] == "failed"

    (work / "BUG").unlink()  # the fix
    retried = burstctl("--config", str(cfg), "retry", "flaky", "--json")
    assert retried.returncode == 0, retried.stderr
    again = json.loads(retried.stdout)
    assert again["state"] == "queued" and again["work_done"] == 40 and again["work_left"] == 60
    r = burstctl("--config", str(cfg), "daemon", "--exit-when-idle")
    assert r.returncode == 0, r.stderr[-2000:]
    shown = json.loads(burstctl("--config", str(cfg), "show", job_id, "--json").stdout)
    assert shown["state"] == "done"
    logs = burstctl("--config", str(cfg), "logs", job_id).stdout
    assert "at step 40" in logs and "resumed from" in logs
    # The result is the one an uninterrupted run gives: nothing was lost or done twice.
    straight = tmp_path / "straight"
    straight.mkdir()
    subprocess.run([sys.executable, str(work / "trainer.py"), "--steps", "100", "--checkpoint-every", "10", "--out",
                    str(straight / "result.json")], cwd=straight, check=True, capture_output=True,
                   env={"PATH": "/usr/bin:/bin", "BURST_CHECKPOINT_DIR": str(straight / "ckpt")})
    result, expected = (json.loads(p.read_text()) for p in (work / "result.json", straight / "result.json"))
    assert result["step"] == 100 and result["state_sha256"] == expected["state_sha256"]
    # Done, it keeps only its newest checkpoint: nothing resumes it now.
    store = tmp_path / "state" / "checkpoints" / job_id
    assert [p.name for p in store.iterdir() if not p.name.startswith(".")] == ["step-00000100"]
    said = burstctl("--config", str(cfg), "events", "--job", job_id, "--type", "job.done", "--json").stdout
    (done,) = [json.loads(line) for line in said.splitlines()]
    assert done["checkpoints_trimmed"] == 2
    # The second record is the retry's, its Measured line filled when the job was done.
    record = Path(shown["record"]).read_text()
    assert "retry of a failed job" in record and "- **Measured:** run" in record

    assert burstctl("--config", str(cfg), "retry", job_id).returncode == 2  # done: nothing to retry


@pytest.mark.slow
def test_a_cloud_job_that_failed_resumes_on_a_new_instance_from_the_checkpoint_that_came_home(tmp_path: Path) -> None:
    from tests.e2e import cli, daemon_until, events, job, sim_instances, simcloud, trainer_job, write_config

    state = tmp_path / "state"
    spec = trainer_job(tmp_path, "flaky-cloud", steps=100, every=10, step_s=0.05, extra=("--out", "result.json"),
                       outputs=["result.json"])
    train = "exec python3 trainer.py --steps 100 --checkpoint-every 10 --step-seconds 0.05 --out result.json"
    text = spec.read_text().splitlines()
    text[1] = f"command = {json.dumps(['sh', '-c', f'if [ -e BUG ]; then {train} --fail-at-step 40; fi; {train}'])}"
    spec.write_text("\n".join(text) + "\n")
    (tmp_path / "work" / "BUG").touch()
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url)
        job_id = json.loads(cli(config, state, "enqueue", str(spec), "--json").stdout)["id"]
        daemon_until(tmp_path, config, state, lambda: job(state, job_id)["state"] == "failed", 180,
                     "the job to fail at step 40")
        assert "a planted bug at step 40" in job(state, job_id)["reason"]

        (tmp_path / "work" / "BUG").unlink()  # the fix, in the workdir the next attempt pushes
        again = json.loads(cli(config, state, "retry", job_id, "--json").stdout)
        assert (again["state"], again["work_done"], again["work_left"]) == ("queued", 0.4, pytest.approx(0.6))
        daemon_until(tmp_path, config, state, lambda: job(state, job_id)["state"] == "done", 180,
                     "the retried job to finish")
        instances = sim_instances(url)
    resumed = [e["data"] for e in events(state, "job.resumed")]
    assert [r["checkpoint"] for r in resumed] == ["step-00000040"]
    assert "resumed from" in cli(config, state, "logs", job_id).stdout
    result = json.loads((state / "outputs" / job_id / "result.json").read_text())
    assert result["step"] == 100
    # Two instances, one per attempt, both gone; the job's cost counts both.
    assert len(instances) == 2 and {i["status"] for i in instances} <= {"terminated"}

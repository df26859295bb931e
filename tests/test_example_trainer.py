"""The example trainer under the job contract: preempted three times (SIGKILL of the whole instance at random
moments and a spot notice), each time resumed by a fresh supervisor from the newest complete checkpoint, it ends in
exactly the state of an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from runbooks import burst_checkpoint as bc
from runbooks import supervisor as sv

REPO = Path(__file__).resolve().parent.parent
SUPERVISOR = REPO / "runbooks" / "supervisor.py"
TRAINER = REPO / "examples" / "trainer.py"
STEPS = 200
EVERY = 10
TRAIN = ["--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--step-seconds", "0.02"]


def wait_for(predicate: Callable[[], object], what: str, timeout: float = 120.0) -> object:
    """Poll until `predicate` is truthy; the timeout is a safety net against hangs, not a measured expectation."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.02)
    raise AssertionError(f"gave up waiting for: {what}")


class NoticeServer:
    """EC2's spot instance-action endpoint on 127.0.0.1: 404 until `post_notice`, then the notice."""

    def __init__(self) -> None:
        self.notice: bytes | None = None
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = server.notice or b"Not Found"
                self.send_response(200 if server.notice else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/latest/meta-data/spot/instance-action"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def post_notice(self) -> None:
        self.notice = json.dumps({"action": "terminate", "time": "2026-11-29T18:30:00Z"}).encode()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def supervised(root: Path, attempt: int, out: Path, *options: str, resume: Path | None = None) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    return [sys.executable, str(SUPERVISOR), "--run-dir", str(root / f"run-{attempt}"), "--job-id", "trainer",
            "--attempt", str(attempt), "--checkpoint-dir", str(root / "ckpt"), "--workdir", str(root),
            "--heartbeat-s", "0.2", "--notice-poll-s", "0.1", "--grace-s", "30",
            *(["--resume-from", str(resume)] if resume else []), *options,
            "--", sys.executable, str(TRAINER), *TRAIN, "--out", str(out)]


def latest_step(ckpt: Path) -> int:
    latest = bc.latest_complete(ckpt)
    return bc.read_manifest(latest)["step"] if latest else 0


def test_three_preemptions_end_bit_identical_to_an_uninterrupted_run(tmp_path: Path) -> None:
    reference_root = tmp_path / "uninterrupted"
    reference_out = reference_root / "result.json"
    ref = subprocess.run(supervised(reference_root, 1, reference_out), capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr
    reference = json.loads(reference_out.read_text())
    assert reference["step"] == STEPS

    root = tmp_path / "preempted"
    ckpt = root / "ckpt"
    out = root / "result.json"
    rng = random.Random(1129)
    resumed_at = []
    for attempt, preemption in enumerate(["sigkill", "notice", "sigkill"], start=1):
        resume = bc.latest_complete(ckpt)
        start_step = latest_step(ckpt)
        resumed_at.append(start_step)
        server = NoticeServer()
        try:
            proc = subprocess.Popen(supervised(root, attempt, out, "--metadata-url", server.url, resume=resume),
                                    stdout=subprocess.PIPE, text=True)
            # Let this attempt make progress of its own, then preempt it at a random moment.
            wait_for(lambda s=start_step: latest_step(ckpt) > s, f"attempt {attempt} to checkpoint")
            time.sleep(rng.uniform(0.0, 0.3))
            if preemption == "sigkill":  # the instance vanishes: supervisor and trainer die with no warning
                beat = sv.read_json(root / f"run-{attempt}" / "heartbeat")
                os.kill(proc.pid, signal.SIGKILL)
                os.killpg(beat["child_pgid"], signal.SIGKILL)
                proc.communicate(timeout=60)
                assert not (root / f"run-{attempt}" / "exit.json").exists()
            else:  # a spot notice: the trainer gets SIGTERM and writes a last checkpoint
                server.post_notice()
                proc.communicate(timeout=120)
                record = sv.read_json(root / f"run-{attempt}" / "exit.json")
                assert (record["reason"], record["exit_code"]) == ("notice", 143)
                assert record["last_checkpoint"] == bc.latest_complete(ckpt).name
        finally:
            server.close()
        assert not out.exists(), f"attempt {attempt} finished before it was preempted"

    final_resume = bc.latest_complete(ckpt)
    assert final_resume is not None
    resumed_at.append(latest_step(ckpt))
    done = subprocess.run(supervised(root, 4, out, resume=final_resume), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert sv.read_json(root / "run-4" / "exit.json")["reason"] == "completed"
    assert resumed_at[0] == 0
    assert resumed_at == sorted(set(resumed_at)), resumed_at  # every attempt started further along
    assert 0 < resumed_at[-1] < STEPS
    assert f"resumed from {final_resume} at step {resumed_at[-1]}" in (root / "run-4" / "stdout.log").read_text()

    result = json.loads(out.read_text())
    assert result["state_sha256"] == reference["state_sha256"]
    assert (result["w"], result["b"], result["step"]) == (reference["w"], reference["b"], reference["step"])


def run_trainer(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
                python: list[str] | None = None, script: Path = TRAINER) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "BURST_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
                "BURST_METRICS_FILE": str(tmp_path / "metrics.json"), "BURST_RESUME_FROM": "", **(env or {})}
    return subprocess.run([*(python or [sys.executable]), str(script), *args], capture_output=True, text=True,
                          timeout=300, env=full_env, cwd=tmp_path)


def test_runs_are_deterministic_and_report_result_and_metrics(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    for root in (first, second):
        root.mkdir()
        proc = run_trainer(root, "--steps", "60", "--checkpoint-every", "20")
        assert proc.returncode == 0, proc.stderr
    result = json.loads((first / "result.json").read_text())  # default: in the working directory
    assert result == json.loads((second / "result.json").read_text())
    assert result["step"] == 60
    assert result["last_batch_loss"] < 1.0  # it learns: the data's noise has variance 0.01
    assert [p.name for p in bc.list_complete(first / "ckpt")] == ["step-00000020", "step-00000040",
                                                                  "step-00000060"]
    metrics = json.loads((first / "metrics.json").read_text())
    assert metrics["units_done"] == 1.0
    assert metrics["step"] == 60
    assert metrics["throughput_units_h"] > 0


def test_progress_is_reported_in_the_job_s_work_units(tmp_path: Path) -> None:
    # A job of W = 4 units reports 4 units done at its end (not 1.0, "the whole job"), and its speed in units.
    proc = run_trainer(tmp_path, "--steps", "40", "--checkpoint-every", "20", env={"BURST_WORK_UNITS": "4.0"})
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["step"] == 40 and metrics["units_done"] == 4.0


def test_sigterm_writes_a_checkpoint_at_the_current_step_and_exits_143(tmp_path: Path) -> None:
    env = {**os.environ, "BURST_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "BURST_RESUME_FROM": ""}
    proc = subprocess.Popen([sys.executable, str(TRAINER), "--steps", "100000", "--checkpoint-every", "7",
                             "--step-seconds", "0.01"], stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("training from step 0")
    wait_for(lambda: bc.latest_complete(tmp_path / "ckpt"), "a periodic checkpoint")
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143
    stopped_at = int(rest.strip().splitlines()[-1].rsplit(" ", 1)[1])
    latest = bc.latest_complete(tmp_path / "ckpt")
    assert bc.read_manifest(latest)["step"] == stopped_at
    assert latest.name == f"step-{stopped_at:08d}"
    assert not (tmp_path / "result.json").exists()


def test_refuses_to_resume_from_a_checkpoint_that_does_not_verify(tmp_path: Path) -> None:
    assert run_trainer(tmp_path, "--steps", "20", "--checkpoint-every", "10").returncode == 0
    latest = bc.latest_complete(tmp_path / "ckpt")
    state = latest / "state.json"
    state.write_text(state.read_text().replace('"step": 20', '"step": 99'))  # same size, different bytes
    proc = run_trainer(tmp_path, "--steps", "40", env={"BURST_RESUME_FROM": str(latest)})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"trainer: error: BURST_RESUME_FROM={latest} is not a complete checkpoint; refusing to resume from it"]


def test_resuming_a_finished_run_with_more_steps_continues_from_it(tmp_path: Path) -> None:
    assert run_trainer(tmp_path, "--steps", "30", "--checkpoint-every", "30").returncode == 0
    resumed = run_trainer(tmp_path, "--steps", "30", "--checkpoint-every", "30",
                          env={"BURST_RESUME_FROM": str(tmp_path / "ckpt" / "step-00000030")})
    assert resumed.returncode == 0
    assert "resumed from" in resumed.stdout
    assert json.loads((tmp_path / "result.json").read_text())["step"] == 30


def test_shard_mib_adds_a_shard_that_differs_per_step_and_resumes_bit_identical(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train = ["--steps", "20", "--checkpoint-every", "10", "--shard-mib", "2"]
    for root in (straight, resumed):
        root.mkdir()
        assert run_trainer(root, *train).returncode == 0
    shutil.rmtree(resumed / "ckpt" / "step-00000020")  # as if preempted after step 10's checkpoint
    proc = run_trainer(resumed, *train, env={"BURST_RESUME_FROM": str(resumed / "ckpt" / "step-00000010")})
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr
    first, final = (bc.read_manifest(straight / "ckpt" / n)["files"] for n in ("step-00000010", "step-00000020"))
    assert first["shard.bin"]["size"] == final["shard.bin"]["size"] == 2 * 1024 * 1024
    assert first["shard.bin"]["sha256"] != final["shard.bin"]["sha256"]  # a new checkpoint's shard really changes
    assert bc.read_manifest(resumed / "ckpt" / "step-00000020")["files"] == final  # every byte, shard included


def test_runs_on_a_bare_python_with_burst_checkpoint_shipped_next_to_it(tmp_path: Path) -> None:
    shipped = tmp_path / "workdir"
    shipped.mkdir()
    shutil.copy(TRAINER, shipped / "trainer.py")
    shutil.copy(REPO / "runbooks" / "burst_checkpoint.py", shipped / "burst_checkpoint.py")
    # -S -E: no site-packages (so no installed `runbooks`), no PYTHONPATH
    proc = run_trainer(tmp_path, "--steps", "20", "--checkpoint-every", "10", python=[sys.executable, "-S", "-E"],
                       script=shipped / "trainer.py")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "result.json").read_text())["step"] == 20


def test_the_example_job_spec_is_accepted_by_burstctl_enqueue(tmp_path: Path) -> None:
    burstctl = shutil.which("burstctl") or str(Path(sys.executable).parent / "burstctl")
    proc = subprocess.run([burstctl, "--state-dir", str(tmp_path / "state"), "enqueue", "--json",
                           str(REPO / "examples" / "trainer-job.toml")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "example-trainer" in proc.stdout


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--checkpoint-every", "0"], ["--step-seconds", "-1"],
                                 ["--shard-mib", "-1"]])
def test_bad_arguments_exit_2(tmp_path: Path, bad: list[str]) -> None:
    proc = run_trainer(tmp_path, *bad)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr

"""The supervisor, driven as the daemon drives it: a real process running real commands, real signals, and a real
HTTP metadata service on 127.0.0.1 standing in for EC2's instance-action endpoint."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from runbooks import burst_checkpoint as bc
from runbooks import supervisor as sv

REPO = Path(__file__).resolve().parent.parent
SUPERVISOR = REPO / "runbooks" / "supervisor.py"
BOOTSTRAP = REPO / "runbooks" / "bootstrap.sh"
TRAINER = REPO / "examples" / "trainer.py"
SECRET = "sk-test-9f8e7d6c5b4a"  # a value that must never leave the child's environment

# Dumps its environment and cwd to argv[1], writes to both streams, exits with argv[2].
ENV_DUMP = """
import json, os, sys
keys = [k for k in os.environ if k.startswith("BURST_") or k in ("API_TOKEN", "PLAIN")]
json.dump({"env": {k: os.environ[k] for k in keys}, "cwd": os.getcwd()}, open(sys.argv[1], "w"))
print("to stdout"); print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[2]))
"""

# Appends a line to argv[1] when it starts, then waits until argv[2] exists. On SIGTERM it writes argv[1]+".term"
# and exits 143, unless argv[3] == "ignore-term". With argv[4] == "grandchild" it also starts a sleeper in its group
# and records the sleeper's pid in argv[1]+".grandchild".
WAITER = """
import os, signal, subprocess, sys, time
started, release = sys.argv[1], sys.argv[2]
mode = sys.argv[3] if len(sys.argv) > 3 else ""
def on_term(signum, frame):
    open(started + ".term", "w").write("SIGTERM")
    sys.exit(143)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore-term" else on_term)
if len(sys.argv) > 4 and sys.argv[4] == "grandchild":
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(started + ".grandchild", "w").write(str(sleeper.pid))
with open(started, "a") as fh:
    fh.write("%d\\n" % os.getpid())
while not os.path.exists(release):
    time.sleep(0.05)
"""


def wait_for(predicate: Callable[[], object], what: str, timeout: float = 60.0) -> object:
    """Poll until `predicate` is truthy. The timeout is a safety net against hangs, not a measured expectation."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for: {what}")


def read_json(path: Path) -> dict | None:
    return sv.read_json(path)


class Job:
    """One supervised attempt's paths and the argv to start it."""

    def __init__(self, root: Path, job_id: str = "job-1", attempt: int = 1) -> None:
        self.root = root
        self.run = root / "run"
        self.ckpt = root / "ckpt"
        self.work = root / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.job_id = job_id
        self.attempt = attempt

    def argv(self, *options: str, command: list[str], attempt: int | None = None) -> list[str]:
        return [sys.executable, str(SUPERVISOR), "--run-dir", str(self.run), "--job-id", self.job_id,
                "--attempt", str(attempt if attempt is not None else self.attempt), "--checkpoint-dir",
                str(self.ckpt), "--workdir", str(self.work), "--heartbeat-s", "0.2", *options, "--", *command]

    def waiter(self, mode: str = "", grandchild: bool = False) -> list[str]:
        script = self.root / "waiter.py"
        script.write_text(WAITER)
        extra = [mode or "-", "grandchild"] if grandchild else ([mode] if mode else [])
        return [sys.executable, str(script), str(self.root / "started"), str(self.root / "release"), *extra]

    def release(self) -> None:
        (self.root / "release").write_text("go")

    def starts(self) -> list[str]:
        path = self.root / "started"
        return path.read_text().split() if path.exists() else []

    def heartbeat(self) -> dict | None:
        return read_json(self.run / sv.HEARTBEAT_FILE)

    def exit_record(self) -> dict | None:
        return read_json(self.run / sv.EXIT_FILE)

    def status(self) -> dict:
        out = subprocess.run([sys.executable, str(SUPERVISOR), "status", "--run-dir", str(self.run)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert len(lines) == 1
        return json.loads(lines[0])

    def wait_running(self) -> dict:
        return wait_for(lambda: (hb := self.heartbeat()) and hb["state"] == "running" and self.starts() and hb,
                        "the child to start")  # type: ignore[return-value]


class MetadataServer:
    """EC2's instance-action endpoint: 404 until `post_notice`, then the notice JSON. With `imdsv2`, a GET without
    the session token gets 401, as on instances that require IMDSv2."""

    PATH = "/latest/meta-data/spot/instance-action"

    def __init__(self, imdsv2: bool = False, prefix: str = "") -> None:
        self.notice: dict | None = None
        self.requests: list[tuple[str, str, int]] = []
        self.imdsv2 = imdsv2
        self.prefix = prefix  # a metadata root with a path, as $AWS_EC2_METADATA_SERVICE_ENDPOINT may give
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
                server.requests.append((self.command, self.path, code))
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:
                if self.path == server.prefix + "/latest/api/token":
                    self._reply(200, b"token-123")
                else:
                    self._reply(404, b"Not Found")

            def do_GET(self) -> None:
                if self.path != server.prefix + MetadataServer.PATH:
                    self._reply(404, b"Not Found")
                elif server.imdsv2 and self.headers.get("X-aws-ec2-metadata-token") != "token-123":
                    self._reply(401, b"Unauthorized")
                elif server.notice is None:
                    self._reply(404, b"Not Found")
                else:
                    self._reply(200, json.dumps(server.notice).encode(), "application/json")

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.root = f"http://127.0.0.1:{self.httpd.server_address[1]}{prefix}"
        self.url = f"{self.root}{self.PATH}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def post_notice(self) -> dict:
        self.notice = {"action": "terminate", "time": "2026-11-29T18:30:00Z"}
        return self.notice

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def metadata() -> Iterator[MetadataServer]:
    server = MetadataServer()
    yield server
    server.close()


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    the_job = Job(tmp_path / "job")
    yield the_job
    # Whatever a failed test left running: end the command's group and the supervisor.
    beat = the_job.heartbeat()
    if beat:
        for pid, kill in ((beat.get("supervisor_pid"), os.kill), (beat.get("child_pgid"), os.killpg)):
            if pid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid, signal.SIGKILL)


def no_listener_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}{MetadataServer.PATH}"


def log_text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def one_json_line(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.strip()]
    return json.loads(lines[-1])


# --- the contract's environment, output and exit records ------------------------------------------------------


def test_exports_the_contract_runs_in_workdir_and_captures_output(job: Job) -> None:
    env_file = job.root / "job.env"
    env_file.write_text(f"# the job's [env] table\nAPI_TOKEN={SECRET}\n\nPLAIN=a=b c\n")
    dump = job.root / "env.json"
    resume = bc.write_checkpoint(job.root / "old-ckpt", "step-00000010", {"a": b"1"})
    proc = subprocess.run(job.argv("--env-file", str(env_file), "--resume-from", str(resume),
                                   command=[sys.executable, "-c", ENV_DUMP, str(dump), "0"]),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    start_report, exit_line = (json.loads(line) for line in proc.stdout.splitlines())
    assert start_report["status"] == "started"

    seen = json.loads(dump.read_text())
    assert seen["cwd"] == str(job.work)
    assert seen["env"] == {
        "BURST_JOB_ID": "job-1", "BURST_ATTEMPT": "1", "BURST_CHECKPOINT_DIR": str(job.ckpt),
        "BURST_RESUME_FROM": str(resume), "BURST_METRICS_FILE": str(job.run / "metrics.json"),
        "API_TOKEN": SECRET, "PLAIN": "a=b c",
    }
    assert (job.run / "stdout.log").read_text() == "to stdout\n"
    assert (job.run / "stderr.log").read_text() == "to stderr\n"
    assert (job.run / "supervisor.pid").read_text().strip() == str(start_report["supervisor_pid"])

    record = job.exit_record()
    assert record == exit_line
    assert record["reason"] == "completed"
    assert (record["exit_code"], record["signal"]) == (0, None)
    assert record["job_id"] == "job-1"
    assert record["attempt"] == 1
    assert record["started_at"] <= record["ended_at"]
    assert job.heartbeat()["state"] == "exited"
    # The secret reached the command and nothing else.
    for path in job.run.iterdir():
        assert SECRET not in path.read_text(errors="replace"), path.name
    assert SECRET not in proc.stdout + proc.stderr


def test_a_failing_command_is_reported_failed_with_its_exit_code(job: Job) -> None:
    proc = subprocess.run(job.argv(command=[sys.executable, "-c", ENV_DUMP, str(job.root / "e.json"), "3"]),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    record = job.exit_record()
    assert (record["reason"], record["exit_code"], record["signal"]) == ("failed", 3, None)


def test_a_command_that_cannot_start_is_failed_127(job: Job) -> None:
    proc = subprocess.run(job.argv(command=[str(job.root / "no-such-program")]), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 127
    record = job.exit_record()
    assert (record["reason"], record["exit_code"]) == ("failed", 127)
    assert "no-such-program" in record["error"]


def test_with_env_runs_a_command_with_the_env_file_added_taken_literally(tmp_path: Path) -> None:
    env_file = tmp_path / "job.env"
    env_file.write_text("GREETING=hello $USER \"q\"\nEMPTY=\n")
    show = ["sh", "-c", 'printf "%s|%s|%s" "$GREETING" "${EMPTY-unset}" "$KEPT"; exit 4']
    proc = subprocess.run([sys.executable, str(SUPERVISOR), "with-env", "--env-file", str(env_file), "--", *show],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "KEPT": "k"})
    assert (proc.returncode, proc.stdout) == (4, 'hello $USER "q"||k')
    proc = subprocess.run([sys.executable, str(SUPERVISOR), "with-env", "--env-file", str(env_file), "--",
                           str(tmp_path / "no-such-program")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 127 and "no-such-program: No such file or directory" in proc.stderr
    proc = subprocess.run([sys.executable, str(SUPERVISOR), "with-env", "--env-file", str(tmp_path / "gone"), "--",
                           "true"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("supervisor: error: --env-file")


def test_the_last_line_is_read_whole_from_the_log_s_end_never_from_the_middle_of_a_line(tmp_path: Path) -> None:
    secret = "Zq9-5ecret-value"
    log = tmp_path / "stderr.log"
    log.write_text("x" * 10_000 + "\nTraceback: token=" + secret + " refused\n")
    assert sv.last_line(log, secrets=[secret]) == "Traceback: token=*** refused"
    # The 8 KiB read from the end begins inside the secret, in a line longer than that: none of it is a line.
    log.write_text("x" * 10_000 + secret + "y" * 8180)
    assert sv.last_line(log, secrets=[secret]) == "(its last line is longer than 8 KiB)"
    log.write_text("pip failed\n[notice] To update, run: pip install --upgrade pip\n")
    assert sv.last_line(log) == "pip failed"


def test_heartbeat_advances_names_the_child_group_and_the_latest_complete_checkpoint(job: Job) -> None:
    proc = subprocess.Popen(job.argv(command=job.waiter()), stdout=subprocess.PIPE, text=True)
    first = job.wait_running()
    later = wait_for(lambda: (hb := job.heartbeat()) and hb["seq"] > first["seq"] + 2 and hb, "heartbeats")
    assert later["ts"] > first["ts"]
    assert later["supervisor_pid"] == proc.pid
    child = int(job.starts()[0])
    assert later["child_pid"] == later["child_pgid"] == child
    assert os.getpgid(child) == child != os.getpgid(proc.pid)  # the command leads its own process group
    assert later["last_checkpoint"] is None

    bc.write_checkpoint(job.ckpt, "step-00000100", {"w": b"1" * 1000})
    (job.ckpt / ".tmp-step-00000200-1").mkdir()  # a write in progress: never reported
    (job.ckpt / "step-00000300").mkdir()  # no manifest: not complete
    wait_for(lambda: job.heartbeat()["last_checkpoint"] == "step-00000100", "the checkpoint in the heartbeat")

    status = job.status()
    assert status["supervisor_alive"] is True
    assert status["child_alive"] is True
    assert status["exit"] is None
    assert status["heartbeat"]["state"] == "running"
    (job.run / "metrics.json").write_text('{"units_done": 0.25}')
    assert job.status()["metrics"] == {"units_done": 0.25}

    job.release()
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    final = job.status()
    assert final["supervisor_alive"] is False
    assert final["child_alive"] is False
    assert final["exit"]["reason"] == "completed"
    assert final["exit"]["last_checkpoint"] == "step-00000100"


# --- stopping: signals, notices, grace, max run time ----------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_supervisor_is_forwarded_as_sigterm(job: Job, sig: signal.Signals) -> None:
    proc = subprocess.Popen(job.argv(command=job.waiter()), stdout=subprocess.PIPE, text=True)
    job.wait_running()
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    assert proc.returncode == 143
    assert (job.root / "started.term").read_text() == "SIGTERM"
    record = job.exit_record()
    assert (record["reason"], record["exit_code"], record["signal"]) == ("terminated", 143, None)


def test_after_the_grace_period_the_whole_group_is_killed(job: Job) -> None:
    proc = subprocess.Popen(job.argv("--grace-s", "0.5", command=job.waiter("ignore-term", grandchild=True)),
                            stdout=subprocess.PIPE, text=True)
    job.wait_running()
    grandchild = int(wait_for(lambda: (p := job.root / "started.grandchild").exists() and p.read_text(),
                              "the grandchild"))
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    record = job.exit_record()
    assert (record["reason"], record["exit_code"], record["signal"], record["signal_name"]) == \
        ("terminated", None, 9, "SIGKILL")
    assert proc.returncode == 128 + 9
    wait_for(lambda: not sv.pid_alive(grandchild), "the grandchild to die with its group")
    assert "grace period over" in (job.run / "supervisor.log").read_text()


def test_leftover_processes_of_a_finished_command_are_ended(job: Job) -> None:
    proc = subprocess.Popen(job.argv(command=job.waiter("-", grandchild=True)), stdout=subprocess.PIPE, text=True)
    job.wait_running()
    grandchild = int(wait_for(lambda: (p := job.root / "started.grandchild").exists() and p.read_text(),
                              "the grandchild"))
    job.release()
    proc.communicate(timeout=60)
    assert job.exit_record()["reason"] == "completed"
    wait_for(lambda: not sv.pid_alive(grandchild), "the leftover process to be killed")


def test_max_run_time_stops_the_command(job: Job) -> None:
    proc = subprocess.run(job.argv("--max-run-s", "0.5", command=job.waiter()), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 143
    assert job.exit_record()["reason"] == "max-run-time"
    assert (job.root / "started.term").exists()


def test_spot_notice_makes_the_trainer_write_a_last_checkpoint(job: Job, metadata: MetadataServer) -> None:
    # Periodic checkpoints are off (every 10^9 steps): any checkpoint comes from the SIGTERM path.
    trainer = [sys.executable, str(TRAINER), "--steps", "1000000", "--checkpoint-every", "1000000000",
               "--step-seconds", "0.01"]
    proc = subprocess.Popen(job.argv("--metadata-url", metadata.url, "--notice-poll-s", "0.1", command=trainer),
                            stdout=subprocess.PIPE, text=True)
    wait_for(lambda: "training from step 0" in log_text(job.run / "stdout.log"), "the trainer to start")
    wait_for(lambda: len(metadata.requests) >= 2, "the supervisor to poll the metadata service")
    notice = metadata.post_notice()
    proc.communicate(timeout=120)

    assert metadata.requests[0] == ("GET", MetadataServer.PATH, 404)
    record = job.exit_record()
    assert (record["reason"], record["exit_code"]) == ("notice", 143)
    assert record["notice"] == notice
    latest = bc.latest_complete(job.ckpt)
    assert latest is not None
    assert record["last_checkpoint"] == latest.name
    step = bc.read_manifest(latest)["step"]
    assert step > 0
    assert f"stopped by SIGTERM at step {step}" in (job.run / "stdout.log").read_text()
    assert "stopping (notice)" in (job.run / "supervisor.log").read_text()


def test_imdsv2_token_is_fetched_when_the_metadata_service_demands_it(job: Job) -> None:
    server = MetadataServer(imdsv2=True)
    try:
        server.post_notice()
        proc = subprocess.run(job.argv("--metadata-url", server.url, "--notice-poll-s", "0.1",
                                       command=job.waiter()), capture_output=True, text=True, timeout=120)
    finally:
        server.close()
    assert proc.returncode == 143
    assert job.exit_record()["reason"] == "notice"
    assert ("PUT", "/latest/api/token", 200) in server.requests
    assert server.requests[0] == ("GET", MetadataServer.PATH, 401)


def test_ec2s_fixed_metadata_address_follows_the_sdk_endpoint_override_prefix_and_token_included(job: Job) -> None:
    server = MetadataServer(imdsv2=True, prefix="/i-0abc")
    try:
        server.post_notice()
        ec2_url = sv.EC2_IMDS_ROOT + MetadataServer.PATH
        proc = subprocess.run(job.argv("--metadata-url", ec2_url, "--notice-poll-s", "0.1", command=job.waiter()),
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, sv.IMDS_ENDPOINT_VAR: server.root + "/"})
    finally:
        server.close()
    assert proc.returncode == 143
    assert job.exit_record()["reason"] == "notice"
    assert ("PUT", "/i-0abc/latest/api/token", 200) in server.requests


def test_the_endpoint_override_leaves_other_metadata_urls_alone() -> None:
    url = "http://127.0.0.1:9/_sim/instances/x/latest/meta-data/spot/instance-action"
    assert sv.resolve_metadata_url(url, {sv.IMDS_ENDPOINT_VAR: "http://10.0.0.1"}) == url
    assert sv.resolve_metadata_url(sv.EC2_IMDS_ROOT + "/latest/x", {}) == sv.EC2_IMDS_ROOT + "/latest/x"


def test_an_unreachable_metadata_service_is_ignored(job: Job) -> None:
    proc = subprocess.Popen(job.argv("--metadata-url", no_listener_url(), "--notice-poll-s", "0.05",
                                     command=job.waiter()), stdout=subprocess.PIPE, text=True)
    first = job.wait_running()
    wait_for(lambda: job.heartbeat()["seq"] > first["seq"] + 3, "heartbeats while polls fail")
    job.release()
    proc.communicate(timeout=60)
    assert job.exit_record()["reason"] == "completed"


# --- daemonizing, idempotent start, orphans -------------------------------------------------------------------


def test_daemonize_survives_its_parent_and_start_is_idempotent(job: Job) -> None:
    start = job.argv("--daemonize", command=job.waiter())
    # Start it from a shell that exits at once, like an SSH session closing.
    first = subprocess.run(["sh", "-c", '"$@"', "sh", *start], capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    report = one_json_line(first.stdout)
    assert report["status"] == "started"
    pid = report["supervisor_pid"]
    job.wait_running()
    assert sv.pid_alive(pid)
    assert os.getsid(pid) != os.getsid(0)  # detached from our session
    assert sv._proc_stat(pid)[1] != str(os.getpid())  # not our child: reparented after the double fork
    assert (job.run / "supervisor.pid").read_text().strip() == str(pid)

    again = subprocess.run(start, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0
    assert one_json_line(again.stdout) == {"status": "already-running", "supervisor_pid": pid, "attempt": 1}
    other = subprocess.run(job.argv("--daemonize", command=job.waiter(), attempt=2), capture_output=True,
                           text=True, timeout=60)
    assert other.returncode == 1
    assert one_json_line(other.stdout)["status"] == "busy"
    assert len(other.stderr.strip().splitlines()) == 1
    assert len(job.starts()) == 1  # the command ran once

    job.release()
    wait_for(job.exit_record, "the daemonized attempt to finish")
    assert job.exit_record()["reason"] == "completed"
    wait_for(lambda: not sv.pid_alive(pid), "the supervisor to exit")
    rerun = subprocess.run(start, capture_output=True, text=True, timeout=60)
    assert rerun.returncode == 0
    assert one_json_line(rerun.stdout)["status"] == "already-exited"
    assert len(job.starts()) == 1  # a finished attempt is not run again

    (job.root / "release").unlink()
    next_attempt = subprocess.run(job.argv("--daemonize", command=job.waiter(), attempt=2), capture_output=True,
                                  text=True, timeout=60)
    assert one_json_line(next_attempt.stdout)["status"] == "started"
    wait_for(lambda: len(job.starts()) == 2, "attempt 2 to start")
    assert read_json(job.run / "exit-attempt-1.json")["reason"] == "completed"
    job.release()
    wait_for(lambda: (rec := job.exit_record()) and rec["attempt"] == 2, "attempt 2 to finish")


# --- the job's setup, once per instance -------------------------------------------------------------------------

# A setup that appends a line (its cwd and $PLAIN) to argv[1], prints, and exits with argv[2]; with argv[3], only
# its first argv[3] runs fail (a network blip), the later ones pass.
SETUP = """
import os, sys
with open(sys.argv[1], "a") as fh:
    fh.write("%s %s\\n" % (os.getcwd(), os.environ.get("PLAIN")))
print("installing things"); print("ERROR: no matching distribution for nothing-such", file=sys.stderr)
if sys.argv[3:4] and sys.argv[3].isdigit() and len(open(sys.argv[1]).read().splitlines()) > int(sys.argv[3]):
    sys.exit(0)
sys.exit(int(sys.argv[2]))
"""


def setup_options(job: Job, argv: list[str]) -> list[str]:
    return ["--setup-json", json.dumps(argv), "--setup-dir", str(job.root / "setup")]


def setup_script(job: Job, code: int = 0, failing_runs: int | None = None) -> list[str]:
    script = job.root / "setup.py"
    script.write_text(SETUP)
    blip = [] if failing_runs is None else [str(failing_runs)]
    return [sys.executable, str(script), str(job.root / "setup-runs"), str(code), *blip]


def setup_runs(job: Job) -> list[str]:
    path = job.root / "setup-runs"
    return path.read_text().splitlines() if path.exists() else []


def test_the_setup_runs_before_the_command_once_per_instance(job: Job) -> None:
    env_file = job.root / "job.env"
    env_file.write_text("PLAIN=from-the-env-file\n")
    setup = setup_options(job, setup_script(job))
    first = subprocess.run(job.argv("--env-file", str(env_file), *setup,
                                    command=[sys.executable, "-c", ENV_DUMP, str(job.root / "e.json"), "0"]),
                           capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert setup_runs(job) == [f"{job.work} from-the-env-file"]  # in the workdir, with the job's environment
    assert (job.root / "e.json").exists()  # then the command
    record = job.exit_record()
    assert record["reason"] == "completed" and record["setup_s"] >= 0
    assert "installing things" in (job.root / "setup" / sv.SETUP_LOG).read_text()
    assert sv.setup_done(job.root / "setup", setup_script(job)) is not None

    # The next attempt on the same instance finds it done.
    second = subprocess.run(job.argv("--env-file", str(env_file), *setup, attempt=2,
                                     command=[sys.executable, "-c", ENV_DUMP, str(job.root / "e.json"), "0"]),
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert len(setup_runs(job)) == 1
    assert "setup_s" not in job.exit_record()
    # An edited setup is another setup: it runs.
    edited = [*setup_script(job), "--again"]
    subprocess.run(job.argv(*setup_options(job, edited), attempt=3, command=["true"]), capture_output=True,
                   timeout=120, check=True)
    assert len(setup_runs(job)) == 2


def test_a_failed_setup_is_reported_with_its_last_line_and_the_command_never_starts(job: Job) -> None:
    proc = subprocess.run(job.argv(*setup_options(job, setup_script(job, code=4)), command=job.waiter()),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4
    record = job.exit_record()
    assert (record["reason"], record["exit_code"]) == ("setup-failed", 4)
    assert record["stderr_tail"] == "ERROR: no matching distribution for nothing-such"
    assert job.starts() == []
    assert sv.setup_done(job.root / "setup", setup_script(job, code=4)) is None


def test_the_line_a_failure_is_told_by_is_the_error_not_pips_advice_to_upgrade_itself(tmp_path: Path) -> None:
    # An out-of-date pip ends almost every failure with a notice: the job had failed with "[notice] To update, run:
    # pip install --upgrade pip", in show, list, its event and its notice.
    log = tmp_path / "setup.log"
    log.write_text("Collecting thispackagedoesnotexist-xyz==9.9\n"
                   "ERROR: No matching distribution found for thispackagedoesnotexist-xyz==9.9\n\n"
                   "[notice] A new release of pip is available: 23.2.1 -> 26.3\n"
                   "[notice] To update, run: pip install --upgrade pip\n")
    assert sv.last_line(log) == "ERROR: No matching distribution found for thispackagedoesnotexist-xyz==9.9"
    log.write_text("[notice] To update, run: pip install --upgrade pip\n")  # nothing else said: that, then
    assert sv.last_line(log) == "[notice] To update, run: pip install --upgrade pip"


def test_a_failed_setup_is_tried_again_after_a_wait_and_a_passing_try_starts_the_command(job: Job) -> None:
    setup = setup_script(job, code=1, failing_runs=2)  # a network blip: two runs fail, the third passes
    proc = subprocess.run(job.argv(*setup_options(job, setup), "--setup-retries", "3", "--setup-retry-s", "0.3",
                                   command=["true"]), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(setup_runs(job)) == 3
    record = job.exit_record()
    assert record["reason"] == "completed" and record["setup_s"] >= 0.3 + 0.6  # it waited 0.3 s, then 0.6 s
    log = (job.root / "setup" / sv.SETUP_LOG).read_text()
    assert "--- burstctl: setup try 2 of 4 ---" in log and "--- burstctl: setup try 3 of 4 ---" in log
    assert "setup: failed (exit 1); try 3 of 4 in 0.6s" in (job.run / "supervisor.log").read_text()
    assert sv.setup_done(job.root / "setup", setup) is not None


def test_a_setup_that_fails_every_try_fails_with_the_last_tries_line(job: Job) -> None:
    proc = subprocess.run(job.argv(*setup_options(job, setup_script(job, code=4)), "--setup-retries", "1",
                                   "--setup-retry-s", "0.1", command=job.waiter()),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4
    record = job.exit_record()
    assert (record["reason"], record["exit_code"], record["error"]) == ("setup-failed", 4, "the setup failed 2 times")
    assert record["stderr_tail"] == "ERROR: no matching distribution for nothing-such"
    assert len(setup_runs(job)) == 2 and job.starts() == []


def test_a_stop_between_tries_of_the_setup_ends_the_wait(job: Job) -> None:
    proc = subprocess.Popen(job.argv(*setup_options(job, setup_script(job, code=1)), "--setup-retries", "2",
                                     "--setup-retry-s", "60", command=job.waiter()), stdout=subprocess.PIPE, text=True)
    log = job.run / "supervisor.log"
    wait_for(lambda: log.exists() and "try 2 of 3 in 60s" in log.read_text(), "the wait before the second try")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)  # not the 60 s wait
    record = job.exit_record()
    assert (record["reason"], record["error"]) == ("terminated", "stopped between tries of the setup")
    assert len(setup_runs(job)) == 1 and job.starts() == []


def test_an_early_setup_is_tried_again_too(job: Job) -> None:
    setup = setup_script(job, code=1, failing_runs=1)
    proc = subprocess.run([sys.executable, str(SUPERVISOR), "setup", *setup_options(job, setup), "--setup-retries",
                           "1", "--setup-retry-s", "0.1", "--workdir", str(job.work)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert one_json_line(proc.stdout)["status"] == "done"
    assert len(setup_runs(job)) == 2 and sv.setup_done(job.root / "setup", setup) is not None
    # Without a retry left, it says so: how many tries, and the last line.
    fails = setup_script(job, code=5)
    proc = subprocess.run([sys.executable, str(SUPERVISOR), "setup", *setup_options(job, fails), "--workdir",
                           str(job.work)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert one_json_line(proc.stdout) == {"status": "failed", "exit_code": 5, "tries": 1,
                                          "tail": "ERROR: no matching distribution for nothing-such"}


def test_a_setup_started_early_is_waited_for_not_run_twice(job: Job) -> None:
    """A successor's setup runs while its predecessor still trains (`supervisor.py setup`); the supervisor started
    at the takeover waits for it, heartbeating, then starts the command."""
    early = job.waiter()  # the setup: records its start, then waits for the release file
    options = setup_options(job, early)
    started = subprocess.run([sys.executable, str(SUPERVISOR), "setup", *options, "--workdir", str(job.work),
                              "--daemonize"], capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    assert one_json_line(started.stdout) == {"status": "started"}
    wait_for(lambda: len(job.starts()) == 1, "the early setup to start")

    command = [sys.executable, "-c", ENV_DUMP, str(job.root / "e.json"), "0"]
    proc = subprocess.Popen(job.argv(*options, command=command), stdout=subprocess.PIPE, text=True)
    first_beat = wait_for(lambda: (hb := job.heartbeat()) and hb["state"] == "setup" and hb, "a setup heartbeat")
    wait_for(lambda: (hb := job.heartbeat()) and hb["seq"] > first_beat["seq"], "the heartbeat to go on")  # type: ignore[index]
    assert not (job.root / "e.json").exists()
    job.release()
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert len(job.starts()) == 1  # the setup ran once, early
    assert (job.root / "e.json").exists() and job.exit_record()["reason"] == "completed"
    assert "already done" in (job.run / "supervisor.log").read_text()


def test_a_stop_during_the_setup_ends_its_group_and_the_command_never_starts(job: Job) -> None:
    proc = subprocess.Popen(job.argv(*setup_options(job, job.waiter()), command=["true"]), stdout=subprocess.PIPE,
                            text=True)
    wait_for(lambda: job.starts() and (hb := job.heartbeat()) and hb["state"] == "setup", "the setup to start")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 143
    record = job.exit_record()
    assert (record["reason"], record["exit_code"]) == ("terminated", 143)
    assert (job.root / "started.term").exists()  # the setup got SIGTERM
    assert sv.setup_done(job.root / "setup", job.waiter()) is None


def test_a_sigkilled_supervisor_leaves_the_group_recorded_and_stop_ends_it(job: Job) -> None:
    proc = subprocess.Popen(job.argv(command=job.waiter()), stdout=subprocess.PIPE, text=True)
    beat = job.wait_running()
    proc.kill()  # nothing can be forwarded now: the command keeps running in its own group
    proc.communicate(timeout=60)
    child = beat["child_pgid"]
    status = job.status()
    assert status["supervisor_alive"] is False
    assert status["child_alive"] is True
    assert status["child_pgid"] == child

    restart = subprocess.run(job.argv(command=job.waiter()), capture_output=True, text=True, timeout=60)
    assert restart.returncode == 1  # a second copy would write the same checkpoints
    assert one_json_line(restart.stdout)["status"] == "orphaned-child"

    stopped = subprocess.run([sys.executable, str(SUPERVISOR), "stop", "--run-dir", str(job.run), "--grace-s", "10"],
                             capture_output=True, text=True, timeout=60)
    assert stopped.returncode == 0
    assert json.loads(stopped.stdout) == {"signalled": "child-group", "pgid": child, "killed": False}
    assert (job.root / "started.term").read_text() == "SIGTERM"  # it got the chance to checkpoint
    assert job.status()["child_alive"] is False


def test_stop_on_a_live_supervisor_goes_through_it(job: Job) -> None:
    proc = subprocess.Popen(job.argv(command=job.waiter()), stdout=subprocess.PIPE, text=True)
    job.wait_running()
    stopped = subprocess.run([sys.executable, str(SUPERVISOR), "stop", "--run-dir", str(job.run)],
                             capture_output=True, text=True, timeout=60)
    assert json.loads(stopped.stdout) == {"signalled": "supervisor", "pid": proc.pid}
    proc.communicate(timeout=60)
    assert job.exit_record()["reason"] == "terminated"


# --- launcher resolution, bad input, bootstrap ----------------------------------------------------------------


@pytest.mark.parametrize(("options", "expected_prefix"), [
    (["--gpus", "2", "--torchrun"], ["torchrun", "--standalone", "--nproc_per_node=2"]),
    (["--gpus", "8", "--torchrun"], ["torchrun", "--standalone", "--nproc_per_node=8"]),
    (["--gpus", "2"], []),
    (["--gpus", "1", "--torchrun"], ["torchrun", "--standalone", "--nproc_per_node=1"]),
])
def test_dry_run_prints_the_launch_argv(job: Job, options: list[str], expected_prefix: list[str]) -> None:
    env_file = job.root / "job.env"
    env_file.write_text(f"API_TOKEN={SECRET}\n")
    command = ["train.py", "--config", "a b.yaml", "$HOME;rm -rf /"]  # arguments, never a shell string
    proc = subprocess.run(job.argv(*options, "--env-file", str(env_file), "--dry-run", command=command),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["argv"] == [*expected_prefix, *command]
    assert plan["cwd"] == str(job.work)
    assert plan["env"]["BURST_JOB_ID"] == "job-1"
    assert plan["env_file_keys"] == ["API_TOKEN"]
    assert SECRET not in proc.stdout
    assert not job.run.exists()  # a dry run touches nothing


@pytest.mark.parametrize(("argv", "expected"), [
    (["--run-dir", "r", "--job-id", "j", "--attempt", "1", "--checkpoint-dir", "c"], "no command"),
    (["--run-dir", "r", "--job-id", "j", "--attempt", "one", "--checkpoint-dir", "c", "--", "x"], "--attempt"),
    (["--run-dir", "r", "--job-id", "j", "--attempt", "1", "--checkpoint-dir", "c", "--grace-s", "-1", "--", "x"],
     "--grace-s"),
    (["--run-dir", "r", "--job-id", "j", "--attempt", "1", "--checkpoint-dir", "c", "--workdir", "/no/such/dir",
      "--", "x"], "--workdir"),
    (["--run-dir", "r", "--job-id", "j", "--attempt", "1", "--checkpoint-dir", "c", "--metadata-url",
      "169.254.169.254/x", "--", "x"], "--metadata-url"),
    (["--job-id", "j", "--attempt", "1", "--checkpoint-dir", "c", "--", "x"], "--run-dir"),
    (["status", "--run-dir", "/no/such/run"], "--run-dir"),
    (["--run-dir", "r", "--job-id", "j", "--attempt", "1", "--checkpoint-dir", "c", "--setup-json", "pip install",
      "--setup-dir", "s", "--", "x"], "--setup-json: expected a JSON list"),
    (["--run-dir", "r", "--job-id", "j", "--attempt", "1", "--checkpoint-dir", "c", "--setup-json", '["pip"]', "--",
      "x"], "needs --setup-dir"),
    (["setup", "--setup-dir", "s", "--workdir", "."], "--setup-json is required"),
    (["setup", "--setup-dir", "s", "--setup-json", '["pip"]', "--setup-retries", "-1", "--workdir", "."],
     "--setup-retries: expected a whole number, 0 or more"),
])
def test_bad_input_exits_2_with_one_line(tmp_path: Path, argv: list[str], expected: str) -> None:
    proc = subprocess.run([sys.executable, str(SUPERVISOR), *argv], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("supervisor: error:")
    assert expected in lines[0]
    assert not (tmp_path / "r").exists()


def test_a_bad_env_file_line_is_named_without_its_value(job: Job) -> None:
    env_file = job.root / "job.env"
    env_file.write_text(f"GOOD=1\nnot a var {SECRET}\n")
    proc = subprocess.run(job.argv("--env-file", str(env_file), command=["true"]), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert f"{env_file}:2" in proc.stderr
    assert SECRET not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_bootstrap_finds_a_python_and_execs_the_supervisor(job: Job, tmp_path: Path) -> None:
    plan = subprocess.run(["sh", str(BOOTSTRAP), *job.argv("--dry-run", command=["python3", "t.py"])[2:]],
                          env={**os.environ, "BURST_PYTHON": sys.executable}, capture_output=True, text=True,
                          timeout=60)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["argv"] == ["python3", "t.py"]
    which = subprocess.run(["sh", str(BOOTSTRAP), "--which-python"], env={**os.environ, "BURST_PYTHON": sys.executable},
                           capture_output=True, text=True, timeout=60)
    assert (which.returncode, which.stdout.strip()) == (0, sys.executable)  # what the daemon runs from then on

    bare = tmp_path / "bare-bin"  # a PATH with the shell tools bootstrap needs and no Python at all
    bare.mkdir()
    (bare / "dirname").symlink_to("/usr/bin/dirname")
    missing = subprocess.run(["/bin/sh", str(BOOTSTRAP), "status", "--run-dir", "x"],
                             env={"PATH": str(bare)}, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 127
    assert missing.stderr.strip().splitlines() == [
        "bootstrap.sh: error: no Python >= 3.8 found (tried $BURST_PYTHON, python3, python); set BURST_PYTHON"]


def test_importable_helpers_match_the_script(tmp_path: Path) -> None:
    env_file = tmp_path / "e.env"
    env_file.write_text("A=1\n# comment\nB= spaced value \n")
    assert sv.read_env_file(env_file) == {"A": "1", "B": " spaced value "}
    assert sv.launcher_argv(["x.py"], gpus=4, torchrun=True) == ["torchrun", "--standalone", "--nproc_per_node=4",
                                                                  "x.py"]
    assert sv.read_status(tmp_path)["supervisor_alive"] is False

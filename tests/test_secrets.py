"""Secrets and the attack surface, end to end with real processes: planted API keys never appear in any output,
log, event, record or database page; the SSH private key and the database are private (0600); job commands are
argument lists, never shell lines; and an instance whose host key changes after first use is not trusted."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from sqlalchemy import update

from orchestrator.remote import ssh
from state import schema as s
from state.store import Store
from tests.e2e import (
    EnvDaemon,
    burstctl_argv,
    events,
    job,
    preempt,
    sim_instances,
    simcloud,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
SIM_SECRET = "sk-PLANTED-sim-7f3e9a1c0b2d"
AWS_SECRET = "PLANTED/aws+secret/9b8c7d6e5f4a3b2c1d0e"
LAMBDA_SECRET = "PLANTED-lambda-4d5e6f7a8b9c"
PG_SECRET = "PLANTED-pg-2a3b4c5d6e7f"  # the database password, where libpq reads it (never in database_url)
LAMBDA_FILE_SECRET = "PLANTED-lambda-file-5e6f7a8b9c0d"  # the key Lambda is given, in its api_key_file
SECRETS = (SIM_SECRET, AWS_SECRET, LAMBDA_SECRET, PG_SECRET, LAMBDA_FILE_SECRET)
ENV = {"BURSTCTL_SIM_API_KEY": SIM_SECRET, "AWS_SECRET_ACCESS_KEY": AWS_SECRET, "LAMBDA_API_KEY": LAMBDA_SECRET,
       "PGPASSWORD": PG_SECRET}


def run(config: Path, state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(burstctl_argv("--config", str(config), "--state-dir", str(state), *args),
                          env={**os.environ, **ENV}, capture_output=True, text=True, timeout=300)


def job_file(tmp: Path, name: str, command: list[str], local_throughput: float = 0) -> Path:
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    shutil.copy(REPO / "examples" / "trainer.py", work / "trainer.py")
    path = tmp / f"{name}.toml"
    path.write_text("\n".join([
        f'name = "{name}"', f"command = {json.dumps(command)}", 'workdir = "work"', "deadline_hours = 10",
        f"local_throughput = {local_throughput}", "rented_throughput = { H100 = 0.5 }",
        "[checkpoint]", "interval_minutes = 0.02",
    ]) + "\n")
    return path


def trainer(steps: int) -> list[str]:
    return ["python3", "trainer.py", "--steps", str(steps), "--checkpoint-every", "5", "--step-seconds", "0.1"]


def running_instance(state: Path, job_id: str) -> str:
    evs = [e for e in events(state, "attempt.running") if e["job_id"] == job_id]
    return evs[-1]["data"]["instance"] if evs else ""


def test_planted_keys_never_appear_in_any_output_log_event_record_or_database(tmp_path: Path) -> None:
    state = tmp_path / "state"
    outputs: list[str] = []

    def cmd(*args: str) -> subprocess.CompletedProcess[str]:
        r = run(config, state, *args)
        outputs.extend([r.stdout, r.stderr])
        return r

    marker = tmp_path / "pwned"
    with simcloud(tmp_path, env={"BURSTCTL_SIM_API_KEY": SIM_SECRET}) as url:
        # Lambda is pointed at simcloud with the wrong key, read from a key file: its 401s go through every error
        # path too, and the key is in no environment variable the redactor could learn it from.
        key_file = tmp_path / "lambda.key"
        key_file.write_text(LAMBDA_FILE_SECRET + "\n")
        key_file.chmod(0o600)
        config = write_config(tmp_path, url, **{"providers.lambda": {"enabled": True, "base_url": f"{url}/api/v1",
                                                                     "api_key_file": str(key_file)}})
        # 30 s of training: still running when its first checkpoint is home, on a loaded machine too (80 steps had
        # ended and the instance was gone when the test came to preempt it).
        burst = json.loads(cmd("enqueue", str(job_file(tmp_path, "burst", trainer(300))), "--json").stdout)["id"]
        # One argument that a shell would split into a second command, on the cloud and on the local runner.
        hostile = ["python3", "-c", "import sys; print(sys.argv[1:])", f"x; touch {marker}", f"$(touch {marker})"]
        cloud_argv = cmd("enqueue", str(job_file(tmp_path, "argv-cloud", hostile)), "--json")
        local_argv = cmd("enqueue", str(job_file(tmp_path, "argv-local", hostile, local_throughput=1)), "--json")
        assert cloud_argv.returncode == 0 and local_argv.returncode == 0, cloud_argv.stderr + local_argv.stderr
        daemon = EnvDaemon(tmp_path, config, state).start(env=ENV)
        try:
            first = wait_for(lambda: running_instance(state, burst), 90, "the burst to run")
            wait_for(lambda: any(e["job_id"] == burst for e in events(state, "checkpoint.synced")), 60,
                     "a checkpoint to come home")
            preempt(url, first, notice_s=1.0)
            wait_for(lambda: any(e["job_id"] == burst for e in events(state, "job.resumed")), 120, "the resume")
            for name in ("argv-cloud", "argv-local"):
                wait_for(lambda n=name: job(state, n)["state"] in ("done", "failed"), 120, f"{name} to end")
            # Everything on simcloud is confirmed gone; Lambda refused the wrong key, so what runs there is not
            # known: exit 1, naming it (and not the key).
            reverted = cmd("revert-local", "--json")
            report = json.loads(reverted.stdout)
            assert reverted.returncode == 1 and report["left"] == [] and report["unreachable_providers"] == ["lambda"]
            for args in (("status", "--json"), ("events", "--json", "--all"), ("providers", "--json"), ("show", burst),
                         ("show", burst, "--json"), ("budget", "--json")):
                cmd(*args)
        finally:
            assert daemon.stop() == 0
        assert all(i["status"] in ("terminated", "preempted") for i in sim_instances(url))

    assert job(state, "argv-cloud")["state"] == "done" and job(state, "argv-local")["state"] == "done"
    assert not marker.exists(), "an argument was run by a shell"
    assert len(events(state, "instance.preempted")) >= 1

    # Every output, and every byte of every file the run left: events.jsonl, the database (and its WAL), decision
    # records, daemon logs, run logs, simcloud's state.
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p != key_file]
    assert any(p.name == "events.jsonl" for p in files) and any(p.suffix == ".md" for p in files)
    st = Store(f"sqlite:///{state / 'burstctl.db'}")
    try:
        table = json.dumps(st.events(), default=str)
    finally:
        st.close()
    for secret in SECRETS:
        assert not any(secret in o for o in outputs), f"{secret} in a command's output"
        assert secret not in table
        for p in files:
            assert secret.encode() not in p.read_bytes(), f"{secret} in {p.relative_to(tmp_path)}"

    # Private files are private.
    assert (state / "ssh" / "id_ed25519").stat().st_mode & 0o777 == 0o600
    assert (state / "burstctl.db").stat().st_mode & 0o777 == 0o600


def test_a_host_key_that_changes_after_first_use_aborts_the_attempt(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with simcloud(tmp_path, env={"BURSTCTL_SIM_API_KEY": SIM_SECRET}) as url:
        config = write_config(tmp_path, url)
        r = run(config, state, "enqueue", str(job_file(tmp_path, "long", trainer(2000))), "--json")
        job_id = json.loads(r.stdout)["id"]
        daemon = EnvDaemon(tmp_path, config, state).start(env=ENV)
        try:
            instance = wait_for(lambda: running_instance(state, job_id), 90, "the attempt to run")
            # From the daemon's side a changed host key and a changed pin are the same: the machine at the
            # recorded address no longer proves it is the one we launched.
            other = tmp_path / "other_host_key"
            ssh.generate_keypair(other)
            st = Store(f"sqlite:///{state / 'burstctl.db'}")
            try:
                with st.tx() as c:
                    c.execute(update(s.instances).where(s.instances.c.id == instance)
                              .values(host_key=Path(f"{other}.pub").read_text().strip()))
            finally:
                st.close()
            wait_for(lambda: [e for e in events(state, "attempt.host_key_mismatch")], 30, "the mismatch")
            wait_for(lambda: [e for e in events(state, "instance.terminated") if e["data"]["instance"] == instance],
                     30, "the instance to be terminated")
        finally:
            daemon.kill(signal.SIGTERM)
        gone = {i["id"]: i["status"] for i in sim_instances(url)}
    assert gone[instance] == "terminated"
    stopped = [e for e in events(state, "attempt.stopping") if e["data"]["reason"] == "host key changed"]
    assert stopped and stopped[0]["data"]["outcome"] == "aborted"
    # never trusted: no step ran against the changed key after the mismatch (no sync, no restart of the trainer)
    mismatch_id = events(state, "attempt.host_key_mismatch")[0]["id"]
    assert not [e for e in events(state, "checkpoint.synced") if e["id"] > mismatch_id
                and e["attempt_id"] == stopped[0]["attempt_id"]]


# A key pasted into a `*_env` field by mistake once came back in `providers`' table ("$sk-live-...") and in "set the
# environment variable sk-live-...". Every `*_env` value must be a variable's name, and the error never quotes it.
PASTED_KEY = "sk-live-REALSECRET99"
ENV_NAME_EXPECTED = ("expected the NAME of an environment variable (letters, digits and '_', not starting with a "
                     "digit) that holds the secret, not the secret itself")


@pytest.mark.parametrize("section", ["sim", "lambda"])
@pytest.mark.parametrize("value", [PASTED_KEY, "9" + PASTED_KEY.replace("-", "_"), "KEY WITH SPACES", ""],
                         ids=["pasted-key", "leading-digit", "spaces", "empty"])
def test_an_api_key_env_that_is_not_a_variable_name_is_bad_input_and_never_echoed(burstctl_here, tmp_path: Path,
                                                                                   section: str, value: str) -> None:
    config = tmp_path / "k.toml"
    config.write_text(f'[providers.{section}]\napi_key_env = "{value}"\n')
    for args in (("providers",), ("budget",)):  # in this process: 16 interpreters' start-up a CI run
        r = burstctl_here("--config", str(config), "--state-dir", str(tmp_path / "state"), *args)
        assert (r.returncode, r.stdout) == (2, "")
        assert r.stderr == f"burstctl: error: {config}: field 'providers.{section}.api_key_env': {ENV_NAME_EXPECTED}\n"


# A key shaped as keys are that is also a valid variable name: refused as such in the config, so here too.
NAME_SHAPED_KEY = "sk_live_REALSECRET99abcdef"


@pytest.mark.parametrize("key", [PASTED_KEY, NAME_SHAPED_KEY], ids=["not-a-name", "also-a-valid-name"])
def test_simcloud_serve_rejects_a_key_given_as_its_api_key_env_without_echoing_it(tmp_path: Path, key: str) -> None:
    r = subprocess.run(burstctl_argv("--state-dir", str(tmp_path / "state"), "simcloud", "serve", "--api-key-env",
                                     key), capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == f"burstctl: error: field '--api-key-env': {ENV_NAME_EXPECTED}\n"


def test_a_valid_api_key_env_name_is_shown_as_the_variable_it_names(tmp_path: Path) -> None:
    config = tmp_path / "k.toml"
    config.write_text('[providers.sim]\napi_key_env = "_MY_SIM_KEY_2"\n')
    r = run(config, tmp_path / "state", "providers", "--json")
    sim = next(p for p in json.loads(r.stdout)["providers"] if p["name"] == "sim")
    assert sim["credential"] == "$_MY_SIM_KEY_2" and sim["credential_present"] is False


def test_a_key_file_is_shown_as_the_file_and_a_missing_one_is_named_as_the_problem(tmp_path: Path) -> None:
    config = tmp_path / "k.toml"
    missing = tmp_path / "nowhere" / "sim.key"
    config.write_text(f'[providers.sim]\napi_key_file = "{missing}"\n')
    r = run(config, tmp_path / "state", "providers", "--json")
    sim = next(p for p in json.loads(r.stdout)["providers"] if p["name"] == "sim")
    assert sim["credential"] == f"file {missing}" and sim["credential_present"] is False
    assert f"cannot read the API key file {missing}: No such file or directory" in json.dumps(sim)


class _EchoingCloud(http.server.BaseHTTPRequestHandler):
    """A Lambda-style API that answers /instance-types with the bearer key it was sent inside the GPU's name, the
    type's name and a region's: what a buggy or hostile endpoint could do."""

    def do_GET(self) -> None:
        key = self.headers.get("Authorization", "").removeprefix("Bearer ")
        name = f"gpu_1x_{key}"
        body = json.dumps({"data": {name: {
            "instance_type": {"name": name, "description": f"1x H100 {key}", "gpu_description": f"H100 {key} (80 GB)",
                              "price_cents_per_hour": 249,
                              "specs": {"vcpus": 26, "memory_gib": 200, "storage_gib": 512, "gpus": 1}},
            "regions_with_capacity_available": [{"name": f"us-{key}", "description": key}]}}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_provider_that_echoes_the_key_in_its_offers_has_it_redacted_in_the_listing(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EchoingCloud)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = tmp_path / "k.toml"
        config.write_text("[providers.sim]\nenabled = false\n[providers.lambda]\nenabled = true\n"
                          f'base_url = "http://127.0.0.1:{server.server_address[1]}/api/v1"\n')
        for args in (("providers", "--json"), ("providers",)):
            r = run(config, tmp_path / "state", *args)
            assert r.returncode == 0, r.stderr
            assert LAMBDA_SECRET not in r.stdout + r.stderr and "gpu_1x_***" in r.stdout, r.stdout
    finally:
        server.shutdown()
        server.server_close()


def test_a_key_a_provider_echoed_into_a_decision_is_redacted_in_its_record(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # An offer's or a refusal's words are the provider's, and reach the decision record's reasons.
    from orchestrator.app import App
    from orchestrator.jobspec import load_job
    from orchestrator.queue import enqueue, facts, record_decision
    from tests.conftest import write_job

    monkeypatch.setenv("LAMBDA_API_KEY", LAMBDA_SECRET)  # the key the config's Lambda section names
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "echoed", local_throughput=0))
    d = {**app.store.get_job(job_id)["decision"]}
    d["reasons"] = [*d["reasons"], f"no capacity for gpu_1x_{LAMBDA_SECRET} (tried: us-{LAMBDA_SECRET})"]
    spec, deadline_at = load_job(tmp_path / "echoed.toml")
    record = record_decision(app, facts(spec, deadline_at, 0.0, app.config), d, 0.0, job_id)
    text = record.read_text()
    assert LAMBDA_SECRET not in text and "gpu_1x_***" in text
    app.close()

"""A job's `pass_env`: secrets for the trainer, by name. The job gets the values of the named variables of the
daemon's environment, locally and on a rented instance, and the values are never stored or shown: not in the
database, events, events.jsonl, decision records, logs, errors or any --json output."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, insert, select

from orchestrator.app import App
from orchestrator.events import REDACTED, Redactor
from orchestrator.lifecycle import passenv
from orchestrator.lifecycle.cloud_steps import write_remote_env_file
from orchestrator.lifecycle.reconcile import Reconciler
from orchestrator.queue import enqueue as enqueue_in
from orchestrator.remote.ssh import MemoryHostKeyTrust, Target, connect, generate_keypair, run
from providers.simcloud.ssh_backend import SshBackend, openssh_available
from runbooks import supervisor
from state import schema as s
from tests.e2e import EnvDaemon, burstctl_argv, cli, enqueue, events, job, simcloud, wait_for, write_config

PASSED = "PLANTED-pass-env-wandb-3c9d1e7f5a2b"  # the secret the daemon holds and the job must see
PASSED_HASH = hashlib.sha256(PASSED.encode()).hexdigest()
VAR = "E2E_WANDB_API_KEY"
ABSENT = "E2E_HF_TOKEN_NOT_SET"  # listed by a job, set nowhere


def spec_file(tmp: Path, name: str, *, pass_env: object = None, extra: str = "", command: list[str] | None = None,
              local_throughput: float = 0, workdir: str = "work") -> Path:
    (tmp / workdir).mkdir(exist_ok=True)
    lines = [f'name = "{name}"', f"command = {json.dumps(command or ['true'])}", f'workdir = "{workdir}"',
             "deadline_hours = 10", f"local_throughput = {local_throughput}", "rented_throughput = { H100 = 0.5 }"]
    if pass_env is not None:
        lines.append(f"pass_env = {json.dumps(pass_env)}")
    path = tmp / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def decide(path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(burstctl_argv("--state-dir", str(path.parent / "state"), "decide", str(path), "--json"),
                          capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


# --- the job file --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "extra", "field", "words"), [
    (["1WANDB"], "", "pass_env.0", "expected the NAME of an environment variable"),
    (["WANDB KEY"], "", "pass_env.0", "'WANDB KEY' is not a variable name: expected letters, digits and '_' (not "
                                      "starting with a digit), such as 'WANDB_KEY'"),  # a typo, not a secret
    (["HF-TOKEN"], "", "pass_env.0", "such as 'HF_TOKEN'"),
    (["OK", "sk-live-0123456789"], "", "pass_env.1", "expected the NAME of an environment variable"),
    (["WANDB\nKEY"], "", "pass_env.0", "expected the NAME of an environment variable"),
    ("HF_TOKEN", "", "pass_env", "expected a list, got a string"),
    (["PYTHONPATH"], "", "pass_env", "is set by burstctl"),
    (["BURST_RESUME_FROM"], "", "pass_env", "is set by burstctl"),
    (["BURST_WORK_UNITS"], "", "pass_env", "is set by burstctl"),
    ([], '[env]\nBURST_CHECKPOINT_DIR = "/tmp/elsewhere"\n', "env", "is set by burstctl"),
    ([], '[env]\nPYTHONPATH = "/nowhere"\n', "env", "is set by burstctl"),
    (["HF_TOKEN"], '[env]\nHF_TOKEN = "x"\n', "pass_env", "also in [env]"),
])
def test_a_bad_pass_env_exits_2_with_one_line_naming_the_file_and_field(
        tmp_path: Path, value: object, extra: str, field: str, words: str) -> None:
    path = spec_file(tmp_path, "bad", pass_env=value, extra=extra)
    r = decide(path)
    assert r.returncode == 2, r.stdout + r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and str(path) in line and f"field '{field}'" in line and words in line, line
    assert "sk-live" not in line  # what was given where a name belongs is never quoted back
    assert not (tmp_path / "state" / "decisions").exists() or not any((tmp_path / "state" / "decisions").iterdir())


def test_a_secret_pasted_in_place_of_its_name_is_refused_without_being_quoted(tmp_path: Path) -> None:
    token = "hf_PastedTokenLooksLikeAName0123456789"  # letters, digits and '_': a valid name, but a value here
    path = spec_file(tmp_path, "pasted", pass_env=["WANDB_API_KEY", token])
    r = decide(path, env={"HF_TOKEN": token})
    assert r.returncode == 2
    assert "field 'pass_env.1'" in r.stderr and "value of an environment variable" in r.stderr
    assert token not in r.stdout + r.stderr


@pytest.mark.parametrize(("name", "value"), [
    ("HF_TOKEN", "PlantedEnvSecret42"), ("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567"),
    ("DB_PASSWORD", "PlantedEnvSecret42"), ("AWS_SECRET_ACCESS_KEY", "PlantedEnvSecret42"),
    ("LOGIN", "ghp_PlantedEnvSecret42abcdef"), ("HUB", "hf_PlantedEnvSecret42abcdefgh"),
], ids=["a-token-s-name", "an-api-key-s-name", "a-password-s-name", "a-secret-s-name", "a-github-token-s-shape",
        "a-hugging-face-token-s-shape"])
def test_a_secret_written_in_env_is_refused_without_being_quoted_and_nothing_is_recorded(
        tmp_path: Path, name: str, value: str) -> None:
    # [env] is stored in plain text (the database, `show --json`, the decision's run): a secret there reached them.
    path = spec_file(tmp_path, "inline", extra=f'[env]\n{name} = "{value}"\n')
    r = decide(path)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr.startswith(f"burstctl: error: {path}: field 'env.{name}': '{name}' looks like a secret")
    assert "name the variable in pass_env instead" in r.stderr and value not in r.stderr
    assert not (tmp_path / "state" / "decisions").exists() or not any((tmp_path / "state" / "decisions").iterdir())


@pytest.mark.parametrize("entry", ['TOKENIZERS_PARALLELISM = "false"', 'MAX_TOKENS = "512"', 'HF_TOKEN = ""',
                                   'MODEL = "Qwen/Qwen2.5-7B-Instruct"'])
def test_env_values_that_are_no_secret_are_taken(tmp_path: Path, entry: str) -> None:
    r = decide(spec_file(tmp_path, "plain", extra=f"[env]\n{entry}\n"))
    assert r.returncode == 0, r.stderr


def test_names_are_kept_once_and_enqueue_stores_names_never_values(tmp_path: Path) -> None:
    state = tmp_path / "state"
    config = write_config(tmp_path, None)
    path = spec_file(tmp_path, "ok", pass_env=[VAR, "HF_TOKEN", VAR])
    env = {**os.environ, VAR: PASSED}  # set in the enqueuing shell too: still only the name is kept
    r = subprocess.run(burstctl_argv("--config", str(config), "--state-dir", str(state), "enqueue", str(path),
                                     "--json"), capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    shown = cli(config, state, "show", "ok", "--json")
    assert json.loads(shown.stdout)["spec"]["pass_env"] == [VAR, "HF_TOKEN"]
    assert PASSED not in r.stdout + shown.stdout
    assert not any(PASSED.encode() in p.read_bytes() for p in state.rglob("*") if p.is_file())


# --- the daemon's side ---------------------------------------------------------------------------------------
def test_values_are_read_from_the_daemons_environment_and_then_scrubbed_from_what_it_writes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"pass_env": [VAR, "E2E_EMPTY"]}
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setenv("E2E_EMPTY", "")
    assert passenv.unusable(spec) == (f"pass_env: {VAR} is not set in the daemon's environment; set it where the "
                                      "daemon runs (under systemd: ~/.config/burstctl/env) and restart the daemon")
    redactor = Redactor([])
    with pytest.raises(passenv.UnusablePassEnv, match=VAR):
        passenv.values(spec, redactor)
    monkeypatch.setenv(VAR, "two\nlines")
    assert "several lines" in (passenv.unusable(spec) or "") and "two" not in (passenv.unusable(spec) or "")
    monkeypatch.setenv(VAR, PASSED)
    assert passenv.unusable(spec) is None  # an empty value counts as set
    assert passenv.values(spec, redactor) == {VAR: PASSED, "E2E_EMPTY": ""}
    assert redactor({"error": f"trainer said {PASSED}"}) == {"error": f"trainer said {REDACTED}"}


MODES = [pytest.param("openssh", marks=pytest.mark.skipif(not openssh_available(), reason="sshd not installed")),
         "paramiko"]


@pytest.fixture(params=MODES)
def instance(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    backend = SshBackend(tmp_path / "simcloud", prefer=request.param)
    key = tmp_path / "keys" / "id_ed25519"
    generate_keypair(key)
    ep = backend.start("i-env", Path(f"{key}.pub").read_text())
    yield Target(host=ep.host, port=ep.port, user=ep.user, key_path=key, host_key=ep.host_key, instance_id="i-env")
    backend.close()


@pytest.mark.slow
def test_the_instances_env_file_is_private_from_its_creation_and_read_back_exactly(
        instance: Target, tmp_path: Path) -> None:
    with connect(instance, trust=MemoryHostKeyTrust()) as conn:
        home = run(conn, ["sh", "-c", "umask 022 && mkdir -p run && pwd"]).stdout.strip()
        path = Path(home) / "run" / "job.env"
        path.write_text("OLD=loose\n")
        path.chmod(0o644)  # a file left by an earlier start, readable by all: replaced, never reused
        env = {"PYTHONPATH": "/x/runbooks", VAR: PASSED + "=with an equals sign"}
        write_remote_env_file(conn, str(path), env)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert supervisor.read_env_file(path) == env
    assert sorted(p.name for p in path.parent.iterdir()) == ["job.env"]  # no temporary left beside it


# --- end to end: simcloud and the local runner, one daemon ------------------------------------------------------
# The job's report, in a checkpoint (what comes home from an instance): the hash of what it got, and the mode of
# its run's env file (in the run dir, beside $BURST_METRICS_FILE).
SEE = """
import hashlib, json, os, stat, sys
import burst_checkpoint
v = os.environ.get(sys.argv[1])
env_file = os.path.join(os.path.dirname(os.environ["BURST_METRICS_FILE"]), "job.env")
seen = {"sha256": hashlib.sha256(v.encode()).hexdigest() if v is not None else None,
        "env_file_mode": stat.S_IMODE(os.stat(env_file).st_mode)}
burst_checkpoint.write_checkpoint(os.environ["BURST_CHECKPOINT_DIR"], "step-00000001",
                                  {"seen.json": json.dumps(seen).encode()})
"""


def seen(state: Path, job_id: str) -> dict[str, object]:
    return dict(json.loads((state / "checkpoints" / job_id / "step-00000001" / "seen.json").read_text()))


@pytest.mark.slow
def test_a_passed_secret_reaches_the_job_locally_and_on_an_instance_and_nothing_else(tmp_path: Path) -> None:
    state = tmp_path / "state"
    outputs: list[str] = []

    def cmd(*args: str) -> subprocess.CompletedProcess[str]:
        r = cli(config, state, *args)
        outputs.extend([r.stdout, r.stderr])
        return r

    with simcloud(tmp_path) as url:  # simcloud's machines start every command with a clean environment
        config = write_config(tmp_path, url)
        cloud = enqueue(config, state, spec_file(tmp_path, "cloud", pass_env=[VAR],
                                                 command=["python3", "-c", SEE, VAR]))
        local = enqueue(config, state, spec_file(tmp_path, "local", pass_env=[VAR], local_throughput=1,
                                                 command=["python3", "-c", SEE, VAR]))
        waits = enqueue(config, state, spec_file(tmp_path, "waits", pass_env=[VAR, ABSENT]))
        # Only the daemon holds the secret: not this process, not simcloud, not the shell that enqueued.
        assert VAR not in os.environ
        daemon = EnvDaemon(tmp_path, config, state).start(env={VAR: PASSED})
        try:
            for ref in (cloud, local):
                wait_for(lambda r=ref: job(state, r)["state"] in ("done", "failed"), 90, f"job {ref} to end")
            wait_for(lambda: ABSENT in (job(state, waits)["reason"] or ""), 30, "the waiting job's reason")
            for args in (("show", cloud, "--json"), ("show", local, "--json"), ("show", waits, "--json"),
                         ("show", cloud), ("list", "--json"), ("list",), ("events", "--json", "--all"),
                         ("status", "--json")):
                assert cmd(*args).returncode == 0, args
        finally:
            assert daemon.stop() == 0

    assert job(state, cloud)["state"] == "done" and job(state, local)["state"] == "done"
    # The job saw the value (it reports its hash), on the instance and locally; on the instance the value was in the
    # run's env file, which only its owner could read.
    assert seen(state, cloud) == {"sha256": PASSED_HASH, "env_file_mode": 0o600}
    assert seen(state, local) == {"sha256": PASSED_HASH, "env_file_mode": 0o600}

    # A variable the daemon does not have: the job waits, naming it, and nothing was launched or failed for it.
    w = job(state, waits)
    assert w["state"] == "queued" and f"pass_env: {ABSENT} is not set in the daemon's environment" in w["reason"]
    assert not [e for e in events(state, "attempt.") if e["job_id"] == waits]
    assert [e for e in events(state, "job.waiting") if e["job_id"] == waits and ABSENT in e["data"]["reason"]]
    assert VAR in json.dumps(json.loads(outputs[0])["spec"]["pass_env"])  # the names are shown

    # The value is nowhere else: every output, every file of the state directory (the database and its WAL,
    # events.jsonl, decision records, run logs and env files), the events table, the daemon's log.
    files = [p for p in state.rglob("*") if p.is_file()] + list(tmp_path.glob("daemon-*.log"))
    names = {p.name for p in files}
    assert {"burstctl.db", "events.jsonl", "daemon-1.log", "job.env"} <= names
    assert any(p.suffix == ".md" for p in files)
    assert not any(PASSED in o for o in outputs), "the secret in a command's output"
    assert PASSED not in json.dumps(events(state), default=str)
    for p in files:
        assert PASSED.encode() not in p.read_bytes(), f"the secret in {p.relative_to(tmp_path)}"


@pytest.mark.slow
def test_a_local_attempt_restarted_without_the_variable_goes_back_to_the_queue_and_waits_saying_which(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VAR, raising=False)
    state = tmp_path / "state"
    app = App(state_dir_override=str(state))
    try:
        job_id, _, _ = enqueue_in(app, spec_file(tmp_path, "restart", pass_env=[VAR], local_throughput=1,
                                                 command=["python3", "-c", SEE, VAR]))
        # An attempt a daemon that had the variable wrote before it died; this one has not got it.
        with app.store.tx() as conn:
            conn.execute(insert(s.attempts).values(
                id=f"{job_id}-a1", job_id=job_id, n=1, where="local", state="intent", provider="local",
                instance_type="local", market=None, idempotency_key=None, info={}, created_at=time.time()))
            app.store.update_job(job_id, conn, state="running", reason="running locally")
        rec = Reconciler(app, {}, cloud=None)
        rec.tick()
        rec.tick()
        j = app.store.get_job(job_id)
        assert j is not None and j["state"] == "queued", j
        assert j["reason"].startswith(f"pass_env: {VAR} is not set in the daemon's environment")
        with app.store.engine.connect() as c:
            rows = c.execute(select(s.attempts.c.state).where(s.attempts.c.job_id == job_id)).scalars().all()
        assert rows == ["aborted"]  # no supervisor was started, and no new attempt while it waits
        assert not (state / "runs" / f"{job_id}-a1" / "supervisor.pid").exists()

        monkeypatch.setenv(VAR, PASSED)  # the daemon restarted with it
        rec = Reconciler(app, {}, cloud=None)
        deadline = time.monotonic() + 30
        while (app.store.get_job(job_id) or {})["state"] != "done" and time.monotonic() < deadline:
            rec.tick()
            time.sleep(0.2)
        assert seen(state, job_id) == {"sha256": PASSED_HASH, "env_file_mode": 0o600}
        with app.store.engine.connect() as c:
            assert c.execute(select(func.count()).select_from(s.attempts)
                             .where(s.attempts.c.job_id == job_id)).scalar() == 2
        assert PASSED not in json.dumps(app.store.events(), default=str)
        assert not any(PASSED.encode() in p.read_bytes() for p in state.rglob("*") if p.is_file())
    finally:
        app.close()


@pytest.mark.parametrize("key_var", ["BURSTCTL_SIM_API_KEY",  # the sim provider's default api_key_env
                                     "AWS_SECRET_ACCESS_KEY"])  # EC2's, which boto3 reads from the environment
def test_a_local_job_does_not_get_the_secrets_burstctl_holds_unless_it_names_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key_var: str) -> None:
    monkeypatch.setenv(key_var, PASSED)
    state = tmp_path / "state"
    app = App(state_dir_override=str(state))
    try:
        quiet, named = (enqueue_in(app, spec_file(tmp_path, name, pass_env=pass_env, local_throughput=1,
                                                  command=["python3", "-c", SEE, key_var]))[0]
                        for name, pass_env in (("quiet", None), ("named", [key_var])))
        rec = Reconciler(app, {}, cloud=None)
        deadline = time.monotonic() + 60
        while {app.store.get_job(j)["state"] for j in (quiet, named)} != {"done"} and time.monotonic() < deadline:
            rec.tick()
            time.sleep(0.2)
        assert seen(state, quiet)["sha256"] is None
        assert seen(state, named)["sha256"] == PASSED_HASH
    finally:
        app.close()

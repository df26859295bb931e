"""Notices: the daemon tells a webhook or a command about the events a person should hear of. A notifier starts from
the newest event, sends what matches in order, never twice and none skipped; one that fails is tried again later,
said once, and never with its URL; a restarted daemon carries on from where it was."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from orchestrator.app import App
from orchestrator.cli.status import status_data
from orchestrator.config import EVENT_FAMILIES
from orchestrator.notify import KEY_PREFIX, notice_text, notice_type, notify_due
from orchestrator.notify import SENDER_ENVIRONMENT as SENDER_ENV
from orchestrator.queue import enqueue
from tests.conftest import REPO, assert_config_refused, write_job


@pytest.fixture
def burstctl(burstctl_in_process):  # the CLI in this process; a daemon's in its own (`burstctl_subprocess`)
    return burstctl_in_process


TOKEN = "T0KEN-9f8e7d6c5b4a"  # the secret part of a webhook URL, as Slack's and ntfy's carry one
HOOK_ENV = "BURSTCTL_TEST_HOOK_URL"


class Webhook:
    """A real HTTP server on loopback that records each POST and answers with the next of `statuses` (then 200)."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self.statuses: list[int] = []
        self.delay_s = 0.0
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                time.sleep(hook.delay_s)
                hook.received.append({"path": self.path, "headers": dict(self.headers), "body": body})
                self.send_response(hook.statuses.pop(0) if hook.statuses else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/{TOKEN}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def notices(self) -> list[dict]:
        return [json.loads(r["body"]) for r in self.received]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook(monkeypatch: pytest.MonkeyPatch) -> Iterator[Webhook]:
    hook = Webhook()
    monkeypatch.setenv(HOOK_ENV, hook.url)
    yield hook
    hook.close()


def _app(tmp_path: Path, notify: str) -> App:
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text(notify)
    return App(config_path=str(cfg), state_dir_override=str(tmp_path / "state"))


def _webhook_app(tmp_path: Path, extra: str = "", database_url: str | None = None) -> App:
    state = f'[state]\ndatabase_url = "{database_url}"\n\n' if database_url else ""
    return _app(tmp_path, f'{state}[[notify]]\nname = "phone"\nurl_env = "{HOOK_ENV}"\n{extra}')


def _job(app: App, tmp_path: Path, name: str = "nightly") -> str:
    (tmp_path / "work").mkdir(exist_ok=True)
    path = write_job(tmp_path, name, command=["true"], workdir="work", deadline_hours=12, local_throughput=1.0)
    return enqueue(app, path)[0]


def _events(app: App, prefix: str = "notify.") -> list[tuple[str, dict]]:
    return [(e["type"], e["data"]) for e in app.store.events(type_prefix=prefix)]


def _nowhere_but_the_environment(app: App, secret: str) -> None:
    """The secret is in no event, no line of events.jsonl and no setting."""
    assert secret not in json.dumps([e["data"] for e in app.store.events()])
    assert secret not in (app.config.state_dir / "events.jsonl").read_text()
    assert secret not in json.dumps(app.store.settings_with_prefix(""))


def test_a_new_notifier_starts_from_the_newest_event_and_sends_what_needs_a_person_in_order(
        tmp_path: Path, webhook: Webhook, db_url: str) -> None:
    app = _webhook_app(tmp_path, database_url=db_url)
    job_id = _job(app, tmp_path)
    app.events.emit("job.done", job_id=job_id, reason="completed", where="local")  # before the notifier was there
    t = time.time()
    assert notify_due(app, t) == 0 and webhook.received == []
    assert [ty for ty, _ in _events(app)] == ["notify.armed"]

    app.events.emit("job.redecided", job_id=job_id, previous="queued", state="awaiting_approval")
    app.events.emit("job.retried", job_id=job_id, previous="failed", state="queued")  # needs no one
    app.events.emit("attempt.running", job_id=job_id)  # not a notice by default
    app.events.emit("job.done", job_id=job_id, reason="completed", where="local")
    app.events.emit("schedule.missed", job_file=str(tmp_path / "nightly.toml"), slot_at=t - 3600)
    assert notify_due(app, t + 1) == 3
    sent = webhook.notices()
    assert [n["type"] for n in sent] == ["job.awaiting_approval", "job.done", "schedule.missed"]
    assert [n["event"] for n in sent] == ["job.redecided", "job.done", "schedule.missed"]
    assert sent[0]["text"] == "burstctl: nightly waits for approval (`burstctl approve`)"
    assert sent[1]["text"] == "burstctl: nightly done" and sent[1]["job"]["id"] == job_id
    assert sent[1]["data"] == {"reason": "completed", "where": "local"}
    assert sent[2]["text"] == "burstctl: nightly.toml: schedule missed a slot" and sent[2]["job"] is None
    assert sent[0]["id"] < sent[1]["id"] < sent[2]["id"]  # event ids: a receiver tells a notice sent twice
    headers = webhook.received[1]["headers"]
    assert headers["X-Burstctl-Notice"] == "job.done" and headers["X-Burstctl-Event-Id"] == str(sent[1]["id"])
    assert notify_due(app, t + 2) == 0 and len(webhook.received) == 3  # nothing twice

    # Another daemon on the same state (a restart) carries on from there.
    app.close()
    again = _webhook_app(tmp_path, database_url=db_url)
    again.events.emit("job.failed", job_id=job_id, reason="exit 1")
    assert notify_due(again, t + 3) == 1
    assert webhook.notices()[-1]["text"] == "burstctl: nightly failed: exit 1"
    again.close()


def test_an_event_that_commits_after_a_later_one_was_sent_is_sent_too(tmp_path: Path, webhook: Webhook,
                                                                      postgres_server) -> None:
    # On PostgreSQL ids are handed out before commit: a slow transaction's event can become visible after one with
    # a higher id was already delivered. Reading only past the last id delivered would skip it for good.
    app = _webhook_app(tmp_path, database_url=postgres_server.new_database())
    notify_due(app)
    with app.store.tx() as conn:
        slow = app.events.emit("job.failed", conn=conn, reason="slow transaction")
        fast = app.events.emit("job.done", reason="completed")
        assert fast > slow
        assert notify_due(app) == 1  # only the committed one is visible yet
    assert notify_due(app) == 1
    assert [n["id"] for n in webhook.notices()] == [fast, slow]
    assert notify_due(app, time.time() + 60) == 0  # and neither again once the look-back has passed
    app.close()


def test_a_finished_job_s_notice_says_what_it_cost_in_the_cloud(tmp_path: Path, webhook: Webhook) -> None:
    app = _webhook_app(tmp_path)
    job_id = _job(app, tmp_path)
    t = time.time()
    charge = app.store.open_charge({"month": "2030-01", "job_id": job_id, "attempt_id": "a-1", "provider": "sim",
                                    "instance_id": "i-1", "instance_type": "gpu_1x_h100", "market": "spot",
                                    "rate_usd_h": 1.1, "started_at": t - 3600})
    app.store.close_charge(charge, ended_at=t, billed_seconds=3600, cost_usd=1.1)
    notify_due(app, t)
    app.events.emit("job.done", job_id=job_id, reason="completed", where="cloud")
    notify_due(app, t + 1)
    assert webhook.notices()[0]["text"] == "burstctl: nightly done (cloud $1.10)"
    app.close()


@pytest.mark.parametrize(("extra", "content_type", "read"), [
    ('format = "slack"', "application/json", json.loads),
    ('format = "text"', "text/plain", lambda body: {"text": body.decode()}),
])
def test_a_webhook_s_format_is_its_body(tmp_path: Path, webhook: Webhook, extra: str, content_type: str,
                                        read) -> None:
    app = _webhook_app(tmp_path, extra)
    notify_due(app)
    app.events.emit("daemon.lock_lost")
    assert notify_due(app) == 1
    (got,) = webhook.received
    assert read(got["body"]) == {"text": "burstctl: daemon lost its database lock and stopped"}
    assert got["headers"]["Content-Type"].startswith(content_type)
    app.close()


def test_events_chooses_the_notices_with_wildcards_and_never_a_notifier_s_own(tmp_path: Path,
                                                                             webhook: Webhook) -> None:
    app = _webhook_app(tmp_path, 'events = ["instance.*", "*.behind_schedule"]')
    notify_due(app)
    for ty in ("job.done", "instance.preempted", "job.behind_schedule", "notify.failed", "instance.terminated"):
        app.events.emit(ty)
    assert notify_due(app) == 3
    assert [n["type"] for n in webhook.notices()] == ["instance.preempted", "job.behind_schedule",
                                                      "instance.terminated"]
    app.close()


def test_a_failing_webhook_is_tried_again_later_said_once_and_the_notices_keep_their_order(
        tmp_path: Path, webhook: Webhook) -> None:
    app = _webhook_app(tmp_path)
    job_id = _job(app, tmp_path)
    t = time.time()
    notify_due(app, t)
    app.events.emit("job.done", job_id=job_id, reason="completed")
    app.events.emit("job.failed", job_id=job_id, reason="exit 3")
    webhook.statuses = [503, 503]

    assert notify_due(app, t + 1) == 0
    (failed,) = [d for ty, d in _events(app) if ty == "notify.failed"]
    assert failed["notifier"] == "phone" and failed["error"] == "the webhook answered HTTP 503"
    (row,) = status_data(app)["notify"]
    assert row["failing_since"] == t + 1 and row["next_try_in_s"] == pytest.approx(5 - (time.time() - t - 1), 0.5)
    assert notify_due(app, t + 2) == 0 and len(webhook.received) == 1  # not before its time
    assert notify_due(app, t + 7) == 0 and len(webhook.received) == 2  # 5 s later: 503 again, not said again
    assert [ty for ty, _ in _events(app)].count("notify.failed") == 1
    assert notify_due(app, t + 8) == 0 and len(webhook.received) == 2  # the wait doubled: 10 s from t + 7
    assert notify_due(app, t + 18) == 2
    assert [n["type"] for n in webhook.notices()] == ["job.done"] * 3 + ["job.failed"]
    (recovered,) = [d for ty, d in _events(app) if ty == "notify.recovered"]
    assert recovered == {"notifier": "phone", "after_tries": 3, "failing_for_s": 17.0}
    (row,) = status_data(app)["notify"]
    assert row["failing_since"] is None and row["delivered"] == 2
    app.close()


def test_many_notices_due_at_once_go_as_one_digest_that_counts_them_and_lists_each(tmp_path: Path,
                                                                                   webhook: Webhook) -> None:
    app = _webhook_app(tmp_path)  # digest_over = 5 by default
    job_id = _job(app, tmp_path)
    notify_due(app)
    ids = [app.events.emit("job.done" if i % 3 else "job.failed", job_id=job_id, reason=f"exit {i}")
           for i in range(30)]
    app.events.emit("attempt.running", job_id=job_id)  # not a notice: not in the digest
    assert notify_due(app) == 30
    (got,) = webhook.received
    assert got["headers"]["X-Burstctl-Notice"] == "digest" and got["headers"]["X-Burstctl-Event-Id"] == str(ids[-1])
    body = json.loads(got["body"])
    assert body["type"] == "digest" and body["data"] == {"count": 30, "types": {"job.done": 20, "job.failed": 10}}
    assert [n["id"] for n in body["notices"]] == ids  # each notice, in order, with its event's id
    lines = body["text"].splitlines()
    assert lines[0] == "burstctl: 30 notices (20 job.done, 10 job.failed)"
    assert lines[1:3] == ["- nightly failed: exit 0", "- nightly done: exit 1"]
    assert len(lines) == 1 + 20 + 1 and lines[-1] == "- and 10 more (`burstctl events`)"
    assert status_data(app)["notify"][0]["delivered"] == 30

    # As many as digest_over, or fewer, still go one by one.
    for _ in range(5):
        app.events.emit("job.done", job_id=job_id, reason="completed")
    assert notify_due(app) == 5 and [n["type"] for n in webhook.notices()[1:]] == ["job.done"] * 5
    app.close()


def test_the_backlog_of_a_webhook_that_was_down_comes_as_one_digest(tmp_path: Path, webhook: Webhook) -> None:
    app = _webhook_app(tmp_path, "digest_over = 2")
    t = time.time()
    notify_due(app, t)
    first = app.events.emit("job.failed", reason="exit 1")
    webhook.statuses = [503]
    assert notify_due(app, t + 1) == 0
    (failed,) = [d for ty, d in _events(app) if ty == "notify.failed"]
    assert failed["event_id"] == first
    for _ in range(3):
        app.events.emit("job.done", reason="completed")
    assert notify_due(app, t + 7) == 4
    assert len(webhook.received) == 2 and webhook.notices()[1]["data"]["count"] == 4
    assert [ty for ty, _ in _events(app)][-1] == "notify.recovered"
    app.close()


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_a_signed_webhook_carries_the_hmac_of_its_exact_body(tmp_path: Path, webhook: Webhook,
                                                             monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    secret = "whsec-0123456789abcdef"
    monkeypatch.setenv("BURSTCTL_TEST_HOOK_SECRET", secret)
    app = _webhook_app(tmp_path, f'format = "{fmt}"\nsecret_env = "BURSTCTL_TEST_HOOK_SECRET"')
    notify_due(app)
    app.events.emit("job.failed", reason=f"exit 1 with {secret} in it")  # a secret a job printed, say
    assert notify_due(app) == 1
    (got,) = webhook.received
    expected = "sha256=" + hmac.new(secret.encode(), got["body"], hashlib.sha256).hexdigest()
    assert got["headers"]["X-Burstctl-Signature"] == expected
    assert secret not in got["body"].decode()  # scrubbed from the event before it was a notice

    monkeypatch.delenv("BURSTCTL_TEST_HOOK_SECRET")  # never sent unsigned
    app.events.emit("job.done", reason="completed")
    assert notify_due(app) == 0 and len(webhook.received) == 1
    (failed,) = [d for ty, d in _events(app) if ty == "notify.failed"]
    assert failed["error"] == ("the environment variable BURSTCTL_TEST_HOOK_SECRET (secret_env) is not set in the "
                               f"{SENDER_ENV}")
    _nowhere_but_the_environment(app, secret)
    app.close()


@pytest.mark.parametrize("trouble", ["closed port", "hangs", "unset"])
def test_a_webhook_that_cannot_be_reached_is_said_without_its_url(tmp_path: Path, webhook: Webhook,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 trouble: str) -> None:
    app = _webhook_app(tmp_path, "timeout_s = 0.5")
    notify_due(app)
    if trouble == "closed port":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        monkeypatch.setenv(HOOK_ENV, f"http://127.0.0.1:{port}/hooks/{TOKEN}")
    elif trouble == "hangs":
        webhook.delay_s = 2.0
    else:
        monkeypatch.delenv(HOOK_ENV)
    app.events.emit("job.done", reason="completed")
    assert notify_due(app) == 0
    (failed,) = [d for ty, d in _events(app) if ty == "notify.failed"]
    assert failed["error"] == {
        "closed port": "cannot reach the webhook (ConnectError)",
        "hangs": "no answer within 0.5 s",
        "unset": f"the environment variable {HOOK_ENV} (url_env) is not set in the {SENDER_ENV}"}[trouble]
    _nowhere_but_the_environment(app, TOKEN)
    app.close()


@pytest.mark.parametrize("url", [f"http://127.0.0.1:{TOKEN}/hooks", f"http://{TOKEN}..example/hooks",
                                 f"http://127.0.0.1:1/hooks/\x01{TOKEN}"],
                         ids=["a-port-that-is-no-number", "an-empty-label-in-the-host", "a-control-character"])
def test_a_webhook_url_that_does_not_parse_is_said_without_it_and_holds_up_no_other_notifier(
        tmp_path: Path, webhook: Webhook, monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    # httpx raised these as no HTTPError: the whole pass failed (`daemon.notify_failed`, every tick, quoting part
    # of the URL), and notify-test with an internal error.
    app = _webhook_app(tmp_path, f'\n[[notify]]\nname = "desk"\nurl_env = "{HOOK_ENV}_DESK"\n')
    monkeypatch.setenv(f"{HOOK_ENV}_DESK", webhook.url)
    notify_due(app)
    monkeypatch.setenv(HOOK_ENV, url)
    app.events.emit("job.done", reason="completed")
    assert notify_due(app) == 1 and [n["type"] for n in webhook.notices()] == ["job.done"]
    (failed,) = [d for ty, d in _events(app) if ty == "notify.failed"]
    assert failed == {**failed, "notifier": "phone", "error": f"{HOOK_ENV} does not hold a valid http(s) URL"}
    _nowhere_but_the_environment(app, TOKEN)
    app.close()


def test_a_command_gets_the_notice_on_stdin_and_in_its_arguments_and_a_failure_is_said_scrubbed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "notifier.py"
    script.write_text(
        "import json, os, sys\n"
        "notice = json.load(sys.stdin)\n"
        "if os.path.exists(sys.argv[1] + '.fail'):\n"
        "    sys.exit(f\"refused: {'x' * 180} key {os.environ['BURSTCTL_SIM_API_KEY']}\")\n"
        "with open(sys.argv[1], 'a') as fh:\n"
        "    fh.write(json.dumps([sys.argv[2:], notice['id'], os.environ['BURSTCTL_NOTICE_TYPE']]) + '\\n')\n")
    got = tmp_path / "got.jsonl"
    monkeypatch.setenv("BURSTCTL_SIM_API_KEY", "sim-key-abcdef123456")
    command = json.dumps([sys.executable, str(script), str(got), "{type}", "{job}", "{text}"])
    app = _app(tmp_path, f'[[notify]]\nname = "desk"\ncommand = {command}\n')
    job_id = _job(app, tmp_path)
    notify_due(app)
    done = app.events.emit("job.done", job_id=job_id, reason="completed")
    assert notify_due(app) == 1
    assert [json.loads(x) for x in got.read_text().splitlines()] == [
        [["job.done", "nightly", "burstctl: nightly done"], done, "job.done"]]

    Path(str(got) + ".fail").touch()
    app.events.emit("job.failed", job_id=job_id, reason="exit 1")
    assert notify_due(app) == 0
    (failed,) = [d for ty, d in _events(app) if ty == "notify.failed"]
    # Its last line, cut to 200 characters once scrubbed: cut first, the key's first 6 would have stayed.
    assert failed["error"] == "the command exited 1: refused: " + "x" * 180 + " key ***"
    _nowhere_but_the_environment(app, "sim-key-abcdef123456")
    app.close()


def test_a_notifier_taken_out_of_the_config_is_forgotten(tmp_path: Path, webhook: Webhook) -> None:
    app = _webhook_app(tmp_path)
    notify_due(app)
    assert list(app.store.settings_with_prefix(KEY_PREFIX)) == [KEY_PREFIX + "phone"]
    app.close()
    app = _app(tmp_path, "")
    notify_due(app)
    assert app.store.settings_with_prefix(KEY_PREFIX) == {}
    assert _events(app)[-1] == ("notify.removed", {"notifier": "phone"})
    app.close()


@pytest.mark.parametrize(("entry", "field", "says"), [
    (f'name = "a"\nurl_env = "{HOOK_ENV}"\ncommand = ["true"]', "notify.0", "exactly one of url_env"),
    ('name = "a"', "notify.0", "exactly one of url_env"),
    ('name = "a"\ncommand = ["true"]\nformat = "slack"', "notify.0.format", "only a webhook"),
    ('name = "a"\ncommand = []', "notify.0.command", "empty"),
    ('name = "a"\ncommand = ["true"]\nsecret_env = "S"', "notify.0.secret_env", "only a webhook"),
    ('name = "a"\ncommand = ["true"]\ndigest_over = 0', "notify.0.digest_over", ""),
    ('name = "a b"\ncommand = ["true"]', "notify.0.name", "not a notifier name"),
    ('name = "a"\ncommand = ["true"]\nevents = []', "notify.0.events", ""),
    # A pattern no event can match: the notifier would stay silent, and `status` call it ok.
    ('name = "a"\ncommand = ["true"]\nevents = ["jobs.*"]', "notify.0.events",
     "'jobs.*' matches no event: expected an event type such as 'job.done'"),
    ('name = "a"\ncommand = ["true"]\nevents = ["jobs.*"]', "notify.0.events", "(did you mean 'job.*'?)"),
    ('name = "a"\ncommand = ["true"]\nevents = ["job"]', "notify.0.events", "(did you mean 'job.*'?)"),
    ('name = "a"\ncommand = ["true"]\n\n[[notify]]\nname = "a"\ncommand = ["true"]', "notify.1.name",
     "names another"),
])
def test_a_bad_notifier_is_one_line_naming_the_file_and_field(burstctl, tmp_path: Path, entry: str, field: str,
                                                              says: str) -> None:
    assert_config_refused(burstctl, tmp_path, f"[[notify]]\n{entry}\n", "budget", field, says)


def test_a_webhook_url_pasted_where_its_variable_s_name_belongs_is_refused_unquoted(burstctl, tmp_path: Path
                                                                                   ) -> None:
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text(f'[[notify]]\nname = "a"\nurl_env = "https://hooks.example/{TOKEN}"\n')
    r = burstctl("--config", str(cfg), "status")
    assert r.returncode == 2 and "field 'notify.0.url_env'" in r.stderr and TOKEN not in r.stderr


def test_notify_test_sends_through_each_notifier_and_fails_naming_those_that_did_not(
        burstctl, tmp_path: Path, webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text(f'[[notify]]\nname = "phone"\nurl_env = "{HOOK_ENV}"\n\n'
                   '[[notify]]\nname = "broken"\ncommand = ["false"]\n')
    env = {HOOK_ENV: webhook.url}
    ok = burstctl("--config", str(cfg), "notify-test", "--name", "phone", "--json", env=env)
    assert ok.returncode == 0, ok.stderr
    assert [r["result"] for r in json.loads(ok.stdout)["notifiers"]] == ["delivered"]
    (notice,) = webhook.notices()
    assert notice["type"] == "notify.test" and notice["text"].startswith("burstctl: test notice from ")

    both = burstctl("--config", str(cfg), "notify-test", env=env)
    assert both.returncode == 1 and "not delivered by broken" in both.stderr and len(webhook.received) == 2
    assert "the command exited 1" in both.stdout
    # From a shell without the variable: the shell's environment is the one at fault, not the daemon's.
    monkeypatch.delenv(HOOK_ENV)
    unset = burstctl("--config", str(cfg), "notify-test", "--name", "phone", "--json")
    assert unset.returncode == 1 and len(webhook.received) == 2
    assert json.loads(unset.stdout)["notifiers"][0]["result"] == (
        f"failed: the environment variable {HOOK_ENV} (url_env) is not set in the {SENDER_ENV}")
    unknown = burstctl("--config", str(cfg), "notify-test", "--name", "pager")
    assert unknown.returncode == 2 and "no notifier named pager (configured: phone, broken)" in unknown.stderr


def test_the_daemon_tells_the_webhook_a_job_is_done_before_it_exits(burstctl, burstctl_subprocess, tmp_path: Path,
                                                                   webhook: Webhook) -> None:
    (tmp_path / "work").mkdir()
    write_job(tmp_path, "quick", command=["true"], workdir="work", deadline_hours=4, local_throughput=1.0)
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text(f'[daemon]\ntick_s = 0.5\n\n[[notify]]\nname = "phone"\nurl_env = "{HOOK_ENV}"\n')
    app = App(config_path=str(cfg), state_dir_override=str(tmp_path / "state"))
    notify_due(app)  # armed before the job exists, as a daemon running all along would be
    app.close()
    assert burstctl("--config", str(cfg), "enqueue", str(tmp_path / "quick.toml")).returncode == 0

    r = burstctl_subprocess("--config", str(cfg), "daemon", "--exit-when-idle", env={HOOK_ENV: webhook.url})
    assert r.returncode == 0, r.stderr[-2000:]
    (done,) = webhook.notices()
    assert (done["type"], done["text"], done["job"]["state"]) == ("job.done", "burstctl: quick done", "done")
    shown = burstctl("--config", str(cfg), "status").stdout
    assert "notify: phone ok (1 delivered, last " in shown
    assert TOKEN not in (tmp_path / "state" / "events.jsonl").read_text() and TOKEN not in r.stderr
    assert os.environ.get(HOOK_ENV) == webhook.url  # the fixture's, for the in-process parts above


def test_an_idle_notifier_writes_its_place_only_when_it_moves(tmp_path: Path, webhook: Webhook,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    app = _webhook_app(tmp_path)
    t = time.time()
    notify_due(app, t)
    app.events.emit("job.failed", reason="exit 1")
    assert notify_due(app, t + 1) == 1
    writes: list[str] = []
    real = app.store.set_setting
    monkeypatch.setattr(app.store, "set_setting", lambda key, *a, **kw: (writes.append(key), real(key, *a, **kw)))
    for k in range(3):
        assert notify_due(app, t + 2 + k) == 0
    assert writes == []  # nothing new: nothing written, tick after tick
    assert notify_due(app, t + 30) == 0 and writes == [KEY_PREFIX + "phone"]  # the look-back let go of the event
    assert notify_due(app, t + 31) == 0 and writes == [KEY_PREFIX + "phone"]
    app.close()


def test_a_notice_says_why_a_job_needs_a_person_and_any_event_in_words(tmp_path: Path) -> None:
    # "burstctl: od-full blocked" said nothing of why; "burstctl: od-full job.redecided" was the event's raw type.
    (tmp_path / "burstctl.toml").write_text("[budget]\nmonthly_cap_usd = 1\n")
    app = App(config_path=str(tmp_path / "burstctl.toml"), state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "od-full", local_throughput=0, market="on-demand"))
    (queued,) = [e for e in app.store.events(job_id=job_id) if e["type"] == "job.enqueued"]
    assert queued["data"]["state"] == "blocked"
    text = notice_text(notice_type(queued), queued["data"], "od-full")
    assert text.startswith("burstctl: od-full blocked: budget: projected rented $") and "$1.00" in text
    assert notice_text("job.redecided", {"state": "queued", "reason": "a reason"}, "od-full") == \
        "burstctl: od-full decided again: a reason"
    assert notice_text("job.plan_restored", {}, "od-full") == "burstctl: od-full plan restored"
    # A checkpoint thrown away with its instance (`checkpoint.lost`, for a notifier that names it): which, and why.
    why = "step-00000143 did not come home before the instance was lost (spot interruption notice); the job " \
          "resumes from step-00000120"
    assert notice_text("checkpoint.lost", {"checkpoint": "step-00000143", "reason": why}, "trainer") == \
        f"burstctl: trainer lost a checkpoint with a preempted instance: {why}"
    # Of no job: said in words, never as the raw type ("burstctl: daemon.config_reloaded").
    assert notice_text("daemon.config_reloaded", {}, None) == "burstctl: daemon reloaded its config file"
    assert notice_text("schedule.armed", {}, None) == "burstctl: schedule armed"
    assert notice_text("provider.unavailable", {"provider": "lambda", "problem": "LAMBDA_API_KEY is not set"},
                       None) == "burstctl: provider cannot be used (lambda): LAMBDA_API_KEY is not set"
    app.close()


# Strings of an event's shape in the code that are not event types: settings' paths, a file's name.
NOT_EVENTS = {"budget.cycle_gpu", "checkpoint.interval_minutes", "daemon.lock", "daemon.tick_s", "job.env", "state.dir"}


def test_the_event_types_a_notifier_may_name_are_those_the_code_records() -> None:
    # `[[notify]] events` refuses a type in no one's list (`job.fialed`, which would send nothing): the list must
    # hold every type the code names, and name none it does not.
    import ast

    from orchestrator.config import EVENT_TYPES

    shaped = re.compile(rf"({'|'.join(EVENT_FAMILIES)})\.[a-z0-9_]+")
    named: set[str] = set()
    for folder in ("orchestrator", "providers", "state"):
        for path in (REPO / folder).rglob("*.py"):
            constants = (n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant))
            named |= {c for c in constants if isinstance(c, str) and shaped.fullmatch(c)}
    named -= NOT_EVENTS
    assert named == EVENT_TYPES, (sorted(named - EVENT_TYPES), sorted(EVENT_TYPES - named))


@pytest.mark.parametrize(("events", "says"), [
    ('["job.fialed"]', "'job.fialed' matches no event type burstctl records (did you mean 'job.failed'?)"),
    ('["job.done", "instance.exploded"]', "'instance.exploded' matches no event type burstctl records"),
    ('["schedule.zz*"]', "'schedule.zz*' matches no event type burstctl records"),
])
def test_a_notifier_naming_an_event_type_that_is_never_recorded_is_refused(
        burstctl, tmp_path: Path, events: str, says: str) -> None:
    assert_config_refused(burstctl, tmp_path, f'[[notify]]\nname = "n"\ncommand = ["true"]\nevents = {events}\n',
                          "budget", "notify.0.events", says)


def test_a_notifier_pattern_that_matches_recorded_types_is_taken() -> None:
    from orchestrator.config import Notify

    Notify.model_validate({"name": "n", "command": ["true"], "events": ["job.*ed", "instance.*", "*", "job.done"]})
    # Types with a digit in their name too (they were refused as recording nothing).
    Notify.model_validate({"name": "n", "command": ["true"], "events": ["checkpoint.s3_unavailable"]})


def test_every_event_burstctl_emits_is_of_a_kind_a_notifier_s_pattern_may_name() -> None:
    # `[[notify]] events` refuses a pattern of no known kind (EVENT_FAMILIES): a new kind of event must be added
    # there, or a notifier could never be set to send it.
    emitted = set()
    for folder in ("orchestrator", "providers", "runbooks"):
        for path in (REPO / folder).rglob("*.py"):
            emitted |= set(re.findall(r'(?:emit|sink)\(\s*f?"([a-z_]+)\.', path.read_text()))
    assert emitted and emitted <= set(EVENT_FAMILIES), sorted(emitted - set(EVENT_FAMILIES))

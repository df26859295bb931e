"""Notices ([[notify]] in the config): the daemon tells a webhook or a command about the events a person should
hear of without watching `burstctl status`: a job done or failed, one waiting for approval, a schedule that missed
its slot, an instance that could not be confirmed gone.

The events table is the outbox. Each notifier keeps its place in it (the setting `notify:<name>`): the events it
has handled, delivered or not matching its `events`. So:
- A notifier seen for the first time starts from the newest event (`notify.armed`): adding one never replays the
  history. One taken out of the config is forgotten (`notify.removed`).
- Notices go in the order of their events, none skipped. A delivery that fails stops its notifier at that event,
  said once (`notify.failed`, never the URL), and tried again after 5 s, doubling, at most 15 min; the first that
  works again says so (`notify.recovered`). One notifier failing never holds up another, or the daemon's tick:
  deliveries run on a thread of their own.
- At least once: a daemon killed between a delivery and the write of the notifier's place sends that notice again.
  Each notice carries its event's id to tell.
- On PostgreSQL an event can commit after one with a higher id: the place is an `EventTail`, which looks back 10 s
  for such events.
- More than `digest_over` notices due at once (a hundred jobs done in one tick, the backlog of a webhook that was
  down for a day) go as one digest, not a hundred POSTs that a chat's rate limit would refuse.
- A webhook with `secret_env` signs each body (HMAC-SHA256), so its receiver can refuse forgeries.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import json
import os
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.app import App
from orchestrator.config import Notify
from orchestrator.events import EventTail

KEY_PREFIX = "notify:"  # settings key, + the notifier's name
RETRY_FIRST_S = 5.0
RETRY_MAX_S = 900.0
PAGE = 1000  # events read per pass: a notifier stopped for a week reads its backlog a page at a time
DIGEST_LINES = 20  # lines of a digest's text (ntfy takes 4 KB a message); its JSON carries every notice
_NEEDS_A_PERSON = ("awaiting_approval", "blocked", "rethink")  # job states a decision can land a job in

# What each notice says after the job's name (or alone, for events of no job).
_PHRASES = {
    "job.done": "done",
    "job.failed": "failed",
    "job.awaiting_approval": "waits for approval (`burstctl approve`)",
    "job.rethink": "cannot meet its deadline even in the cloud: rethink its scope",
    "job.blocked": "blocked",
    "job.behind_schedule": "is behind schedule",
    "schedule.missed": "schedule missed a slot",
    "schedule.job_invalid": "schedule skipped a slot: its job file does not validate",
    "schedule.skipped": "schedule skipped a slot: the previous cycle is not over",
    "instance.terminate_unverified": "instance not confirmed gone: it may still bill",
    "instance.orphan_terminate_failed": "orphaned instance could not be terminated: it may still bill",
    "attempt.provider_unavailable": "runs on a provider the daemon cannot use: its instance is not watched",
    "attempt.provider_refused": "its provider refuses to be asked (a refused API key?): watched over SSH, not "
                                "stoppable until fixed",
    "attempt.provider_answers": "its provider answers again",
    "attempt.released": "came home while its cloud does not answer: its instance is terminated once it does",
    "attempt.release_held": "not brought home: work would be left on an instance whose cloud does not answer "
                            "(`burstctl revert-local --resume-from-home` gives it up)",
    "daemon.config_rejected": "daemon rejected its config file",
    "daemon.lock_lost": "daemon lost its database lock and stopped",
    "notify.test": "test notice",
    "job.enqueued": "queued",
    "job.redecided": "decided again",
    "job.retried": "queued again",
    "job.resumed": "resumed",
    "job.requeued_local": "brought home to run locally",
    "job.market_switch": "changes market",
    "instance.preempted": "preempted",
    "checkpoint.lost": "lost a checkpoint with a preempted instance",
    "checkpoint.lost_corrected": "brought home after all the checkpoint said lost",
    # Of no job: said alone.
    "daemon.started": "daemon started",
    "daemon.stopping": "daemon stopping",
    "daemon.stopped": "daemon stopped",
    "daemon.config_reloaded": "daemon reloaded its config file",
    "revert_local.done": "revert-local done: local-only until `burstctl burst-enable`",
    "burst.enabled": "bursting enabled again",
    "provider.unreachable": "provider unreachable",
    "provider.unavailable": "provider cannot be used",
    "instance.orphan_terminated": "orphaned instance terminated",
    "instance.confirmed_gone": "instance confirmed gone by the operator (burstctl confirm-gone)",
    "state.events_pruned": "old events pruned",
    "state.checkpoints_pruned": "old checkpoints pruned",
}


def _phrase(kind: str, *, of_a_job: bool = True) -> str:
    """What a notice of this type says: its phrase, or the type in words: after a job's name without its family
    (`job.plan_restored`: "plan restored"), alone with it (`schedule.armed`: "schedule armed")."""
    return _PHRASES.get(kind) or (kind.split(".", 1)[-1] if of_a_job else kind).replace("_", " ").replace(".", " ")


class DeliveryFailed(Exception):
    """A notice that did not arrive; the message is safe to store (no URL, secrets scrubbed)."""


# --- what a notice is (no I/O) ---------------------------------------------------------------------------------


def notice_type(event: dict[str, Any]) -> str:
    """The event's type, or, for a job queued, decided again or retried into a state that needs a person,
    `job.<state>`."""
    if event["type"] in ("job.enqueued", "job.redecided", "job.retried"):
        data = event.get("data") or {}
        if data.get("state") in _NEEDS_A_PERSON:
            return f"job.{data['state']}"
        if data.get("action") == "await-approval":  # a hybrid, queued: its local phase runs while it waits
            return "job.awaiting_approval"
    return str(event["type"])


def wanted(patterns: Iterable[str], kind: str) -> bool:
    """Whether a notifier with these `events` sends a notice of this type (never its own `notify.*`)."""
    return not kind.startswith("notify.") and any(fnmatch.fnmatchcase(kind, p) for p in patterns)


def notice_text(kind: str, data: dict[str, Any], job_name: str | None, spent_usd: float | None = None) -> str:
    """One line: `burstctl: <job> <what happened>[: <reason>][ (cloud $x.xx)]`."""
    if kind == "budget.crossed":
        return (f"burstctl: {data['fraction']:.0%} of {data['month']}'s cloud budget spent "
                f"(${data['spent_usd']:.2f} of ${data['cap_usd']:.2f})")
    what = _phrase(kind, of_a_job=job_name is not None)
    if job_name is None and data.get("provider"):
        what += f" ({data['provider']})"
    subject = f"{job_name} {what}" if job_name else what
    reason = data.get("reason") or data.get("error") or data.get("problem")
    if kind.startswith("schedule.") and data.get("job_file"):
        subject = f"{os.path.basename(str(data['job_file']))}: {subject}"
    text = f"burstctl: {subject}" + (f": {reason}" if reason and reason != "completed" else "")
    if spent_usd:
        text += f" (cloud ${spent_usd:.2f})"
    return text


def notice(event: dict[str, Any], kind: str, job: dict[str, Any] | None, spent_usd: float | None) -> dict[str, Any]:
    """The notice sent for an event: what a webhook's `json` body and a command's stdin carry."""
    data = dict(event.get("data") or {})
    return {"id": event["id"], "ts": event["ts"], "type": kind, "event": event["type"],
            "text": notice_text(kind, data, job["name"] if job else None, spent_usd),
            "job": {"id": job["id"], "name": job["name"], "state": job["state"]} if job else None,
            "attempt": event.get("attempt_id"), "data": data}


def digest(notices: list[dict[str, Any]], now: float) -> dict[str, Any]:
    """One notice for many: a first line that counts them by type, then a line each (the first DIGEST_LINES in
    `text`; `notices` has them all, each with its event's id)."""
    kinds = Counter(n["type"] for n in notices)
    lines = [f"burstctl: {len(notices)} notices ("
             + ", ".join(f"{count} {kind}" for kind, count in kinds.most_common()) + ")"]
    lines += [f"- {n['text'].removeprefix('burstctl: ')}" for n in notices[:DIGEST_LINES]]
    if len(notices) > DIGEST_LINES:
        lines.append(f"- and {len(notices) - DIGEST_LINES} more (`burstctl events`)")
    return {"id": notices[-1]["id"], "ts": now, "type": "digest", "event": "digest", "text": "\n".join(lines),
            "job": None, "attempt": None, "data": {"count": len(notices), "types": dict(kinds)}, "notices": notices}


def signature(secret: str, body: bytes) -> str:
    """`X-Burstctl-Signature`: what a receiver recomputes from the body it got and the shared secret."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


# --- delivery -------------------------------------------------------------------------------------------------


def deliver(target: Notify, payload: dict[str, Any], redact: Callable[[Any], Any]) -> None:
    """Send one notice through one notifier, or raise DeliveryFailed."""
    if target.url_env is not None:
        _post(target, payload)
    else:
        _run_command(target, payload, redact)


# Where a notifier's variables are read: the daemon's environment for its notices, the shell's for notify-test.
SENDER_ENVIRONMENT = ("environment of the process sending the notice (the daemon's: set it where the daemon runs, e.g. "
         "~/.config/burstctl/env, and restart it; for notify-test, this shell's)")


def _post(target: Notify, payload: dict[str, Any]) -> None:
    import httpx

    assert target.url_env is not None
    url = os.environ.get(target.url_env, "").strip()
    if not url:
        raise DeliveryFailed(f"the environment variable {target.url_env} (url_env) is not set in the "
                             f"{SENDER_ENVIRONMENT}")
    if not url.startswith(("http://", "https://")):
        raise DeliveryFailed(f"{target.url_env} does not hold an http(s) URL")
    headers = {"X-Burstctl-Notice": payload["type"], "X-Burstctl-Event-Id": str(payload["id"])}
    # The body as bytes here, not by httpx: the signature is over exactly what is sent.
    if target.format == "text":
        body = payload["text"].encode()
        headers["Content-Type"] = "text/plain; charset=utf-8"
    else:
        body = json.dumps(payload if target.format == "json" else {"text": payload["text"]}).encode()
        headers["Content-Type"] = "application/json"
    if target.secret_env is not None:
        secret = os.environ.get(target.secret_env, "")
        if not secret:
            raise DeliveryFailed(f"the environment variable {target.secret_env} (secret_env) is not set in the "
                                 f"{SENDER_ENVIRONMENT}")
        headers["X-Burstctl-Signature"] = signature(secret, body)
    try:
        # Errors are said by their class and status only: httpx puts the URL (the secret) in its messages.
        response = httpx.post(url, timeout=target.timeout_s, headers=headers, content=body)
    except httpx.TimeoutException:
        raise DeliveryFailed(f"no answer within {target.timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise DeliveryFailed(f"cannot reach the webhook ({type(exc).__name__})") from None
    except (httpx.InvalidURL, ValueError):
        # A port that is no number, a control character, an empty label in the host (idna's UnicodeError): httpx
        # raises neither as an HTTPError, and its words quote part of the URL.
        raise DeliveryFailed(f"{target.url_env} does not hold a valid http(s) URL") from None
    if not response.is_success:
        raise DeliveryFailed(f"the webhook answered HTTP {response.status_code}")


def _run_command(target: Notify, payload: dict[str, Any], redact: Callable[[Any], Any]) -> None:
    assert target.command is not None
    fields = {"{text}": payload["text"], "{type}": payload["type"],
              "{job}": (payload["job"] or {}).get("name") or ""}
    argv = [_fill(arg, fields) for arg in target.command]
    env = {**os.environ, "BURSTCTL_NOTICE_TYPE": payload["type"], "BURSTCTL_NOTICE_TEXT": payload["text"],
           "BURSTCTL_JOB": fields["{job}"]}
    try:
        done = subprocess.run(argv, input=json.dumps(payload).encode(), capture_output=True, env=env,
                              timeout=target.timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise DeliveryFailed(f"the command did not finish within {target.timeout_s:g} s") from None
    except OSError as exc:
        raise DeliveryFailed(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no stderr"]
        raise DeliveryFailed(f"the command exited {done.returncode}: {redact(tail[0])[:200]}")


def _fill(arg: str, fields: dict[str, str]) -> str:
    for token, value in fields.items():
        arg = arg.replace(token, value)
    return arg


# --- the daemon's pass ----------------------------------------------------------------------------------------


@dataclass
class Place:
    """A notifier's place in the event log and its health, as kept in the settings table."""

    settled: int
    recent: dict[int, float] = field(default_factory=dict)
    failures: int = 0
    failing_since: float | None = None
    last_error: str | None = None
    next_try_at: float = 0.0
    delivered: int = 0
    last_delivered_at: float | None = None

    @classmethod
    def read(cls, kept: dict[str, Any]) -> Place:
        return cls(**{**kept, "recent": {int(i): float(t) for i, t in (kept.get("recent") or {}).items()}})

    def kept(self) -> dict[str, Any]:
        return {**self.__dict__, "recent": {str(i): t for i, t in self.recent.items()}}


def notify_due(app: App, now: float | None = None, *, send: Callable[..., None] = deliver) -> int:
    """Deliver what every configured notifier is due, each from its place; returns notices delivered."""
    now = time.time() if now is None else now
    targets = {n.name: n for n in app.config.notify}
    kept = app.store.settings_with_prefix(KEY_PREFIX)
    for key in kept:
        if key[len(KEY_PREFIX):] not in targets:
            app.store.delete_setting(key)
            app.events.emit("notify.removed", notifier=key[len(KEY_PREFIX):])
    sent = 0
    for name, target in targets.items():
        key = KEY_PREFIX + name
        if key not in kept:
            place = Place(settled=app.store.last_event_id())
            app.store.set_setting(key, place.kept())
            app.events.emit("notify.armed", notifier=name, after_event=place.settled)
            continue
        place = Place.read(kept[key])
        if now < place.next_try_at:
            continue
        sent += _catch_up(app, target, place, now, send)
    return sent


def _catch_up(app: App, target: Notify, place: Place, now: float, send: Callable[..., None]) -> int:
    key = KEY_PREFIX + target.name
    tail = EventTail(app.store, after_id=place.settled, recent=place.recent, limit=PAGE,
                     clock=lambda: now)
    jobs: dict[str, dict[str, Any] | None] = {}
    sent = 0
    passed: list[int] = []  # events handled since the place was last written: not matching, or delivered

    def save(changed: bool = True) -> None:
        """Write the place; unless `changed` (a delivery, a failure), only when it moved: an idle daemon writes
        nothing every tick."""
        tail.take(passed)
        passed.clear()
        if changed or (tail.settled, tail.recent) != (place.settled, place.recent):
            place.settled, place.recent = tail.settled, dict(tail.recent)
            app.store.set_setting(key, place.kept())

    def notice_of(event: dict[str, Any], kind: str) -> dict[str, Any]:
        job = None
        if event.get("job_id"):
            if event["job_id"] not in jobs:
                jobs[event["job_id"]] = app.store.get_job(event["job_id"])
            job = jobs[event["job_id"]]
        spent = app.store.job_spend(job["id"], now)[0] if job and kind in ("job.done", "job.failed") else None
        return notice(event, kind, job, spent)

    def delivered(payload: dict[str, Any], count: int) -> bool:
        """Send; on success count it and say a recovery, on failure say it and set the next try."""
        try:
            send(target, payload, app.redactor)
        except DeliveryFailed as exc:
            _failed(app, target, place, now, str(exc), payload.get("notices", [payload])[0]["id"])
            return False
        place.delivered += count
        place.last_delivered_at = now
        if place.failures:
            app.events.emit("notify.recovered", notifier=target.name, after_tries=place.failures + 1,
                            failing_for_s=round(now - (place.failing_since or now), 1))
            place.failures, place.failing_since, place.last_error, place.next_try_at = 0, None, None, 0.0
        return True

    page = [(event, notice_type(event)) for event in tail.peek()]
    due = [(event, kind) for event, kind in page if wanted(target.events, kind)]
    if len(due) > target.digest_over:
        if not delivered(digest([notice_of(event, kind) for event, kind in due], now), len(due)):
            save()
            return 0
        passed.extend(event["id"] for event, _ in page)
        save()
        return len(due)
    for event, kind in page:
        if not wanted(target.events, kind):
            passed.append(event["id"])
            continue
        if not delivered(notice_of(event, kind), 1):
            save()
            return sent
        sent += 1
        passed.append(event["id"])
        save()  # after each delivery: a daemon killed now sends this notice no more than once again
    save(changed=False)
    return sent


def _failed(app: App, target: Notify, place: Place, now: float, error: str, event_id: int) -> None:
    if error != place.last_error:  # once per failure, not once per try
        app.events.emit("notify.failed", notifier=target.name, error=error, event_id=event_id,
                        tries=place.failures + 1)
    place.failures += 1
    place.failing_since = place.failing_since or now
    place.last_error = error
    place.next_try_at = now + min(RETRY_FIRST_S * 2 ** (place.failures - 1), RETRY_MAX_S)


def health(app: App, now: float | None = None) -> list[dict[str, Any]]:
    """Each configured notifier: delivered so far, and whether it is failing (since when, why, next try)."""
    now = time.time() if now is None else now
    kept = app.store.settings_with_prefix(KEY_PREFIX)
    out = []
    for target in app.config.notify:
        place = Place.read(kept[KEY_PREFIX + target.name]) if KEY_PREFIX + target.name in kept else None
        out.append({"name": target.name, "armed": place is not None,
                    "delivered": place.delivered if place else 0,
                    "last_delivered_at": place.last_delivered_at if place else None,
                    "failing_since": place.failing_since if place else None,
                    "last_error": place.last_error if place else None,
                    "next_try_in_s": round(max(0.0, place.next_try_at - now), 1) if place and place.failures
                    else None})
    return out


def trial_notice(host: str, now: float) -> dict[str, Any]:
    """What `burstctl notify-test` sends: a notice of no event (id 0)."""
    return {"id": 0, "ts": now, "type": "notify.test", "event": "notify.test",
            "text": f"burstctl: test notice from {host}", "job": None, "attempt": None, "data": {}}

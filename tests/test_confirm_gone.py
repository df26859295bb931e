"""`burstctl confirm-gone`: the operator's word that an instance is gone, for a provider that will never say so (the
account closed, the key deleted for good, the vendor gone). Without it, an instance revert-local left while its
provider's API was down stayed "not confirmed gone" for ever: its charge open in the month's spend and the budget,
listed by `status`, and its job held off the cloud. Checked in-process against the real store, the simulated cloud's
API and the real sweep, as tests/test_reconcile_rules.py's revert rules are (its helpers set the outage up); the
whole story with a daemon and SSH is in tests/test_e2e_revert.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from orchestrator.app import App
from orchestrator.cli.status import status_data
from orchestrator.core.budget import month_key
from orchestrator.core.release import utc
from orchestrator.lifecycle.reconcile import Reconciler
from providers.simcloud.api import SimCloudServer
from state import schema as s
from tests.test_reconcile_rules import _released_home, _running_on_the_cloud

HOUR = 3600.0


def _database(app: App) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table."""
    with app.store.engine.connect() as c:
        return {t.name: [tuple(r) for r in c.execute(select(t).order_by(*t.primary_key))]
                for t in s.metadata.sorted_tables}


def _launched_an_hour_ago(app: App) -> float:
    """The released attempt and its instance's charge, as if launched an hour ago (on the second, as `--at` is
    given); when. (simcloud's API, as Lambda's, says no launch time: an orphan's charge starts from its attempt's.)"""
    started = float(int(time.time() - HOUR))
    with app.store.tx() as c:
        c.execute(update(s.ledger).values(started_at=started))
        c.execute(update(s.attempts).values(created_at=started))
    return started


def _measured_line(app: App, job_id: str) -> str:
    record = Path(app.store.get_job(job_id)["record_path"])
    (line,) = [ln for ln in record.read_text().splitlines() if ln.startswith("- **Measured:**")]
    return line


def _instance(app: App, instance_id: str) -> dict[str, Any]:
    with app.store.engine.connect() as c:
        return dict(c.execute(select(s.instances).where(s.instances.c.id == instance_id)).mappings().one())


def test_what_the_operator_says_is_gone_ends_its_charge_then_and_everything_that_waited_for_it_goes_on(
        tmp_path: Path, burstctl_in_process: Any) -> None:
    # revert-local released a job home while its provider's API was down, and the job was then cancelled: measured
    # with its instance's charge still open. The provider never answers again. The operator, who saw the instance
    # gone in its console half an hour ago, says so: the charge ends then, as the provider's confirmation would have
    # ended it, the attempt ends, and the job is measured again with the whole charge.
    app = App(state_dir_override=str(tmp_path / "state"))
    with SimCloudServer(api_key="sim-rules-key") as sim:
        now = [time.time()]
        job_id, attempt, provider, instance = _released_home(app, tmp_path, sim, now, started_ago_s=600)
        started = _launched_an_hour_ago(app)
        assert burstctl_in_process("cancel", job_id).returncode == 0
        assert "is still being terminated" in _measured_line(app, job_id)
        month = month_key(time.time())
        assert app.store.month_spend(month, time.time() + HOUR) > app.store.month_spend(month, time.time())

        gone_at = started + HOUR / 2
        r = burstctl_in_process("confirm-gone", "sim", instance.id, "--at", utc(gone_at), "--json")
        assert r.returncode == 0, r.stderr
        said = json.loads(r.stdout)
        assert (said["by"], said["at"], said["already_confirmed"]) == ("operator", utc(gone_at), False)
        assert (said["attempt"], said["attempt_outcome"], said["job"]) == (f"{job_id}-a1", "aborted", job_id)

        (charge,) = app.store.ledger_rows()
        assert (charge["ended_at"], charge["billed_seconds"]) == (gone_at, HOUR / 2)
        assert charge["cost_usd"] == 3.29 / 2 and said["closed_usd"] == round(3.29 / 2, 4)
        assert app.store.month_spend(month, time.time() + HOUR) == app.store.month_spend(month, time.time())
        assert attempt()["state"] == "aborted"
        inst = _instance(app, instance.id)
        assert (inst["verified_gone"], inst["gone_at"], inst["gone_by"]) == (True, gone_at, "operator")
        events = app.store.events(job_id=job_id)
        (confirmed,) = [e["data"] for e in events if e["type"] == "instance.confirmed_gone"]
        assert confirmed == {"by": "operator", "provider": "sim", "instance": instance.id, "at": gone_at,
                             "closed_usd": round(3.29 / 2, 4)}
        (ended,) = [e["data"] for e in events if e["type"] == "instance.terminated"]
        assert ended == {"instance": instance.id, "outcome": "aborted", "released": True, "confirmed_by": "operator"}
        # Measured again with the whole charge, saying whose word ended it.
        measured = [e["data"] for e in events if e["type"] == "job.measured"]
        assert [m["cost_usd"] for m in measured] == [0.0, round(3.29 / 2, 4)]
        assert measured[-1]["confirmed_gone_by_operator"] == [f"sim {instance.id}"]
        line = _measured_line(app, job_id)
        assert line.startswith("- **Measured:** cancelled: run 0.17 h, cost $1.65 (billed 0.50 h: ")
        assert line.endswith(f"; instance sim {instance.id} confirmed gone by the operator, not its provider, at "
                             f"{utc(gone_at)}: its charge ends then")
        assert "still being terminated" not in line

        # Where the provider's word would be named, the operator's is.
        status = status_data(app)
        assert status["instances"] == [] and status["attempts"] == []
        assert [(g["id"], g["gone_at"]) for g in status["confirmed_gone_by_operator"]] == [(instance.id, gone_at)]
        text = " ".join(burstctl_in_process("status").stdout.split())
        assert (f"confirmed gone by the operator this month, not by their provider (`burstctl confirm-gone`): sim "
                f"{instance.id} at {utc(gone_at)}") in text
        shown = " ".join(burstctl_in_process("show", job_id).stdout.split())
        assert (f"instance sim {instance.id} (attempt {job_id}-a1): confirmed gone by the operator, not its provider, "
                f"at {utc(gone_at)}; its charge ends then") in shown
        (reported,) = json.loads(burstctl_in_process("report", "--json").stdout)["jobs"]
        assert reported["confirmed_by_operator"] == 1
        assert "$1.65†" in burstctl_in_process("report").stdout

        # Said twice, it changes nothing the second time.
        before = _database(app)
        r = burstctl_in_process("confirm-gone", "sim", instance.id)
        assert r.returncode == 0, r.stderr
        assert " ".join(r.stdout.split()) == (f"sim {instance.id} was confirmed gone already, by the operator at "
                                              f"{utc(gone_at)}: nothing changed")
        assert _database(app) == before
        provider.close()
    app.close()


def test_a_job_held_off_the_cloud_for_its_instance_from_before_goes_back_to_its_plan_once_the_operator_says_it_is_gone(
        tmp_path: Path, burstctl_in_process: Any) -> None:
    # burst-enable while the released instance is not confirmed gone keeps the job here (`relaunch_held`); its
    # provider never answers, so only the operator can lift that, and does, with the daemon's next look none the
    # wiser: nothing of it is held in a daemon's memory.
    app = App(state_dir_override=str(tmp_path / "state"))
    with SimCloudServer(api_key="sim-rules-key") as sim:
        now = [time.time()]
        job_id, attempt, provider, instance = _released_home(app, tmp_path, sim, now)
        rec = Reconciler(app, {"sim": provider}, cloud=None, clock=lambda: now[0])  # the daemon's
        assert burstctl_in_process("burst-enable").returncode == 0
        job = app.store.get_job(job_id)
        assert (job["state"], job["placement"]) == ("queued", "local")
        assert rec.admission.relaunch_held(job) is not None
        assert rec.admission.attempts_active("cloud") == 1

        r = burstctl_in_process("confirm-gone", "sim", instance.id)
        assert r.returncode == 0, r.stderr
        job = app.store.get_job(job_id)
        assert (job["state"], job["placement"]) == ("queued", job["decision"]["placement"])  # back on its plan
        assert job["reason"] == (f"its instance from before, {instance.id}, is confirmed gone by the operator: back "
                                 f"to its {job['decision']['placement']} plan")
        assert rec.admission.relaunch_held(job) is None
        assert rec.admission.attempts_active("cloud") == 0  # its cloud slot is free
        assert attempt()["state"] == "aborted" and app.store.ledger_rows()[0]["ended_at"] is not None
        now[0] += 16.0
        rec.tick()  # the daemon's next tick: the attempt is over, nothing is terminated again
        assert attempt()["state"] == "aborted"
        rec.close()
        provider.close()
    app.close()


def test_what_cannot_be_taken_for_an_instance_gone_is_refused_in_one_line_and_changes_nothing(
        tmp_path: Path, burstctl_in_process: Any) -> None:
    app = App(state_dir_override=str(tmp_path / "state"))
    with SimCloudServer(api_key="sim-rules-key") as sim:
        now = [time.time()]
        _, _, provider, instance = _released_home(app, tmp_path, sim, now)
        started = _launched_an_hour_ago(app)
        # Another job's instance, whose run goes on: the daemon's to end, not the operator's to declare gone.
        running_job, _ = _running_on_the_cloud(app, tmp_path, "i-running")
        with app.store.tx() as c:
            c.execute(s.instances.insert().values(provider="sim", id="i-running", attempt_id=f"{running_job}-a1",
                                                  state="running", verified_gone=False))
        before = _database(app)
        cases = {
            ("nimbus", instance.id): ("PROVIDER", "burstctl knows no instance on 'nimbus': expected the provider of an "
                                                  "instance it launched or found (sim; "),
            ("sim", "i-nowhere"): ("INSTANCE_ID", "burstctl knows no instance 'i-nowhere' on sim: expected one it "
                                                  "launched or found there"),
            ("sim", "i-running"): ("INSTANCE_ID", f"is the instance of attempt {running_job}-a1, which is running, "
                                                  "not being terminated"),
            ("sim", instance.id, "--at", "yesterday"): ("--at", "is not a date and time: expected an ISO 8601 date "
                                                                "and time with a time zone"),
            ("sim", instance.id, "--at", "2026-12-01"): ("--at", "is a date without a time: expected an ISO 8601 "),
            ("sim", instance.id, "--at", "2026-12-01T10:00"): ("--at", "has no time zone: expected an ISO 8601 "),
            ("sim", instance.id, "--at", "1767225600"): ("--at", "is a number: expected an ISO 8601 "),
            ("sim", instance.id, "--at", utc(time.time() + HOUR)): ("--at", "is in the future ("),
            ("sim", instance.id, "--at", utc(started - 60)): (
                "--at", f"is before the instance's charge started ({utc(started - 60)}, it started {utc(started)}): "
                        "expected when the instance stopped billing, from then until now"),
        }
        for args, (field, said) in cases.items():
            for json_flag in ((), ("--json",)):
                r = burstctl_in_process("confirm-gone", *args, *json_flag)
                assert r.returncode == 2, (args, r.stdout, r.stderr)
                assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
                assert r.stderr.startswith(f"burstctl: error: field '{field}': {said}"), (args, r.stderr)
                assert _database(app) == before, args
        provider.close()
    app.close()


def test_when_the_operator_was_wrong_the_instance_its_provider_lists_again_is_metered_again_from_their_word(
        tmp_path: Path, burstctl_in_process: Any) -> None:
    # The operator said the instance went half an hour ago; its provider answers again and lists it running. The
    # sweep takes it for what it is, an instance of ours that no attempt drives: not confirmed gone any more, its
    # charge open again from where the operator's word ended it (no hour unbilled, none billed twice), terminated,
    # and closed once the provider confirms it gone. The job over meanwhile is measured again with it all.
    app = App(state_dir_override=str(tmp_path / "state"))
    with SimCloudServer(api_key="sim-rules-key") as sim:
        now = [time.time()]
        job_id, _, provider, instance = _released_home(app, tmp_path, sim, now)
        started = _launched_an_hour_ago(app)
        assert burstctl_in_process("cancel", job_id).returncode == 0
        said_at = started + HOUR / 2
        assert burstctl_in_process("confirm-gone", "sim", instance.id, "--at", utc(said_at)).returncode == 0
        assert [i.status for i in sim.instances()] == ["active"]  # it was not gone

        sim.clear_faults()  # the provider answers again, but for its terminate
        sim.inject("server-error", count=1000, status=503, route="instance-operations/terminate")
        rec = Reconciler(app, {"sim": provider}, cloud=None)
        assert rec.sweep() == {}
        inst = _instance(app, instance.id)
        assert (inst["state"], inst["verified_gone"], inst["gone_at"], inst["gone_by"]) == (
            "unverified", False, None, None)
        first, again = app.store.ledger_rows()
        assert (first["started_at"], first["ended_at"]) == (started, said_at)
        assert (again["started_at"], again["ended_at"], again["job_id"]) == (said_at, None, job_id)
        assert [i["id"] for i in status_data(app)["instances"]] == [instance.id]
        assert status_data(app)["confirmed_gone_by_operator"] == []
        month = month_key(time.time())
        assert app.store.month_spend(month, time.time() + HOUR) > app.store.month_spend(month, time.time())
        assert [e["type"] for e in app.store.events(type_prefix="instance.orphan")] == [
            "instance.orphan_terminate_failed"]

        sim.clear_faults()  # and now its terminate too
        assert rec.sweep() == {"sim": [instance.id]}
        assert [i.status for i in sim.instances()] == ["terminated"]
        first, again = app.store.ledger_rows()
        assert again["started_at"] == first["ended_at"] and again["ended_at"] is not None
        inst = _instance(app, instance.id)
        assert (inst["verified_gone"], inst["gone_by"]) == (True, "provider")
        line = _measured_line(app, job_id)
        assert f", cost ${first['cost_usd'] + again['cost_usd']:.2f} (billed 1.00 h: " in line
        assert "operator" not in line
        rec.close()
        provider.close()
    app.close()

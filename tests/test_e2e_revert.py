"""The kill switch and reversibility, end to end with real processes: `revert-local` brings a running burst home
(last checkpoint, terminate, confirm, requeue locally) and the job finishes locally from that checkpoint; with the
cloud unreachable nothing is silently left, and the local platform keeps working."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from tests.e2e import (
    GONE,
    SIM_KEY,
    Daemon,
    EnvDaemon,
    burstctl_argv,
    cli,
    cloud,
    events,
    free_port,
    job,
    ledger,
    sim_admin,
    sim_billing,
    sim_instances,
    simcloud,
    store_sections,
    trainer_job,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.slow


def measured_line(record: Path) -> str:
    """A decision record's Measured line."""
    (line,) = [ln for ln in record.read_text().splitlines() if ln.startswith("- **Measured:**")]
    return line


def priced_job(tmp: Path, name: str, steps: int = 400, gpu: str = "H100") -> Path:
    """Fits locally but misses its deadline there; the price of the deadline is within the auto-approve ceiling."""
    return trainer_job(tmp, name, steps=steps, every=10, local_throughput=0.1, rented=10, deadline_hours=2, gpu=gpu)


# Each provider once and each store once: ec2 on SQLite added nothing the other two do not cover (a minute of CI).
@pytest.mark.parametrize(("kind", "backend"), [("simcloud", "sqlite"), ("ec2", "postgresql")])
def test_revert_local_brings_a_running_burst_home_and_it_finishes_locally(
        tmp_path: Path, kind: str, backend: str, request: pytest.FixtureRequest) -> None:
    state = tmp_path / "state"
    database = store_sections(backend, request)
    with cloud(kind, tmp_path) as c:
        config = c.config(tmp_path, policy={"hybrid_margin_h": 5.0}, **database)
        r = cli(config, state, "enqueue", str(priced_job(tmp_path, "deadline-job", gpu=c.gpu)), "--json")
        job_id = json.loads(r.stdout)["id"]
        assert json.loads(r.stdout)["decision"]["verdict"] == "priced"
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: events(state, "checkpoint.synced"), 120, "a checkpoint from the cloud")
            before = json.loads(cli(config, state, "status", "--json").stdout)
            assert [i["state"] for i in before["instances"]] == ["running"]  # not what launch saw (booting)
            r = cli(config, state, "revert-local", "--json")
            assert r.returncode == 0, r.stdout + r.stderr
            report = json.loads(r.stdout)
            assert report["all_gone"] and report["mode"] == "local-only"
            # The wind-down's end requeued it (and the running daemon may have started it locally since): this run
            # requeued it, and says so.
            assert report["requeued_local"] == [job_id] and report["already_local"] == []
            (row,) = report["instances"]
            assert row["terminated"] == "yes" and row["checkpoint_synced"].startswith("step-")
            assert all(i["status"] in GONE for i in c.instances())

            status = json.loads(cli(config, state, "status", "--json").stdout)
            assert status["mode"] == "local-only"
            # A second run is a no-op.
            again = cli(config, state, "revert-local", "--json")
            assert again.returncode == 0 and json.loads(again.stdout)["instances"] == []

            wait_for(lambda: job(state, job_id)["state"] == "done", 240, "the job to finish locally")
        finally:
            assert daemon.stop() == 0
    resumed = [e for e in events(state, "job.resumed") if e["data"].get("where") == "local"]
    assert resumed and resumed[0]["data"]["checkpoint"] == row["checkpoint_synced"]
    assert not any(e["type"] == "attempt.intent" for e in events(state) if e["id"] > resumed[0]["id"])

    assert cli(config, state, "burst-enable").returncode == 0
    assert json.loads(cli(config, state, "status", "--json").stdout)["mode"] == "burst-enabled"


def test_with_a_config_that_does_not_validate_revert_local_sets_the_switch_and_the_daemon_brings_the_burst_home(
        tmp_path: Path) -> None:
    # A typo saved while a burst runs: the daemon keeps the settings it last read; revert-local, which cannot know
    # the user's providers from the file, sets the switch and says so; the daemon winds the attempt down and the
    # job finishes locally from the checkpoint that came home.
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url, policy={"hybrid_margin_h": 5.0})
        r = cli(config, state, "enqueue", str(priced_job(tmp_path, "typo-job", steps=250)), "--json")
        job_id = json.loads(r.stdout)["id"]
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: events(state, "checkpoint.synced"), 120, "a checkpoint from the cloud")
            config.write_text(config.read_text() + "\n[budget]\nmonthy_cap_usd = 20\n")
            r = cli(config, state, "revert-local")
            assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
            (line,) = r.stderr.strip().splitlines()
            assert line.startswith("burstctl: error: the kill switch is set: nothing will be launched; this shell "
                                   f"wound nothing down and swept no provider, because {config}: field "
                                   "'budget.monthy_cap_usd': is not a known field (did you mean 'monthly_cap_usd'?); "
                                   "the running daemon (pid "), line
            wait_for(lambda: job(state, job_id)["state"] == "done", 240, "the job to come home and finish locally")
        finally:
            assert daemon.stop() == 0
        assert all(i["status"] in GONE for i in sim_instances(url))
    assert events(state, "daemon.config_rejected")
    (stopped,) = [e for e in events(state, "attempt.stopping") if e["job_id"] == job_id]
    assert stopped["data"]["reason"] == "revert-local"
    resumed = [e for e in events(state, "job.resumed") if e["data"].get("where") == "local"]
    assert resumed and resumed[0]["data"]["checkpoint"]


def test_a_cloud_run_that_ended_well_before_revert_local_saw_it_is_finished_not_brought_home_to_run_again(
        tmp_path: Path) -> None:
    # The trainer exits 0 on the instance while no daemon is watching; revert-local is the first to look. Stopping
    # it would hold this job (it does not fit locally) and `burst-enable` would rent an instance to finish nothing.
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url)
        spec = trainer_job(tmp_path, "ends-alone", steps=60, every=20, extra=("--out", "result.json"),
                           outputs=["result.json"])
        job_id = json.loads(cli(config, state, "enqueue", str(spec), "--json").stdout)["id"]
        daemon = Daemon(tmp_path, config, state).start()
        wait_for(lambda: events(state, "attempt.running"), 120, "the attempt to run")
        assert daemon.stop() == 0
        wait_for(lambda: list((tmp_path / "sim" / "instances").glob("*/**/exit.json")), 60,
                 "the trainer to exit on the instance")
        assert job(state, job_id)["state"] == "running"

        r = cli(config, state, "revert-local")
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"finished (their run had ended; final checkpoint and outputs home): ends-alone ({job_id})" in r.stdout
        report = json.loads(cli(config, state, "revert-local", "--json").stdout)  # the second run: nothing to do
        assert report["instances"] == [] and report["already_local"] == [] and report["all_gone"]
        assert all(i["status"] in GONE for i in sim_instances(url))
    assert job(state, job_id)["state"] == "done"
    assert json.loads((state / "outputs" / job_id / "result.json").read_text())["step"] == 60
    assert [e["data"]["outcome"] for e in events(state, "instance.terminated")] == ["succeeded"]
    assert not events(state, "job.requeued_local") and not events(state, "job.blocked")
    (done,) = events(state, "revert_local.done")[:1]
    assert done["data"]["finished"] == [job_id] and done["data"]["held"] == []


def test_revert_local_with_the_cloud_gone_reports_what_is_unverified(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url)
        cli(config, state, "enqueue", str(priced_job(tmp_path, "burst-job", steps=2000)))
        daemon = Daemon(tmp_path, config, state).start()
        wait_for(lambda: events(state, "attempt.running"), 120, "the attempt to run")
        daemon.kill(signal.SIGTERM)
        # From a shell without simcloud's key (a service's keys live in its env file): sim was never asked what
        # runs there, so nothing on it is confirmed gone, and it says why rather than "no instance was running".
        shell = {k: v for k, v in os.environ.items() if k != "BURSTCTL_SIM_API_KEY"}
        keyless = subprocess.run(burstctl_argv("--config", str(config), "--state-dir", str(state), "revert-local",
                                               "--json", "--timeout", "20"), env=shell, capture_output=True,
                                 text=True, timeout=300)
        assert keyless.returncode == 1
        report = json.loads(keyless.stdout)
        assert not report["all_gone"] and report["left"][0]["terminated"] == "unverified"
        assert "BURSTCTL_SIM_API_KEY" in report["not_swept"]["sim"]
        assert "sim not swept (no API key: set the environment variable BURSTCTL_SIM_API_KEY)" in keyless.stderr
    # simcloud is gone now (its instances died with it): nothing can confirm the instance is gone.
    r = cli(config, state, "revert-local", "--json", "--timeout", "20")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert not report["all_gone"] and report["left"][0]["terminated"] == "unverified"
    assert "not confirmed gone" in r.stderr and report["left"][0]["instance"] in r.stderr
    assert SIM_KEY not in r.stdout + r.stderr


def test_with_every_cloud_unreachable_local_work_goes_on(tmp_path: Path) -> None:
    state = tmp_path / "state"
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    config = write_config(tmp_path, dead)
    work = tmp_path / "w"
    work.mkdir()
    local = tmp_path / "local.toml"
    local.write_text('name = "local-one"\ncommand = ["python3", "-c", "print(42)"]\nworkdir = "w"\n'
                     'deadline_hours = 5\nlocal_throughput = 1\nrented_throughput = { H100 = 2 }\n')
    cloudy = tmp_path / "cloudy.toml"
    cloudy.write_text('name = "needs-cloud"\ncommand = ["python3", "-c", "print(1)"]\nworkdir = "w"\n'
                      'deadline_hours = 5\nlocal_throughput = 0\nrented_throughput = { H100 = 2 }\n')
    assert cli(config, state, "enqueue", str(cloudy)).returncode == 0
    daemon = Daemon(tmp_path, config, state).start()
    try:
        t0 = time.monotonic()
        assert cli(config, state, "enqueue", str(local)).returncode == 0  # deciding and queueing still work
        wait_for(lambda: job(state, "local-one")["state"] == "done", 60, "the local job to finish")
        assert time.monotonic() - t0 < 60
        wait_for(lambda: json.loads(cli(config, state, "status", "--json").stdout)["mode"]
                 == "local-only (no cloud reachable)", 60, "status to report local-only")
        assert job(state, "needs-cloud")["state"] in ("queued", "blocked")
    finally:
        assert daemon.stop() == 0


def test_status_tells_how_the_cloud_answers_now_with_nothing_queued_and_not_after_the_daemon_stops(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    config = write_config(tmp_path, f"http://127.0.0.1:{free_port()}", daemon={"offers_ttl_s": 1.0})
    daemon = Daemon(tmp_path, config, state).start()
    try:
        # Nothing is queued, so nothing needs offers: the daemon still asks each provider once per offers_ttl_s.
        wait_for(lambda: json.loads(cli(config, state, "status", "--json").stdout)["mode"]
                 == "local-only (no cloud reachable)", 30, "status to see the cloud gone")
        first = json.loads(cli(config, state, "status", "--json").stdout)["cloud_health_at"]
        wait_for(lambda: json.loads(cli(config, state, "status", "--json").stdout)["cloud_health_at"] > first, 30,
                 "the providers to be asked again")
        assert "cloud (asked " in cli(config, state, "status").stdout
        # While bursting is off the daemon asks no cloud: the answer shown is the last one, from before.
        cli(config, state, "revert-local", "--timeout", "5")
        assert "before bursting was turned off: not asked until `burstctl burst-enable`" in cli(
            config, state, "status").stdout
        assert cli(config, state, "burst-enable").returncode == 0
    finally:
        assert daemon.stop() == 0
    after = cli(config, state, "status")
    assert "mode: burst-enabled" in after.stdout  # a stopped daemon's last answer is not today's mode
    assert "by the daemon, which is not running): sim UNREACHABLE" in after.stdout


def test_status_says_a_provider_that_refuses_the_daemons_key_refuses_it_and_why_not_that_it_is_unreachable(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        sim_admin(url, "faults", {"kind": "invalid-key", "count": 100000})  # the key revoked
        config = write_config(tmp_path, url, daemon={"offers_ttl_s": 1.0})
        daemon = Daemon(tmp_path, config, state).start()

        def status() -> dict[str, object]:
            return dict(json.loads(cli(config, state, "status", "--json").stdout))

        try:
            wait_for(lambda: status()["cloud_health"] == {"sim": False}, 30, "the daemon to ask sim")
            refused = status()
            assert refused["mode"] == "local-only (the cloud refuses the daemon's requests: see cloud)"
            text = " ".join(cli(config, state, "status").stdout.split())
            # What to do is about the key, not the network: said where the user looks first, naming where it is read.
            assert "sim REFUSES: AuthFailed: GET /instance-types: HTTP 401 global/invalid-api-key" in text
            assert "$BURSTCTL_SIM_API_KEY" in text and "UNREACHABLE" not in text and SIM_KEY not in text
            httpx.delete(f"{url}/_sim/faults", timeout=10).raise_for_status()  # the key accepted again
            wait_for(lambda: status()["mode"] == "burst-enabled", 30, "status to see sim answer again")
            assert status()["cloud_refused"] == {}
            assert "sim answers" in cli(config, state, "status").stdout
        finally:
            assert daemon.stop() == 0


def test_a_cloud_key_no_http_header_can_carry_leaves_that_cloud_unusable_and_local_work_going_on(
        tmp_path: Path) -> None:
    # Pasted with curly quotes from a document: the HTTP client raised an error no adapter maps, the daemon did not
    # start, and local jobs did not run with it, for a cloud that is additive.
    state = tmp_path / "state"
    config = write_config(tmp_path, f"http://127.0.0.1:{free_port()}")
    pasted = f"\u201c{SIM_KEY}\u201d"
    work = tmp_path / "w"
    work.mkdir()
    local = tmp_path / "local.toml"
    local.write_text('name = "local-one"\ncommand = ["python3", "-c", "print(42)"]\nworkdir = "w"\n'
                     'deadline_hours = 5\nlocal_throughput = 1\nrented_throughput = { H100 = 2 }\n')
    daemon = EnvDaemon(tmp_path, config, state).start(env={"BURSTCTL_SIM_API_KEY": pasted})
    try:
        assert cli(config, state, "enqueue", str(local)).returncode == 0
        wait_for(lambda: job(state, "local-one")["state"] == "done", 60, "the local job to finish")
    finally:
        assert daemon.stop() == 0
    said = ("the API key in the environment variable BURSTCTL_SIM_API_KEY cannot be sent in an HTTP header: its "
            "character 1 is U+201C LEFT DOUBLE QUOTATION MARK (pasted with quotes?)")
    r = subprocess.run(burstctl_argv("--config", str(config), "--state-dir", str(state), "providers", "--json"),
                       env={**os.environ, "BURSTCTL_SIM_API_KEY": pasted}, capture_output=True, text=True, timeout=60)
    sim = next(p for p in json.loads(r.stdout)["providers"] if p["name"] == "sim")
    assert sim["problem"] == said and r.returncode == 2 and "internal error" not in r.stderr
    assert SIM_KEY not in r.stdout + r.stderr + (tmp_path / "daemon-1.log").read_text()


def test_with_the_cloud_api_down_revert_local_brings_the_stopped_burst_home_to_finish_and_its_instance_goes_later(
        tmp_path: Path) -> None:
    # The user leaves the cloud while its API is down (503 on every call): revert-local stops the run over SSH and
    # brings its last checkpoint home, but no terminate can be confirmed. The job must not wait for a cloud that may
    # never come back: it finishes here from that checkpoint, while the daemon, restarted meanwhile, keeps its
    # instance metered and keeps asking for its end, which comes once the API answers again.
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url, policy={"hybrid_margin_h": 5.0})
        r = cli(config, state, "enqueue", str(priced_job(tmp_path, "abandoned-cloud", steps=300)), "--json")
        job_id = json.loads(r.stdout)["id"]
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: events(state, "checkpoint.synced"), 120, "a checkpoint from the cloud")
            (instance,) = [i["id"] for i in sim_instances(url)]
            sim_admin(url, "faults", {"kind": "server-error", "status": 503, "count": 1_000_000})  # the API is down

            r = cli(config, state, "revert-local", "--json", "--timeout", "90")
            report = json.loads(r.stdout)
            assert r.returncode == 1, r.stdout + r.stderr  # its instance is not confirmed gone, and says so
            assert report["requeued_local"] == [job_id] and report["not_moved_home"] == {}
            (row,) = report["instances"]
            assert (row["instance"], row["terminated"]) == (instance, "unverified")
            (released,) = events(state, "attempt.released")
            home = released["data"]["checkpoint"]
            assert home is not None and home == row["checkpoint_synced"] and released["data"]["run"] == "stopped"

            # Nothing is held only in memory: a daemon killed now carries on from the database.
            daemon.kill()
            daemon.start()
            wait_for(lambda: job(state, job_id)["state"] == "done", 240, "the job to finish locally, the API down")
            # The provider never answered meanwhile: the instance is still being terminated, said and metered.
            assert all(i["id"] == instance and i["status"] not in GONE for i in sim_instances(url))
            status = json.loads(cli(config, state, "status", "--json").stdout)
            assert [(a["id"], a["state"]) for a in status["attempts"]] == [(released["attempt_id"], "released")]
            assert [i["id"] for i in status["instances"]] == [instance]
            assert [c["ended_at"] for c in ledger(state) if c["instance_id"] == instance] == [None]
            shown = " ".join(cli(config, state, "show", job_id).stdout.split())
            assert f"instance sim {instance} (attempt 1): the job came home without it; being terminated" in shown
            # Its Measured line, written as it finished, says that instance's charge is still to come.
            record = Path(job(state, job_id)["record_path"])
            assert f"; instance sim {instance} is still being terminated: $" in measured_line(record)

            httpx.delete(f"{url}/_sim/faults", timeout=10).raise_for_status()  # the API is back
            wait_for(lambda: all(i["status"] in GONE for i in sim_instances(url)), 90, "the instance terminated")
            wait_for(lambda: all(c["ended_at"] is not None for c in ledger(state)), 60, "its charge closed")
            wait_for(lambda: not json.loads(cli(config, state, "status", "--json").stdout)["instances"], 60,
                     "status to see it gone")
        finally:
            assert daemon.stop() == 0
    (ended,) = [e for e in events(state, "instance.terminated") if e["attempt_id"] == released["attempt_id"]]
    assert ended["data"]["outcome"] == "aborted" and ended["data"]["released"] is True
    # Measured again once that charge was closed: the whole of it, as the ledger has it, in the job's cost.
    line = measured_line(record)
    assert f"cost ${sum(c['cost_usd'] for c in ledger(state)):.2f}" in line and "being terminated" not in line
    assert not events(state, "job.failed") and len(events(state, "job.done")) == 1  # done once, by the local run
    # It resumed here from the checkpoint the stopped run brought home, and nothing of the old instance came home
    # after the job had moved.
    (resumed,) = [e for e in events(state, "job.resumed") if e["data"].get("where") == "local"]
    assert resumed["data"]["checkpoint"] == home and resumed["id"] > released["id"]
    assert not [e for e in events(state, "checkpoint.synced")
                if e["attempt_id"] == released["attempt_id"] and e["id"] > released["id"]]
    assert not [e for e in events(state, "attempt.intent") if e["id"] > released["id"]]  # no launch meanwhile


def test_a_job_released_home_is_not_burst_again_until_its_instance_from_before_is_confirmed_gone(
        tmp_path: Path) -> None:
    # revert-local while the provider does not answer terminates (503s on that call alone): the stopped run's job is
    # released (it does not fit locally, so it waits for burst-enable) and its instance goes on billing until the
    # provider confirms it gone. The user turns bursting back on before that. The job must not be launched on a new
    # instance beside the old one, which still bills and holds its cloud slot: it waits, saying for which instance,
    # and so do burst-enable and status; once the provider confirms the old one gone it bursts again and finishes.
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url)
        r = cli(config, state, "enqueue", str(trainer_job(tmp_path, "no-room-here", steps=300, every=10)), "--json")
        job_id = json.loads(r.stdout)["id"]
        assert not json.loads(r.stdout)["decision"]["fits_locally"]
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: events(state, "checkpoint.synced"), 120, "a checkpoint from the cloud")
            (old,) = [i["id"] for i in sim_instances(url)]
            sim_admin(url, "faults", {"kind": "server-error", "status": 503, "count": 1_000_000,
                                      "route": "instance-operations/terminate"})
            r = cli(config, state, "revert-local", "--json", "--timeout", "90")
            assert r.returncode == 1, r.stdout + r.stderr
            assert json.loads(r.stdout)["held_until_burst_enable"] == [job_id]
            (released,) = events(state, "attempt.released")

            r = cli(config, state, "burst-enable", "--json")
            assert r.returncode == 0, r.stdout + r.stderr
            said = json.loads(r.stdout)["held_for_released_instance"]
            assert list(said) == [job_id] and f"sim {old}" in said[job_id]
            wait_for(lambda: f"sim {old}" in (job(state, job_id)["reason"] or ""), 60,
                     "the job to say it waits for its instance from before")
            time.sleep(5)  # ten ticks of the daemon, which may launch
            assert [i["id"] for i in sim_instances(url) if i["status"] not in GONE] == [old]
            assert [e for e in events(state, "attempt.intent") if e["id"] > released["id"]] == []
            status = json.loads(cli(config, state, "status", "--json").stdout)
            (shown,) = status["attempts"]
            assert shown["state"] == "released" and shown["problem"].startswith(
                f"instance {old} from before revert-local is still being terminated")

            httpx.delete(f"{url}/_sim/faults", timeout=10).raise_for_status()  # the terminate is answered again
            wait_for(lambda: job(state, job_id)["state"] == "done", 240, "the job to burst again and finish")
        finally:
            assert daemon.stop() == 0
        billed = {b["instance_id"]: b for b in sim_billing(url)}
    (ended,) = [e for e in events(state, "instance.terminated") if e["attempt_id"] == released["attempt_id"]]
    (new,) = [i for i in billed if i != old]
    # The new instance was launched only after the old one was confirmed gone: never two billing at once.
    assert billed[new]["launched_at"] >= billed[old]["ended_at"]
    assert next(e for e in events(state, "attempt.intent") if e["id"] > released["id"])["id"] > ended["id"]


def test_instances_their_provider_never_confirms_gone_are_confirmed_gone_by_the_operator_and_what_waited_goes_on(
        tmp_path: Path) -> None:
    # revert-local while the provider's API is down (503 on every call), two spot runs stopped and their last
    # checkpoints home: one job finishes here, measured with its instance's charge still open; the other does not fit
    # here and is held off the cloud while its instance from before is not confirmed gone. The provider never
    # confirms either: its console shows both gone (reclaimed), and the operator says so with when. Each charge ends
    # then, as the provider's word would have ended it, and the month's spend stops growing; the attempts end; the job
    # done is measured again with its whole charge; the held job goes back to its plan and, once the provider answers
    # again, bursts on a new instance and finishes. The daemon runs throughout: it sees the operator's word at its
    # next tick.
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url, policy={"hybrid_margin_h": 5.0, "default_market": "spot"})
        here = json.loads(cli(config, state, "enqueue", str(priced_job(tmp_path, "comes-home", steps=600)),
                              "--json").stdout)["id"]
        away = json.loads(cli(config, state, "enqueue", str(trainer_job(tmp_path, "no-room-here", steps=600, every=10)),
                              "--json").stdout)["id"]
        assert not job(state, away)["decision"]["fits_locally"]
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: {e["job_id"] for e in events(state, "checkpoint.synced")} == {here, away}, 180,
                     "a checkpoint of each from the cloud")
            launched = {e["job_id"]: e["data"]["instance"] for e in events(state, "instance.launched")}
            sim_admin(url, "faults", {"kind": "server-error", "status": 503, "count": 1_000_000})  # the API is down
            r = cli(config, state, "revert-local", "--json", "--timeout", "90")
            assert r.returncode == 1, r.stdout + r.stderr
            report = json.loads(r.stdout)
            assert (report["requeued_local"], report["held_until_burst_enable"]) == ([here], [away])
            assert "`burstctl confirm-gone PROVIDER INSTANCE_ID`" in r.stderr
            released = {e["job_id"]: e for e in events(state, "attempt.released")}
            wait_for(lambda: job(state, here)["state"] == "done", 240, "the job that fits to finish here")
            record = Path(job(state, here)["record_path"])
            assert f"; instance sim {launched[here]} is still being terminated: $" in measured_line(record)
            shown = " ".join(cli(config, state, "show", away).stdout.split())
            assert f"(`burstctl confirm-gone sim {launched[away]}` once you have seen it gone" in shown

            # The operator sees both gone in the console (reclaimed, its API still down), and says so.
            for instance in launched.values():
                httpx.post(f"{url}/_sim/instances/{instance}/preempt", json={}, timeout=10).raise_for_status()
            gone_at = float(int(time.time()) - 1)
            for instance in launched.values():
                r = cli(config, state, "confirm-gone", "sim", instance, "--at",
                        datetime.fromtimestamp(gone_at, UTC).isoformat(), "--json")
                assert r.returncode == 0, r.stdout + r.stderr
                assert json.loads(r.stdout)["by"] == "operator" and SIM_KEY not in r.stdout + r.stderr
            charges = {c["instance_id"]: c for c in ledger(state)}
            for job_id, instance in launched.items():
                charge = charges[instance]
                assert charge["ended_at"] == gone_at
                assert charge["cost_usd"] == pytest.approx(charge["rate_usd_h"] * (gone_at - charge["started_at"])
                                                           / 3600)
                (ended,) = [e for e in events(state, "instance.terminated")
                            if e["attempt_id"] == released[job_id]["attempt_id"]]
                assert (ended["data"]["outcome"], ended["data"]["confirmed_by"]) == ("aborted", "operator")
            said = [e for e in events(state, "instance.confirmed_gone")]
            assert sorted(e["data"]["instance"] for e in said) == sorted(launched.values())
            assert all((e["data"]["by"], e["data"]["at"]) == ("operator", gone_at) for e in said)
            status = json.loads(cli(config, state, "status", "--json").stdout)
            assert status["instances"] == [] and status["attempts"] == []
            assert sorted(g["id"] for g in status["confirmed_gone_by_operator"]) == sorted(launched.values())
            spent = status["month_to_date_usd"]
            time.sleep(2)  # the meter: no charge is open, so nothing accrues
            assert json.loads(cli(config, state, "status", "--json").stdout)["month_to_date_usd"] == spent
            # The job done is measured again, with the whole charge, and says whose word ended it.
            line = measured_line(record)
            assert f"cost ${charges[launched[here]]['cost_usd']:.2f}" in line and "being terminated" not in line
            assert line.endswith(f"instance sim {launched[here]} confirmed gone by the operator, not its provider, "
                                 f"at {datetime.fromtimestamp(gone_at, UTC):%Y-%m-%dT%H:%M:%SZ}: its charge ends then")

            # The held job is held no more: burst-enable puts it back on its plan, and it bursts once the API answers.
            r = cli(config, state, "burst-enable", "--json")
            assert r.returncode == 0 and json.loads(r.stdout)["held_for_released_instance"] == {}, r.stdout
            time.sleep(3)
            assert sorted(i["id"] for i in sim_instances(url)) == sorted(launched.values())  # the API is down
            httpx.delete(f"{url}/_sim/faults", timeout=10).raise_for_status()
            wait_for(lambda: job(state, away)["state"] == "done", 240, "the held job to burst again and finish")
        finally:
            assert daemon.stop() == 0
        billed = {b["instance_id"]: b for b in sim_billing(url)}
    (new,) = [i for i in billed if i not in launched.values()]
    assert billed[new]["launched_at"] >= billed[launched[away]]["ended_at"]  # never two of its instances at once
    # The operator was right: nothing of the old instances was found again, or billed twice.
    assert [c["instance_id"] for c in ledger(state)].count(launched[away]) == 1
    assert not [e for e in events(state, "instance.orphan") if e["data"]["instance"] in launched.values()]
    assert f"cost ${sum(c['cost_usd'] for c in ledger(state) if c['job_id'] == away):.2f}" in measured_line(
        Path(job(state, away)["record_path"]))

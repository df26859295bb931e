"""The daemon applies an edited config file without a restart (at its next tick, or at once on SIGHUP); a file that
does not validate changes nothing, and what was opened at the start (`[state]`, `orchestrator_id`) waits for one."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from orchestrator import daemon as daemon_module
from orchestrator.app import App
from orchestrator.cli import status as status_module
from orchestrator.cli.status import status_data
from orchestrator.config import load_config
from orchestrator.config_watch import ConfigWatch, changed_paths
from orchestrator.queue import enqueue
from tests.conftest import write_job

NO_CLOUD = "[providers.sim]\nenabled = false\n"


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "burstctl.toml"
    path.write_text(text)
    return path


def _daemon_with_an_edit(tmp_path: Path, before: str, after: str, *, ticks: int = 4) -> tuple[App, Path]:
    """Run the daemon in this process for `ticks` ticks; the config file goes from `before` to `after` after the
    second. Returns the daemon's app (closed by the caller) and the file."""
    path = _config(tmp_path, before)
    app = App(config_path=str(path), state_dir_override=str(tmp_path / "state"))

    def on_tick(n: int) -> None:
        if n == 2:
            path.write_text(after)

    daemon_module.run_daemon(app, tick_s=0.1, max_ticks=ticks, on_tick=on_tick)
    return app, path


def test_changed_settings_are_named_by_path_never_by_value() -> None:
    old = {"budget": {"monthly_cap_usd": 15.0, "cycle_gpu": "H100"}, "prices": {"H100": {"spot_usd_h": 1.0}}}
    new = {"budget": {"monthly_cap_usd": 40.0, "cycle_gpu": "H100"}, "prices": {"H100": {"spot_usd_h": 1.0},
                                                                                "A10": {"spot_usd_h": 0.2}}}
    assert changed_paths(old, new) == ["budget.monthly_cap_usd", "prices.A10"]
    assert changed_paths(old, old) == []


def test_an_edit_is_seen_once_and_what_needs_a_restart_is_kept_as_running(tmp_path: Path) -> None:
    path = _config(tmp_path, "[budget]\nmonthly_cap_usd = 15\n[state]\nevents_files_kept = 4\n")
    running = load_config(str(path))
    watch = ConfigWatch(str(path), None, running)
    assert watch.check() is None  # the first look reads the file: unchanged since it was read
    assert watch.check() is None  # and then only a changed file is read
    path.write_text("[budget]\nmonthly_cap_usd = 40\n[state]\nevents_files_kept = 9\n")
    change = watch.check()
    assert change is not None and change.config is not None and change.read is not None
    assert change.applied == ["budget.monthly_cap_usd"]
    assert change.restart_needed == ["state.events_files_kept"]
    assert change.config.budget.monthly_cap_usd == 40
    assert change.config.state.events_files_kept == 4  # the event log was opened with 4: kept until a restart
    assert change.read.state.events_files_kept == 9  # what the file says (status compares it with the file)


def test_a_file_that_does_not_validate_is_rejected_with_one_line_naming_file_and_field(tmp_path: Path) -> None:
    path = _config(tmp_path, "[daemon]\nlocal_concurrency = 1\n")
    watch = ConfigWatch(str(path), None, load_config(str(path)))
    path.write_text("[daemon]\nlocal_concurrency = -1\n")
    change = watch.check()
    assert change is not None and change.config is None
    assert change.error is not None and "\n" not in change.error
    assert change.error.startswith(f"{path}: field 'daemon.local_concurrency':")
    assert watch.running.daemon.local_concurrency == 1


def test_a_raised_budget_cap_frees_a_blocked_job_without_restarting_the_daemon(tmp_path: Path) -> None:
    """The daemon's own loop: the cap is raised in the file between two ticks, and the next tick decides the job
    against the new cap (here no cloud is configured, so it is then blocked for that reason instead)."""
    path = _config(tmp_path, "[budget]\nmonthly_cap_usd = 0.01\n" + NO_CLOUD)
    app = App(config_path=str(path), state_dir_override=str(tmp_path / "state"))
    job_id, decision, _ = enqueue(app, write_job(tmp_path, "big", local_throughput=0, rented_throughput={"H100": 2.0}))
    assert decision.action == "blocked" and "budget" in app.store.get_job(job_id)["reason"]

    def on_tick(n: int) -> None:
        if n == 2:
            path.write_text("[budget]\nmonthly_cap_usd = 100\n" + NO_CLOUD)

    daemon_module.run_daemon(app, tick_s=0.1, max_ticks=4, on_tick=on_tick)
    events = list(app.store.events())
    reloaded = [e for e in events if e["type"] == "daemon.config_reloaded"]
    assert len(reloaded) == 1
    assert reloaded[0]["data"]["changed"] == ["budget.monthly_cap_usd"]
    assert reloaded[0]["data"]["restart_needed"] == []
    assert app.config.budget.monthly_cap_usd == 100
    job = app.store.get_job(job_id)
    assert "budget" not in job["reason"] and "no cloud provider is usable" in job["reason"]
    # status: the daemon read the file as it is now, and nothing waits for a restart.
    app2 = App(config_path=str(path), state_dir_override=str(tmp_path / "state"))
    assert daemon_module.config_fingerprint(app2.config)["sha256"] == \
        app2.store.get_setting(daemon_module.CONFIG_SEEN_KEY)["sha256"]
    app2.close()
    app.close()


def test_sighup_reads_the_file_even_when_its_stamp_did_not_change(tmp_path: Path) -> None:
    """An edit that keeps the file's size and time (a copy with -p, a coarse clock) is seen when asked to."""
    path = _config(tmp_path, "[budget]\nmonthly_cap_usd = 10\n" + NO_CLOUD)
    app = App(config_path=str(path), state_dir_override=str(tmp_path / "state"))
    stamp = path.stat()

    def on_tick(n: int) -> None:
        if n == 2:
            path.write_text("[budget]\nmonthly_cap_usd = 20\n" + NO_CLOUD)
            os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
        if n == 4:
            assert app.config.budget.monthly_cap_usd == 10  # not seen: same size, same time
            os.kill(os.getpid(), signal.SIGHUP)

    before = signal.getsignal(signal.SIGHUP)
    daemon_module.run_daemon(app, tick_s=0.1, max_ticks=6, on_tick=on_tick)
    assert signal.getsignal(signal.SIGHUP) is before
    assert app.config.budget.monthly_cap_usd == 20
    (reloaded,) = (e["data"] for e in app.store.events() if e["type"] == "daemon.config_reloaded")
    assert (reloaded["changed"], reloaded["on_sighup"]) == (["budget.monthly_cap_usd"], True)
    app.close()


def test_a_rejected_edit_leaves_the_daemon_on_its_settings_and_says_why_once(tmp_path: Path) -> None:
    app, path = _daemon_with_an_edit(tmp_path, "[budget]\nmonthly_cap_usd = 10\n" + NO_CLOUD,
                                     "[budget]\nmonthly_cap_usd = 'lots'\n" + NO_CLOUD, ticks=6)
    rejected = [e for e in app.store.events() if e["type"] == "daemon.config_rejected"]
    assert len(rejected) == 1
    assert rejected[0]["data"]["error"] == f"{path}: field 'budget.monthly_cap_usd': expected a number, got a string"
    assert app.config.budget.monthly_cap_usd == 10
    assert not any(e["type"] == "daemon.tick_failed" for e in app.store.events())
    app.close()


def test_status_names_the_settings_that_wait_for_a_restart(tmp_path: Path, monkeypatch) -> None:
    app, path = _daemon_with_an_edit(tmp_path, "[state]\nevents_files_kept = 4\n" + NO_CLOUD,
                                     "[state]\nevents_files_kept = 9\n" + NO_CLOUD)
    seen = app.store.get_setting(daemon_module.CONFIG_SEEN_KEY)
    assert seen["restart_needed"] == ["state.events_files_kept"]
    app.close()
    viewer = App(config_path=str(path), state_dir_override=str(tmp_path / "state"))
    assert status_data(viewer)["config_restart_needed"] == []  # no daemon running: nothing to restart
    # As `status` shows it while that daemon runs: what waits, and that the file is otherwise applied.
    monkeypatch.setattr(status_module, "running_daemon", lambda _app: {"pid": 12345})
    d = status_data(viewer)
    assert d["config_restart_needed"] == ["state.events_files_kept"]
    assert d["config_changed_since_daemon_read_it"] is False
    viewer.close()


def test_an_edit_that_would_drop_a_provider_with_live_instances_is_rejected(tmp_path: Path, monkeypatch) -> None:
    """Disabling a provider while an attempt runs on it would leave its instance billed with nobody to stop it."""
    from apscheduler.schedulers.blocking import BlockingScheduler
    from sqlalchemy import insert

    from orchestrator.lifecycle.service import build_reconciler
    from state import schema as s

    monkeypatch.setenv("BURSTCTL_SIM_API_KEY", "sim-reload-key")
    sim_on = "[providers.sim]\nenabled = true\nbase_url = \"http://127.0.0.1:9/api/v1\"\n"
    path = _config(tmp_path, "[budget]\nmonthly_cap_usd = 10\n" + sim_on)
    app = App(config_path=str(path), state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "big", local_throughput=0, rented_throughput={"H100": 2.0}))
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(id=f"{job_id}-a1", job_id=job_id, n=1, where="cloud", state="running",
                                            provider="sim", instance_type="gpu_1x_h100", market="spot",
                                            idempotency_key="k1", info={}, created_at=0.0))
    running = build_reconciler(app)
    assert set(running.providers) == {"sim"}
    watch = ConfigWatch(str(path), str(tmp_path / "state"), app.config)
    path.write_text("[budget]\nmonthly_cap_usd = 20\n" + NO_CLOUD)

    kept = daemon_module._reload(app, BlockingScheduler(), running, watch, force=False, ticks_fixed=True)
    assert kept is running and app.config.budget.monthly_cap_usd == 10
    rejected = [e for e in app.store.events() if e["type"] == "daemon.config_rejected"]
    assert rejected[-1]["data"]["error"].startswith(f"{path}: provider(s) sim would no longer be usable while "
                                                    "attempts run on them")
    # Once nothing runs there, the same file is taken (on its next change, or SIGHUP: `force`).
    with app.store.tx() as c:
        c.execute(s.attempts.update().values(state="aborted"))
    fresh = daemon_module._reload(app, BlockingScheduler(), running, watch, force=True, ticks_fixed=True)
    assert fresh is not running and fresh.providers == {} and app.config.budget.monthly_cap_usd == 20
    app.close()


def test_a_provider_without_credentials_is_said_once_not_again_at_every_reload(tmp_path: Path,
                                                                                monkeypatch) -> None:
    monkeypatch.delenv("LAMBDA_API_KEY", raising=False)
    lambda_on = NO_CLOUD + "[providers.lambda]\nenabled = true\n"
    app, _ = _daemon_with_an_edit(tmp_path, "[budget]\nmonthly_cap_usd = 10\n" + lambda_on,
                                  "[budget]\nmonthly_cap_usd = 20\n" + lambda_on)
    events = list(app.store.events())
    assert [e["data"]["changed"] for e in events if e["type"] == "daemon.config_reloaded"] == [
        ["budget.monthly_cap_usd"]]
    said = [e for e in events if e["type"] == "provider.unavailable"]
    assert len(said) == 1 and said[0]["data"]["provider"] == "lambda"
    assert "LAMBDA_API_KEY" in said[0]["data"]["problem"]
    app.close()


def test_a_rotated_api_key_file_is_read_again_at_the_next_tick_without_a_restart(tmp_path: Path) -> None:
    """simcloud takes only the new key: the daemon's calls fail with the old one, and succeed once the file holds
    the new one, with no signal and no edit of the config. Neither key reaches an event."""
    from providers.simcloud.api import SimCloudServer

    key = tmp_path / "sim.key"
    key.write_text("old-key-000000\n")
    key.chmod(0o600)
    with SimCloudServer(api_key="new-key-111111") as sim:
        path = _config(tmp_path, f'[providers.sim]\nbase_url = "{sim.api_url}"\napi_key_file = "{key}"\n'
                                 "[daemon]\nsweep_s = 0.1\n")
        app = App(config_path=str(path), state_dir_override=str(tmp_path / "state"))

        def on_tick(n: int) -> None:
            if n == 4:
                key.write_text("new-key-111111\n")

        daemon_module.run_daemon(app, tick_s=0.25, max_ticks=10, on_tick=on_tick)
    events = list(app.store.events())
    (reloaded,) = [e for e in events if e["type"] == "daemon.config_reloaded"]
    assert reloaded["data"]["changed"] == ["providers.sim.api_key_file"]
    # Refused before (a successful call is not kept in the trail), reachable after, and refused no more.
    failed = [e["id"] > reloaded["id"] for e in events if e["type"] == "provider.call"]
    assert failed and not any(failed)
    health = [(e["id"] > reloaded["id"], e["data"]["providers"]) for e in events if e["type"] == "cloud.health"]
    assert health == [(False, {"sim": False}), (True, {"sim": True})]
    trail = str(events) + (tmp_path / "state" / "events.jsonl").read_text()
    assert "old-key-000000" not in trail and "new-key-111111" not in trail
    app.close()

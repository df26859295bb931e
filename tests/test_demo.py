"""`burstctl demo --json`: the newcomer's whole story runs, and leaves nothing behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import run_burstctl

pytestmark = pytest.mark.slow


def _processes_of(*marks: str) -> set[int]:
    """Processes whose command line names one of `marks` (the demo's workdir or state directory): its simcloud,
    daemon and per-instance sshds, and none of another demo's running on the machine at the same time."""
    found = set()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes()
        except OSError:
            continue
        if any(m.encode() in cmd for m in marks):
            found.add(int(p.name))
    found.discard(os.getpid())
    return found


def test_demo_plays_the_whole_story_whatever_the_users_config_and_leaves_nothing_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The user's own config names a key variable that is not set: the demo's simcloud and daemon must not read it.
    user_config = tmp_path / "mine.toml"
    user_config.write_text('[providers.sim]\napi_key_env = "MY_SIM_KEY"\n')
    monkeypatch.setenv("BURSTCTL_CONFIG", str(user_config))
    monkeypatch.delenv("MY_SIM_KEY", raising=False)
    state = tmp_path / "demo-state"  # its trail is kept where the user asked (the default is a throwaway dir)
    r = run_burstctl("--state-dir", str(state), "demo", "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout)
    assert summary["state_dir"] == str(state) and Path(summary["event_log"]) == state / "events.jsonl"
    assert [c["verdict"] for c in summary["candidates"]] == ["local", "burst", "priced"]
    assert summary["candidates"][2]["delta_cost_usd"] == pytest.approx(16.12, abs=0.01)
    spot, home = summary["jobs"]
    assert spot["state"] == "done" and spot["preemptions"] == 1 and spot["attempts"] == 2
    assert home["state"] == "done" and home["where"].endswith("local")
    # Each one's result is in one place, whether it finished on an instance or here after revert-local.
    for job in (spot, home):
        assert job["outputs"] == [str(state / "outputs" / job["id"] / "result.json")]
        assert json.loads(Path(job["outputs"][0]).read_text())["step"] > 0
    assert summary["instances_left"] == 0
    # Its notifier told of each job as it was done, with what the cloud cost, the last one before the daemon exited.
    assert summary["notices"] == [f"burstctl: {j['job']} done (cloud ${j['cost_usd']:.2f})" for j in (spot, home)]
    assert Path(summary["notices_log"]).read_text().splitlines() == summary["notices"]
    assert Path(summary["event_log"]).exists() and any(Path(summary["decision_records"]).iterdir())
    assert Path(summary["workdir"]).name.startswith("burstctl-demo-")
    assert _processes_of(summary["workdir"], str(state)) == set()


def test_the_demo_refuses_a_state_dir_that_is_not_empty_and_changes_nothing(tmp_path: Path) -> None:
    state = tmp_path / "mine"
    state.mkdir()
    (state / "state.db").write_text("the user's")
    r = run_burstctl("--state-dir", str(state), "demo", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"burstctl: error: field '--state-dir': '{state}' is not empty: the demo keeps its state apart from yours; "
        "give a new directory, or none"]
    assert [f.name for f in state.iterdir()] == ["state.db"] and (state / "state.db").read_text() == "the user's"
    r = run_burstctl("--state-dir", str(state / "state.db"), "demo", timeout=60)
    assert r.returncode == 2 and f"'{state / 'state.db'}' is a file: the demo keeps" in r.stderr


def test_the_demo_stops_waiting_as_soon_as_one_of_its_jobs_has_failed_and_says_why(tmp_path: Path) -> None:
    # It waited out its 120 s for a job that had failed in 5 s, then said only that it had timed out.
    from orchestrator.app import App
    from orchestrator.demo import Demo
    from orchestrator.errors import OperationalError
    from orchestrator.queue import enqueue
    from state import schema as s
    from tests.conftest import write_job

    demo = Demo(tmp_path / "demo", say=lambda line: None)
    app = App(state_dir_override=str(demo.state))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "spot-trainer", local_throughput=0))
    assert demo._none_failed()
    with app.store.tx() as c:
        c.execute(s.jobs.update().where(s.jobs.c.id == job_id).values(
            state="failed", reason="gave up after 5 failed steps: PermissionError: [Errno 13] Permission denied"))
    with pytest.raises(OperationalError) as failed:
        demo._none_failed()
    assert str(failed.value) == (
        f"demo: spot-trainer failed: gave up after 5 failed steps: PermissionError: [Errno 13] Permission denied "
        f"(its events: burstctl --state-dir {demo.state} events --job {job_id})")
    app.close()

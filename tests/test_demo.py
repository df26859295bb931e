"""`burstctl demo --json`: the newcomer's whole story runs, and leaves nothing behind: no process, and no directory
per run (each demo empties its own one, ~/.cache/burstctl/demo, and runs there again)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.demo import CHILDREN, DEMO_MARKER, claimed, demo_dir
from orchestrator.errors import OperationalError
from tests.conftest import children_left_by_a_kill, run_burstctl


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


@pytest.mark.slow
def test_demo_plays_the_whole_story_whatever_the_users_config_and_leaves_nothing_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The user's own config names a key variable that is not set: the demo's simcloud and daemon must not read it.
    user_config = tmp_path / "mine.toml"
    user_config.write_text('[providers.sim]\napi_key_env = "MY_SIM_KEY"\n')
    monkeypatch.setenv("BURSTCTL_CONFIG", str(user_config))
    monkeypatch.delenv("MY_SIM_KEY", raising=False)
    # The last demo's files, in its directory: this one empties it and runs there.
    workdir = Path(os.environ["HOME"]) / ".cache" / "burstctl" / "demo"
    (workdir / "state" / "outputs").mkdir(parents=True)
    (workdir / DEMO_MARKER).write_text("the last demo's\n")
    (workdir / "state" / "outputs" / "old.json").write_text("{}")
    state = tmp_path / "demo-state"  # its trail is kept where the user asked (the default is the demo's directory)
    r = run_burstctl("--state-dir", str(state), "demo", "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout)
    assert summary["state_dir"] == str(state) and Path(summary["event_log"]) == state / "events.jsonl"
    assert Path(summary["workdir"]) == workdir and (workdir / DEMO_MARKER).is_file()
    assert not (workdir / "state").exists() and not (workdir / "sim").exists()
    assert [c["verdict"] for c in summary["candidates"]] == ["local", "burst", "priced"]
    assert [c["job"] for c in summary["candidates"]] == ["a-grpo-smoke", "b-full-grpo-7b", "c-big-local-deadline"]
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


def test_each_demo_runs_in_one_directory_in_the_users_cache_not_a_new_one_in_tmp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A directory in /tmp per run piled up, and the closing hint pointed into it.
    assert demo_dir() == Path(os.environ["HOME"]) / ".cache" / "burstctl" / "demo"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert demo_dir() == tmp_path / "cache" / "burstctl" / "demo"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: ignored, as the XDG specification says
    assert demo_dir() == Path(os.environ["HOME"]) / ".cache" / "burstctl" / "demo"


def test_a_demo_empties_the_last_demos_directory_and_keeps_its_mark(tmp_path: Path) -> None:
    workdir = tmp_path / "cache" / "burstctl" / "demo"
    with claimed(workdir):  # made, marked, private
        assert [f.name for f in workdir.iterdir()] == [DEMO_MARKER]
        assert workdir.stat().st_mode & 0o777 == 0o700
        (workdir / "state" / "decisions").mkdir(parents=True)
        (workdir / "state" / "decisions" / "2026-12-05-spot-trainer.md").write_text("# Decision")
        (workdir / "burstctl.toml").write_text("[daemon]\n")
        (workdir / "elsewhere").symlink_to(tmp_path / "yours")
    (tmp_path / "yours").mkdir()
    (tmp_path / "yours" / "keep.txt").write_text("yours")
    with claimed(workdir):  # the next demo: the last one's files are gone; what a link pointed at is not touched
        assert [f.name for f in workdir.iterdir()] == [DEMO_MARKER]
    assert (tmp_path / "yours" / "keep.txt").read_text() == "yours"
    assert (tmp_path / "cache" / "burstctl" / "demo.lock").exists()


def test_a_demo_never_empties_a_directory_it_did_not_make(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("the user's")
    with pytest.raises(OperationalError) as refused, claimed(workdir):
        pytest.fail("claimed a directory holding the user's files")
    assert str(refused.value) == (f"'{workdir}' holds files burstctl demo did not make (it has no {DEMO_MARKER}): "
                                  "move them away, and the demo makes its directory there")
    assert [f.name for f in workdir.iterdir()] == ["notes.txt"]
    (workdir / "notes.txt").unlink()
    with claimed(workdir):  # empty, it is taken, and marked from now on
        assert (workdir / DEMO_MARKER).is_file()
    # A link where the directory goes, even to one that is marked, is not followed.
    (tmp_path / "linked").symlink_to(workdir)
    with pytest.raises(OperationalError, match=r"\(it is a symbolic link\): move it away"), \
            claimed(tmp_path / "linked"):
        pytest.fail("claimed a symbolic link")
    assert (workdir / DEMO_MARKER).is_file()


def test_the_next_demo_ends_the_simcloud_and_daemon_a_demo_killed_outright_left_before_it_empties_their_directory(
        tmp_path: Path) -> None:
    # SIGKILL runs no `finally`: the demo's simcloud and daemon ran on, and the next demo emptied the directory they
    # wrote in under them. A pid written down is ended only while it is the same process (its start ticks).
    from runbooks.supervisor import pid_alive, process_start_ticks

    workdir = tmp_path / "demo"
    with children_left_by_a_kill((
            "import sys, time\n"
            "from pathlib import Path\n"
            "from orchestrator.demo import Demo, claimed\n"
            "with claimed(Path(sys.argv[1])) as w:\n"
            "    Demo(w, say=lambda line: None).start()\n"
            "    print('started', flush=True)\n"
            "    time.sleep(120)\n"), lambda: workdir / CHILDREN, str(workdir)) as records:
        assert set(records) == {"simcloud", "daemon"}
        assert all(pid_alive(pid, start) for pid, start in records.values())  # left running
        # A record whose pid is another process now (here: one started at another time) is not that process's.
        other = subprocess.Popen(["sleep", "60"])
        (workdir / CHILDREN / "00-reused.json").write_text(json.dumps(
            {"name": "reused", "pid": other.pid, "start": (process_start_ticks(other.pid) or 0) - 1}))

        try:
            with claimed(workdir):  # the next demo
                assert [f.name for f in workdir.iterdir()] == [DEMO_MARKER]
                assert not any(pid_alive(pid, start) for pid, start in records.values())
            assert other.poll() is None
        finally:
            other.kill()
            other.wait()


def test_a_second_demo_while_one_runs_is_refused_rather_than_empty_the_first_ones_directory(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    with claimed(workdir):
        (workdir / "state").mkdir()
        with pytest.raises(OperationalError) as refused, claimed(workdir):
            pytest.fail("two demos in one directory")
        assert str(refused.value) == (f"another burstctl demo is running in {workdir}: wait for it to end (each "
                                      "demo runs in that directory)")
        assert (workdir / "state").is_dir()
    with claimed(demo_dir()):  # as a command: one line, exit 1, nothing started
        r = run_burstctl("demo", timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"burstctl: error: another burstctl demo is running in {demo_dir()}: wait for it to end (each demo runs in "
        "that directory)"]


def test_the_demo_refuses_a_state_dir_inside_its_own_directory(tmp_path: Path) -> None:
    inside = demo_dir() / "mine"
    r = run_burstctl("--state-dir", str(inside), "demo", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"burstctl: error: field '--state-dir': '{inside}' is inside {demo_dir()}, which each demo empties: give a "
        "directory elsewhere, or none"]
    assert not demo_dir().exists()

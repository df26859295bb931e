"""The demo's and rehearsals' private child processes: each reads the private config it is given, never the
user's, one that dies is reported at once with its own error line instead of a timeout, and none outlives the
command that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from orchestrator.children import Children, free_port
from orchestrator.errors import OperationalError
from runbooks.supervisor import pid_alive
from tests.conftest import owner_stopped_as_its_child_starts


def _private_config(folder: Path, key_env: str) -> Path:
    path = folder / "private.toml"
    path.write_text(f'[providers.sim]\napi_key_env = "{key_env}"\n\n[state]\ndir = "{folder / "state"}"\n')
    return path


@pytest.mark.parametrize("user_env", ["env.toml", ""], ids=["a-file", "set-but-empty"])
def test_a_child_reads_the_private_config_and_not_burstctl_config_or_the_cwds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, user_env: str) -> None:
    # Both of the user's configs name a key variable that is unset; the private one names one that is set. A
    # $BURSTCTL_CONFIG set but empty, bad input to the user's own commands, does not reach the child either.
    (tmp_path / "burstctl.toml").write_text('[providers.sim]\napi_key_env = "MY_SIM_KEY"\n')
    (tmp_path / "env.toml").write_text('[providers.sim]\napi_key_env = "MY_OTHER_SIM_KEY"\n')
    monkeypatch.setenv("BURSTCTL_CONFIG", str(tmp_path / user_env) if user_env else "")
    private = tmp_path / "private"
    private.mkdir()
    kids = Children(private, {**os.environ, "PRIVATE_SIM_KEY": "k"}, _private_config(private, "PRIVATE_SIM_KEY"))
    assert "BURSTCTL_CONFIG" not in kids.env
    port = free_port()
    try:
        kids.spawn("simcloud", "simcloud", "serve", "--port", str(port), "--state", str(private / "sim"))
        kids.wait(lambda: "serving" in kids.log("simcloud").read_text(), 60, "simcloud to serve")
    finally:
        kids.stop_all()


def test_a_child_that_dies_at_start_is_reported_at_once_with_its_own_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "BURSTCTL_TEST_UNSET_KEY"}
    kids = Children(tmp_path, env, _private_config(tmp_path, "BURSTCTL_TEST_UNSET_KEY"))
    started = time.monotonic()
    try:
        kids.spawn("simcloud", "simcloud", "serve", "--port", str(free_port()), "--state", str(tmp_path / "sim"))
        with pytest.raises(OperationalError) as err:
            kids.wait(lambda: False, 60, "simcloud to answer")
    finally:
        kids.stop_all()
    assert time.monotonic() - started < 30  # not the 60 s timeout: it is known dead as soon as it exits
    message = str(err.value)
    assert "simcloud exited with code 2" in message and "BURSTCTL_TEST_UNSET_KEY is not set" in message
    assert "timed out" not in message and "burstctl: error:" not in message and "\n" not in message


def test_a_stop_signal_as_a_child_starts_still_has_that_child_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # SIGTERM raised between the child's start and its listing in procs left it out of stop_all(): the demo's
    # SIGTERM test, sending it as soon as the daemon's process appeared, once left that daemon running for good.
    import orchestrator.children as children

    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen_then_sigterm(*args: typing.Any, **kwargs: typing.Any) -> subprocess.Popen[bytes]:
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        os.kill(os.getpid(), signal.SIGTERM)  # to this process, as `timeout` or a CI cancel sends it
        return proc

    kids = Children(tmp_path, {**os.environ, "PRIVATE_SIM_KEY": "k"}, _private_config(tmp_path, "PRIVATE_SIM_KEY"))
    monkeypatch.setattr(children.subprocess, "Popen", popen_then_sigterm)
    try:
        with pytest.raises(SystemExit) as stopped:
            try:
                kids.spawn("simcloud", "simcloud", "serve", "--port", str(free_port()), "--state",
                           str(tmp_path / "sim"))
            finally:
                kids.stop_all()
        assert stopped.value.code == 128 + signal.SIGTERM
        (proc,) = started
        assert proc.poll() is not None, "the child started as the signal came runs on"
    finally:
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def test_a_child_whose_owner_was_killed_the_instant_it_started_it_is_ended_by_the_next_run(tmp_path: Path) -> None:
    # Killed between starting a child and writing it down (SIGKILL, the OOM killer), a demo or rehearsal left that
    # simcloud or daemon written down nowhere: the next run could not end it, and it ran for ever. Any other
    # program's process is left alone.
    from orchestrator.child_records import end_left_over

    records = tmp_path / "children"
    starter = ("import os, sys; from pathlib import Path; from orchestrator.children import Children\n"
               "kids = Children(Path(sys.argv[1]), {**os.environ, 'PRIVATE_SIM_KEY': 'k'}, Path(sys.argv[2]), "
               "records=Path(sys.argv[3]))\n"
               "kids.spawn('simcloud', 'simcloud', 'serve', '--port', sys.argv[4], '--state', sys.argv[5])\n")
    config = _private_config(tmp_path, "PRIVATE_SIM_KEY")
    unrelated = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        with owner_stopped_as_its_child_starts(starter, str(tmp_path), str(config), str(records), str(free_port()),
                                               str(tmp_path / "sim")) as orphan:
            assert pid_alive(orphan)  # its owner is gone, it runs on
            assert end_left_over(records) == ["simcloud"]  # what the next demo or rehearsal does first
            assert not pid_alive(orphan) and not list(records.iterdir())
            assert unrelated.poll() is None
    finally:
        unrelated.kill()
        unrelated.wait()


def _running_under(folder: Path) -> list[str]:
    """The command lines of the processes that name `folder` (the demo's children, their machines and jobs)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if str(folder) in line:
            found.append(line)
    return found


def test_a_demo_sent_sigterm_stops_its_children_before_it_exits(tmp_path: Path) -> None:
    # `timeout`, `kill` or a CI job's cancel signal the demo alone: its simcloud and daemon run in sessions of their
    # own, and used to run on for good, owned by init.
    temp = tmp_path / "cache"  # the demo's directory is in it, and named by every child's command line
    temp.mkdir()
    demo = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "demo"],
                            env={**os.environ, "XDG_CACHE_HOME": str(temp)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not any(" daemon" in line for line in _running_under(temp)):
            assert demo.poll() is None and time.monotonic() < deadline, "the demo's daemon never started"
            time.sleep(0.2)
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(90) == 128 + signal.SIGTERM
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while _running_under(temp) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running_under(temp) == []
    workdir = temp / "burstctl" / "demo"  # what state it has stays for reading; its cloud's machines and logs go
    assert (workdir / ".burstctl-demo").is_file() and not (workdir / "sim").exists()

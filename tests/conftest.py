"""Shared fixtures. Every test gets its own state directory and no ambient burstctl config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import settings

from orchestrator.config import toml_value
from tests.postgres import PostgresServer, find_bin_dir

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"

# Hypothesis fails an example that takes longer than 200 ms by default: a timed assertion, which on a shared, loaded
# machine failed a property test at 215 ms. The tests here specify behaviour; speed is measured in benchmarks/.
settings.register_profile("burstctl", deadline=None)
settings.load_profile("burstctl")

# pytest-xdist's `--dist loadfile` deals whole files out in collection order (the Makefile turns off its default
# reordering by test count, which dealt the few-test, minute-long end-to-end files last): the longest go first, so
# that no long file starts near the end and sets the run's tail alone. Seconds per file summed from a CI run's
# `pytest --durations=0` on 2026-12-05 (a loaded machine: about 1.3 times a quiet one's), less the runs since cut;
# files not listed follow in their usual order.
LONGEST_FILES_FIRST = (
    "test_chaos.py",  # 535
    "test_simulate.py",  # 435
    "test_e2e_burst.py",  # 350
    "test_e2e_revert.py",  # 276
    "test_chaos_random.py",  # 253
    "test_faults.py",  # 243
    "test_rehearse.py",  # 238
    "test_e2e_hybrid.py",  # 212
    "test_e2e_spot_market.py",  # 194
    "test_e2e_sync_beside_tick.py",  # 166
    "test_e2e_spot_probe.py",  # 138
    "test_e2e_torchrun.py",  # 136
    "test_retry.py",  # 128
    "test_simcloud_cli.py",  # 125
    "test_e2e_faults.py",  # 112
    "test_sync.py",  # 95
    "test_secrets.py",  # 94
    "test_demo.py",  # 77
    "test_torchrun.py",  # 55
    "test_e2e_ec2_s3.py",  # 54
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)  # the demo's directory: in the test's HOME, below
    # Beside the test's directory, not in it: a job's workdir there must not hold the home (jobspec refuses it).
    home = tmp_path.with_name(f"{tmp_path.name}-home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("BURSTCTL_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    os.makedirs(home, exist_ok=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One private PostgreSQL server per test process. Skipped where PostgreSQL or psycopg is missing, unless
    BURSTCTL_TEST_POSTGRES=require (CI sets it, and installs both), where that is a failure."""
    required = os.environ.get("BURSTCTL_TEST_POSTGRES") == "require"
    bin_dir = find_bin_dir()
    why = None
    if bin_dir is None:
        why = "PostgreSQL's initdb/pg_ctl not found (Debian: apt-get install postgresql)"
    else:
        try:
            import psycopg  # noqa: F401
        except ImportError:
            why = "psycopg not installed (pip install -e '.[postgres]')"
    if why is not None:
        if required:
            pytest.fail(why)
        pytest.skip(why)
    server = PostgresServer(bin_dir).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The store's URL on each backend: SQLite (WAL) in the test's directory, and a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'burstctl.db'}"
    return request.getfixturevalue("postgres_server").new_database()


def run_burstctl(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the real `burstctl` entry point in a subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def burstctl_here(capsys: pytest.CaptureFixture[str]):
    """`burstctl_here(...)`: the CLI run in this process (no interpreter start: a second less a call), its exit
    code and output as a CompletedProcess, like `run_burstctl`'s."""
    from orchestrator.cli import main

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, out, err)

    return run


@pytest.fixture
def burstctl(burstctl_subprocess):
    """`burstctl(...)` with a private state dir; returns the CompletedProcess. A test file whose calls start no
    daemon may run them in its own process instead, overriding this fixture with `burstctl_in_process`."""
    return burstctl_subprocess


@pytest.fixture
def burstctl_subprocess(tmp_path: Path):
    """`burstctl(...)`, the real script in a subprocess, with a private state dir; returns the CompletedProcess."""
    state = tmp_path / "state"

    def _run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
             state_dir: Path | None = state) -> subprocess.CompletedProcess[str]:
        pre = ["--state-dir", str(state_dir)] if state_dir is not None else []
        return run_burstctl(*pre, *args, cwd=cwd or tmp_path, env=env)

    _run.state_dir = state  # type: ignore[attr-defined]
    return _run


@pytest.fixture
def burstctl_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """`burstctl` above, run in this process: the same arguments, working directory and result, without an
    interpreter's start (about 0.7 s of CPU a call). For commands that start no daemon."""
    from orchestrator.cli import main

    state = tmp_path / "state"

    def _run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
             state_dir: Path | None = state) -> subprocess.CompletedProcess[str]:
        argv = [*(["--state-dir", str(state_dir)] if state_dir is not None else []), *args]
        assert "daemon" not in args, "a daemon runs as its own process: `burstctl_subprocess`"
        capsys.readouterr()
        with monkeypatch.context() as m:
            m.chdir(cwd or tmp_path)
            for name, value in (env or {}).items():
                m.setenv(name, value)
            code = main(argv)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(argv, code, out, err)

    _run.state_dir = state  # type: ignore[attr-defined]
    return _run


def write_job(folder: Path, name: str = "job", **fields: object) -> Path:
    """Write a job spec TOML; fields override a valid default job."""
    base: dict[str, object] = {
        "name": name, "kind": "train", "command": ["python", "train.py"], "workdir": ".",
        "deadline_hours": 24, "work_units": 1, "local_throughput": 0.33, "rented_throughput": {"H100": 2.0},
        "checkpoint": {"resumable": True},  # the default job checkpoints; without the table it would not
    }
    base.update(fields)
    lines = []
    tables = []
    for k, v in base.items():
        if v is None:
            continue
        if isinstance(v, dict) and k in ("checkpoint", "env", "model"):
            tables.append((k, v))
        else:
            lines.append(f"{k} = {toml_value(v)}")
    for k, v in tables:
        lines.append(f"[{k}]")
        lines.extend(f"{json.dumps(kk)} = {toml_value(vv)}" for kk, vv in v.items())
    path = folder / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    workdir = folder / str(base.get("workdir") or ".")
    if base.get("command") == ["python", "train.py"] and workdir.is_dir():
        (workdir / "train.py").touch(exist_ok=True)  # the default job's script is there, as intake checks
    return path


@contextmanager
def small_tmpfs(mount_point: Path, size_mib: int) -> Iterator[Path]:
    """A real `size_mib` MiB tmpfs at `mount_point` (needs root and mount(2)); the test is skipped, with the
    reason, when it cannot be mounted."""
    mount_point.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mount_point)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill: {res.stderr.strip() or res.returncode}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def child_processes(pid: int, comm: str) -> list[tuple[int, list[str]]]:
    """(pid, argv) of `pid`'s direct children named `comm`, from /proc. A child that has just exited (a zombie)
    is listed with an empty argv."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat_line = Path(f"/proc/{entry}/stat").read_text()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        except OSError:
            continue
        name = stat_line[stat_line.index("(") + 1:stat_line.rindex(")")]
        ppid = int(stat_line[stat_line.rindex(")") + 2:].split()[1])
        if name == comm and ppid == pid:
            found.append((int(entry), argv))
    return found


@contextmanager
def children_left_by_a_kill(code: str, records: Callable[[], Path], *args: str) -> Iterator[dict[str, tuple[int, int]]]:
    """Run `code` (with `args`) in a Python process until it prints "started", then SIGKILL it, which runs no
    `finally`; yield the children it wrote down in `records()` (`Children(records=...)`) by name: (pid, start
    ticks). What of them still runs once the block ends is killed, whatever the test found."""
    from runbooks.supervisor import pid_alive

    killed = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    try:
        assert killed.stdout is not None and killed.stdout.readline() == "started\n"
        written = {r["name"]: (r["pid"], r["start"]) for r in
                   (json.loads(f.read_text()) for f in records().glob("*.json"))}
    finally:
        killed.kill()
        killed.wait()
    try:
        yield written
    finally:
        for pid, start in written.values():
            if pid_alive(pid, start):
                os.killpg(pid, signal.SIGKILL)


# Run before the owner's code: its first `subprocess.Popen` prints the pid of the child it started, then the owner
# is SIGKILLed right there, before Popen's caller gets the child back (or, for an owner alive in that instant, stays
# there).
_STOPPED_AS_ITS_CHILD_STARTS = """
import os, signal, subprocess, time


class _StoppedOnceStarted(subprocess.Popen):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        print(self.pid, flush=True)
        if KILLED:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)


subprocess.Popen = _StoppedOnceStarted
"""


@contextmanager
def owner_stopped_as_its_child_starts(code: str, *args: str, killed: bool = True) -> Iterator[int]:
    """Run `code` (with `args`) in a Python process stopped the instant its first `subprocess.Popen` has started a
    child: SIGKILLed there (`killed`: no `finally`, nothing after Popen runs), or held there, alive. Yields the
    child's pid, once a killed owner is gone. The owner, and what still runs of the child's session, are killed
    when the block ends, whatever the test found."""
    from runbooks.supervisor import pid_alive, process_start_ticks

    prelude = f"KILLED = {killed}\n{_STOPPED_AS_ITS_CHILD_STARTS}"
    owner = subprocess.Popen([sys.executable, "-c", prelude + code, *args], stdout=subprocess.PIPE, text=True)
    child, start = 0, None
    try:
        assert owner.stdout is not None
        child = int(owner.stdout.readline())
        start = process_start_ticks(child)
        if killed:
            assert owner.wait(30) == -signal.SIGKILL
        yield child
    finally:
        owner.kill()
        owner.wait()
        if pid_alive(child, start):
            os.killpg(child, signal.SIGKILL)


def assert_config_refused(burstctl, tmp_path: Path, text: str, command: str, field: str, says: str) -> None:
    """A config file that does not validate: `burstctl COMMAND` exits 2 with one line naming the file and the field,
    no traceback, and nothing is created in the state directory. COMMAND is not one that only reads the state
    (`STATE_READERS`): those show it before they say the line."""
    from orchestrator.cli.base import STATE_READERS

    assert command not in STATE_READERS
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text(text)
    r = burstctl("--config", str(cfg), command)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"burstctl: error: {cfg}: field '{field}': ") and says in line
    assert not (tmp_path / "state").exists()

"""The idle daemon's cost, measured by hand: resident memory and CPU over 60 s.

    .venv/bin/python benchmarks/daemon_idle.py [--window-s 60] [--jobs 1000] [--tick-s 5]

Three processes are measured over the same window, side by side (so the machine's noise hits them alike):
- baseline: a bare `python -c 'import time; time.sleep(60)'` (the same interpreter);
- `burstctl daemon` with nothing queued;
- `burstctl daemon` with N queued-but-blocked jobs (each must burst — local throughput 0 — and the monthly budget
  cap is $0, so every one is blocked and re-decided by the daemon, a batch per tick).
Both daemons use the default config (tick 5 s, sweep 120 s) against a private simcloud, so the sim provider
answers as it would in a real setup. They get a warm-up (imports, the first tick and sweep) before the window.
CPU is utime + stime from /proc/<pid>/stat over the window; memory is VmRSS from /proc/<pid>/status (the
largest of the once-a-second samples, and the last). Ratios are against the baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
BURSTCTL = [sys.executable, "-c", "from orchestrator.cli import entry; entry()"]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14 and 15 of stat)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Measured:
    name: str
    pid: int
    cpu_start: float = 0.0
    cpu_end: float = 0.0
    rss_max: float = 0.0
    rss_end: float = 0.0

    def sample(self) -> None:
        rss = rss_mib(self.pid)
        self.rss_max = max(self.rss_max, rss)
        self.rss_end = rss


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(path: Path, url: str, state: Path, tick_s: float, cap_usd: float | None) -> None:
    lines = ["[providers.sim]", f'base_url = "{url}/api/v1"', "", "[daemon]", f"tick_s = {tick_s}", "",
             "[state]", f'dir = "{state}"', ""]
    if cap_usd is not None:
        lines += ["[budget]", f"monthly_cap_usd = {cap_usd}", ""]
    path.write_text("\n".join(lines))


def enqueue_blocked(config: Path, state: Path, work: Path, n: int) -> int:
    """N jobs that must burst, with a $0 budget: all blocked. Returns how many ended up blocked."""
    from orchestrator.app import App
    from orchestrator.queue import enqueue

    spec = work.parent / "blocked-job.toml"
    spec.write_text('name = "blocked"\ncommand = ["python3", "-c", "pass"]\nworkdir = "work"\n'
                    'deadline_hours = 48\nlocal_throughput = 0\nrented_throughput = { H100 = 0.5 }\n')
    app = App(config_path=str(config), state_dir_override=str(state))
    try:
        for _ in range(n):
            enqueue(app, spec)
        from sqlalchemy import func, select

        from state import schema as s
        with app.store.engine.connect() as c:
            return int(c.execute(select(func.count()).select_from(s.jobs).where(s.jobs.c.state == "blocked"))
                       .scalar() or 0)
    finally:
        app.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--tick-s", type=float, default=5.0)
    ap.add_argument("--warmup-s", type=float, default=10.0)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="burstctl-bench-idle-"))
    env = {**os.environ, "BURSTCTL_SIM_API_KEY": "bench-idle-key"}
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(argv: list[str], log: str) -> subprocess.Popen[bytes]:
        with (tmp / log).open("w") as fh:
            p = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    try:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        spawn([*BURSTCTL, "simcloud", "serve", "--port", str(port), "--state", str(tmp / "sim")], "simcloud.log")
        for _ in range(100):
            try:
                if httpx.get(f"{url}/_sim/instances", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        (tmp / "work").mkdir()
        setups = {}
        for name, cap in (("empty", None), ("blocked", 0.0)):
            state = tmp / name
            cfg = tmp / f"{name}.toml"
            write_config(cfg, url, state, args.tick_s, cap)
            setups[name] = (cfg, state)
        t = time.perf_counter()
        blocked = enqueue_blocked(*setups["blocked"], tmp / "work", args.jobs)
        print(f"enqueued {args.jobs} jobs ({blocked} blocked) in {time.perf_counter() - t:.1f} s", file=sys.stderr)

        daemons = {name: spawn([*BURSTCTL, "--config", str(cfg), "--state-dir", str(state), "daemon"],
                               f"daemon-{name}.log") for name, (cfg, state) in setups.items()}
        time.sleep(args.warmup_s)
        for name, p in daemons.items():
            if p.poll() is not None:
                raise SystemExit(f"daemon {name} exited: see {tmp}/daemon-{name}.log")
        base = spawn([sys.executable, "-c", f"import time; time.sleep({args.window_s:g})"], "baseline.log")
        rows = [Measured("baseline: python -c 'import time; time.sleep(60)'", base.pid),
                Measured("daemon, nothing queued", daemons["empty"].pid),
                Measured(f"daemon, {blocked} queued-but-blocked jobs", daemons["blocked"].pid)]
        for m in rows[1:]:
            m.cpu_start = cpu_s(m.pid)
        end = time.monotonic() + args.window_s - 0.5  # the baseline exits at the window's end: read it just before
        while time.monotonic() < end:
            for m in rows:
                m.sample()
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
        for m in rows:
            m.sample()
            m.cpu_end = cpu_s(m.pid)
        base.wait(10)

        b = rows[0]
        b_cpu = b.cpu_end - b.cpu_start
        print(f"# idle daemon, {datetime.now(UTC):%Y-%m-%d}, {os.cpu_count()} cores, window {args.window_s:g} s, "
              f"tick {args.tick_s:g} s, sweep 120 s")
        print("| process | CPU over the window | CPU % | × baseline CPU | RSS max / end | × baseline RSS |")
        print("|---|---|---|---|---|---|")
        for m in rows:
            cpu = m.cpu_end - m.cpu_start
            ratio = f"{cpu / b_cpu:.0f}×" if b_cpu > 0 else "(baseline 0 s)"
            print(f"| {m.name} | {cpu:.2f} s | {100 * cpu / args.window_s:.2f} % | {ratio} "
                  f"| {m.rss_max:.1f} / {m.rss_end:.1f} MiB | {m.rss_max / b.rss_max:.1f}× |")
        print(f"(baseline CPU includes its interpreter start-up; clock tick {1 / CLK_TCK:.2f} s)")
        return 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

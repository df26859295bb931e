"""The job supervisor: runs one attempt of a training command on the instance (or locally) and reports through files.

    python3 supervisor.py --run-dir RUN --job-id J --attempt A --checkpoint-dir CKPT [--resume-from PATH]
        [--metadata-url URL] [--heartbeat-s 2] [--notice-poll-s 1] [--grace-s 30] [--gpus N] [--torchrun]
        [--env-file F] [--secret-env NAME ...] [--workdir W] [--max-run-s S] [--s3-uri s3://B/P [--s3-region R]]
        [--setup-json '["pip", "install", "-r", "requirements.txt"]' --setup-dir DIR [--setup-retries N]
        [--setup-retry-s 10]] [--daemonize] [--dry-run] -- CMD ARGS...
    python3 supervisor.py setup --setup-dir DIR --setup-json JSON [--setup-retries N] [--setup-retry-s 10]
        --workdir W [--env-file F] [--secret-env NAME ...] [--daemonize]
        # the setup alone (a successor's, run while its predecessor still trains); one JSON line
    python3 supervisor.py status --run-dir RUN          # one JSON line: heartbeat, exit record, liveness, metrics
    python3 supervisor.py stop --run-dir RUN [--grace-s 30]
    python3 supervisor.py with-env --env-file F -- CMD ARGS...   # exec CMD with the env file's values added
        # (`burstctl ssh --job-env`: a session with the job's environment, without the BURST_* contract's run files)

Files in RUN: supervisor.pid, supervisor.lock (held for the supervisor's life), heartbeat (JSON, atomically
replaced every heartbeat period), exit.json (at the end), stdout.log/stderr.log (the command's output, appended),
metrics.json (written by the trainer via $BURST_METRICS_FILE), supervisor.log (the supervisor's own notes),
s3.json (with --s3-uri: what the uploader put in S3, and its last error).
With --setup-json the job's setup command runs first (heartbeat state "setup", output in DIR/setup.log), once per
instance: DIR/setup-done.json records a success (with the command's hash), after which later attempts and a second
start skip it. DIR/setup.lock is held while a setup runs, so a setup started early by `supervisor.py setup` and the
supervisor that needs it never run it twice at once: the supervisor waits, heartbeating, and a stop or a spot
notice still ends the wait. A setup that fails is run again up to --setup-retries times (after --setup-retry-s,
doubling: a pip install's network blip passes), each try's output after a marker line in setup.log. One that still
fails is reported like a failed command, with reason "setup-failed" and the last line of its output, and the
command never starts.

With --s3-uri every new complete checkpoint is uploaded there (`s3_checkpoints.py upload-newest`, run as a child:
it needs boto3, this file does not), and once more after the command exits and before exit.json is written, so
when the daemon sees the exit the last checkpoint is already in S3. Heartbeats go on during that final upload.

On a spot notice (polled from --metadata-url), on SIGTERM/SIGINT, or at --max-run-s, the command's process group
gets SIGTERM so the trainer can write a last checkpoint, then SIGKILL after --grace-s (burstctl gives the job's
`checkpoint.stop_grace_s`). If the supervisor itself is SIGKILLed it cannot forward anything: the command keeps
running in its own process group, whose id is in the heartbeat (`child_pgid`) so `supervisor.py stop` (SIGTERM, then
SIGKILL after its own --grace-s) or the daemon can end it.

Stdlib-only and Python 3.8+ compatible: the instance may have nothing but a plain `python3`. The daemon also
imports it (`from runbooks import supervisor`) for `launcher_argv`, `read_env_file` and `read_status`.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

PID_FILE = "supervisor.pid"
LOCK_FILE = "supervisor.lock"
HEARTBEAT_FILE = "heartbeat"
EXIT_FILE = "exit.json"
METRICS_FILE = "metrics.json"
STDOUT_LOG = "stdout.log"
STDERR_LOG = "stderr.log"
SUPERVISOR_LOG = "supervisor.log"
S3_FILE = "s3.json"
SETUP_LOCK = "setup.lock"  # in --setup-dir: one per job on the instance, shared by its attempts
SETUP_DONE = "setup-done.json"
SETUP_LOG = "setup.log"
S3_SCRIPT = "s3_checkpoints.py"  # beside this file
MANIFEST = "manifest.json"  # burst_checkpoint's manifest, written last inside a checkpoint

_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TICK_S = 0.1  # how often the main loop looks at the child, the flags and the clock


class BadArgs(Exception):
    """Bad command line or input file: exit 2 with one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]  # one line, not usage + error
        raise BadArgs(message)


# --- small helpers --------------------------------------------------------------------------------------------


def _now() -> float:
    return time.time()


def write_json_atomic(path: Path, obj: object, *, durable: bool = False) -> None:
    """Readers polling `path` see the old or the new content, never a torn write."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        fh.write(json.dumps(obj, sort_keys=True) + "\n")
        if durable:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(str(tmp), str(path))


def read_json(path: Path) -> dict | None:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (index 0 = state), or None without /proc or process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            raw = fh.read()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()


def process_start_ticks(pid: int) -> int | None:
    """The kernel's start time of PID: with the pid it identifies a process even after pid reuse (Linux)."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields else None


def pid_alive(pid: int | None, start_ticks: int | None = None) -> bool:
    """True if PID runs (not a zombie) and, when known, is the same process that had `start_ticks`."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _proc_stat(pid)
    if fields is None:
        return not os.path.isdir("/proc")  # no /proc (not Linux): kill(0) is all we have
    if fields[0] == "Z":
        return False
    return start_ticks is None or int(fields[19]) == start_ticks


def group_alive(pgid: int | None) -> bool:
    """True if process group PGID has a member that is not a zombie."""
    if not pgid or pgid <= 0:
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if not os.path.isdir("/proc"):
        return True
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _proc_stat(int(entry))
            if fields and int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def attempt_processes(run_dir: Path, job_id: str, attempt: int) -> list[int]:
    """Live processes started with this attempt's contract environment (job, attempt, and the run dir through
    BURST_METRICS_FILE): the command and everything it started, in its group or not. torchrun puts each worker in its
    own session, so a SIGKILL to the command's group misses them (and they outlive a killed torchrun). Linux only
    (/proc/PID/environ); elsewhere an empty list."""
    return processes_with_env({f"BURST_JOB_ID={job_id}".encode(), f"BURST_ATTEMPT={attempt}".encode(),
                               f"BURST_METRICS_FILE={Path(run_dir).resolve() / METRICS_FILE}".encode()})


def processes_with_env(wanted: set[bytes]) -> list[int]:
    """Live processes but this one whose environment (as they were started with it) holds every `NAME=value` entry in
    `wanted`. Only this user's are readable. Linux only (/proc/PID/environ); elsewhere an empty list."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = set(fh.read().split(b"\0"))
        except OSError:
            continue
        fields = _proc_stat(int(entry))
        if wanted <= env and fields and fields[0] != "Z":
            found.append(int(entry))
    return found


def parent_pid(pid: int) -> int | None:
    """PID's parent (1, or a subreaper, once its own parent is gone), or None without the process or /proc."""
    fields = _proc_stat(pid)
    return int(fields[1]) if fields else None


def _signal_pids(pids: list[int], sig: int) -> list[int]:
    signalled = []
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            continue
        signalled.append(pid)
    return signalled


def read_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """KEY=VALUE lines (the job's `env` table). Blank lines and lines starting with '#' are skipped; the value is
    everything after the first '=', taken literally (no quotes, no expansion). Errors never echo a value."""
    out = {}
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise BadArgs(f"--env-file {path}: cannot read ({exc.strerror})") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not _ENV_KEY_RE.match(key):
            raise BadArgs(f"--env-file {path}:{lineno}: expected KEY=VALUE with KEY a shell variable name")
        out[key] = value
    return out


SECRET_MIN_CHARS = 4  # shorter values are not scrubbed (as the daemon's redactor): they would mask common words
REDACTED = "***"


def secret_values(names: list[str], env_file_values: dict[str, str]) -> list[str]:
    """The values of `names` (--secret-env: the job's pass_env), from the env file or else this process's
    environment, longest first so a secret that holds another is replaced whole."""
    found = {env_file_values.get(n, os.environ.get(n, "")) for n in names}
    return sorted((v for v in found if len(v) >= SECRET_MIN_CHARS), key=len, reverse=True)


def redact(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return text


def launcher_argv(command: list[str], gpus: int = 1, torchrun: bool = False) -> list[str]:
    """The argv the supervisor executes: the command as given, or under torchrun (one process per GPU).

    A job that asks for torchrun always gets it, one GPU included: its script reads torchrun's RANK/WORLD_SIZE and
    rendezvous variables (the local runner starts it with one GPU). `--standalone`: one node, with a free
    rendezvous port, so two jobs on one host never collide on torchrun's fixed 29500."""
    if torchrun:
        return ["torchrun", "--standalone", f"--nproc_per_node={gpus}", *command]
    return list(command)


def latest_checkpoint_name(ckpt_dir: Path) -> str | None:
    """Newest visible checkpoint with a manifest whose file sizes match (no hashing: this runs every heartbeat;
    the manifest is written last and the directory renamed into place, so this is enough to be complete)."""
    try:
        names = sorted((p.name for p in ckpt_dir.iterdir() if p.is_dir() and not p.name.startswith(".")),
                       reverse=True)
    except OSError:
        return None
    for name in names:
        manifest = read_json(ckpt_dir / name / MANIFEST)
        files = manifest.get("files") if manifest else None
        if not isinstance(files, dict):
            continue
        try:
            if all((ckpt_dir / name / rel).stat().st_size == entry.get("size") for rel, entry in files.items()):
                return name
        except (OSError, AttributeError):
            continue
    return None


# --- the spot notice ------------------------------------------------------------------------------------------
EC2_IMDS_ROOT = "http://169.254.169.254"
# The AWS SDKs' override of the metadata service's address; honoured the same way here (a VPC endpoint, or the
# simulated EC2, which gives each instance its own metadata root).
IMDS_ENDPOINT_VAR = "AWS_EC2_METADATA_SERVICE_ENDPOINT"


def resolve_metadata_url(url: str, env: dict | None = None) -> str:
    """`url` with EC2's fixed metadata root replaced by $AWS_EC2_METADATA_SERVICE_ENDPOINT when that is set."""
    override = (os.environ if env is None else env).get(IMDS_ENDPOINT_VAR, "").strip()
    if override and url.startswith(EC2_IMDS_ROOT + "/"):
        return override.rstrip("/") + url[len(EC2_IMDS_ROOT):]
    return url


def fetch_notice(url: str, timeout: float = 2.0) -> dict | None:
    """The instance-action notice at `url`, or None (404, unreachable, or not a notice). EC2 semantics: 404 until
    a notice exists, then {"action": "terminate", "time": ...}. A 401 means IMDSv2: get a token and ask again."""
    headers: dict[str, str] = {}
    for _ in range(2):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
                body = json.loads(resp.read().decode("utf-8"))
            return body if isinstance(body, dict) and body.get("action") else None
        except urllib.error.HTTPError as exc:
            if exc.code != 401 or headers:
                return None
            token = _imds_token(url, timeout)
            if token is None:
                return None
            headers = {"X-aws-ec2-metadata-token": token}
        except (OSError, ValueError):  # metadata service gone, timeouts, garbage: no notice as far as we know
            return None
    return None


def _imds_token(url: str, timeout: float) -> str | None:
    # The token lives beside meta-data under the same root (which may carry a path prefix).
    parts = urllib.parse.urlsplit(url)
    root = url.split("/latest/", 1)[0] if "/latest/" in url else f"{parts.scheme}://{parts.netloc}"
    token_url = f"{root}/latest/api/token"
    req = urllib.request.Request(token_url, method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "21600"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read().decode("utf-8").strip() or None
    except (OSError, ValueError):
        return None


class NoticePoller(threading.Thread):
    """Polls the metadata URL in the background so a slow or dead metadata service never stalls the heartbeat."""

    def __init__(self, url: str, period_s: float) -> None:
        super().__init__(name="notice-poller", daemon=True)
        self.url = url
        self.period_s = period_s
        self.notice: dict | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            notice = fetch_notice(self.url, timeout=max(0.5, min(2.0, self.period_s)))
            if notice is not None:
                self.notice = notice
                return
            self._stop_event.wait(self.period_s)

    def stop(self) -> None:
        self._stop_event.set()


# --- checkpoints to S3 -----------------------------------------------------------------------------------------
class S3Uploader(threading.Thread):
    """Uploads each new complete checkpoint in the background, one `s3_checkpoints.py upload-newest` child at a
    time; `finish()` makes the last upload after the command exits. RUN/s3.json records the outcome."""

    def __init__(self, args: argparse.Namespace, log: Callable[[str], None], poll_s: float = 1.0) -> None:
        super().__init__(name="s3-uploader", daemon=True)
        self.args = args
        self.log = log
        self.poll_s = poll_s
        self.record: dict = {"uri": args.s3_uri, "uploaded": None, "at": None, "error": None, "failures": 0}
        self._final = threading.Event()
        self._wake = threading.Event()
        self._done: str | None = None  # the newest local checkpoint name handled without error

    def argv(self) -> list[str]:
        script = str(Path(__file__).resolve().parent / S3_SCRIPT)
        region = ["--region", self.args.s3_region] if self.args.s3_region else []
        return [sys.executable, script, "upload-newest", "--uri", self.args.s3_uri,
                "--dir", str(self.args.checkpoint_dir), *region]

    def upload_once(self, timeout_s: float) -> None:
        name = latest_checkpoint_name(self.args.checkpoint_dir)
        if name is None or name == self._done:
            return
        try:
            proc = subprocess.run(self.argv(), capture_output=True, text=True, timeout=timeout_s,
                                  stdin=subprocess.DEVNULL)
            lines = proc.stdout.strip().splitlines()
            result = json.loads(lines[-1]) if lines else {}
            error = None if proc.returncode == 0 else (
                result.get("error") or (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1])
        except subprocess.TimeoutExpired:
            result, error = {}, f"upload took longer than {timeout_s:g}s"
        except (OSError, ValueError) as exc:
            result, error = {}, f"{type(exc).__name__}: {exc}"
        if error is None:
            self._done = name
            self.record.update(uploaded=result.get("uploaded"), at=_now(), error=None, failures=0)
            self.log(f"s3: {result.get('uploaded')} is in {self.args.s3_uri}")
        else:
            self.record.update(error=error[:500], failures=self.record["failures"] + 1)
            self.log(f"s3: upload failed ({self.record['failures']}): {error[:500]}")
        try:
            write_json_atomic(self.args.run_dir / S3_FILE, self.record)
        except OSError as exc:
            self.log(f"s3.json write failed: {exc}")

    def run(self) -> None:
        while not self._final.is_set():
            self.upload_once(self.args.s3_final_timeout_s)
            self._wake.wait(self.poll_s)
        self.upload_once(self.args.s3_final_timeout_s)  # the last checkpoint, written as the command stopped

    def finish(self) -> None:
        self._final.set()
        self._wake.set()


# --- running one attempt --------------------------------------------------------------------------------------


def _positive(kind: type) -> Callable[[str], object]:
    def parse(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value
    return parse


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number, 0 or more, got {text!r}")
    return value


def _code_and_signal(returncode: int) -> tuple[int | None, int | None]:
    """A Popen return code as (exit code, signal): a negative one is the signal that ended the process."""
    return (returncode, None) if returncode >= 0 else (None, -returncode)


def parse_run_args(argv: list[str]) -> argparse.Namespace:
    if "--" in argv:
        split = argv.index("--")
        opts, command = argv[:split], argv[split + 1:]
    else:
        opts, command = argv, []
    p = _Parser(prog="supervisor.py", description="Run one attempt of a job under supervision.")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--job-id", required=True)
    p.add_argument("--attempt", required=True, type=int)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--resume-from", default="")
    p.add_argument("--metadata-url", default="")
    p.add_argument("--heartbeat-s", type=_positive(float), default=2.0)
    p.add_argument("--notice-poll-s", type=_positive(float), default=1.0)
    p.add_argument("--grace-s", type=_positive(float), default=30.0)
    p.add_argument("--gpus", type=_positive(int), default=1)
    p.add_argument("--torchrun", action="store_true")
    p.add_argument("--env-file", default="")
    p.add_argument("--secret-env", action="append", default=[], metavar="NAME",
                   help="a variable (env file or environment) whose value never appears in this run's records")
    p.add_argument("--workdir", default=".")
    p.add_argument("--max-run-s", type=_positive(float), default=None)
    p.add_argument("--s3-uri", default="", help="upload complete checkpoints to this s3://BUCKET/PREFIX")
    p.add_argument("--s3-region", default="")
    p.add_argument("--s3-final-timeout-s", type=_positive(float), default=600.0)
    _add_setup_args(p)
    p.add_argument("--daemonize", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print what would run (argv, cwd, env names) as JSON")
    args = p.parse_args(opts)
    if not command:
        raise BadArgs("no command: give it after '--', e.g. -- python3 train.py")
    args.command = command
    args.run_dir = Path(args.run_dir).resolve()
    args.checkpoint_dir = Path(args.checkpoint_dir).resolve()
    args.workdir = Path(args.workdir).resolve()
    if not args.workdir.is_dir():
        raise BadArgs(f"--workdir: directory '{args.workdir}' does not exist")
    if args.resume_from:
        args.resume_from = str(Path(args.resume_from).resolve())
        if not Path(args.resume_from).is_dir():
            raise BadArgs(f"--resume-from: checkpoint directory '{args.resume_from}' does not exist")
    if args.metadata_url and urllib.parse.urlsplit(args.metadata_url).scheme not in ("http", "https"):
        raise BadArgs("--metadata-url: expected a full http:// URL")
    if args.s3_uri and not re.match(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$", args.s3_uri):
        raise BadArgs("--s3-uri: expected s3://BUCKET/PREFIX")
    args.env_extra = read_env_file(args.env_file) if args.env_file else {}
    args.secrets = secret_values(args.secret_env, args.env_extra)
    _check_setup_args(args)
    return args


def _add_setup_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--setup-json", default="", help="the job's setup command, a JSON list of strings")
    p.add_argument("--setup-dir", default="", help="the setup's lock, log and done record (one per job)")
    p.add_argument("--setup-retries", type=_non_negative_int, default=0,
                   help="run a failed setup again this many times (a network blip in a pip install)")
    p.add_argument("--setup-retry-s", type=_positive(float), default=10.0,
                   help="the wait before the first retry; it doubles for each next one")


def _check_setup_args(args: argparse.Namespace) -> None:
    """`args.setup`: the setup argv ([] without one); `args.setup_dir` resolved."""
    args.setup = []
    if args.setup_json:
        try:
            args.setup = json.loads(args.setup_json)
        except ValueError:
            args.setup = None
        if not (isinstance(args.setup, list) and args.setup and all(isinstance(a, str) for a in args.setup)):
            raise BadArgs("--setup-json: expected a JSON list of strings, e.g. [\"pip\", \"install\", \"-r\", "
                          "\"requirements.txt\"]")
        if not args.setup_dir:
            raise BadArgs("--setup-json needs --setup-dir")
    args.setup_dir = Path(args.setup_dir).resolve() if args.setup_dir else None


def setup_key(argv: list[str]) -> str:
    """What a setup-done record is for: the setup command (an edited one runs again)."""
    return hashlib.sha256(json.dumps(argv).encode()).hexdigest()


def setup_done(setup_dir: Path, argv: list[str]) -> dict | None:
    """The record of this setup's success on this instance, if there is one."""
    record = read_json(setup_dir / SETUP_DONE)
    return record if record and record.get("key") == setup_key(argv) else None


def setup_waits(args: argparse.Namespace) -> list[float]:
    """The wait before each try of the setup: none before the first, then --setup-retry-s, doubling."""
    return [0.0] + [args.setup_retry_s * 2 ** k for k in range(args.setup_retries)]


def mark_setup_try(args: argparse.Namespace, n: int, tries: int) -> None:
    """A line in the setup log before a retry, so that its output reads apart from the failed try's."""
    with open(args.setup_dir / SETUP_LOG, "a") as log:
        log.write(f"--- burstctl: setup try {n} of {tries} ---\n")


def open_setup_lock(setup_dir: Path) -> int:
    setup_dir.mkdir(parents=True, exist_ok=True)
    return os.open(str(setup_dir / SETUP_LOCK), os.O_RDWR | os.O_CREAT, 0o644)


def start_setup(args: argparse.Namespace, env: dict[str, str]) -> subprocess.Popen:
    """The setup command as a child in its own session (a stop ends its whole group), output to its log."""
    with open(args.setup_dir / SETUP_LOG, "ab") as log:
        return subprocess.Popen(args.setup, cwd=str(args.workdir), env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def record_setup_done(args: argparse.Namespace, seconds: float) -> None:
    write_json_atomic(args.setup_dir / SETUP_DONE, {"key": setup_key(args.setup), "seconds": round(seconds, 3),
                                                    "at": _now()}, durable=True)


def burst_env(args: argparse.Namespace) -> dict[str, str]:
    """The variables of the job contract (the env file's come first, so the contract's cannot be overridden)."""
    return {
        "BURST_JOB_ID": args.job_id,
        "BURST_ATTEMPT": str(args.attempt),
        "BURST_CHECKPOINT_DIR": str(args.checkpoint_dir),
        "BURST_RESUME_FROM": args.resume_from or "",
        "BURST_METRICS_FILE": str(args.run_dir / METRICS_FILE),
    }


def dry_run_plan(args: argparse.Namespace) -> dict:
    """What a start would execute. Env-file values are left out: they may be secrets."""
    return {
        "argv": launcher_argv(args.command, args.gpus, args.torchrun),
        "cwd": str(args.workdir),
        "env": burst_env(args),
        "env_file_keys": sorted(args.env_extra),
        "run_dir": str(args.run_dir),
    }


class Supervisor:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_dir: Path = args.run_dir
        self.stop_signal: int | None = None
        self.seq = 0
        self.child: subprocess.Popen | None = None
        self.state = "starting"
        self.started_at = _now()
        self.notice: dict | None = None
        self.s3: dict | None = None
        self.setup_s: float | None = None  # how long this start's setup ran (None: none run by it)
        self.my_start_ticks = process_start_ticks(os.getpid())
        self._log_fh = open(self.run_dir / SUPERVISOR_LOG, "a")  # noqa: SIM115  # open for the whole run

    def log(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._log_fh.write(f"{stamp} [{os.getpid()}] {message}\n")
        self._log_fh.flush()

    def heartbeat(self) -> None:
        self.seq += 1
        child_pid = self.child.pid if self.child else None
        record = {
            "ts": _now(), "seq": self.seq, "state": self.state,
            "supervisor_pid": os.getpid(), "supervisor_start_ticks": self.my_start_ticks,
            "child_pid": child_pid, "child_pgid": child_pid,  # the child leads its own group (new session)
            "job_id": self.args.job_id, "attempt": self.args.attempt, "started_at": self.started_at,
            "last_checkpoint": latest_checkpoint_name(self.args.checkpoint_dir), "notice": self.notice,
            "setup_s": self.setup_s,
        }
        try:
            write_json_atomic(self.run_dir / HEARTBEAT_FILE, record)
        except OSError as exc:  # a full disk must not kill the job; the daemon sees a stale heartbeat instead
            self.log(f"heartbeat write failed: {exc}")

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum

    def run(self) -> int:
        """Run the setup (if any) and start the command, supervise it to the end; returns the exit code to mirror
        (128+N for signal N)."""
        args = self.args
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup semantics: a closing SSH session is not a stop
        self.heartbeat()
        env = {**os.environ, **args.env_extra}  # the setup's; the command also gets the contract's (burst_env)
        poller = (NoticePoller(resolve_metadata_url(args.metadata_url), args.notice_poll_s)
                  if args.metadata_url else None)
        if poller:
            poller.start()
        try:
            if args.setup:
                failed = self._setup(env, poller)
                if failed is not None:
                    return failed
            return self._run_command({**env, **burst_env(args)}, poller)
        finally:
            if poller:
                poller.stop()

    def _setup(self, env: dict[str, str], poller: NoticePoller | None) -> int | None:
        """Run the job's setup unless this instance has done it (an earlier attempt, or this one's early `setup`
        run, waited for if it still runs). None when it is done; else the exit code to mirror, with the exit record
        written (the command never starts)."""
        args = self.args
        self.state = "setup"
        fd = open_setup_lock(args.setup_dir)
        try:
            next_heartbeat = _now() + args.heartbeat_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:  # an early setup runs: wait for it, still stoppable
                    pass
                reason = self._stop_wanted(poller)
                if reason is not None:
                    return self._finish(None, None, reason, error="stopped while waiting for the setup")
                if _now() >= next_heartbeat:
                    self.heartbeat()
                    next_heartbeat = _now() + args.heartbeat_s
                time.sleep(_TICK_S)
            if setup_done(args.setup_dir, args.setup):
                self.log("setup: already done on this instance")
                return None
            self.log(f"setup: starting {json.dumps(args.setup)} in {args.workdir}")
            self.heartbeat()
            started = _now()
            waits, code = setup_waits(args), 0
            for n, wait_s in enumerate(waits, start=1):
                if wait_s:
                    self.log(f"setup: failed (exit {code}); try {n} of {len(waits)} in {wait_s:g}s")
                    self.child = None
                    if (reason := self._pause(wait_s, poller)) is not None:
                        return self._finish(None, None, reason, error="stopped between tries of the setup")
                    mark_setup_try(args, n, len(waits))
                try:
                    self.child = start_setup(args, env)
                except OSError as exc:  # not there, not executable: another try would not change it
                    return self._finish(127 if isinstance(exc, FileNotFoundError) else 126, None, "setup-failed",
                                        error=f"cannot start the setup {args.setup[0]!r}: {exc.strerror}")
                stop_reason = self._watch(self.child, poller, max_run_s=None)
                code = self._reap(self.child)
                if stop_reason is not None:
                    return self._finish(*_code_and_signal(code), stop_reason, tail_of=args.setup_dir / SETUP_LOG)
                if code == 0:
                    break
            else:
                return self._finish(*_code_and_signal(code), "setup-failed", tail_of=args.setup_dir / SETUP_LOG,
                                    error=f"the setup failed {len(waits)} times" if len(waits) > 1 else None)
            self.setup_s = _now() - started
            record_setup_done(args, self.setup_s)
            self.log(f"setup: done in {self.setup_s:.1f}s")
            self.child = None
            return None
        finally:
            os.close(fd)  # releases the lock

    def _pause(self, seconds: float, poller: NoticePoller | None) -> str | None:
        """Wait `seconds`, heartbeating, unless a stop is wanted first: then why."""
        now = _now()
        until, next_heartbeat = now + seconds, now
        while (now := _now()) < until:
            if (reason := self._stop_wanted(poller)) is not None:
                return reason
            if now >= next_heartbeat:
                self.heartbeat()
                next_heartbeat = now + self.args.heartbeat_s
            time.sleep(min(_TICK_S, until - now))
        return None

    def _run_command(self, env: dict[str, str], poller: NoticePoller | None) -> int:
        args = self.args
        argv = launcher_argv(args.command, args.gpus, args.torchrun)
        args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.log(f"attempt {args.attempt} of job {args.job_id}: starting {json.dumps(argv)} in {args.workdir} "
                 f"(env file keys: {sorted(args.env_extra)})")
        try:
            with open(self.run_dir / STDOUT_LOG, "ab") as out, open(self.run_dir / STDERR_LOG, "ab") as err:
                self.child = subprocess.Popen(argv, cwd=str(args.workdir), env=env, stdin=subprocess.DEVNULL,
                                              stdout=out, stderr=err, start_new_session=True)
        except OSError as exc:
            self.log(f"cannot start the command: {exc.strerror}")
            return self._finish(127 if isinstance(exc, FileNotFoundError) else 126, None, "failed",
                                error=f"cannot start {argv[0]!r}: {exc.strerror}")
        self.state = "running"
        self.heartbeat()
        uploader = S3Uploader(args, self.log) if args.s3_uri else None
        if uploader:
            uploader.start()
        stop_reason = self._watch(self.child, poller, max_run_s=args.max_run_s)
        code = self._reap(self.child)
        exit_code, sig = _code_and_signal(code)
        reason = stop_reason or ("completed" if code == 0 else "failed")
        if uploader:
            self._final_upload(uploader)
        return self._finish(exit_code, sig, reason)

    def _stop_wanted(self, poller: NoticePoller | None) -> str | None:
        """Why the run must stop now, if it must: a signal to the supervisor, or a spot notice."""
        if self.stop_signal is not None:
            return "terminated"
        if poller is not None and poller.notice is not None:
            self.notice = poller.notice
            return "notice"
        return None

    def _watch(self, child: subprocess.Popen, poller: NoticePoller | None, max_run_s: float | None) -> str | None:
        """Heartbeat until `child` exits; on a stop (`_stop_wanted`, or `max_run_s` up) SIGTERM its group, then
        SIGKILL after the grace period. Returns why it was stopped, or None when it exited by itself."""
        args = self.args
        child_started = _now()
        next_heartbeat = child_started + args.heartbeat_s
        stop_reason: str | None = None
        kill_at: float | None = None
        while True:
            # Look without reaping: while the exited leader is a zombie its pid (= the group id) cannot be reused,
            # so the straggler kill below cannot hit a stranger's group.
            if os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                break
            now = _now()
            if stop_reason is None:
                stop_reason = self._stop_wanted(poller)
                if stop_reason is None and max_run_s is not None and now - child_started >= max_run_s:
                    stop_reason = "max-run-time"
                if stop_reason is not None:
                    self.log(f"stopping ({stop_reason}): SIGTERM to process group {child.pid}, "
                             f"SIGKILL in {args.grace_s:g}s")
                    self.state = "stopping"
                    _signal_group(child.pid, signal.SIGTERM)
                    kill_at = now + args.grace_s
                    next_heartbeat = now
            elif kill_at is not None and now >= kill_at:
                self.log(f"grace period over: SIGKILL to process group {child.pid}")
                _signal_group(child.pid, signal.SIGKILL)
                self._kill_strays()
                kill_at = None
            if now >= next_heartbeat:
                self.heartbeat()
                next_heartbeat = now + args.heartbeat_s
            time.sleep(_TICK_S)
        return stop_reason

    def _reap(self, child: subprocess.Popen) -> int:
        """End what `child` left running (its group, and this attempt's processes outside it); its return code."""
        if group_alive(child.pid):  # the command left processes behind in its group: end them with it
            _signal_group(child.pid, signal.SIGKILL)
            self.log(f"killed leftover processes of group {child.pid}")
        self._kill_strays()
        return child.wait()

    def _kill_strays(self) -> None:
        """SIGKILL what the command started outside its group (e.g. torchrun's workers) and left running."""
        killed = _signal_pids(attempt_processes(self.run_dir, self.args.job_id, self.args.attempt), signal.SIGKILL)
        if killed:
            self.log(f"killed processes of this attempt outside group {self.child.pid if self.child else None}: "
                     f"{killed}")

    def _final_upload(self, uploader: S3Uploader) -> None:
        """Before the exit is reported: whoever sees it may rely on the last checkpoint being in S3."""
        self.state = "uploading"
        uploader.finish()
        deadline = _now() + self.args.s3_final_timeout_s + 5
        while uploader.is_alive() and _now() < deadline:
            self.heartbeat()
            uploader.join(self.args.heartbeat_s)
        self.s3 = dict(uploader.record)

    def _finish(self, exit_code: int | None, sig: int | None, reason: str, error: str | None = None,
                tail_of: Path | None = None) -> int:
        record = {
            "job_id": self.args.job_id, "attempt": self.args.attempt,
            "exit_code": exit_code, "signal": sig,
            "signal_name": signal.Signals(sig).name if sig else None,
            "reason": reason, "started_at": self.started_at, "ended_at": _now(),
            "last_checkpoint": latest_checkpoint_name(self.args.checkpoint_dir),
            "notice": self.notice, "child_pid": self.child.pid if self.child else None,
        }
        if self.s3 is not None:
            record["s3"] = self.s3
        if error:
            record["error"] = error
        if self.setup_s is not None:
            record["setup_s"] = round(self.setup_s, 3)
        if exit_code not in (0, None) or reason in ("failed", "setup-failed"):
            # Why it failed, in the command's own words: the daemon has only this record, not the log.
            record["stderr_tail"] = last_line(tail_of or self.run_dir / STDERR_LOG, secrets=self.args.secrets)
        write_json_atomic(self.run_dir / EXIT_FILE, record, durable=True)
        self.state = "exited"
        self.heartbeat()
        self.log(f"exited: reason={reason} exit_code={exit_code} signal={sig}")
        print(json.dumps(record, sort_keys=True), flush=True)
        return exit_code if exit_code is not None else 128 + (sig or 0)


# Lines a tool prints after its error that say nothing of it: pip's advice to upgrade itself follows almost every
# failure of an out-of-date pip ("[notice] To update, run: pip install --upgrade pip").
TRAILER_NOISE = re.compile(r"\[notice\] |WARNING: You are using pip version |You should consider upgrading via ")


def last_line(path: Path, limit: int = 300, secrets: list[str] | None = None) -> str | None:
    """The last non-empty line of a log that is not a tool's trailing advice (read from its end, whatever its size),
    with `secrets` replaced and then cut to `limit` characters: cut first, a secret's first characters would stay."""
    try:
        with open(path, "rb") as fh:
            start = max(0, fh.seek(0, os.SEEK_END) - 8192)
            fh.seek(start)
            text = fh.read().decode(errors="replace")
    except OSError:
        return None
    if start:  # begun mid-line, maybe mid-secret: only whole lines
        text = text.partition("\n")[2]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    said = [ln for ln in lines if not TRAILER_NOISE.match(ln)] or lines
    if not said:
        return "(its last line is longer than 8 KiB)" if start else None
    return redact(said[-1], secrets or [])[:limit]


def _claim_run_dir(args: argparse.Namespace) -> tuple[dict, int | None]:
    """Take the run dir's lock or find out who holds it. Returns (report, lock fd); fd None means do not run."""
    run_dir: Path = args.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(run_dir / LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        # A live supervisor holds the lock. Which attempt? Its first heartbeat may still be on its way.
        deadline = _now() + 5.0
        beat = read_json(run_dir / HEARTBEAT_FILE)
        while (beat is None or not pid_alive(beat.get("supervisor_pid"))) and _now() < deadline:
            time.sleep(0.05)
            beat = read_json(run_dir / HEARTBEAT_FILE)
        same = bool(beat and beat.get("attempt") == args.attempt and beat.get("job_id") == args.job_id)
        return ({"status": "already-running" if same else "busy",
                 "supervisor_pid": beat.get("supervisor_pid") if beat else None,
                 "attempt": beat.get("attempt") if beat else None}, None)
    beat = read_json(run_dir / HEARTBEAT_FILE)
    if beat and beat.get("state") != "exited" and group_alive(beat.get("child_pgid")):
        # Its supervisor was killed but the command still runs: a second copy would write the same checkpoints.
        os.close(fd)
        return {"status": "orphaned-child", "child_pgid": beat.get("child_pgid"), "attempt": beat.get("attempt")}, None
    previous = read_json(run_dir / EXIT_FILE)
    if previous and previous.get("attempt") == args.attempt and previous.get("job_id") == args.job_id:
        os.close(fd)
        return {"status": "already-exited", "exit": previous}, None
    if previous:  # an earlier attempt in the same run dir: keep its record, out of the way of `status`
        os.replace(str(run_dir / EXIT_FILE), str(run_dir / f"exit-attempt-{previous.get('attempt')}.json"))
    write_json_atomic(run_dir / HEARTBEAT_FILE, {"ts": _now(), "seq": 0, "state": "starting",
                                                 "supervisor_pid": os.getpid(), "job_id": args.job_id,
                                                 "attempt": args.attempt})
    with open(run_dir / f".{PID_FILE}.tmp", "w") as fh:
        fh.write(f"{os.getpid()}\n")
    os.replace(str(run_dir / f".{PID_FILE}.tmp"), str(run_dir / PID_FILE))
    return {"status": "started", "supervisor_pid": os.getpid(), "attempt": args.attempt}, fd


def _report_code(report: dict) -> int:
    """0 when the attempt is (or was) running as asked; 1 when the run dir belongs to something else."""
    if report["status"] in ("busy", "orphaned-child"):
        print(f"supervisor: error: run dir in use ({report['status']}, attempt {report.get('attempt')}); "
              f"`supervisor.py stop` ends it", file=sys.stderr)
        return 1
    return 0


def start(args: argparse.Namespace) -> int:
    """Foreground start: claim the run dir, print the start report, supervise, mirror the command's exit code."""
    report, fd = _claim_run_dir(args)
    print(json.dumps(report, sort_keys=True), flush=True)
    if fd is None:
        return _report_code(report)
    return Supervisor(args).run()


def start_daemonized(args: argparse.Namespace) -> int:
    """Double fork and setsid so the starting SSH session may close; the caller gets the start report on stdout
    once the supervisor has claimed the run dir (or found it claimed)."""
    args.run_dir.mkdir(parents=True, exist_ok=True)
    read_fd, write_fd = os.pipe()
    first = os.fork()
    if first > 0:
        os.close(write_fd)
        chunks = []
        while True:
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(read_fd)
        os.waitpid(first, 0)
        try:
            report = json.loads(b"".join(chunks).decode())
        except ValueError:
            print(f"supervisor: error: the daemonized supervisor died before starting; see "
                  f"{args.run_dir / SUPERVISOR_LOG}", file=sys.stderr)
            return 1
        print(json.dumps(report, sort_keys=True), flush=True)
        return _report_code(report)

    os.close(read_fd)

    def supervise() -> int:
        report, fd = _claim_run_dir(args)
        os.write(write_fd, json.dumps(report).encode())
        os.close(write_fd)
        return Supervisor(args).run() if fd is not None else _report_code(report)

    _run_detached(args.run_dir / SUPERVISOR_LOG, supervise)


def _run_detached(log: Path, body: Callable[[], int]) -> NoReturn:
    """In a forked child: a session of its own, forked once more (no controlling terminal can come back), stdin
    from /dev/null and output appended to `log`; run `body` and exit with its code, never returning into the
    caller's code (a traceback goes to `log`)."""
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        log_fd = os.open(str(log), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        code = body()
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# --- status and stop ------------------------------------------------------------------------------------------


def read_status(run_dir: str | os.PathLike[str]) -> dict:
    """Everything the daemon polls, in one dict: heartbeat, exit record, metrics, and who is still alive."""
    run = Path(run_dir)
    beat = read_json(run / HEARTBEAT_FILE)
    try:
        pid: int | None = int((run / PID_FILE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pid = None
    ticks = beat.get("supervisor_start_ticks") if beat and beat.get("supervisor_pid") == pid else None
    pgid = beat.get("child_pgid") if beat else None
    return {
        "run_dir": str(run), "now": _now(),
        "supervisor_pid": pid, "supervisor_alive": pid_alive(pid, ticks),
        "child_pgid": pgid, "child_alive": group_alive(pgid),
        "heartbeat": beat, "exit": read_json(run / EXIT_FILE), "metrics": read_json(run / METRICS_FILE),
        "s3": read_json(run / S3_FILE),
    }


def stop(run_dir: Path, grace_s: float) -> dict:
    """Ask for a last checkpoint and an end: SIGTERM the live supervisor (it forwards and escalates), or, if the
    supervisor is gone, SIGTERM the orphaned command group, wait up to `grace_s`, then SIGKILL it."""
    status = read_status(run_dir)
    if status["supervisor_alive"]:
        os.kill(status["supervisor_pid"], signal.SIGTERM)
        return {"signalled": "supervisor", "pid": status["supervisor_pid"]}
    pgid = status["child_pgid"]
    beat = status["heartbeat"] or {}

    def strays() -> list[int]:  # the attempt's processes outside the group (torchrun's workers)
        pids = attempt_processes(run_dir, beat["job_id"], beat["attempt"]) if beat.get("job_id") else []
        return [pid for pid in pids if (fields := _proc_stat(pid)) and int(fields[2]) != pgid]

    if not status["child_alive"] and not strays():
        return {"signalled": None}
    _signal_group(pgid, signal.SIGTERM)
    _signal_pids(strays(), signal.SIGTERM)
    deadline = _now() + grace_s
    while (group_alive(pgid) or strays()) and _now() < deadline:
        time.sleep(_TICK_S)
    killed = group_alive(pgid) and _signal_group(pgid, signal.SIGKILL)
    killed = bool(_signal_pids(strays(), signal.SIGKILL)) or killed
    return {"signalled": "child-group", "pgid": pgid, "killed": bool(killed)}


def parse_setup_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog="supervisor.py setup")
    _add_setup_args(p)
    p.add_argument("--workdir", required=True)
    p.add_argument("--env-file", default="")
    p.add_argument("--secret-env", action="append", default=[], metavar="NAME",
                   help="a variable (env file or environment) whose value never appears in this run's records")
    p.add_argument("--daemonize", action="store_true")
    args = p.parse_args(argv)
    if not args.setup_json:
        raise BadArgs("--setup-json is required")
    _check_setup_args(args)
    args.workdir = Path(args.workdir).resolve()
    if not args.workdir.is_dir():
        raise BadArgs(f"--workdir: directory '{args.workdir}' does not exist")
    args.env_extra = read_env_file(args.env_file) if args.env_file else {}
    args.secrets = secret_values(args.secret_env, args.env_extra)
    return args


def run_setup(args: argparse.Namespace) -> dict:
    """The setup alone, ahead of the supervisor that needs it (which then finds it done, or waits for it): run
    unless done, waiting for a setup already running. Its result, as one JSON-able dict."""
    fd = open_setup_lock(args.setup_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if setup_done(args.setup_dir, args.setup):
            return {"status": "done-already"}
        started = _now()
        waits, code = setup_waits(args), 0
        for n, wait_s in enumerate(waits, start=1):
            if wait_s:
                time.sleep(wait_s)
                mark_setup_try(args, n, len(waits))
            try:
                code = start_setup(args, {**os.environ, **args.env_extra}).wait()
            except OSError as exc:
                return {"status": "failed", "error": f"cannot start the setup {args.setup[0]!r}: {exc.strerror}"}
            if code == 0:
                break
        else:
            return {"status": "failed", "exit_code": code, "tries": len(waits),
                    "tail": last_line(args.setup_dir / SETUP_LOG, secrets=args.secrets)}
        record_setup_done(args, _now() - started)
        return {"status": "done", "seconds": round(_now() - started, 3)}
    finally:
        os.close(fd)


def setup_command(args: argparse.Namespace) -> int:
    """`supervisor.py setup`: in the foreground, or detached (--daemonize: the SSH session that starts it may
    close; the caller gets {"status": "started"} at once and finds the outcome in the setup dir)."""
    if not args.daemonize:
        result = run_setup(args)
        print(json.dumps(result, sort_keys=True), flush=True)
        return 0 if result["status"] != "failed" else 1
    args.setup_dir.mkdir(parents=True, exist_ok=True)
    if os.fork() > 0:
        print(json.dumps({"status": "started"}), flush=True)
        return 0
    _run_detached(args.setup_dir / SETUP_LOG, lambda: 0 if run_setup(args)["status"] != "failed" else 1)


def with_env(argv: list[str]) -> int:
    """Replace this process with CMD, its environment this one's plus the env file's values. A command that cannot
    be run exits 127 (not found) or 126, as a shell's would."""
    split = argv.index("--") if "--" in argv else len(argv)
    p = _Parser(prog="supervisor.py with-env")
    p.add_argument("--env-file", required=True)
    args, command = p.parse_args(argv[:split]), argv[split + 1:]
    if not command:
        raise BadArgs("a command is required after --")
    env = {**os.environ, **read_env_file(args.env_file)}
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print(f"supervisor: {command[0]}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    return 0  # not reached: exec replaced this process


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["setup"]:
            return setup_command(parse_setup_args(argv[1:]))
        if argv[:1] == ["with-env"]:
            return with_env(argv[1:])
        if argv[:1] in (["status"], ["stop"]):
            p = _Parser(prog=f"supervisor.py {argv[0]}")
            p.add_argument("--run-dir", required=True)
            if argv[0] == "stop":
                p.add_argument("--grace-s", type=_positive(float), default=30.0)
            sub = p.parse_args(argv[1:])
            run_dir = Path(sub.run_dir)
            if not run_dir.is_dir():
                raise BadArgs(f"--run-dir: directory '{run_dir}' does not exist")
            result = read_status(run_dir) if argv[0] == "status" else stop(run_dir, sub.grace_s)
            print(json.dumps(result, sort_keys=True), flush=True)
            return 0
        args = parse_run_args(argv)
        if args.dry_run:
            print(json.dumps(dry_run_plan(args), sort_keys=True), flush=True)
            return 0
        return start_daemonized(args) if args.daemonize else start(args)
    except BadArgs as exc:
        print(f"supervisor: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`exclude` in a job file: what the push of its workdir to a rented instance leaves out, on top of the fixed
patterns (.git, __pycache__, *.pyc, .venv, and checkpoint.dir). rsync's --exclude and the SFTP fallback's own walker
leave out the same files: a real workdir is pushed over real SSH (an OpenSSH sshd, and simcloud's paramiko server)
by both transports, and the walker's reading of patterns is held to rsync's own. A bad pattern is bad input: exit 2,
one line naming the file and the field, nothing queued."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator import jobspec
from orchestrator.errors import BadInput
from orchestrator.lifecycle.cloud_steps import EXCLUDE, push_exclude
from orchestrator.rehearse import rehearsal_spec
from orchestrator.remote.ssh import MemoryHostKeyTrust, Target, generate_keypair
from orchestrator.remote.sync import Transport, compile_excludes, push_dir, pushed_paths
from providers.simcloud.ssh_backend import SshBackend, openssh_available
from tests.conftest import write_job

HAVE_RSYNC = shutil.which("rsync") is not None and shutil.which("ssh") is not None
needs_rsync = pytest.mark.skipif(not HAVE_RSYNC, reason="rsync/ssh not installed")
SERVERS = [pytest.param("openssh", marks=pytest.mark.skipif(not openssh_available(), reason="sshd not installed")),
           "paramiko"]

# A workdir as a training job leaves it: the script and its code, and beside them what no instance needs.
WORKDIR_FILES = [
    "train.py", "config.yaml", "wandb.py", "notes.ckpt.txt",
    "data/vocab.json", "data/raw/shard-0.bin", "data/raw/shard-1.bin",
    "src/model.py", "src/data/raw/fixture.bin", "src/wandb/notes.txt", "src/checkpoints/README", "src/cache/kv.bin",
    "tools/wandb",  # a file named like an excluded directory
    "wandb/run-1/files/output.log", "cache/tokens.bin",
    "model.ckpt", "runs/old/epoch-3.ckpt",
    "checkpoints/step-1/w.bin",  # checkpoint.dir: the trainer's store outside burstctl
    ".git/HEAD", "src/__pycache__/model.cpython-312.pyc", "util.pyc", ".venv/bin/python",
]
JOB_EXCLUDE = ["data/raw/", "wandb/", "*.ckpt", "**/cache/"]
# What reaches the instance, directories included: "data/raw/" has a '/' inside, so it is the workdir's data/raw
# only (src/data/raw stays); "wandb/" matches a directory at any depth, not a file of that name; "*.ckpt" a name at
# any depth; "**/cache/" a directory at any depth, the top included. checkpoint.dir is the workdir's own (not
# src/checkpoints). A directory whose every file is left out still goes, empty (runs/old), as with rsync.
PUSHED = {
    "train.py", "config.yaml", "wandb.py", "notes.ckpt.txt",
    "data/", "data/vocab.json",
    "src/", "src/model.py", "src/data/", "src/data/raw/", "src/data/raw/fixture.bin", "src/checkpoints/",
    "src/checkpoints/README",
    "tools/", "tools/wandb",
    "runs/", "runs/old/",
}


def make_workdir(root: Path) -> Path:
    for rel in WORKDIR_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"{rel}\n")
    return root


def tree(root: Path) -> set[str]:
    """Every entry under `root`, relative to it, directories with a trailing '/'."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        found |= {prefix + d + "/" for d in dirnames} | {prefix + f for f in filenames}
    return found


@pytest.fixture(params=SERVERS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SshBackend]:
    b = SshBackend(tmp_path / "simcloud", prefer=request.param)
    yield b
    b.close()


@pytest.mark.slow
def test_both_transports_push_the_workdir_without_what_the_job_leaves_out(backend: SshBackend,
                                                                         tmp_path: Path) -> None:
    key = tmp_path / "keys" / "id_ed25519"
    generate_keypair(key)
    workdir = make_workdir(tmp_path / "work")
    # The patterns the daemon gives the push of this job (`CloudSteps._prepare`).
    spec = {"workdir": str(workdir), "checkpoint": {"dir": "checkpoints"}, "exclude": JOB_EXCLUDE}
    landed: dict[Transport, set[str]] = {}
    transports: list[Transport] = ["rsync", "sftp"] if HAVE_RSYNC else ["sftp"]
    for transport in transports:
        ep = backend.start(f"i-{transport}", Path(f"{key}.pub").read_text())
        assert ep.sandbox is not None
        target = Target(ep.host, ep.port, ep.user, key, ep.host_key, f"i-{transport}")
        push_dir(target, MemoryHostKeyTrust(), workdir, "burst/job/work", exclude=push_exclude(spec),
                 transport=transport)
        remote = Path(ep.sandbox) / "burst" / "job" / "work"
        landed[transport] = tree(remote)
        assert (remote / "src/data/raw/fixture.bin").read_text() == "src/data/raw/fixture.bin\n"  # whole
    assert landed["sftp"] == PUSHED
    if HAVE_RSYNC:
        assert landed["rsync"] == PUSHED
    assert sorted(pushed_paths(workdir, push_exclude(spec))) == sorted(PUSHED)  # what the daemon would say it sends


def test_a_pattern_with_a_slash_before_its_end_is_a_path_from_the_workdir() -> None:
    # As in a .gitignore; rsync itself would match "data/raw/" at any depth, so it is anchored with a leading '/'.
    assert [jobspec.rsync_exclude(p) for p in ["data/raw/", "logs/*.txt", "data/", "*.ckpt", "wandb", "**/cache/",
                                               "**/x/*.bin"]] == [
        "/data/raw/", "/logs/*.txt", "data/", "*.ckpt", "wandb", "**/cache/", "**/x/*.bin"]


def test_a_job_queued_before_exclude_existed_is_pushed_as_it_was() -> None:
    # Its stored spec has no `exclude`: the fixed patterns and its checkpoint dir only, that dir of the workdir and
    # not one of the same name deeper.
    stored = {"workdir": "/w", "checkpoint": {"dir": "out/ckpt", "interval_minutes": 30.0}}
    assert push_exclude(stored) == [*EXCLUDE, "/out/ckpt"]
    # A checkpoint dir is a name, not a pattern: its '[' is a '[' to rsync too.
    assert push_exclude({"checkpoint": {"dir": "ckpt[1]"}})[-1] == "/ckpt\\[1]"
    assert compile_excludes(["/ckpt\\[1]"])[0].matches(b"ckpt[1]", True)
    assert not compile_excludes(["/ckpt\\[1]"])[0].matches(b"ckpt1", True)


# Names that read differently as a glob, a literal or a class; a symlink to a directory (sent as a link, so a
# "d/" pattern does not match it); a name that is not UTF-8 text.
TRICKY = ["a", "ab", "b/a", "b/ab", "data/x", "x/data/y", "[a]", "a*b", "a b", "é/z", "c\\d", "logs/1.txt",
          "logs/2.log", "deep/logs/3.txt", "k/l/m/n.ckpt", "-", "]"]


@needs_rsync
@pytest.mark.parametrize("patterns", [
    list(EXCLUDE), ["data/"], ["/data"], ["data"], ["*/data"], ["b/a"], ["/logs/*.txt"], ["logs/*.txt"], ["*.ckpt"],
    ["**/n.ckpt"], ["k/**"], ["k/***"], ["/**/m"], ["k/**/n.ckpt"], ["?"], ["[a]"], ["\\[a]"], ["a\\*b"], ["a*b"],
    ["[!a]*"], ["[^a-c]"], ["[]a]"], ["[[:alpha:]]"], ["[[:punct:]]"], ["*[[:space:]]*"], ["é/"], ["?/"], ["c\\d"],
    ["c\\\\d*"], ["lnk/"], ["lnk"], ["*/"], ["**"], ["a**"], ["**a"], ["-"], ["]"], ["*/*/", "*.txt"]])
def test_the_sftp_walker_leaves_out_exactly_what_rsync_does(tmp_path: Path, patterns: list[str]) -> None:
    src = tmp_path / "src"
    for rel in TRICKY:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(rel)
    (src / "lnk").symlink_to("b")
    (src / os.fsdecode(b"raw-\xff")).write_text("not UTF-8")
    # rsync's own selection (-n: nothing copied), as its push runs it (-rl: recursive, links as links).
    out = subprocess.run(["rsync", "-rl", "-8", "-n", "--out-format=%n", *[f"--exclude={p}" for p in patterns],
                          f"{src}/", str(tmp_path / "dst")], capture_output=True, check=True,
                         env={**os.environ, "LC_ALL": "C"}).stdout
    by_rsync = {os.fsdecode(line) for line in out.split(b"\n") if line and line != b"./"}
    assert set(pushed_paths(src, patterns)) == by_rsync


@pytest.mark.parametrize(("exclude", "field", "says"), [
    ([""], "exclude", "an empty pattern leaves nothing out: expected a pattern relative to the workdir"),
    (["/data"], "exclude", "'/data' is not relative to the workdir"),
    (["~/datasets"], "exclude", "'~/datasets' is not relative to the workdir"),
    (["../shared/"], "exclude", "'../shared/' climbs out of the workdir with '..', and only the workdir is pushed"),
    (["data/../../x"], "exclude", "climbs out of the workdir"),
    (["./data"], "exclude", "'./data' has an empty or '.' part, which no path in the workdir has"),
    (["data//raw"], "exclude", "has an empty or '.' part"),
    (["- data"], "exclude", "'- data' would be read by rsync as a filter rule"),
    (["shard-[0-9.bin"], "exclude", "'shard-[0-9.bin': a '[' is not closed by a ']'"),
    (["[[:word:]]"], "exclude", "[:word:] is not a character class rsync knows"),
    (["data/", 3], "exclude.1", "expected a string"),
    ("data/", "exclude", "expected a list"),
    # The instance would not have the script: found there, it costs a boot and a billing minimum.
    (["data/", "*.py"], "exclude.1", "'*.py' leaves 'train.py', the script the command runs, out of the push"),
])
def test_a_bad_pattern_exits_2_with_one_line_and_queues_nothing(burstctl_in_process, tmp_path: Path,
                                                                exclude: object, field: str, says: str) -> None:
    path = write_job(tmp_path, "excl", exclude=exclude)
    r = burstctl_in_process("enqueue", str(path))
    assert r.returncode == 2, (r.stdout, r.stderr)
    (line,) = r.stderr.strip().splitlines()
    assert f"{path}: field '{field}': " in line and says in line, line
    assert json.loads(burstctl_in_process("list", "--json").stdout) == []


def test_a_script_in_a_directory_left_out_is_refused_unless_a_setup_may_fetch_it(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").touch()
    with pytest.raises(BadInput, match=re.escape("field 'exclude.0': 'src/' leaves 'src/train.py', the script")):
        jobspec.load_job(write_job(tmp_path, "nested", command=["python3", "src/train.py"], exclude=["src/"]))
    with pytest.raises(BadInput, match=re.escape("field 'exclude.1': '*.py' leaves 'ddp.py'")):  # torchrun's script
        jobspec.load_job(write_job(tmp_path, "ddp", command=["ddp.py"], torchrun=True, exclude=["data/", "*.py"]))
    fetched = write_job(tmp_path, "fetched", command=["python3", "src/train.py"], exclude=["src/"],
                        setup="git clone https://example.org/repo src")
    assert jobspec.load_job(fetched)[0].exclude == ["src/"]


def test_a_rehearsal_pushes_what_the_burst_would(tmp_path: Path) -> None:
    spec, _ = jobspec.load_job(write_job(tmp_path, "rehearsed", exclude=JOB_EXCLUDE))
    forced = tmp_path / "forced.toml"
    forced.write_text(rehearsal_spec(spec, tmp_path / "rehearsed.toml"))
    assert jobspec.load_job(forced)[0].exclude == JOB_EXCLUDE

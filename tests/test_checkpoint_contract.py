"""Complete-only checkpoints: what is visible is complete, what is partial is never listed or resumed from."""

from __future__ import annotations

import ast
import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runbooks import burst_checkpoint as bc

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "runbooks" / "burst_checkpoint.py"

# A writer process: writes checkpoint NAME with an 8 MiB shard, reports "half" after the first 4 MiB and then
# blocks on stdin, so the test can SIGKILL it while the shard is provably half-written.
HALF_WRITER = r"""
import sys
sys.path.insert(0, sys.argv[1])
import burst_checkpoint as bc

def writer(tmp):
    with open(tmp / "shard-0.bin", "wb") as fh:
        fh.write(b"\x01" * (4 << 20))
        fh.flush()
        print("half", flush=True)
        sys.stdin.readline()
        fh.write(b"\x02" * (4 << 20))

bc.write_checkpoint(sys.argv[2], sys.argv[3], {"state.json": b"{}"}, writer=writer, meta={"step": 7})
print("done", flush=True)
"""

# A writer process for the random-kill test: content is a function of the name, so a listed checkpoint can be
# checked byte for byte.
LOOP_WRITER = r"""
import sys
sys.path.insert(0, sys.argv[1])
import burst_checkpoint as bc

for n in range(int(sys.argv[3]), 10**6):
    name = "step-%08d" % n
    bc.write_checkpoint(sys.argv[2], name, {"a.bin": name.encode() * 100000, "b.txt": b"step %d" % n},
                        meta={"step": n})
"""


def _expected_loop_files(name: str) -> dict[str, bytes]:
    n = int(name.split("-")[1])
    return {"a.bin": name.encode() * 100000, "b.txt": b"step %d" % n}


def test_write_then_read_back_manifest_sizes_hashes_step_and_job(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BURST_JOB_ID", "job-42")
    files = {"model.bin": os.urandom(3000), "opt/state.bin": b"optimizer", "empty": b""}
    path = bc.write_checkpoint(tmp_path / "ckpt", "step-00000300", files, meta={"step": 300, "lr": 0.1})

    assert path == tmp_path / "ckpt" / "step-00000300"
    assert bc.verify(path)
    manifest = bc.read_manifest(path)
    assert manifest["step"] == 300
    assert manifest["job_id"] == "job-42"
    assert manifest["meta"]["lr"] == 0.1
    assert abs(manifest["created_at"] - time.time()) < 3600  # a wall-clock stamp, not a duration
    assert set(manifest["files"]) == {"model.bin", "opt/state.bin", "empty"}
    for rel, data in files.items():
        assert (path / rel).read_bytes() == data
        assert manifest["files"][rel] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step-00000300"]  # no temporary left behind


def test_writer_callable_runs_in_a_hidden_directory_before_the_manifest(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    seen: dict[str, object] = {}

    def writer(tmp: Path) -> None:
        seen["tmp_name"] = tmp.name
        seen["final_visible"] = (ckpt / "step-1").exists()
        seen["manifest_present"] = (tmp / bc.MANIFEST).exists()
        (tmp / "framework").mkdir()
        (tmp / "framework" / "weights.pt").write_bytes(b"w" * 100)

    path = bc.write_checkpoint(ckpt, "step-1", {"a": b"1"}, writer=writer)
    assert str(seen["tmp_name"]).startswith(f".tmp-step-1-{os.getpid()}")
    assert seen["final_visible"] is False
    assert seen["manifest_present"] is False
    assert bc.read_manifest(path)["files"]["framework/weights.pt"]["size"] == 100


def test_list_latest_are_sorted_by_name_and_skip_incomplete(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    for step in (300, 100, 200):
        bc.write_checkpoint(ckpt, f"step-{step:08d}", {"x": b"%d" % step}, meta={"step": step})
    (ckpt / "step-00000400").mkdir()  # a directory without a manifest: someone's partial copy
    (ckpt / "step-00000400" / "x").write_bytes(b"400")
    assert [p.name for p in bc.list_complete(ckpt)] == ["step-00000100", "step-00000200", "step-00000300"]
    assert bc.latest_complete(ckpt) == ckpt / "step-00000300"
    assert bc.latest_complete(tmp_path / "missing") is None
    assert bc.list_complete(tmp_path / "missing") == []


@pytest.mark.parametrize("damage", ["truncate", "flip-byte", "delete-file", "delete-manifest", "garble-manifest"])
def test_verify_catches_damage(tmp_path: Path, damage: str) -> None:
    ckpt = tmp_path / "ckpt"
    good = bc.write_checkpoint(ckpt, "step-1", {"a": b"first"})
    path = bc.write_checkpoint(ckpt, "step-2", {"shard.bin": bytes(range(256)) * 64, "b": b"x"})
    shard = path / "shard.bin"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-1])
    elif damage == "flip-byte":
        data = bytearray(shard.read_bytes())
        data[1000] ^= 0xFF
        shard.write_bytes(bytes(data))  # same size: only the hash can tell
    elif damage == "delete-file":
        shard.unlink()
    elif damage == "delete-manifest":
        (path / bc.MANIFEST).unlink()
    else:
        (path / bc.MANIFEST).write_text("{not json")

    assert not bc.verify(path)
    assert bc.list_complete(ckpt) == [good]
    assert bc.latest_complete(ckpt) == good
    if damage == "flip-byte":
        assert bc.verify(path, deep=False)  # the cheap check sees sizes only, as documented


def test_prune_never_counts_a_corrupted_newest_checkpoint_as_kept(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    for step in (1, 2, 3):
        bc.write_checkpoint(ckpt, f"step-{step}", {"x": b"%d" % step})
    (ckpt / "step-3" / "x").write_bytes(b"9")  # same size, wrong bytes
    bc.prune(ckpt, keep=1)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-3"]
    assert bc.latest_complete(ckpt) == ckpt / "step-2"


def test_extra_files_not_in_the_manifest_are_ignored(tmp_path: Path) -> None:
    path = bc.write_checkpoint(tmp_path, "step-1", {"a": b"1"})
    (path / "notes.txt").write_text("added later")
    assert bc.verify(path)


def test_same_name_is_replaced_as_a_whole(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    bc.write_checkpoint(ckpt, "step-5", {"old-only": b"old", "a": b"old"})
    path = bc.write_checkpoint(ckpt, "step-5", {"a": b"new"})
    assert bc.verify(path)
    assert sorted(p.name for p in path.iterdir()) == ["a", bc.MANIFEST]
    assert (path / "a").read_bytes() == b"new"
    assert [p.name for p in ckpt.iterdir()] == ["step-5"]


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "../up", "-dash"])
def test_bad_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError):
        bc.write_checkpoint(tmp_path, name, {"a": b"1"})


@pytest.mark.parametrize("rel", ["/abs", "../out", bc.MANIFEST])
def test_bad_file_paths_are_refused(tmp_path: Path, rel: str) -> None:
    with pytest.raises(ValueError):
        bc.write_checkpoint(tmp_path, "step-1", {rel: b"1"})
    assert bc.list_complete(tmp_path) == []


def test_a_write_that_raises_leaves_no_temporary_behind(tmp_path: Path) -> None:
    """A writer that raised (torch.save on a full disk) or a bad file name left `.tmp-<name>-<pid>` with whatever
    was written so far; `prune` removes one only once its pid is dead, so a trainer that caught the error and
    carried on kept it (gigabytes, on the disk that was full) for the rest of its run."""
    def failing(tmp: Path) -> None:
        (tmp / "shard.bin").write_bytes(b"\x01" * 4096)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        bc.write_checkpoint(tmp_path, "step-1", {"state.json": b"{}"}, writer=failing)
    with pytest.raises(ValueError, match="relative path"):
        bc.write_checkpoint(tmp_path, "step-2", {"a.bin": b"1", "/abs": b"1"})
    with pytest.raises(ValueError, match=bc.MANIFEST):
        bc.write_checkpoint(tmp_path, "step-3", writer=lambda tmp: (tmp / bc.MANIFEST).write_text("{}"))
    assert os.listdir(tmp_path) == []
    assert bc.prune(tmp_path, keep=1) == []


def test_sigkill_mid_write_leaves_nothing_listed_and_prune_cleans_up(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    previous = bc.write_checkpoint(ckpt, "step-00000006", {"state.json": b"{}"}, meta={"step": 6})
    proc = subprocess.Popen([sys.executable, "-c", HALF_WRITER, str(REPO / "runbooks"), str(ckpt), "step-00000007"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "half"
    tmp_dir = ckpt / f".tmp-step-00000007-{proc.pid}"
    assert (tmp_dir / "shard-0.bin").stat().st_size == 4 << 20  # really mid-write
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)

    assert bc.list_complete(ckpt) == [previous]
    assert bc.latest_complete(ckpt) == previous
    cli = subprocess.run([sys.executable, str(SCRIPT), "latest", str(ckpt)], capture_output=True, text=True,
                         timeout=60)
    assert cli.stdout.strip() == str(previous)
    assert tmp_dir.exists()

    removed = bc.prune(ckpt, keep=2)
    assert removed == [tmp_dir]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000006"]


def test_sigkill_at_random_moments_never_exposes_a_partial_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    rng = random.Random(20261129)
    start = 0
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", LOOP_WRITER, str(REPO / "runbooks"), str(ckpt), str(start)])
        time.sleep(rng.uniform(0.15, 0.6))  # when to pull the plug; the outcome is checked, not the timing
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        listed = bc.list_complete(ckpt)
        for path in listed:
            files = _expected_loop_files(path.name)
            assert {p.name for p in path.iterdir()} == {*files, bc.MANIFEST}
            for rel, data in files.items():
                assert (path / rel).read_bytes() == data
        latest = bc.latest_complete(ckpt)
        start = int(latest.name.split("-")[1]) + 1 if latest else start
    assert bc.list_complete(ckpt), "the writer never finished a single checkpoint in six runs"
    bc.prune(ckpt, keep=2)
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".tmp-")]
    assert len(bc.list_complete(ckpt)) == min(2, start)


def test_prune_keeps_the_newest_and_live_writers_temporaries(tmp_path: Path) -> None:
    tmp_path = tmp_path / "ckpt"
    for step in range(1, 6):
        bc.write_checkpoint(tmp_path, f"step-{step:08d}", {"x": b"%d" % step})
    live_tmp = tmp_path / f".tmp-step-00000009-{os.getpid()}"  # a writer that is still running (us)
    live_tmp.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_tmp = tmp_path / f".tmp-step-00000008-{int(dead.stdout)}"
    dead_tmp.mkdir()

    removed = bc.prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == sorted([dead_tmp.name, "step-00000001", "step-00000002",
                                                      "step-00000003"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live_tmp.name, "step-00000004", "step-00000005"])
    with pytest.raises(ValueError):
        bc.prune(tmp_path, keep=0)


def test_cli_latest_list_verify_prune_with_a_bare_python(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        # -S -E: no site-packages, no PYTHONPATH — what a stock instance has
        return subprocess.run([sys.executable, "-S", "-E", str(SCRIPT), *args], capture_output=True, text=True,
                              timeout=60)

    ckpt = tmp_path / "ckpt"
    empty = cli("latest", str(ckpt))
    assert empty.returncode == 0
    assert empty.stdout == ""
    for step in (1, 2, 3):
        bc.write_checkpoint(ckpt, f"step-{step}", {"x": b"x"})
    assert cli("latest", str(ckpt)).stdout.strip() == str(ckpt / "step-3")
    assert cli("list", str(ckpt)).stdout.split() == [str(ckpt / f"step-{s}") for s in (1, 2, 3)]
    assert cli("verify", str(ckpt / "step-2")).returncode == 0
    (ckpt / "step-2" / "x").write_bytes(b"y")
    assert cli("verify", str(ckpt / "step-2")).returncode == 1
    pruned = cli("prune", str(ckpt), "--keep", "1")
    assert pruned.returncode == 0
    assert pruned.stdout.split() == [str(ckpt / "step-1"), str(ckpt / "step-2")]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-3"]
    bad = cli("prune", str(ckpt), "--keep", "0")
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("script", ["runbooks/burst_checkpoint.py", "runbooks/supervisor.py", "examples/trainer.py"])
def test_instance_scripts_are_python38_stdlib_only(script: str) -> None:
    source = (REPO / script).read_text()
    tree = ast.parse(source, feature_version=(3, 8))  # rejects syntax newer than 3.8
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    ours = {"burst_checkpoint", "runbooks"}
    assert imported - ours <= set(sys.stdlib_module_names), imported - ours - set(sys.stdlib_module_names)
    # Runtime-evaluated 3.9+ idioms the parser accepts under `from __future__ import annotations`.
    for needle in ("removeprefix(", "removesuffix(", "datetime.UTC", "strict=True", "strict=False"):
        assert needle not in source, needle

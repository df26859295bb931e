"""`burstctl rehearse` through the real entry point: a private simcloud and daemon as child processes, real SSH,
real trainer processes, injected spot preemptions. It must pass a trainer that resumes from its checkpoint and
catch one that ignores BURST_RESUME_FROM or never checkpoints; bad input exits 2 with one line before anything
starts."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.rehearse import AttemptWatch, SeenCheckpoint, written_by
from tests.conftest import children_left_by_a_kill

REPO = Path(__file__).resolve().parent.parent
SIM_RATE_USD_H = 1.00  # simcloud's H100 spot list price, which a rehearsal always rents
STEPS, EVERY, STEP_S = 160, 10, 0.1  # about 16 s of training, a checkpoint every second


def burstctl(*args: str, timeout: float = 400, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from orchestrator.cli import entry; entry()", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def job_file(tmp: Path, name: str, command: list[str]) -> Path:
    lines = [
        f'name = "{name}"', f"command = {json.dumps(command)}", 'workdir = "work"', "deadline_hours = 10",
        "local_throughput = 0.5", "rented_throughput = { A10 = 0.5 }",  # would run locally: rehearse forces spot
        "[checkpoint]", "interval_minutes = 0.02",
    ]
    path = tmp / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def workdir(tmp: Path) -> Path:
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    shutil.copy(REPO / "examples" / "trainer.py", work / "trainer.py")
    return work


def trainer_argv(script: str = "trainer.py") -> list[str]:
    return ["python3", script, "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--step-seconds", str(STEP_S)]


def rehearse_json(spec: Path, *extra: str) -> tuple[int, dict, str]:
    r = burstctl("rehearse", str(spec), "--json", *extra)
    assert r.stdout.strip(), r.stderr
    return r.returncode, json.loads(r.stdout), r.stderr


@pytest.mark.slow
def test_the_example_trainer_resumes_correctly_after_two_preemptions(tmp_path: Path) -> None:
    workdir(tmp_path)
    rc, res, err = rehearse_json(job_file(tmp_path, "trainer", trainer_argv()), "--preemptions", "2", "--seed", "7")
    assert rc == 0, err
    assert res["verdict"] == "resumes correctly" and res["ok"] is True
    assert res["preemptions_injected"] == 2 and res["state"] == "done" and res["finished"] is True
    assert res["attempts"] == 3  # the first attempt and one per preemption
    assert res["instances_left"] == 0
    for p in res["preemptions"]:
        assert p["had_checkpoint"] is True and p["resumed_correctly"] is True
        assert p["resumed_from"].startswith("step-") and p["checkpoint_before"].startswith("step-")
        # It resumed from a checkpoint at or before the furthest step it had reached, and moved past it.
        assert 0 < p["resumed_step"] <= p["step_before"] and p["lost_steps"] == p["step_before"] - p["resumed_step"]
        assert int(p["first_checkpoint_after"].removeprefix("step-")) > p["resumed_step"]
        assert p["lost_work_s"] >= 0 and p["resume_s"] > 0
        assert p["next_attempt"] != p["attempt_id"]
        # The timeline is in order: detected, then the old instance is gone, then the new attempt runs.
        t = p["timeline"]
        assert t["detected"] <= t["terminated"] <= t["running"] == p["resume_s"]
        assert t["launched"] <= t["ready"] <= t["running"]
        if p["detected_by"] == "spot interruption notice":
            # Seen through the heartbeat: said (and pulled) first, and the next instance launched on it (make
            # before break) before the old attempt was taken for lost.
            assert t["notice_seen"] <= t["intent"] <= t["launched"] <= t["detected"]
        elif "notice_seen" not in t:  # learned of from the provider alone: break, then make
            assert t["terminated"] <= t["launched"]
        assert {"bootstrap", "push_workdir", "push_checkpoint", "start"} <= set(p["timings"])
    # The second preemption hit the attempt the first one resumed.
    assert res["preemptions"][1]["attempt_id"] == res["preemptions"][0]["next_attempt"]
    # The meter agrees with simcloud's own billing, within a tick per instance.
    assert res["cost_usd"] > 0
    assert abs(res["cost_usd"] - res["billed_usd"]) <= res["attempts"] * 1.5 * SIM_RATE_USD_H / 3600
    assert not re.search(r"rehearse-[0-9a-f]{24}", json.dumps(res) + err)  # simcloud's API key never shows


@pytest.mark.slow
def test_a_trainer_that_ignores_burst_resume_from_is_caught(tmp_path: Path) -> None:
    work = workdir(tmp_path)
    # The example trainer with its resume input thrown away: it starts over from step 0 on every attempt.
    (work / "ignores_resume.py").write_text(
        "import os, runpy, sys\n"
        "os.environ['BURST_RESUME_FROM'] = ''\n"
        "sys.argv[0] = 'trainer.py'\n"
        "runpy.run_path('trainer.py', run_name='__main__')\n")
    spec = job_file(tmp_path, "forgetful", trainer_argv("ignores_resume.py"))
    rc, res, _ = rehearse_json(spec, "--preemptions", "1")
    assert rc == 1
    assert res["verdict"] == "ignores BURST_RESUME_FROM" and res["ok"] is False
    (p,) = res["preemptions"]
    assert p["had_checkpoint"] is True and p["resumed_from"].startswith("step-")
    assert p["resumed_correctly"] is False
    # Its first checkpoint after the resume is not past the step it was handed.
    assert int(p["first_checkpoint_after"].removeprefix("step-")) <= p["resumed_step"]
    assert res["instances_left"] == 0


@pytest.mark.slow
def test_a_job_that_never_checkpoints_is_caught(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "no_checkpoints.py").write_text("import time\nfor _ in range(100):\n    time.sleep(0.1)\n")
    rc, res, _ = rehearse_json(job_file(tmp_path, "amnesiac", ["python3", "no_checkpoints.py"]),
                               "--preemptions", "1")
    assert rc == 1
    assert res["verdict"] == "loses all work on preemption: no checkpoint" and res["ok"] is False
    (p,) = res["preemptions"]
    assert p["had_checkpoint"] is False and p["resumed_from"] is None and p["checkpoint_before"] is None
    # Everything the attempt did was lost: the work lost is the whole time it ran.
    assert p["lost_work_s"] >= p["ran_s"]
    assert res["state"] == "done" and res["instances_left"] == 0  # it finished by starting over


@pytest.mark.slow
def test_the_users_own_config_does_not_reach_the_private_simcloud_or_daemon(tmp_path: Path) -> None:
    # The user's ./burstctl.toml (the cwd is tmp_path) names its own key variable, unset here, and its own state
    # directory: the private simcloud would die at start (or refuse the daemon's key) if it read them.
    user_state = tmp_path / "user-state"
    (tmp_path / "burstctl.toml").write_text(f'[providers.sim]\napi_key_env = "MY_SIM_KEY"\n\n'
                                            f"[state]\ndir = {json.dumps(str(user_state))}\n")
    workdir(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "MY_SIM_KEY"}
    short = ["python3", "trainer.py", "--steps", "60", "--checkpoint-every", str(EVERY), "--step-seconds", str(STEP_S)]
    r = burstctl("rehearse", str(job_file(tmp_path, "trainer", short)), "--json", "--preemptions", "1",
                 "--every-s", "2", "--timeout", "120", env=env)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["verdict"] == "resumes correctly" and res["instances_left"] == 0
    assert not user_state.exists()  # the user's state was not touched either


@pytest.mark.parametrize(("make_args", "needle"), [
    (lambda t: [str(t / "nope.toml")], "nope.toml"),
    (lambda t: [str(_spec(t, 'name = "x"\n'))], "command"),
    (lambda t: [str(_spec(t, "this is not toml\n"))], "bad.toml"),
    (lambda t: [str(_spec(t, _VALID)), "--preemptions", "0"], "--preemptions"),
    (lambda t: [str(_spec(t, _VALID)), "--every-s", "-1"], "--every-s"),
    (lambda t: [str(_spec(t, _VALID)), "--timeout", "0"], "--timeout"),
    (lambda t: [str(_spec(t, _VALID)), "--seed", "x"], "--seed"),
    (lambda t: [str(_spec(t, _VALID + "torchrun = true\n"))], "field 'torchrun': a rehearsal of a torchrun job needs "
     "torch installed here"),
    # What `enqueue` refuses is refused before the rehearsal, not found out by a job that never ran.
    (lambda t: [str(_spec(t, _VALID.replace("H100", "FOO")))], "field 'rented_throughput.FOO': 'FOO' is not a GPU type "
     "of [prices]"),
    (lambda t: [str(_spec(t, _VALID + '[model]\npreset = "nonexistent-99b"\n'))], "field 'model.preset': unknown "
     "preset 'nonexistent-99b'"),
    # A first preemption due only after --timeout rehearses nothing, after waiting all of it out.
    (lambda t: [str(_spec(t, _VALID + "[checkpoint]\ninterval_minutes = 20\n"))],
     "field 'checkpoint.interval_minutes': the job checkpoints every 20 min, so its first preemption is due after "
     "about 2400 s of running"),
    (lambda t: [str(_spec(t, _VALID)), "--every-s", "1000", "--timeout", "600"], "field '--every-s': the first "
     "preemption is due after about 1000 s of running, past --timeout 600 s"),
])
def test_bad_input_exits_2_with_one_line_and_starts_nothing(tmp_path: Path, make_args: Callable[[Path], list[str]],
                                                            needle: str) -> None:
    scratch = tmp_path / "scratch"  # where a rehearsal would make its throwaway directory
    scratch.mkdir()
    # PATH without torch's bin: the rehearsal of a torchrun job cannot run its bare script there.
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "torchrun").exists())
    r = burstctl("rehearse", *make_args(tmp_path), timeout=60,
                 env={**os.environ, "TMPDIR": str(scratch), "PATH": path})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and needle in lines[0], r.stderr
    assert r.stdout == ""
    assert not list(scratch.iterdir())  # no simcloud, no daemon, no state was started


def test_a_rehearsal_that_timed_out_before_its_first_preemption_says_so_not_that_the_job_ended(
        tmp_path: Path) -> None:
    from orchestrator.rehearse import Rehearsal, RehearsalOptions

    reh = Rehearsal(tmp_path / "job.toml", RehearsalOptions(timeout_s=600.0), lambda _: None, tmp_path)
    reh.every_s = 2400.0
    assert reh._verdict("running", timed_out=True, left=0) == ("did not finish within 600 s", False)
    assert reh.notes == ["no preemption within --timeout 600 s: the first was due after about 2400 s of running, "
                         "once the job had started on its instance"]
    reh.notes.clear()
    assert reh._verdict("done", timed_out=False, left=0) == ("not rehearsed: no preemption happened", False)
    assert reh.notes == ["the job ended before the first preemption: make it run longer or lower --every-s"]


_VALID = ('name = "ok"\ncommand = ["python3", "-c", "pass"]\nworkdir = "."\ndeadline_hours = 1\n'
          "local_throughput = 1\nrented_throughput = { H100 = 1 }\n")


def _spec(tmp: Path, text: str) -> Path:
    path = tmp / "bad.toml"
    path.write_text(text)
    return path


@pytest.mark.slow
def test_a_job_that_fails_at_once_is_reported_failed_with_its_reason(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "fails.py").write_text("import sys\nsys.exit(3)\n")
    rc, res, _ = rehearse_json(job_file(tmp_path, "fails-at-once", ["python3", "fails.py"]), "--preemptions", "1")
    assert rc == 1 and res["ok"] is False
    assert res["state"] == "failed" and res["verdict"] == "did not finish: job failed"
    assert [n for n in res["notes"] if n.startswith("the job failed: ")], res["notes"]
    assert not any("make it run longer" in n for n in res["notes"])


def test_a_checkpoint_that_never_came_home_is_reported_as_lost_work_not_as_an_unverified_resume(
        tmp_path: Path) -> None:
    """A trainer preempted before its first periodic checkpoint writes one on the notice's SIGTERM; when the reclaim
    comes before the daemon has pulled it, the next attempt rightly starts over. The verdict says so, naming the
    checkpoint; it used to read "no checkpoint written after preemption(s) [1]", which sent the user looking for
    a resume bug in a trainer whose later attempts wrote checkpoints and resumed correctly."""
    from orchestrator.rehearse import Preemption, Rehearsal, RehearsalOptions

    r = Rehearsal(tmp_path / "job.toml", RehearsalOptions(), say=lambda _: None, workdir=tmp_path)
    stranded = Preemption(n=1, attempt_id="j-a1", instance="i1", running_at=0.0, notice_at=2.6, reclaim_due=4.6,
                          checkpoint_before="step-00000022", step_before=22, had_checkpoint=True)
    resumed = Preemption(n=2, attempt_id="j-a2", instance="i2", running_at=10.0, notice_at=13.6, reclaim_due=15.6,
                         checkpoint_before="step-00000052", step_before=52, had_checkpoint=True,
                         resumed_from="step-00000052", resumed_step=52, resumed_correctly=True)
    r.preemptions = [stranded, resumed]
    verdict, ok = r._verdict("done", False, 0)
    assert not ok
    assert verdict.startswith("loses all work on preemption: step-00000022 did not come home before the reclaim")
    assert "[1]" in verdict and "no checkpoint written after" not in verdict


def test_a_trainer_that_started_over_is_caught_however_late_the_daemon_says_it_runs() -> None:
    # Resumed from step 20, the trainer started over instead: step 10, then 20 again, then 30, on its new instance.
    # Under load the daemon said the attempt runs (running_at) only after the first two were written. Judged by that
    # time alone, its first checkpoint was step 30, past the step it was handed: "resumes correctly".
    pushed = SeenCheckpoint("step-00000020", 20, 50.0)
    disk = {c.name: c for c in (SeenCheckpoint("step-00000010", 10, 98.5), SeenCheckpoint("step-00000020", 20, 99.0),
                                SeenCheckpoint("step-00000030", 30, 101.0))}
    watch = AttemptWatch("j-a2", "i-2", running_at=100.0, resumed_from=pushed.name, checkpoints=disk)
    home = [pushed, SeenCheckpoint("step-00000030", 30, 101.0)]
    first = min(written_by(watch, home, None, pushed), key=lambda c: c.created_at or 0.0)
    assert (first.name, first.step) == ("step-00000010", 10)  # not past 20: it ignored BURST_RESUME_FROM

    # The checkpoint pushed for it to resume from is not its own; one seen only at home counts while it ran.
    on_its_disk = AttemptWatch("j-a2", "i-2", running_at=100.0, resumed_from=pushed.name,
                               checkpoints={pushed.name: pushed})
    later = SeenCheckpoint("step-00000040", 40, 120.0)
    assert written_by(on_its_disk, [pushed, later], None, pushed) == [later]
    assert written_by(on_its_disk, [pushed, later], 110.0, pushed) == []  # the next attempt's, not this one's


def test_the_next_rehearsal_ends_what_a_rehearsal_killed_outright_left_running_and_removes_its_directory(
        tmp_path: Path) -> None:
    # SIGKILL (the OOM killer) runs no `finally`: the simcloud, the daemon ticking for ever and its instances ran on,
    # and the rehearsal's directory, a new one each run, stayed; nothing told the next rehearsal where they were.
    from orchestrator.rehearse import CHILDREN, OWNER, end_left_over_rehearsals, rehearsals_dir, workspace
    from runbooks.supervisor import pid_alive

    def entries() -> list[Path]:
        return sorted(rehearsals_dir().iterdir())

    with children_left_by_a_kill((
            "import time\n"
            "from pathlib import Path\n"
            "from orchestrator.rehearse import Rehearsal, RehearsalOptions, workspace\n"
            "with workspace() as (w, records):\n"
            "    Rehearsal(Path('job.toml'), RehearsalOptions(), lambda _: None, w, records=records).start(None)\n"
            "    print('started', flush=True)\n"
            "    time.sleep(120)\n"), lambda: entries()[0] / CHILDREN) as children:
        [killed] = entries()
        workdir = Path(json.loads((killed / OWNER).read_text())["workdir"])
        assert set(children) == {"simcloud", "daemon"} and workdir.is_dir()
        assert all(pid_alive(pid, start) for pid, start in children.values())  # left running
        # A dead rehearsal's entry naming a directory no rehearsal made: the entry goes, never the directory.
        not_made = tmp_path / "burstctl-rehearse-not-made"
        not_made.mkdir()
        forged = rehearsals_dir() / f"{killed.name}-forged"
        forged.mkdir()
        (forged / OWNER).write_text(json.dumps({"workdir": str(not_made), "keep": False}))

        with workspace() as (running, _):  # a rehearsal running meanwhile is left alone
            [alive] = set(entries()) - {killed, forged}
            said = end_left_over_rehearsals()
            assert said == [f"a rehearsal killed outright (pid {killed.name.split('-')[0]}): ended the simcloud and "
                            f"daemon it left running, removed its directory {workdir}",
                            f"a rehearsal killed outright (pid {killed.name.split('-')[0]}): kept its directory "
                            f"{not_made}, which is not a rehearsal's"]
            assert not any(pid_alive(pid, start) for pid, start in children.values())
            assert not workdir.exists() and not_made.is_dir()
            assert entries() == [alive] and running.is_dir()
        assert entries() == [] and not running.exists()  # a rehearsal that ends removes its own entry


# A rehearsal killed the instant its temporary directory is made (SIGKILL, the OOM killer), before it can write
# anything else; it prints the directory first.
_KILLED_AS_ITS_DIRECTORY_IS_MADE = """
import os, signal
from orchestrator.rehearse import DIR_PREFIX, workspace

made = os.mkdir


def mkdir(path, *args, **kwargs):
    made(path, *args, **kwargs)
    if os.path.basename(path).startswith(DIR_PREFIX):
        print(os.fspath(path), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


os.mkdir = mkdir
with workspace():
    pass
"""


def test_the_next_rehearsal_removes_the_directory_of_one_killed_the_instant_it_made_it(tmp_path: Path) -> None:
    # Its directory was made, then written down: killed in between, a rehearsal left a directory in $TMPDIR that no
    # later rehearsal knew of.
    from orchestrator.rehearse import end_left_over_rehearsals, rehearsals_dir

    temp = tmp_path / "temp"
    temp.mkdir()
    killed = subprocess.Popen([sys.executable, "-c", _KILLED_AS_ITS_DIRECTORY_IS_MADE], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "TMPDIR": str(temp)})
    out, _ = killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL
    workdir = Path(out.strip())
    assert workdir.parent == temp and workdir.is_dir()  # left behind

    assert end_left_over_rehearsals() == [f"a rehearsal killed outright (pid {killed.pid}): removed its directory "
                                          f"{workdir}"]
    assert list(temp.iterdir()) == [] and list(rehearsals_dir().iterdir()) == []


def test_a_job_that_finished_during_a_notice_is_not_said_to_have_started_over(tmp_path: Path) -> None:
    """The second notice came as the trainer was finishing: it wrote its last checkpoint, exited 0, and the job was
    done on that attempt (no next attempt). The rehearsal said "loses all work on preemption: step-00000120 did not
    come home before the reclaim ...; the next attempt started over" (exit 1) of a trainer that resumed correctly
    after the first preemption, and counted all of its 120 steps as lost."""
    from orchestrator.rehearse import Preemption, Rehearsal, RehearsalOptions

    r = Rehearsal(tmp_path / "job.toml", RehearsalOptions(), say=lambda _: None, workdir=tmp_path)
    c57, c60, c120 = (SeenCheckpoint(f"step-{n:08d}", n, 100.0 + n) for n in (57, 60, 120))
    r.attempts = {
        "j-a1": AttemptWatch("j-a1", "i1", running_at=100.0, checkpoints={c57.name: c57}, exited_at=157.5),
        "j-a2": AttemptWatch("j-a2", "i2", running_at=161.0, resumed_from=c57.name,
                             checkpoints={c57.name: c57, c60.name: c60, c120.name: c120}, exited_at=220.5),
    }
    resumed = Preemption(n=1, attempt_id="j-a1", instance="i1", running_at=100.0, notice_at=157.0, reclaim_due=159.0,
                         reclaimed_at=159.0, next_attempt="j-a2", resumed_from=c57.name)
    finished = Preemption(n=2, attempt_id="j-a2", instance="i2", running_at=161.0, notice_at=219.0,
                          reclaim_due=221.0, reclaimed_at=221.0, released_by_daemon=True)
    r.preemptions = [resumed, finished]
    r._attempt_state = {"j-a1": "preempted", "j-a2": "succeeded"}.get  # type: ignore[method-assign]
    r._settle("j")
    assert resumed.resumed_correctly is True and resumed.first_checkpoint_after == c60.name
    assert finished.finished_before_reclaim is True and finished.lost_steps == 0 and finished.lost_work_s == 0.0
    verdict, ok = r._verdict("done", False, 0)
    assert (verdict, ok) == ("resumes correctly", True)
    assert any("finished on its instance during the notice of preemption(s) [2]" in n for n in r.notes), r.notes

    # Every notice landing on a finishing trainer rehearsed nothing.
    r.preemptions, r.notes = [finished], []
    assert r._verdict("done", False, 0) == ("not rehearsed: no preemption happened", False)

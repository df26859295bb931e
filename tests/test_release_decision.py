"""When a job whose instance's provider does not answer its terminate comes home after revert-local
(`orchestrator/core/release.py`): pure, facts in, a verdict out."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator.core.release import ReleaseFacts, RunSeen, decide_release

# revert-local stopped the run, its last checkpoint came home, and the provider does not answer the terminate.
STOPPED_AND_HOME = ReleaseFacts(bursting_enabled=False, outcome="aborted", stop_reason="revert-local",
                                provider_answers=False, run=RunSeen.STOPPED, on_instance="step-00000020",
                                home="step-00000020", pull_under_way=False, resume_from_home=False)


def test_a_stopped_run_whose_newest_checkpoint_is_home_comes_home() -> None:
    assert decide_release(STOPPED_AND_HOME).release
    # So does one whose instance cannot be reached either: nothing more can come from it, and it held nothing newer.
    assert decide_release(replace(STOPPED_AND_HOME, run=RunSeen.UNREACHABLE, on_instance="step-00000010")).release
    # And a run lost on the way (preempted: heartbeat lost, say), whatever stopped it.
    assert decide_release(replace(STOPPED_AND_HOME, outcome="preempted", stop_reason="heartbeat lost")).release


@pytest.mark.parametrize("change", [
    {"provider_answers": True},  # its terminate goes through: the attempt ends as ever
    {"bursting_enabled": True},  # not reverted (or burst-enable since): the job may burst again, as before
    {"outcome": "aborted", "stop_reason": "budget-cap"},  # not revert-local's stop: not this rule's to move
    {"outcome": "succeeded", "stop_reason": "completed"},  # a run that ended is not resumed anywhere
    {"outcome": "failed", "stop_reason": "job exited"},
    {"pull_under_way": True},  # it could land in the store after the job moved: looked at again once over
])
def test_it_stays_as_before_without_a_word(change: dict[str, object]) -> None:
    verdict = decide_release(replace(STOPPED_AND_HOME, **change))  # type: ignore[arg-type]
    assert not verdict.release and verdict.held is None


def test_work_left_on_the_instance_waits_for_the_user_saying_what_coming_home_gives_up() -> None:
    newer = decide_release(replace(STOPPED_AND_HOME, run=RunSeen.UNREACHABLE, on_instance="step-00000030"))
    assert not newer.release
    assert newer.held == ("its newest checkpoint, step-00000030, is on the instance and not home (step-00000020 is); "
                          "burstctl revert-local --resume-from-home resumes it here from step-00000020, giving up "
                          "the work since")
    running = decide_release(replace(STOPPED_AND_HOME, run=RunSeen.RUNNING))
    assert not running.release and running.held is not None and running.held.startswith(
        "its run on the instance did not stop, and may write checkpoints that would never come home")
    nothing = decide_release(replace(STOPPED_AND_HOME, on_instance="step-00000010", home=None))
    assert nothing.held is not None and "resumes it here from nothing (it would start over)" in nothing.held
    # With the user's leave it comes home from what is home, but never under a pull still writing there.
    for held in (replace(STOPPED_AND_HOME, run=RunSeen.RUNNING), replace(STOPPED_AND_HOME, on_instance="step-9")):
        assert decide_release(replace(held, resume_from_home=True)).release
        assert not decide_release(replace(held, resume_from_home=True, pull_under_way=True)).release

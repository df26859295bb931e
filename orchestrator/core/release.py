"""Whether a cloud attempt whose instance cannot be confirmed gone may give its job back to this machine. Pure: facts
in, a verdict out (the shell, `Reconciler.release_if_home`, gathers the facts and acts on it).

After `revert-local` a stopped run's attempt waits, `terminating`, for its provider to confirm the instance gone. A
provider that does not answer (down, or refusing the key) could keep the job "running" in a cloud the user has left
for good. The job comes home (the attempt `released`, its instance still terminated and metered in the background)
when nothing of it is left out there: its run has stopped, or its instance cannot be reached either, and the newest
checkpoint it held, as last seen, is home. Otherwise the work on the instance would be thrown away without a word;
the user decides that (`burstctl revert-local --resume-from-home`), and is told what it costs.

A released job is not launched in the cloud again while its instance from before is not confirmed gone
(`relaunch_held`): that instance still bills, and still holds a cloud slot (`daemon.max_cloud_attempts`) and its
charge's share of the budget; a second one for the same job beside it is the double billing revert-local was run to
end. The job runs here meanwhile, or waits when it does not fit here.

A provider that will never answer again (the account closed, the vendor gone) would hold that job off the cloud,
and meter its instance, for ever: the operator may say the instance is gone instead (`burstctl confirm-gone`), and
`operator_gone` decides whether their word is taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

# Where a released job goes: what the attempt's end says for it, now rather than once its instance is confirmed gone.
# Only ends that give the job back to the queue; a run that ended (succeeded or failed) is not resumed anywhere.
REVERT_LOCAL = "revert-local"
RELEASABLE = frozenset({("aborted", REVERT_LOCAL), ("preempted", None)})  # (outcome, stop reason; None: any)
RESUME_FROM_HOME_FLAG = "burstctl revert-local --resume-from-home"


class RunSeen(StrEnum):
    """The attempt's run as its supervisor says it now."""
    STOPPED = "stopped"  # exited, or its supervisor is gone
    RUNNING = "running"  # still training: it did not stop for the stop asked
    UNREACHABLE = "unreachable"  # SSH does not answer either: nothing more can come home from it


@dataclass(frozen=True)
class ReleaseFacts:
    bursting_enabled: bool
    outcome: str  # what the attempt ends with (`info.outcome`)
    stop_reason: str | None
    provider_answers: bool  # False: its terminate, or the look after it, was not answered or was refused
    run: RunSeen
    on_instance: str | None  # the newest checkpoint the instance holds, as last seen
    home: str | None  # the newest checkpoint home
    pull_under_way: bool  # a pull from the instance still runs: it could write into the store after the job moved
    resume_from_home: bool  # the user asked for it: resume here from what is home, whatever the instance holds


@dataclass(frozen=True)
class ReleaseVerdict:
    release: bool
    held: str | None = None  # why not, when only the user can change it (said, with what to do)


def releasable(outcome: str, stop_reason: str | None) -> bool:
    """Whether an attempt ending with this outcome, stopped for this reason, gives its job back to the queue: the
    shell asks before it looks at the run over SSH, which would tell nothing then."""
    return (outcome, stop_reason) in RELEASABLE or (outcome, None) in RELEASABLE


def decide_release(f: ReleaseFacts) -> ReleaseVerdict:
    """Release the job when bursting is off, the attempt's end gives the job back, its provider cannot confirm the
    instance gone, no pull from it is under way, and nothing newer than home is, or may still be written, out there
    (unless the user said to resume from home all the same)."""
    if f.provider_answers or f.bursting_enabled:
        return ReleaseVerdict(False)  # the terminate goes through, or the job may burst again: as before
    if not releasable(f.outcome, f.stop_reason):
        return ReleaseVerdict(False)
    if f.pull_under_way:
        return ReleaseVerdict(False)  # looked at again once it has ended and is written down
    if f.resume_from_home:
        return ReleaseVerdict(True)
    newer = f.on_instance is not None and (f.home is None or f.on_instance > f.home)
    home = f.home or "nothing (it would start over)"
    if f.run is RunSeen.RUNNING:
        return ReleaseVerdict(False, f"its run on the instance did not stop, and may write checkpoints that would "
                                     f"never come home; {RESUME_FROM_HOME_FLAG} resumes it here from {home}")
    if newer:
        return ReleaseVerdict(False, f"its newest checkpoint, {f.on_instance}, is on the instance and not home "
                                     f"({home} is); {RESUME_FROM_HOME_FLAG} resumes it here from {home}, "
                                     "giving up the work since")
    return ReleaseVerdict(True)


def relaunch_held(unconfirmed: Sequence[str]) -> str | None:
    """Why a job may not be launched in the cloud now (a launch of its own, a plan put back by burst-enable, a
    hand-over from a run here), or None. `unconfirmed`: the instances of its released attempts ("sim i-1"), which
    their provider has not yet confirmed gone."""
    if not unconfirmed:
        return None
    return (f"its instance from before revert-local, {', '.join(unconfirmed)}, is still being terminated (its "
            "provider has not confirmed it gone, and it bills until then): no other instance is launched for the job "
            f"until it is (`burstctl confirm-gone {unconfirmed[0]}` once you have seen it gone in its provider's "
            "console)")


# The states of an attempt whose instance waits only for its provider's word that it is gone: its run is over, and
# its end (and, for a released one, its job's hold on the cloud) is taken once the instance is confirmed gone.
WAITING_FOR_GONE = frozenset({"terminating", "released"})
OPERATOR = "operator"  # who confirmed an instance gone when its provider will not (`burstctl confirm-gone`)
PROVIDER = "provider"


@dataclass(frozen=True)
class GoneFacts:
    """An instance burstctl knows, as the operator says it is gone (`burstctl confirm-gone`)."""
    verified_gone: bool  # already confirmed gone (by its provider, or the operator before)
    attempt: str | None  # the attempt not yet over whose instance it is (None: none, an orphan)
    attempt_state: str | None
    charge_from: float | None  # when its open charge started (the earliest, if several); None: it has none
    at: float  # when the operator says it stopped billing (unix seconds)
    now: float


@dataclass(frozen=True)
class GoneVerdict:
    confirm: bool
    already: bool = False  # confirmed gone before: nothing to do
    field: str | None = None  # the argument that is wrong, when it is
    problem: str | None = None  # what is expected instead


def operator_gone(f: GoneFacts) -> GoneVerdict:
    """Whether the operator's word that the instance is gone is taken: for an instance being terminated (its
    attempt `terminating` or `released`, or an orphan) that is not confirmed gone yet, gone at a time from its charge's
    start until now. An attempt still under way (its run watched over SSH, its stop not asked) is the daemon's to
    end: taken gone, its run would be given up with its checkpoints unpulled."""
    if f.verified_gone:
        return GoneVerdict(False, already=True)
    if f.attempt is not None and f.attempt_state not in WAITING_FOR_GONE:
        return GoneVerdict(False, field="INSTANCE_ID", problem=(
            f"is the instance of attempt {f.attempt}, which is {f.attempt_state}, not being terminated: the daemon "
            "watches it and terminates it once it stops (`burstctl cancel JOB` or `burstctl revert-local` stops it); "
            "expected an instance being terminated that its provider cannot confirm gone"))
    if f.at > f.now:
        return GoneVerdict(False, field="--at", problem=(
            f"is in the future ({utc(f.at)}, now {utc(f.now)}): expected when the instance stopped billing, at or "
            "before now"))
    if f.charge_from is not None and f.at < f.charge_from:
        return GoneVerdict(False, field="--at", problem=(
            f"is before the instance's charge started ({utc(f.at)}, it started {utc(f.charge_from)}): expected when "
            "the instance stopped billing, from then until now"))
    return GoneVerdict(True)


def utc(ts: float) -> str:
    """A moment as the CLI says one: ISO 8601 in UTC, to the second."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

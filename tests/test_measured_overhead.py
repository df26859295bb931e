"""Measured boot, sync and teardown times replace the configured t_ovh in later decisions."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, select

from orchestrator.app import App
from orchestrator.core.decision import decide
from orchestrator.lifecycle.cloud_steps import CloudSteps
from orchestrator.lifecycle.reconcile import Reconciler
from orchestrator.queue import context, enqueue, measured_overhead_h
from providers.lambda_cloud import LambdaCloud
from providers.simcloud.api import SimCloudServer
from providers.simcloud.ssh_backend import SshBackend
from state import schema as s
from tests.conftest import write_job


def test_decisions_use_the_configured_overhead_until_something_was_measured(tmp_path: Path) -> None:
    app = App(state_dir_override=str(tmp_path / "state"))
    assert measured_overhead_h(app) is None
    assert context(app, 0.0).overhead_h == app.config.policy.overhead_h
    with app.store.tx() as c:
        for boot in (100.0, 120.0, 110.0):
            c.execute(insert(s.measurements).values(ts=0.0, provider="sim", instance_type="t", metric="boot_s",
                                                    value=boot))
        for metric, value in (("push_workdir_s", 30.0), ("sync_s", 20.0), ("teardown_s", 10.0)):
            c.execute(insert(s.measurements).values(ts=0.0, provider="sim", instance_type="t", metric=metric,
                                                    value=value))
    assert measured_overhead_h(app) == pytest.approx((110.0 + 30.0 + 20.0 + 10.0) / 3600.0)
    assert context(app, 0.0).overhead_h == pytest.approx(170.0 / 3600.0)
    app.close()


def test_a_jobs_measured_cloud_throughput_replaces_its_guess_in_later_decisions(tmp_path: Path) -> None:
    from orchestrator.jobspec import JobSpec
    from orchestrator.queue import facts, measured_rented_throughput

    app = App(state_dir_override=str(tmp_path / "state"))
    spec = JobSpec.model_validate({"name": "weekly-finetune", "command": ["true"], "deadline_hours": 10,
                                   "local_throughput": 0, "rented_throughput": {"H100": 0.17, "A100": 0.09}})
    assert facts(spec, 36000.0, 0.0, app.config, measured=measured_rented_throughput(app, spec)).rented == \
        {"H100": 0.17, "A100": 0.09}
    with app.store.tx() as c:
        for v in (0.21, 0.25, 0.23):
            c.execute(insert(s.measurements).values(ts=0.0, provider="sim", instance_type="H100:weekly-finetune",
                                                    metric="throughput_units_h", value=v))
        c.execute(insert(s.measurements).values(ts=0.0, provider="sim", instance_type="H100:another-job",
                                                metric="throughput_units_h", value=9.0))
    measured = measured_rented_throughput(app, spec)
    assert measured == {"H100": pytest.approx(0.23)}
    job = facts(spec, 36000.0, 0.0, app.config, measured=measured)
    assert job.rented == {"H100": pytest.approx(0.23), "A100": 0.09}
    # The decision says so: a smoke run under the same name would otherwise silently reprice the real job.
    assert job.rented_in_file == {"H100": 0.17}
    assert "s_R on H100: 0.23 units/h per GPU, measured on earlier runs of weekly-finetune (the job file says " \
        "0.17)" in decide(job, context(app, 0.0)).reasons
    app.close()


def test_a_long_job_names_measured_throughput_is_found_under_its_kept_key(tmp_path: Path) -> None:
    # The key is kept to the column's 64 characters; a lookup by the untruncated name used to miss it.
    from orchestrator.jobspec import JobSpec
    from orchestrator.queue import measured_rented_throughput, measured_rented_throughputs, throughput_key

    app = App(state_dir_override=str(tmp_path / "state"))
    name, gpu = "grpo-qwen2.5-7b-instruct-math-lora-r64-weekly-v2", "RTX-PRO-6000-Blackwell-96GB"
    spec = JobSpec.model_validate({"name": name, "command": ["true"], "deadline_hours": 10,
                                   "local_throughput": 0, "rented_throughput": {gpu: 0.17}})
    assert len(f"{gpu}:{name}") > 64
    with app.store.tx() as c:
        c.execute(insert(s.measurements).values(ts=0.0, provider="sim", instance_type=throughput_key(gpu, name),
                                                metric="throughput_units_h", value=0.3))
    assert measured_rented_throughput(app, spec) == {gpu: pytest.approx(0.3)}
    # A batch reads every name's figures at once; names with nothing measured are absent.
    assert measured_rented_throughputs(app, {name: [gpu, "A100"], "other": [gpu]}) == {name: {gpu: pytest.approx(0.3)}}
    app.close()


def test_a_blocked_job_is_decided_again_with_its_measured_throughput(tmp_path: Path) -> None:
    # Blocked by the budget at its guessed s_R (100 H100-hours); a later run measured it 100× faster, and the next
    # batch of re-decisions (one read for the batch) lets it burst.
    import time

    from orchestrator.lifecycle.reconcile import Reconciler
    from orchestrator.queue import enqueue, throughput_key
    from tests.conftest import write_job

    cfg = tmp_path / "burstctl.toml"
    cfg.write_text("[budget]\nmonthly_cap_usd = 20\n")
    app = App(config_path=str(cfg), state_dir_override=str(tmp_path / "state"))
    job_id, decision, _ = enqueue(app, write_job(tmp_path, "slow-guess", local_throughput=0,
                                                 rented_throughput={"H100": 0.01}))
    assert app.store.get_job(job_id)["state"] == "blocked", decision.to_dict()["reasons"]
    with app.store.tx() as c:
        c.execute(insert(s.measurements).values(ts=0.0, provider="sim", instance_type=throughput_key("H100",
                                                "slow-guess"), metric="throughput_units_h", value=1.0))
    Reconciler(app, {}, cloud=None).admission._redecide_blocked(time.time())
    assert app.store.get_job(job_id)["state"] == "queued"
    app.close()



def test_a_jobs_measured_setup_adds_to_its_overhead_and_only_to_a_job_that_has_a_setup(tmp_path: Path) -> None:
    from orchestrator.core.decision import UNMEASURED_SETUP, SetupEstimate, decide
    from orchestrator.jobspec import JobSpec
    from orchestrator.queue import facts, setup_estimate, setup_key

    app = App(state_dir_override=str(tmp_path / "state"))
    fields = {"command": ["true"], "deadline_hours": 10, "local_throughput": 0, "rented_throughput": {"H100": 0.17}}
    spec = JobSpec.model_validate({"name": "weekly-finetune", "setup": "pip install -r requirements.txt", **fields})

    def measure(name: str, *seconds: float) -> None:
        with app.store.tx() as c:
            for v in seconds:
                c.execute(insert(s.measurements).values(ts=0.0, provider="sim", instance_type=setup_key(name),
                                                        metric="setup_s", value=v))

    def reasons(setup: SetupEstimate) -> list[str]:
        now = time.time()
        job = facts(spec, now + 10 * 3600, now, app.config, setup=setup)
        return [r for r in decide(job, context(app, now)).to_dict()["reasons"] if "setup" in r]

    # Nothing has ever run a setup here: nothing to go on, and the record says it is left out.
    assert setup_estimate(app, spec) == UNMEASURED_SETUP
    assert reasons(setup_estimate(app, spec)) == [f"this job's setup: {UNMEASURED_SETUP.basis}"]
    # Other jobs' setups have run: a first run is priced with their median, and says so.
    measure("nightly-eval", 120.0, 300.0, 180.0)
    first = setup_estimate(app, spec)
    assert first.hours == pytest.approx(180.0 / 3600.0)
    assert "not measured for this job yet: the median of the newest 3 setups of any job" in first.basis
    assert reasons(first)[0].endswith(f"(3.0 min, {first.basis})")
    # Its own runs, once it has them, are what counts.
    measure(spec.name, 600.0, 660.0, 540.0)
    own = setup_estimate(app, spec)
    assert own.hours == pytest.approx(600.0 / 3600.0) and own.basis == "measured on its earlier runs"
    assert reasons(own)[0].endswith("plus this job's setup (10.0 min, measured on its earlier runs)")
    # The same name without a setup now (it was dropped from the spec) pays none and the record says nothing.
    no_setup = JobSpec.model_validate({"name": "weekly-finetune", **fields})
    now = time.time()
    assert facts(no_setup, now + 36000, now, app.config, setup=own).setup_h == 0.0
    app.close()


def test_decisions_price_a_burst_at_what_the_providers_last_listed_and_skip_what_none_sells(tmp_path: Path) -> None:
    from orchestrator.queue import enabled_providers, record_offers_seen
    from providers.base import Offer

    app = App(state_dir_override=str(tmp_path / "state"))
    assert enabled_providers(app.config) == ["sim"]
    now = 1_000_000.0
    assert context(app, now).listed == {} and context(app, now).listed_shapes is None  # nothing listed yet

    def offer(count: int, od: float, spot: float | None) -> Offer:
        return Offer(provider="sim", instance_type=f"gpu_{count}x_h100", gpu_model="H100", gpu_count=count,
                     vram_gib=80, vcpus=26, on_demand_usd_h=od, spot_usd_h=spot, regions=())

    # The daemon keeps each refresh of a provider's offers (capacity or not: a listing says what it sells).
    record_offers_seen(app, "sim", [offer(1, 3.29, 1.10), offer(2, 6.38, None)], now - 120)
    ctx = context(app, now)
    assert ctx.listed_shapes == {"H100": (1, 2)}
    one, two = ctx.listed[("H100", 1)], ctx.listed[("H100", 2)]
    assert (one.od_usd_per_gpu_h, one.spot_usd_per_gpu_h, one.seen) == (3.29, 1.10, "sim 2 min ago")
    assert one.vram_gb == pytest.approx(80 * 2**30 / 1e9)  # the card's label, for a fit [prices] may overstate
    assert (two.od_usd_per_gpu_h, two.spot_usd_per_gpu_h) == (3.19, None)
    # A day on, which machines are sold is no longer taken as known; a week on, nor are the prices.
    assert context(app, now + 2 * 86400).listed_shapes is None and context(app, now + 2 * 86400).listed
    assert context(app, now + 8 * 86400).listed == {}
    app.close()


def _a_job_to_boot(tmp_path: Path) -> tuple[App, str]:
    """A cloud job (on-demand, no local run) queued in a fresh state: (the app, its id)."""
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "booted", local_throughput=0, market="on-demand"))
    return app, job_id


def _ticked_until_ready(app: App, job_id: str, rec: Reconciler, provider: LambdaCloud, ticks: int, pause_s: float
                        ) -> tuple[dict[str, Any], list[float]]:
    """Ticks `rec` until the job's instance is ready (at most `ticks`), then closes it and the provider: (the
    instance.ready event's data, every boot_s measured)."""
    for _ in range(ticks):
        rec.tick()
        if any(e["type"] == "instance.ready" for e in app.store.events(job_id=job_id)):
            break
        time.sleep(pause_s)
    (ready,) = [e["data"] for e in app.store.events(job_id=job_id) if e["type"] == "instance.ready"]
    with app.store.engine.connect() as c:
        measured = [r.value for r in c.execute(select(s.measurements).where(s.measurements.c.metric == "boot_s"))]
    rec.close()
    provider.close()
    return ready, measured


def _booting_on(sim: SimCloudServer, retried: bool = True, clock: Callable[[], float] | None = None) -> LambdaCloud:
    """The adapter the boot tests look at `sim` through; not `retried`: a throttled call fails at once, as one whose
    retries were spent (each tick of an outage is one failed look). `clock`: the test's, on which the throttle's
    Retry-After runs out between its ticks minutes apart."""
    from providers.base import RetryPolicy

    retry = {} if retried else {"retry": RetryPolicy(attempts=1, max_total_s=0.0, initial_s=0.0, max_wait_s=0.0)}
    return LambdaCloud(name="sim", base_url=sim.api_url, api_key="sim-boot-key", regions=("us-east-1",),
                       request_interval_s=0.0, **retry, **({"clock": clock} if clock else {}))


@pytest.mark.parametrize("outage", [False, True])
def test_a_boot_the_provider_did_not_answer_through_is_not_measured_into_later_decisions_overhead(
        tmp_path: Path, outage: bool) -> None:
    # The provider's API throttled every look at a booting instance for 25 minutes (5 ticks, 5 minutes apart). Its
    # boot_s, launch to reachable, was those 25 minutes, and the median of boot_s is part of every later decision's
    # t_ovh. Whether the instance was up before the API answered again is not known: the boot is not measured.
    app, job_id = _a_job_to_boot(tmp_path)
    now = [time.time()]
    backend = SshBackend(tmp_path / "simcloud")
    with SimCloudServer(api_key="sim-boot-key", backend=backend) as sim:
        provider = _booting_on(sim, retried=False, clock=lambda: now[0])
        rec = Reconciler(app, {"sim": provider}, cloud=CloudSteps(app, {"sim": provider}), clock=lambda: now[0])
        if outage:
            sim.inject("throttle", count=1000, route="instances")
            for _ in range(5):
                rec.tick()
                now[0] += 300.0
            sim.clear_faults()
            # The instance booted meanwhile (its sshd started in real time): the first look after the outage finds it
            # up, and the five ticks below need not wait for it.
            until = time.monotonic() + 60
            while not any(i.status == "active" for i in sim.instances()) and time.monotonic() < until:
                time.sleep(0.05)
        ready, measured = _ticked_until_ready(app, job_id, rec, provider, ticks=5, pause_s=0.0)
    if outage:
        assert measured == [] and measured_overhead_h(app) is None
        assert ready["boot_s"] >= 1500.0  # what was seen, said as such
        assert ready["not_measured"].startswith("the provider did not answer during the boot")
    else:
        assert measured == [pytest.approx(ready["boot_s"])] and ready["boot_s"] < 60.0 and "not_measured" not in ready
    app.close()


def test_an_api_outage_longer_than_boot_timeout_s_does_not_end_an_instance_still_booting_when_it_ends(
        tmp_path: Path) -> None:
    # The provider's API throttled every look at a booting instance for 25 minutes (5 ticks, 5 minutes apart), longer
    # than daemon.boot_timeout_s (15 minutes), and the daemon was restarted meanwhile. The first look after the
    # outage found the instance still booting and ended it as boot-timeout: the job launched, and paid for, a second
    # instance. The boot's clock does not run while the provider does not answer: the same instance is waited for.
    app, job_id = _a_job_to_boot(tmp_path)
    now = [time.time()]
    backend = SshBackend(tmp_path / "simcloud")
    with SimCloudServer(api_key="sim-boot-key", backend=backend, boot_delay_s=2.0) as sim:
        provider = _booting_on(sim, retried=False, clock=lambda: now[0])

        def reconciler() -> Reconciler:
            rec = Reconciler(app, {"sim": provider}, cloud=CloudSteps(app, {"sim": provider}), clock=lambda: now[0])
            rec.tick_s = 300.0  # a daemon ticking every 5 minutes: the ticks below watched the whole outage
            return rec

        rec = reconciler()
        sim.inject("throttle", count=1000, route="instances")
        for i in range(5):
            if i == 3:
                rec.abandon()  # killed; the next daemon starts within the outage
                rec = reconciler()
            rec.tick()
            now[0] += 300.0
        sim.clear_faults()
        rec.tick()  # the first look after the outage: the instance still boots (for 2 s)
        ready, _ = _ticked_until_ready(app, job_id, rec, provider, ticks=100, pause_s=0.1)
        assert len(sim.instances()) == 1, "one instance launched"
    assert ready["boot_s"] >= 1500.0
    assert not [e for e in app.store.events(job_id=job_id) if e["type"] == "attempt.stopping"]
    with app.store.engine.connect() as c:
        (info,) = [r.info for r in c.execute(select(s.attempts).where(s.attempts.c.job_id == job_id))]
    assert info["boot_unanswered_s"] >= 1500.0 and "boot_unanswered_since" not in info
    app.close()


@pytest.mark.parametrize("restarted", [False, True])
def test_a_boot_the_daemon_was_not_watching_throughout_is_not_measured_into_later_decisions_overhead(
        tmp_path: Path, restarted: bool) -> None:
    # A daemon launched the instance and died; the next one started 10 minutes later and found it up. boot_s,
    # launch to reachable, held those 10 minutes of downtime, and went into every later decision's t_ovh. A boot
    # launched before the daemon watching it started is not measured. A reconciler rebuilt on a config reload
    # (`carry_over`) has watched throughout: its boot is measured.
    app, job_id = _a_job_to_boot(tmp_path)
    now = [time.time()]
    backend = SshBackend(tmp_path / "simcloud")
    with SimCloudServer(api_key="sim-boot-key", backend=backend, boot_delay_s=3.0) as sim:
        provider = _booting_on(sim)
        first = Reconciler(app, {"sim": provider}, cloud=CloudSteps(app, {"sim": provider}), clock=lambda: now[0])
        first.tick_s = 300.0  # 10 minutes between two of its looks are not a gap in its watch (`Watch`)
        first.tick()  # written down and launched; it boots for 3 s (the tick waits 1 s)
        assert [e["type"] for e in app.store.events(job_id=job_id) if e["type"].startswith("instance.")] == \
            ["instance.launched"]
        if restarted:
            first.abandon()  # killed: the next daemon starts after 10 minutes down
            now[0] += 600.0
            rec = Reconciler(app, {"sim": provider}, cloud=CloudSteps(app, {"sim": provider}), clock=lambda: now[0])
        else:
            rec = Reconciler(app, {"sim": provider}, cloud=CloudSteps(app, {"sim": provider}), clock=lambda: now[0])
            now[0] += 600.0  # the config file read again, 10 minutes into a boot this process watched
            rec.carry_over(first)
        ready, measured = _ticked_until_ready(app, job_id, rec, provider, ticks=20, pause_s=0.2)
    assert ready["boot_s"] >= 600.0  # what was seen, said as such
    if restarted:
        assert measured == [] and measured_overhead_h(app) is None
        assert ready["not_measured"].startswith("the daemon started after the launch")
    else:
        assert measured == [pytest.approx(ready["boot_s"])] and "not_measured" not in ready
    app.close()

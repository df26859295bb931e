"""A hybrid plan, executed: local hours are nearly free, so a job that misses its deadline locally runs locally
first, stops at the planned switch time with a last checkpoint (SIGTERM), and bursts only the rest — resuming in
the cloud from that checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e import Daemon, cli, events, job, sim_instances, simcloud, trainer_job, wait_for, write_config

pytestmark = pytest.mark.slow


def test_local_first_then_burst_the_rest_from_the_local_checkpoint(tmp_path: Path) -> None:
    state = tmp_path / "state"
    # W = 0.1, s_L = 2, s_R = 10, D = 0.03 h, t_ovh = 0.005 h, no margin: local misses (T_L = 0.05 h), renting
    # meets it (T_R = 0.015 h), and the latest safe switch is x* = (0.03 − 0.005 − 0.01) / (1 − 0.2) = 67.5 s.
    spec = trainer_job(tmp_path, "hybrid", steps=1000, every=20, work_units=0.1, local_throughput=2, rented=10,
                       deadline_hours=0.03)
    with simcloud(tmp_path) as url:
        # On-demand: with no margin the late burst could not absorb a preemption, so a spot job would burst at
        # once instead (tests/test_decision.py); an on-demand job runs local first.
        config = write_config(tmp_path, url, policy={"overhead_h": 0.005, "hybrid_margin_h": 0.0,
                                                     "default_market": "on-demand"})
        r = cli(config, state, "enqueue", str(spec), "--json")
        assert r.returncode == 0, r.stderr
        decided = json.loads(r.stdout)
        job_id = decided["id"]
        assert decided["placement"] == "hybrid"
        local_phase, cloud_phase = decided["decision"]["plan"]
        assert local_phase["where"] == "local" and cloud_phase["where"] == "cloud"
        assert local_phase["hours"] == pytest.approx(0.01875, abs=1e-4)
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: job(state, job_id)["state"] == "done", 300, "the hybrid job to finish")
        finally:
            assert daemon.stop() == 0
        instances = sim_instances(url)

    types = [e["type"] for e in events(state)]
    assert types.index("attempt.stop_requested") < types.index("job.switching") < types.index("attempt.intent")
    resumed = [e["data"] for e in events(state, "job.resumed")]
    assert resumed and resumed[-1].get("provider") == "sim"  # the cloud phase started from the local checkpoint
    step = int(resumed[-1]["checkpoint"].removeprefix("step-"))
    assert 200 <= step < 1000  # real local progress was carried into the cloud
    assert len(instances) == 1 and instances[0]["status"] == "terminated"

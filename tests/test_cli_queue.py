"""The CLI through its real entry point: decide, enqueue, list, show, approve, cancel, budget, events.

Run in this process (`burstctl_in_process`): main() as the `burstctl` script calls it, without an interpreter's
start for each of the file's two hundred calls; `test_cli_commands.py` and the e2e tests run the script itself."""

from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import stat
import time
import typing
from datetime import datetime
from pathlib import Path

import pytest
from pydantic import BaseModel
from sqlalchemy import insert

from orchestrator import jobspec, queue
from orchestrator.app import App
from orchestrator.config import Config
from orchestrator.errors import BadInput, OperationalError
from state import schema as s
from tests.conftest import REPO, assert_config_refused, write_job

SEED_FLAGS = ["--rate", "3.00"]


@pytest.fixture
def burstctl(burstctl_in_process):
    return burstctl_in_process


@pytest.mark.parametrize(
    ("flags", "verdict", "figures"),
    [
        (["--s-local", "0.33", "--s-rented", "2.0", "--deadline-h", "24"], "local", {"t_local_h": 3.0303}),
        (["--s-local", "0", "--s-rented", "0.17", "--deadline-h", "48"], "burst",
         {"t_rented_h": 6.3824, "c_rented_usd": 19.1471}),
        (["--s-local", "0.033", "--s-rented", "0.17", "--deadline-h", "12"], "priced",
         {"t_local_h": 30.303, "t_rented_h": 6.3824, "delta_cost_usd": 16.1167, "hours_saved": 23.9206}),
    ],
    ids=["A-local", "B-burst", "C-priced"],
)
def test_decide_by_the_seed_scripts_flags(burstctl, flags, verdict, figures) -> None:
    r = burstctl("decide", *flags, *SEED_FLAGS, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["verdict"] == verdict
    for k, v in figures.items():
        assert d[k] == pytest.approx(v, abs=1e-3), k
    assert Path(d["record"]).exists()


def test_decide_prints_the_gates_in_the_seed_scripts_words(burstctl) -> None:
    r = burstctl("decide", "--s-local", "0.033", "--s-rented", "0.17", "--deadline-h", "12", *SEED_FLAGS)
    assert r.returncode == 0
    assert "GATE 2: local MISSES the deadline (30.30 h > 12.00 h)." in r.stdout
    assert "  rented makes it: 6.38 h ≤ 12.00 h." in r.stdout
    assert "price of the deadline: ΔC ≈ $16.12 to save 23.92 h (all of it on-demand; approval weighs what the " \
        "plan below" in r.stdout
    # No provider is asked in flags mode: the market is --rate's, not "no spot offer from the enabled providers".
    reasons = json.loads(burstctl("decide", "--s-local", "0.033", "--s-rented", "0.17", "--deadline-h", "12",
                                  *SEED_FLAGS, "--json").stdout)["reasons"]
    assert "market: on-demand at --rate: flags give no spot price" in reasons
    assert not [r for r in reasons if "enabled providers" in r]


def test_decide_writes_delta_c_and_arrows_as_the_readme_and_its_decision_record_do(burstctl) -> None:
    # It printed the seed script's ASCII (dC ~ $16.12, -> RUN LOCAL, <=) beside its own ΔC, → and ≈ in the same
    # output; the README and the decision records write ΔC, →, ≤ and ≈.
    seen = ""
    for name in ("a-grpo-smoke", "b-full-grpo-7b", "c-big-local-deadline"):
        r = burstctl("decide", str(REPO / "examples" / "seed" / f"{name}.toml"))
        assert r.returncode == 0, r.stderr
        seen += r.stdout
        for ascii_form in ("dC", "->", "<=", " ~ "):
            assert ascii_form not in r.stdout, (ascii_form, r.stdout)
    assert "GATE 2: local MAKES the deadline (3.03 h ≤ 24.00 h) → RUN LOCAL. Renting is waste." in seen
    assert "GATE 1: does NOT fit locally → BURST (no local option)." in seen
    assert "  rented wall-clock ≈ 6.38 h, cost ≈ $19.15 (on-demand;" in seen
    assert "GATE 1: fits locally. local wall-clock ≈ 30.30 h, cost ≈ $3.03 (electricity)." in seen
    assert "  price of the deadline: ΔC ≈ $16.12 to save 23.92 h" in seen
    assert "verdict: PRICED → await-approval" in seen
    record = next((burstctl.state_dir / "decisions").glob("*-c-big-local-deadline.md")).read_text()
    assert "T_R = 6.38 h ≤ D; ΔC = $16.12 to save 23.92 h" in record and "→ await-approval" in record
    # The JSON keeps its keys.
    d = json.loads(burstctl("decide", str(REPO / "examples" / "seed" / "c-big-local-deadline.toml"), "--json",
                            "--no-record").stdout)
    assert d["delta_cost_usd"] == pytest.approx(16.12, abs=0.01) and d["action"] == "await-approval"


def test_decide_says_why_a_job_does_not_fit_locally(burstctl, tmp_path: Path) -> None:
    r = burstctl("decide", "--s-local", "0", "--s-rented", "0.17", "--deadline-h", "48", *SEED_FLAGS)
    assert "GATE 1: does NOT fit locally → BURST (no local option).\n  why: local throughput is 0." in r.stdout
    (tmp_path / "slotless.toml").write_text("[daemon]\nlocal_concurrency = 0\n")
    job = write_job(tmp_path, "would-fit", local_throughput=0.5, rented_throughput={"H100": 0.17}, deadline_hours=48)
    r = burstctl("--config", str(tmp_path / "slotless.toml"), "decide", str(job))
    assert "  why: daemon.local_concurrency is 0: the daemon starts no local run." in r.stdout
    # Too big for the local card and for every rented one: gate 1 sends it nowhere, and says so before the verdict.
    huge = write_job(tmp_path, "huge", local_throughput=0.1, rented_throughput={"H100": 1.0},
                     model={"preset": "qwen2.5-7b", "method": "full"})
    r = burstctl("decide", str(huge), "--no-record")
    assert "GATE 1: does NOT fit locally → no local option, and no rented one (below)." in r.stdout
    assert "→ BURST" not in r.stdout and "verdict: RETHINK" in r.stdout
    # Memory: what the job needs against the local card as nvidia-smi reads it, less the margin; and a rented A10
    # (23028 MiB) keeps the same margin free, so 7B LoRA at 3584 tokens goes to the H100.
    big = write_job(tmp_path, "lora-7b", local_throughput=0.5, rented_throughput={"A10": 0.5, "H100": 2.0},
                    deadline_hours=48, model={"preset": "qwen2.5-7b", "method": "lora", "context": 3584})
    r = burstctl("decide", str(big))
    # In the estimate's GB, and in the GiB the config sets (local.vram_gib = 15.92)
    assert ("  why: it needs 23.8 GB, the local RTX 5080 has 17.1 GB = 15.92 GiB with 1.1 GB = 1.00 GiB kept "
            "free.") in r.stdout
    assert "A10: needs 23.8 GB per GPU and 1.1 GB = 1.00 GiB kept free, has 24.1 GB = 22.49 GiB: skipped" in r.stdout


def test_a_local_run_just_past_the_deadline_is_printed_with_the_decimals_that_show_it(burstctl) -> None:
    # 1 / 0.0833 = 12.0048 h against 12 h: "12.00 h > 12.00 h" would contradict itself.
    r = burstctl("decide", "--s-local", "0.0833", "--s-rented", "0.17", "--deadline-h", "12", *SEED_FLAGS)
    assert "GATE 2: local MISSES the deadline (12.005 h > 12.000 h)." in r.stdout
    # Closer than six decimals show (a deadline counted from a moment after the run's start, say): by how much.
    from orchestrator.cli.decide import _apart

    assert _apart(5.0 + 1e-7, 5.0) == ("5.00 h + 0.4 ms", "5.00 h")
    assert _apart(5.0, 5.0) == ("5.00 h", "5.00 h")
    # The comparison is the gates' own, not the JSON's figures rounded to 4 decimals (which printed a miss, "RUN
    # LOCAL, late", for this local run that makes its deadline): the text never contradicts the verdict.
    r = burstctl("decide", "--s-local", "0.20000196001920818", "--deadline-h", "4.99996", "--rate", "3",
                 "--s-rented", "5", "--no-record")
    assert "GATE 2: local MAKES the deadline (4.99995 h ≤ 4.99996 h) → RUN LOCAL." in r.stdout


def test_decide_on_candidate_c_reports_the_cheaper_hybrid_plan(burstctl) -> None:
    r = burstctl("decide", "--s-local", "0.033", "--s-rented", "0.17", "--deadline-h", "12", *SEED_FLAGS, "--json")
    d = json.loads(r.stdout)
    assert d["plan_kind"] == "hybrid"
    assert [p["where"] for p in d["plan"]] == ["local", "cloud"]
    assert d["plan_cost_usd"] < d["c_rented_usd"]


def test_a_job_file_that_says_it_does_not_resume_gets_no_hybrid_plan(burstctl, tmp_path: Path) -> None:
    fields = dict(work_units=1, local_throughput=0.033, rented_throughput={"H100": 0.17}, deadline_hours=12,
                  market="on-demand")
    resumes = json.loads(burstctl("decide", str(write_job(tmp_path, "resumes", **fields)), "--json").stdout)
    restarts = json.loads(burstctl("decide", str(write_job(tmp_path, "restarts", checkpoint={"resumable": False},
                                                           **fields)), "--json").stdout)
    assert (resumes["plan_kind"], restarts["plan_kind"]) == ("hybrid", "burst")


def test_with_only_lambda_cloud_enabled_and_nothing_listed_yet_a_burst_is_planned_on_demand(
        burstctl, tmp_path: Path) -> None:
    # Lambda Cloud sells no spot: planned from [prices]' spot figure, the job was held and approved at a third of
    # what its on-demand run then cost.
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text("[providers.sim]\nenabled = false\n\n[providers.lambda]\nenabled = true\n")
    job = str(write_job(tmp_path, "big", local_throughput=0, rented_throughput={"H100": 0.17}, deadline_hours=48))
    d = json.loads(burstctl("--config", str(cfg), "decide", job, "--json").stdout)
    assert [p["market"] for p in d["plan"]] == ["on-demand"] and d["plan_cost_usd"] == pytest.approx(19.15, abs=0.01)
    # simcloud is enabled by default: with its key at hand spot is for sale; without one, simcloud is no cloud.
    cfg.write_text("[providers.lambda]\nenabled = true\n")
    d = json.loads(burstctl("--config", str(cfg), "decide", job, "--json", env={"BURSTCTL_SIM_API_KEY": "k"}).stdout)
    assert [p["market"] for p in d["plan"]] == ["spot"]
    d = json.loads(burstctl("--config", str(cfg), "decide", job, "--json", env={"BURSTCTL_SIM_API_KEY": ""}).stdout)
    assert [p["market"] for p in d["plan"]] == ["on-demand"]


def test_a_job_file_without_a_checkpoint_table_is_taken_as_one_that_does_not_resume(burstctl, tmp_path: Path) -> None:
    # A trainer that never heard of $BURST_CHECKPOINT_DIR loses its work at a hand-over: no hybrid plan for it.
    fields = dict(work_units=1, local_throughput=0.033, rented_throughput={"H100": 0.17}, deadline_hours=12,
                  market="on-demand")
    silent = json.loads(burstctl("decide", str(write_job(tmp_path, "silent", checkpoint=None, **fields)),
                                 "--json").stdout)
    table = json.loads(burstctl("decide", str(write_job(tmp_path, "table", checkpoint={"interval_minutes": 20},
                                                        **fields)), "--json").stdout)
    assert (silent["plan_kind"], table["plan_kind"]) == ("burst", "hybrid")


def test_a_market_the_job_did_not_choose_is_credited_to_the_policy_default(burstctl, tmp_path: Path) -> None:
    (tmp_path / "burstctl.toml").write_text('[policy]\ndefault_market = "on-demand"\n')
    chosen_by_policy = json.loads(burstctl("decide", str(write_job(tmp_path, "p", local_throughput=0)),
                                          "--json").stdout)
    chosen_by_job = json.loads(burstctl("decide", str(write_job(tmp_path, "j", local_throughput=0,
                                                                market="on-demand")), "--json").stdout)
    assert "market: policy.default_market asks for on-demand" in chosen_by_policy["reasons"]
    assert "market: job asks for on-demand" in chosen_by_job["reasons"]


def test_decision_record_has_every_section(burstctl) -> None:
    r = burstctl("decide", "--s-local", "0", "--s-rented", "0.17", "--deadline-h", "48", *SEED_FLAGS, "--json",
                 "--name", "full-grpo")
    text = Path(json.loads(r.stdout)["record"]).read_text()
    for heading in ("**Job:**", "**Gate 1 (feasibility):**", "**Gate 2 (deadline):**", "**Verdict:**",
                    "**Instance:**", "**Rate used:**", "**Expected run time and overhead:**", "**Measured:**",
                    "## Rationale"):
        assert heading in text
    assert Path(json.loads(r.stdout)["record"]).name.endswith("-full-grpo.md")
    # A decide queues nothing: its record says it is a what-if, never to be measured, unlike a queued job's.
    assert text.startswith("# Decision (what-if, not queued): full-grpo")
    assert "- **Measured:** never: a what-if (`burstctl decide`), not queued" in text
    queued = burstctl("enqueue", str(REPO / "examples" / "seed" / "b-full-grpo-7b.toml"), "--json")
    record = Path(json.loads(queued.stdout)["record"]).read_text()
    assert record.startswith("# Decision: b-full-grpo-7b") and "_(filled in after the run)_" in record


def test_enqueue_the_seed_examples_then_list_show_and_events(burstctl) -> None:
    ids = {}
    for name in ("a-grpo-smoke", "b-full-grpo-7b", "c-big-local-deadline"):
        r = burstctl("enqueue", str(REPO / "examples" / "seed" / f"{name}.toml"), "--json")
        assert r.returncode == 0, r.stderr
        ids[name] = json.loads(r.stdout)
    assert ids["a-grpo-smoke"]["verdict"] == "local" and ids["a-grpo-smoke"]["state"] == "queued"
    assert ids["b-full-grpo-7b"]["verdict"] == "burst" and ids["b-full-grpo-7b"]["state"] == "queued"
    assert ids["c-big-local-deadline"]["verdict"] == "priced"
    assert ids["c-big-local-deadline"]["decision"]["delta_cost_usd"] == pytest.approx(16.12, abs=0.01)

    listed = json.loads(burstctl("list", "--json").stdout)
    assert [j["name"] for j in listed] == ["a-grpo-smoke", "b-full-grpo-7b", "c-big-local-deadline"]
    # The table's `over local` is what the approval ceiling weighs: the plan's cost less local's, not the ΔC.
    c = ids["c-big-local-deadline"]["decision"]
    row = next(line for line in burstctl("list").stdout.splitlines() if "c-big-local-deadline" in line)
    assert f"${c['plan_cost_usd'] - c['c_local_usd']:.2f}" in row and "$16.12" not in row
    # --json carries the table's plan and over-local columns, as numbers.
    assert {k: listed[2][k] for k in ("plan", "plan_cost_usd", "over_local_usd")} == {
        "plan": "hybrid on-demand", "plan_cost_usd": c["plan_cost_usd"],
        "over_local_usd": pytest.approx(c["plan_cost_usd"] - c["c_local_usd"])}
    assert (listed[0]["plan"], listed[0]["over_local_usd"]) == ("local", None)
    shown = json.loads(burstctl("show", "b-full-grpo-7b", "--json").stdout)
    assert shown["decision"]["verdict"] == "burst"
    assert {e["type"] for e in shown["events"]} == {"job.enqueued", "job.decided"}

    events = [json.loads(line) for line in burstctl("events", "--json", "--type", "job.decided").stdout.splitlines()]
    assert len(events) == 3
    assert all("inputs" in e and "decision" in e for e in events)
    jsonl = (burstctl.state_dir / "events.jsonl").read_text().splitlines()
    assert sum(1 for line in jsonl if json.loads(line)["event"] == "job.decided") == 3
    # `job.*` as [[notify]] writes it is the prefix `job.`; a type never recorded is said, with the nearest one.
    assert len(burstctl("events", "--json", "--type", "job.*").stdout.splitlines()) == 6
    typo = burstctl("events", "--type", "job.decidd")
    assert typo.returncode == 0 and typo.stdout == ""
    assert "no event of a type starting with 'job.decidd' has been recorded yet (did you mean 'job.decided'?)" \
        in typo.stderr
    glob = burstctl("events", "--type", "job.*ed")
    assert glob.returncode == 2 and "field '--type': 'job.*ed' is not a prefix" in glob.stderr
    two = burstctl("events", "--type", "job.enqueued", "--type", "job.done")  # the first had been dropped unsaid
    assert (two.returncode, two.stdout) == (2, "")
    assert "field '--type': is given 2 times: expected one type or prefix" in two.stderr


def test_approving_a_hybrid_no_months_budget_pays_promises_no_burst(burstctl, tmp_path: Path) -> None:
    # Seed C's hybrid rents its last hours on-demand for more than the whole $15 cap: the approval says the
    # hand-over waits for a higher cap rather than "then the rest bursts".
    job = write_job(tmp_path, "seed-c", local_throughput=0.033, rented_throughput={"H100": 0.17},
                    deadline_hours=12, market="on-demand")
    (tmp_path / "burstctl.toml").write_text("[budget]\nmonthly_cap_usd = 15\n")
    decided = json.loads(burstctl("enqueue", str(job), "--json").stdout)
    assert decided["state"] == "queued" and decided["placement"] == "hybrid"  # its local phase is not held
    assert decided["decision"]["action"] == "await-approval"
    r = burstctl("approve", "seed-c")
    assert r.returncode == 0, r.stderr
    assert "then the rest bursts" not in r.stdout
    assert "is more than the whole $15.00 monthly cap, so it runs on locally, late, unless budget.monthly_cap_usd " \
           "is raised" in " ".join(r.stdout.split())


def test_approve_queues_a_priced_job_and_cancel_ends_it(burstctl, tmp_path: Path) -> None:
    job = write_job(tmp_path, "priced", local_throughput=0.033, rented_throughput={"H100": 0.17},
                    deadline_hours=12, market="on-demand")
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text("[budget]\nmonthly_cap_usd = 100\n")
    r = burstctl("enqueue", str(job), "--json")
    assert (json.loads(r.stdout)["state"], json.loads(r.stdout)["approved"]) == ("queued", False)  # a hybrid
    assert "queued: its plan costs $12.90 more than local" in " ".join(burstctl("list").stdout.split())  # as held
    r = burstctl("approve", "priced", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state"] == "queued" and json.loads(r.stdout)["approved"]
    r = burstctl("approve", "priced")
    assert r.returncode == 2 and "not awaiting approval" in r.stderr
    assert burstctl("cancel", "priced").returncode == 0
    r = burstctl("cancel", "priced")
    assert r.returncode == 2 and "cannot become cancelled" in r.stderr


def test_budget_shows_the_cadence_the_rest_of_the_month_buys(burstctl) -> None:
    b = json.loads(burstctl("budget", "--json").stdout)
    assert b["cap_usd"] == 15.0 and b["spent_usd"] == 0
    assert b["usd_per_cycle_spot"] == pytest.approx(1.5) and b["usd_per_cycle_on_demand"] == pytest.approx(4.5)
    assert b["cycles_left_spot"] == 10 and b["cycles_left_on_demand"] == 3
    # Where the price comes from is printed as it is: rich took "[prices.H100]" for a tag and printed nothing.
    assert "$/cycle on spot (1.5 H100-h, [prices.H100])" in burstctl("budget").stdout


def test_money_in_json_is_rounded_to_the_places_of_the_rest(burstctl, tmp_path: Path) -> None:
    # Each of these had a float's every digit: 1.5 h × $3.29 was 4.9350000000000005, $11.1932 − $1.6667 over local
    # was 9.526499999999999, and a 3-GPU machine listed at $9.87/h was 3.2899999999999996 per GPU.
    from orchestrator.queue import record_offers_seen
    from providers.base import Offer

    (tmp_path / "burstctl.toml").write_text(
        "[budget]\ncycle_gpu_hours = 1.5\n\n[prices.H100]\non_demand_usd_h = 3.29\nspot_usd_h = 1.1\nvram_gib = 80\n")
    budget = json.loads(burstctl("budget", "--json").stdout)
    assert (budget["usd_per_cycle_on_demand"], budget["usd_per_cycle_spot"]) == (4.935, 1.65)
    (tmp_path / "burstctl.toml").write_text("")  # the built-in [prices]
    burstctl("enqueue", str(write_job(tmp_path, "priced", local_throughput=0.06, rented_throughput={"H100": 0.17},
                                      deadline_hours=12, market="on-demand")))
    (listed,) = json.loads(burstctl("list", "--json").stdout)
    assert (listed["plan_cost_usd"], listed["over_local_usd"]) == (11.1932, 9.5265)
    app = App(state_dir_override=str(burstctl.state_dir))
    try:
        record_offers_seen(app, "sim", [Offer(provider="sim", instance_type="gpu_3x_h100", gpu_model="H100",
                                              gpu_count=3, vram_gib=80, vcpus=26, on_demand_usd_h=9.87,
                                              spot_usd_h=None, regions=())], time.time())
    finally:
        app.close()
    burstctl("enqueue", str(write_job(tmp_path, "three", local_throughput=0, gpus=3, market="on-demand")))
    shown = json.loads(burstctl("show", "three", "--json").stdout)
    assert shown["decision"]["rate_usd_per_gpu_h"] == 3.29


def test_budget_counts_what_admitted_jobs_hold_without_calling_them_other(burstctl) -> None:
    assert burstctl("enqueue", str(REPO / "examples" / "seed" / "b-full-grpo-7b.toml")).returncode == 0
    out = burstctl("budget").stdout
    assert "held for 1 admitted job" in out and "other" not in out  # no job is being admitted beside it


def test_show_says_revert_local_brought_a_job_home_and_how_it_goes_back_on_its_plan(burstctl, tmp_path: Path) -> None:
    (tmp_path / "burstctl.toml").write_text("[providers.sim]\nenabled = false\n")  # no cloud to sweep
    assert burstctl("enqueue", str(REPO / "examples" / "seed" / "c-big-local-deadline.toml")).returncode == 0
    assert burstctl("revert-local", "--timeout", "5").returncode == 0
    shown = burstctl("show", "c-big-local-deadline").stdout
    assert "now placed local, not hybrid as decided: revert-local brought it home; bursting is still off" in shown
    app = App(state_dir_override=str(burstctl.state_dir))
    job_id = app.store.get_job("c-big-local-deadline")["id"]
    app.store.update_job(job_id, state="done")  # it finished here: nothing goes back on a plan
    shown = burstctl("show", "c-big-local-deadline").stdout
    assert "revert-local brought it home" in shown and "bursting is still off" not in shown
    app.store.update_job(job_id, state="queued")
    app.close()
    assert burstctl("burst-enable").returncode == 0
    assert "now placed" not in burstctl("show", "c-big-local-deadline").stdout  # back on its plan


def test_show_says_where_the_attempt_under_way_runs_now_beside_the_market_decided(burstctl, tmp_path: Path) -> None:
    # A spot decision whose run the market policy moved to on-demand showed only "market spot" (the decision's).
    (tmp_path / "burstctl.toml").write_text("[providers.sim]\nenabled = false\n")
    job_file = write_job(tmp_path, "moved", local_throughput=0)
    assert burstctl("enqueue", str(job_file)).returncode == 0
    app = App(state_dir_override=str(burstctl.state_dir))
    job_id = app.store.get_job("moved")["id"]
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(id=f"{job_id}-a1", job_id=job_id, n=1, where="cloud", state="failed",
                                            provider="sim", instance_type="gpu_1x_h100", market="spot",
                                            instance_id="i-old", info={}, created_at=0.0))
        c.execute(insert(s.attempts).values(id=f"{job_id}-a2", job_id=job_id, n=2, where="cloud", state="running",
                                            provider="sim", instance_type="gpu_1x_h100", market="on-demand",
                                            instance_id="i-now", info={}, created_at=1.0))
    app.close()
    assert "now: attempt 2, running, on sim gpu_1x_h100 (on-demand), instance i-now" in burstctl("show", job_id).stdout
    now = json.loads(burstctl("show", job_id, "--json").stdout)["progress"]["now"]
    assert now == {"attempt": 2, "state": "running", "where": "cloud", "provider": "sim",
                   "instance_type": "gpu_1x_h100", "market": "on-demand", "instance_id": "i-now"}


def test_a_state_directory_that_did_not_exist_is_said_to_be_new(burstctl, tmp_path: Path) -> None:
    # A mistyped --state-dir showed an empty queue, or queued a job no daemon would see, without a word.
    assert burstctl("enqueue", str(REPO / "examples" / "seed" / "a-grpo-smoke.toml")).returncode == 0
    typo = tmp_path / "stat"
    listed = burstctl("list", state_dir=typo)
    assert listed.returncode == 0 and listed.stdout.strip() == "no jobs"
    assert listed.stderr.strip() == f"burstctl: note: {typo} did not exist: made it, a new and empty state directory"
    assert burstctl("list", state_dir=typo).stderr == ""  # said once
    assert "a-grpo-smoke" in burstctl("list").stdout


def test_a_sqlite_database_that_did_not_exist_is_said_to_be_new(burstctl, tmp_path: Path) -> None:
    # A mistyped state.database_url made an empty database wherever it pointed, without a word.
    assert burstctl("enqueue", str(REPO / "examples" / "seed" / "a-grpo-smoke.toml")).returncode == 0
    typo = tmp_path / "elsewhere" / "burstctl.db"
    (tmp_path / "burstctl.toml").write_text(f'[state]\ndatabase_url = "sqlite:///{typo}"\n')
    listed = burstctl("list")
    assert listed.returncode == 0 and listed.stdout.strip() == "no jobs"
    assert listed.stderr.strip() == (f"burstctl: note: {typo} did not exist: made it, a new and empty database "
                                     "(state.database_url)")
    assert burstctl("list").stderr == ""  # said once
    (tmp_path / "burstctl.toml").write_text("")
    assert "a-grpo-smoke" in burstctl("list").stdout


def test_a_cap_set_to_a_fraction_of_a_cent_is_shown_as_set_not_rounded(burstctl, tmp_path: Path) -> None:
    (tmp_path / "burstctl.toml").write_text("[budget]\nmonthly_cap_usd = 0.105\n")
    assert "monthly cap $0.105" in " ".join(burstctl("budget").stdout.replace("│", " ").split())
    assert "of $0.105" in burstctl("status").stdout


def test_state_database_is_private_and_in_wal_mode(burstctl) -> None:
    burstctl("budget")
    db = burstctl.state_dir / "burstctl.db"
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600
    assert sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_config_resolution_prefers_flag_then_env_then_cwd(burstctl, tmp_path: Path) -> None:
    (tmp_path / "burstctl.toml").write_text("[budget]\nmonthly_cap_usd = 30\n")
    env_cfg = tmp_path / "env.toml"
    env_cfg.write_text("[budget]\nmonthly_cap_usd = 45\n")
    flag_cfg = tmp_path / "flag.toml"
    flag_cfg.write_text("[budget]\nmonthly_cap_usd = 60\n")
    assert json.loads(burstctl("budget", "--json").stdout)["cap_usd"] == 30
    assert json.loads(burstctl("budget", "--json", env={"BURSTCTL_CONFIG": str(env_cfg)}).stdout)["cap_usd"] == 45
    r = burstctl("--config", str(flag_cfg), "budget", "--json", env={"BURSTCTL_CONFIG": str(env_cfg)})
    assert json.loads(r.stdout)["cap_usd"] == 60


EMPTY_CONFIG_ENV = ("burstctl: error: $BURSTCTL_CONFIG: is set but empty: expected the path of a config file (unset "
                    "it for ./burstctl.toml, ~/.config/burstctl/config.toml or the built-in defaults)")


@pytest.mark.parametrize("empty", ["", " \t"], ids=["empty", "blank"])
def test_a_burstctl_config_set_but_empty_is_bad_input_not_the_defaults(burstctl, tmp_path: Path, empty: str) -> None:
    # `BURSTCTL_CONFIG=` in an env file, or a script's variable that was never set, meant a file: the command ran on
    # ./burstctl.toml or the built-in defaults (another state, the simulated cloud only) without a word.
    (tmp_path / "burstctl.toml").write_text("[budget]\nmonthly_cap_usd = 30\n")
    for args in (("budget", "--json"), ("status",), ("enqueue", str(write_job(tmp_path, "meant")))):
        r = burstctl(*args, env={"BURSTCTL_CONFIG": empty})
        assert (r.returncode, r.stdout, r.stderr.strip()) == (2, "", EMPTY_CONFIG_ENV), args
    assert json.loads(burstctl("list", "--json").stdout) == []  # nothing was queued on the defaults
    # `--config` names the file: the variable is not read, empty or not.
    r = burstctl("--config", str(tmp_path / "burstctl.toml"), "budget", "--json", env={"BURSTCTL_CONFIG": empty})
    assert r.returncode == 0 and json.loads(r.stdout)["cap_usd"] == 30


def test_config_example_is_valid(burstctl) -> None:
    r = burstctl("--config", str(REPO / "config.example.toml"), "budget", "--json")
    assert r.returncode == 0, r.stderr


def _setting_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    out: list[str] = []
    for name, field in model.model_fields.items():
        key, kind = field.alias or name, field.annotation
        if prefix == "" and typing.get_origin(kind) is list:
            kind = typing.get_args(kind)[0]  # a top-level list of tables is an array of tables, [[key]]
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out += _setting_paths(kind, f"{prefix}{key}.")
        else:
            out.append(prefix + key)
    return out


def test_config_example_shows_every_setting_in_its_section() -> None:
    sections: dict[str, str] = {}
    current = ""
    for line in (REPO / "config.example.toml").read_text().splitlines():
        header = re.match(r"^#? ?\[\[?([\w.]+)\]", line)  # [table], [[array of tables]], or one commented out
        if header:
            current = header.group(1)
        sections[current] = sections.get(current, "") + line + "\n"
    missing = [path for path in _setting_paths(Config) if path not in ("prices", "source")
               and not re.search(rf"^#? ?{re.escape(path.rsplit('.', 1)[-1])} *=", sections.get(
                   path.rpartition(".")[0], ""), re.M)]
    assert missing == []


def test_the_settings_config_example_shows_commented_as_the_default_are_the_defaults() -> None:
    # A line pasted as "the default" must not quietly change what is sent (it once left out budget.crossed).
    import tomllib

    from orchestrator.config import DEFAULT_NOTICES

    text = (REPO / "config.example.toml").read_text()
    block = re.search(r"^# events = (\[.*?\])", text, re.M | re.S)
    assert block is not None
    events = tomllib.loads("events = " + re.sub(r"(?m)^#\s*|#.*$", "", block.group(1)))["events"]
    assert events == DEFAULT_NOTICES


# --- bad input: exit 2, one line naming file and field, no traceback, nothing queued ----------------------------
BAD_JOBS = {
    "missing-field": ({"local_throughput": None}, "local_throughput", "required"),
    "unknown-field": ({"colour": "blue"}, "colour", "not a known field"),
    "shell-pipeline-as-command": ({"command": "python3 train.py | tee log"}, "command",
                                  "is split into arguments and run without a shell, so '|' would reach the program "
                                  "as an argument: to use a shell, write "
                                  "[\"sh\", \"-c\", \"python3 train.py | tee log\"]"),
    "misspelt-field": ({"deadline_critcal": True}, "deadline_critcal",
                       "is not a known field (did you mean 'deadline_critical'?)"),
    "misspelt-nested-field": ({"checkpoint": {"interval_minute": 5}}, "checkpoint.interval_minute",
                              "(did you mean 'interval_minutes'?)"),
    # Words, not pydantic's regex or its parser's complaint.
    "bad-name": ({"name": "my job!"}, "name", "expected a name of letters, digits, '.', '_' and '-'"),
    "unreadable-deadline": ({"deadline_hours": None, "deadline": "tomorrow"}, "deadline",
                            "expected an ISO 8601 date and time with a time zone"),
    # Several problems are named in the one line, not found one run at a time.
    "two-problems": ({"gpus": 0, "colour": "blue"}, "gpus",
                     "got 0 (also field 'colour': is not a known field)"),
    "wrong-type": ({"gpus": "two"}, "gpus", "integer"),
    "zero-work": ({"work_units": 0}, "work_units", "greater than 0"),
    "negative-work": ({"work_units": -3}, "work_units", "greater than 0"),
    "past-deadline": ({"deadline_hours": None, "deadline": "2020-01-01T00:00:00Z"}, "deadline", "past"),
    "zero-gpus": ({"gpus": 0}, "gpus", "expected a number greater than or equal to 1, got 0"),
    # A whole number given to a field of fractions is not told to be "an integer" (0.5 min is a fine interval).
    "zero-interval": ({"checkpoint": {"interval_minutes": 0}}, "checkpoint.interval_minutes",
                      "expected a number greater than 0, got 0"),
    "non-numeric-throughput": ({"local_throughput": "fast"}, "local_throughput", "number"),
    "bad-kind": ({"kind": "finetune"}, "kind", "train"),
    "unknown-preset": ({"model": {"preset": "gpt-17"}}, "model.preset", "qwen2.5-7b"),
    "no-workdir": ({"workdir": "nope"}, "workdir", "does not exist"),
    "workdir-a-file": ({"workdir": "workdir-a-file.toml"}, "workdir", "is a file; expected the directory"),
    # The whole workdir goes to every instance the job runs on: a home directory's keys with it.
    "workdir-the-root": ({"workdir": "/"}, "workdir", "'/' is the filesystem's root, and the whole workdir is "
                         "copied to a rented instance (~/.ssh and ~/.aws too); expected the project's own directory"),
    # Values of the wrong TOML type are refused, never converted: `true` is not 1 h, "no" is not false.
    "bool-for-hours": ({"deadline_hours": True}, "deadline_hours", "expected a number, got true"),
    "string-for-number": ({"deadline_hours": "12"}, "deadline_hours", "expected a number, got a string"),
    "fraction-for-count": ({"gpus": 2.5}, "gpus", "expected an integer, got 2.5"),
    "string-for-bool": ({"checkpoint": {"resumable": "no"}}, "checkpoint.resumable", "expected true or false"),
    "int-for-bool": ({"deadline_critical": 1}, "deadline_critical", "expected true or false, got 1"),
    # Only the workdir is copied to an instance: a script beside it runs locally and is missing there.
    "command-outside-workdir": ({"command": ["python3", "../train.py"]}, "command.1", "outside the workdir"),
    # Found on a rented instance, a misspelt script costs a boot and a billing minimum.
    "script-misspelt": ({"command": ["python3", "trian.py", "--steps", "9"]}, "command.1",
                        "'trian.py' is not in the workdir '.' (did you mean 'train.py'?)"),
    "checkpoint-dir-outside-workdir": ({"checkpoint": {"dir": "../../.."}}, "checkpoint.dir", "inside the workdir"),
    "setup-not-strings": ({"setup": ["pip", 3]}, "setup.1", "expected a string"),
    "setup-retries-too-many": ({"setup": "pip install x", "setup_retries": 11}, "setup_retries",
                               "less than or equal to 10"),
    "outputs-outside-workdir": ({"outputs": ["result.json", "../results"]}, "outputs",
                                "'../results' is not inside the workdir"),
    "outputs-absolute": ({"outputs": ["/etc/passwd"]}, "outputs", "'/etc/passwd' is not inside the workdir"),
    # Found only when it runs: a NUL in [env] restarted a local job about once a second for ever, holding the GPU;
    # a line break cut the value and started another variable in the job's environment file.
    "env-nul": ({"env": {"A": "x\0y"}}, "env", "'A' holds a NUL character: expected one line of text"),
    "env-line-break": ({"env": {"A": "x\nPYTHONPATH=/injected"}}, "env",
                       "'A' holds a line break: expected one line of text"),
    "env-bad-name": ({"env": {"A=B": "x"}}, "env", "'A=B' is not a variable name"),
    "env-name-a-digit-first": ({"env": {"1A": "x"}}, "env", "'1A' is not a variable name"),
    "command-nul": ({"command": ["python3", "train.py", "--tag", "a\0b"]}, "command",
                    "holds a NUL character: no program's argument can"),
    "command-empty-program": ({"command": [" ", "train.py"]}, "command", "must not be empty"),
    "command-one-argument": ({"command": ["python3 train.py"]}, "command",
                             "'python3 train.py' is one argument, run as a program of that name: write "
                             "[\"python3\", \"train.py\"]"),
    "setup-shell-operator": ({"setup": "pip install x && echo done"}, "setup", "'&&' would reach the program"),
    # In this file's words, not pydantic's ("Input should be a valid dictionary or instance of CheckpointSpec").
    "a-number-for-a-table": ({"checkpoint": 5}, "checkpoint", "expected a table, got 5"),
    "name-too-long": ({"name": "n" * 49}, "name", "expected at most 48 characters"),
    # An estimate of inf GB, and `Infinity` in --json, which is not JSON.
    "model-params-1e308": ({"model": {"params": 1.7e308}}, "model.params", "less than or equal to 1e+14"),
    "model-context-1e21": ({"model": {"preset": "qwen2.5-7b", "context": 10**21}}, "model.context",
                           "less than or equal to 1e+08"),
    "command-unclosed-quote": ({"command": "python3 'train.py"}, "command",
                               "cannot be split into arguments (no closing quotation): expected every quote closed"),
    # `show j25073e72` would find another job than the one of that name.
    "name-shaped-like-an-id": ({"name": "j25073e72"}, "name", "'j25073e72' has the shape of a job id"),
    # Read as seconds since 1970: "in the past (1970-01-01...)".
    "deadline-a-number": ({"deadline_hours": None, "deadline": 5}, "deadline",
                          "is a number: expected an ISO 8601 date and time with a time zone"),
    # So was a string of digits: "20261207" was "in the past (1970-08-23...)".
    "deadline-digits-in-quotes": ({"deadline_hours": None, "deadline": "20261207"}, "deadline",
                                  "is a number: expected an ISO 8601 date and time with a time zone"),
    # Hours so few that they round to now are said of deadline_hours, not of a deadline the file never gave.
    "deadline-hours-that-are-now": ({"deadline_hours": 1e-300}, "deadline_hours", "is 1e-300 hours, which is now"),
    # Path("") is the job file's own directory, and the missing script was reported under command.1.
    "workdir-empty": ({"workdir": ""}, "workdir", "is empty: expected a directory relative to the job file"),
    # Each found only on a rented instance, where the script is not and nothing expands the word.
    "script-absolute": ({"command": ["python3", "/home/me/train.py"]}, "command.1",
                        "'/home/me/train.py' is an absolute path, and only the workdir is copied to a rented "
                        "instance, where it would not be; expected a path relative to the workdir"),
    "script-from-home": ({"command": "python3 ~/train.py"}, "command.1",
                         "'~/train.py' reaches the program as written: it runs without a shell, so '~' is not your "
                         "home directory"),
    "variable-in-command": ({"command": ["python3", "train.py", "--out", "${BURST_CHECKPOINT_DIR}/x"]}, "command.3",
                            "so $BURST_CHECKPOINT_DIR is not expanded; expected the program to read the variable "
                            "itself (os.environ[\"BURST_CHECKPOINT_DIR\"]), or a shell to expand it"),
    "variable-in-setup": ({"setup": "pip install -r $REQS"}, "setup.3", "so $REQS is not expanded"),
    # No ceiling: a spot decision's expected cost and hours were 300 digits long, and the run's guard `--max-run-s inf`.
    "checkpoint-interval-1e308": ({"checkpoint": {"resumable": True, "interval_minutes": 1e308}},
                                  "checkpoint.interval_minutes",
                                  "1e+308 is more than 5259600: expected the minutes between checkpoints, at most 10 "
                                  "years"),
    "max-run-hours-1e308": ({"max_run_hours": 1e308}, "max_run_hours",
                            "1e+308 is more than 87660: expected hours, at most 10 years"),
}


@pytest.mark.parametrize(("arg", "leaves"), [
    ("../train.py", True), ("..", True), ("a/../../x", True), ("--config=../cfg.yaml", True),
    ("train.py", False), ("a/../b.py", False), ("./train.py", False), ("/opt/data/../x", False), ("-m", False),
    ("--lr=0.1", False), ("~/data", False), ("https://host/a/../b", False)])
def test_a_command_argument_that_climbs_out_of_the_workdir_is_told_apart(arg: str, leaves: bool) -> None:
    assert jobspec._leaves_workdir(arg) is leaves


def test_a_script_a_setup_may_fetch_or_a_module_is_not_looked_for(tmp_path: Path) -> None:
    assert jobspec.load_job(write_job(tmp_path, "fetched", command=["python3", "clone/train.py"],
                                      setup="git clone https://example.org/repo clone"))
    assert jobspec.load_job(write_job(tmp_path, "module", command=["python3", "-m", "trainer.main"]))
    assert jobspec.load_job(write_job(tmp_path, "shell", command=["sh", "-c", "python3 x.py"]))


def test_an_absolute_script_inside_the_workdir_is_told_by_its_relative_path(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").touch()
    with pytest.raises(BadInput, match=r"field 'command.1': '/.*/src/train.py' is an absolute path, .* expected "
                                       r"'src/train.py'"):
        jobspec.load_job(write_job(tmp_path, "abs", command=["python3", str(tmp_path / "src" / "train.py")]))
    # A setup may put it there; a program at an absolute path is the instance image's.
    assert jobspec.load_job(write_job(tmp_path, "fetched", command=["python3", "/opt/job/train.py"],
                                      setup="sh fetch.sh"))
    assert jobspec.load_job(write_job(tmp_path, "program", command=["/usr/bin/python3", "src/train.py"]))


def test_words_a_shell_would_expand_are_refused_unless_a_shell_runs_them(tmp_path: Path) -> None:
    (tmp_path / "train.py").touch()
    assert jobspec.load_job(write_job(tmp_path, "sh-c", command=["bash", "-lc", "python3 train.py --out $HOME/x"]))
    # Lower case and a lone '$' are a program's own words (a regex, a price), not a variable by convention.
    assert jobspec.load_job(write_job(tmp_path, "own", command=["python3", "train.py", "--re", "^a$b", "--p", "5$"]))
    with pytest.raises(BadInput, match=r"field 'command.3': .* so \$HF_HOME is not expanded"):
        jobspec.load_job(write_job(tmp_path, "var", command=["python3", "train.py", "--cache", "$HF_HOME"]))


def test_a_setup_given_as_a_string_is_split_like_the_command(tmp_path: Path) -> None:
    spec, _ = jobspec.load_job(write_job(tmp_path, "setup", setup="pip install -r 'requirements dev.txt'"))
    assert spec.setup == ["pip", "install", "-r", "requirements dev.txt"]
    assert jobspec.load_job(write_job(tmp_path, "plain"))[0].setup == []


@pytest.mark.parametrize("case", sorted(BAD_JOBS))
def test_bad_job_specs_exit_2_with_one_line_and_queue_nothing(burstctl, tmp_path: Path, case: str) -> None:
    fields, field, expected = BAD_JOBS[case]
    (tmp_path / "train.py").touch()
    path = write_job(tmp_path, **{"name": case, **fields})
    r = burstctl("enqueue", str(path))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert str(path) in lines[0] and field in lines[0] and expected in lines[0], lines[0]
    assert json.loads(burstctl("list", "--json").stdout) == []


def test_a_workdir_that_is_or_holds_the_home_directory_is_refused(burstctl, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # The whole workdir goes to every instance the job runs on: the home's ~/.ssh and ~/.aws would go with it.
    home = tmp_path / "users" / "me"
    (home / "project").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    for workdir, what in ((home, "is your home directory"), (home.parent, f"is a directory that holds your home "
                                                                         f"directory ({home})")):
        path = write_job(tmp_path, "wide", workdir=str(workdir), command=["true"])
        r = burstctl("enqueue", str(path))
        assert (r.returncode, r.stderr.strip()) == (2, f"burstctl: error: {path}: field 'workdir': '{workdir}' {what}, "
                                                       "and the whole workdir is copied to a rented instance (~/.ssh "
                                                       "and ~/.aws too); expected the project's own directory")
    assert burstctl("enqueue", str(write_job(tmp_path, "narrow", workdir=str(home / "project"),
                                             command=["true"]))).returncode == 0


# A deadline is a finite number of hours within 10 years: inf, nan or 1e300 once crashed `enqueue` after it had
# written a decision record for a job that never existed.
DEADLINE_HOURS_EXPECTED = "expected a finite number of hours greater than 0 and at most 87660 (10 years)"


def _written(burstctl) -> list[Path]:
    """Every decision record in the state directory."""
    return list(burstctl.state_dir.rglob("*.md"))


@pytest.mark.parametrize("hours", [math.inf, -math.inf, math.nan, 1e300, 1e9, 87661],
                         ids=["inf", "-inf", "nan", "1e300", "1e9", "just-past-10-years"])
def test_an_infinite_or_too_far_deadline_is_bad_input_and_nothing_is_written(burstctl, tmp_path: Path,
                                                                              hours: float) -> None:
    path = write_job(tmp_path, "far", deadline_hours=hours)
    for command in ("enqueue", "decide"):
        r = burstctl(command, str(path))
        assert (r.returncode, r.stderr) == (2, f"burstctl: error: {path}: field 'deadline_hours': "
                                               f"{DEADLINE_HOURS_EXPECTED}\n"), command
    assert json.loads(burstctl("list", "--json").stdout) == []
    assert _written(burstctl) == []


def test_a_deadline_of_exactly_10_years_is_accepted(burstctl, tmp_path: Path) -> None:
    r = burstctl("enqueue", str(write_job(tmp_path, "decade", deadline_hours=87660)), "--json")
    assert r.returncode == 0, r.stderr
    assert [j["name"] for j in json.loads(burstctl("list", "--json").stdout)] == ["decade"]


def test_a_deadline_instant_more_than_10_years_ahead_is_bad_input(burstctl, tmp_path: Path) -> None:
    path = write_job(tmp_path, "far", deadline_hours=None, deadline="9999-12-31T23:00:00Z")
    r = burstctl("enqueue", str(path))
    assert (r.returncode, r.stderr) == (2, f"burstctl: error: {path}: field 'deadline': is more than 10 years ahead "
                                           "(9999-12-31T23:00:00+00:00); expected an instant within 10 years\n")
    assert json.loads(burstctl("list", "--json").stdout) == [] and _written(burstctl) == []


def test_a_deadline_in_year_one_is_in_the_past_not_a_crash(burstctl, tmp_path: Path) -> None:
    # Year 1 at +14:00 is before the first instant a UTC datetime can hold.
    path = write_job(tmp_path, "old", deadline_hours=None, deadline="0001-01-01T00:00:00+14:00")
    r = burstctl("enqueue", str(path))
    assert (r.returncode, r.stderr) == (2, f"burstctl: error: {path}: field 'deadline': is in the past "
                                           "(0001-01-01T00:00:00+14:00); expected a future instant\n")


NON_FINITE_FIELDS = {
    "work_units": {"work_units": math.inf},
    "local_throughput": {"local_throughput": math.nan},
    "rented_throughput.H100": {"rented_throughput": {"H100": math.inf}},
    "max_run_hours": {"max_run_hours": math.inf},
    "checkpoint.interval_minutes": {"checkpoint": {"interval_minutes": math.inf}},
    "model.params": {"model": {"params": math.nan}},
}


@pytest.mark.parametrize("field", sorted(NON_FINITE_FIELDS))
def test_inf_or_nan_in_any_number_of_a_job_is_bad_input(burstctl, tmp_path: Path, field: str) -> None:
    path = write_job(tmp_path, "inf", **NON_FINITE_FIELDS[field])
    r = burstctl("enqueue", str(path))
    assert (r.returncode, r.stderr) == (2, f"burstctl: error: {path}: field '{field}': "
                                           "expected a finite number, not inf or nan\n")
    assert json.loads(burstctl("list", "--json").stdout) == [] and _written(burstctl) == []


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--deadline-h", "inf", DEADLINE_HOURS_EXPECTED),
        ("--deadline-h", "nan", DEADLINE_HOURS_EXPECTED),
        ("--deadline-h", "1e300", DEADLINE_HOURS_EXPECTED),
        ("--s-local", "inf", "expected a finite non-negative number"),
        ("--s-rented", "inf", "expected a finite positive number"),
        ("--rate", "nan", "expected a finite positive number"),
        ("--work", "1e999", "expected a finite positive number"),
        ("--overhead-h", "inf", "expected a finite non-negative number"),
        ("--local-usd-h", "nan", "expected a finite non-negative number"),
    ],
)
def test_decide_flags_reject_inf_and_nan_and_record_nothing(burstctl, flag: str, value: str, expected: str) -> None:
    flags = {"--s-local": "0.1", "--deadline-h": "12", "--rate": "3", flag: value}
    r = burstctl("decide", *[x for kv in flags.items() for x in kv])
    shown = {"1e300": "1e+300", "1e999": "inf"}.get(value, value)  # as Python prints the float click parsed
    assert (r.returncode, r.stderr) == (2, f"burstctl: error: field '{flag}': {expected}, got {shown}\n")
    assert _written(burstctl) == []


def test_work_no_gpu_given_finishes_within_the_longest_deadline_is_refused(burstctl, tmp_path: Path) -> None:
    # 1e300 units at 0.17 units/h is finite but meets no deadline, and would print 300-digit hours.
    r = burstctl("decide", "--work", "1e300", "--s-local", "0.033", "--s-rented", "0.17", "--deadline-h", "12",
                 "--rate", "3")
    assert (r.returncode, r.stderr) == (2, "burstctl: error: field '--work': 1e+300 units take 5.88e+300 h at the "
                                           "fastest rate given (0.17 units/h, the rented ones × gpus); expected work "
                                           "some GPU finishes within 10 years (87660 h), the longest deadline\n")
    path = write_job(tmp_path, "endless", work_units=1e308, local_throughput=0, rented_throughput={"H100": 0.17})
    r = burstctl("enqueue", str(path))
    assert r.returncode == 2 and f"{path}: field 'work_units': 1e+308 units take beyond any number of hours" in r.stderr
    # A job stored before this check (the daemon re-reads specs every tick) still loads: it is an intake rule.
    from orchestrator.jobspec import JobSpec

    assert JobSpec.model_validate({"name": "old", "command": ["true"], "deadline_hours": 1, "work_units": 1e308,
                                   "local_throughput": 0, "rented_throughput": {"H100": 0.17}}).work_units == 1e308
    # A job slow locally but fine rented is not: the fastest GPU given is what counts.
    slow_here = write_job(tmp_path, "slow-here", work_units=1, local_throughput=1e-4, rented_throughput={"H100": 0.17})
    assert burstctl("decide", str(slow_here), "--json").returncode == 0
    assert _written(burstctl) != []


# Each figure a what-if can give has a ceiling no real one reaches, the config's own for the same setting
# (policy.overhead_h at most 24 h; a local $/h of at most 5,000 W × $5/kWh), so that the dollars stay finite: a rate
# of 1e308 $/GPU-h was an internal error, and with --json exited 0 printing `"plan_cost_usd": Infinity`, not JSON.
TOO_LARGE_FLAGS = {
    "rate": (["--rate", "1e308"], "field '--rate': 1e+308 is more than 1000: expected dollars per GPU-hour (an H100 "
                                  "rents for $2 to $12)"),
    "overhead-h": (["--overhead-h", "1e308"], "field '--overhead-h': 1e+308 is more than 24: expected hours, not "
                                              "minutes (half an hour is 0.5), as policy.overhead_h"),
    "local-usd-h": (["--local-usd-h", "1e308"], "field '--local-usd-h': 1e+308 is more than 25: expected dollars per "
                                                "hour, not cents (a 400 W GPU at $0.25/kWh costs 0.10), as the local "
                                                "$/h local.board_power_w and local.electricity_usd_per_kwh can give"),
    "gpus": (["--gpus", "65"], "field '--gpus': expected an integer from 1 to 64 (as a job file's gpus), got 65"),
    "gpus-beyond-a-float": (["--gpus", "1" + "0" * 400], "field '--gpus': expected an integer from 1 to 64 (as a job "
                                                         "file's gpus), got a 401-digit number"),
    "s-local": (["--s-local", "1e-300"], "field '--s-local': 1 units take 1e+300 h at 1e-300 units/h; expected at "
                                         "least 1.14e-05 units/h, which finishes them within 10 years (87660 h), the "
                                         "longest deadline, or 0 if the job does not fit on the local GPU"),
    "s-rented": (["--s-rented", "1e-300", "--gpus", "8", "--s-local", "1"],  # local finishes: the work is no problem
                 "field '--s-rented': 1 units take 1.25e+299 h at 1e-300 units/h per GPU on 8 GPUs; expected at least "
                 "1.43e-06 units/h per GPU, which finishes them within 10 years (87660 h), the longest deadline"),
}


@pytest.mark.parametrize("case", sorted(TOO_LARGE_FLAGS))
@pytest.mark.parametrize("as_json", [False, True], ids=["human", "json"])
def test_a_what_if_figure_beyond_any_real_one_is_refused_in_one_line_and_records_nothing(
        burstctl, case: str, as_json: bool) -> None:
    args, line = TOO_LARGE_FLAGS[case]
    flags = {"--work": "1", "--s-local": "0", "--s-rented": "2", "--deadline-h": "24", "--rate": "3", "--gpus": "64"}
    flags.update(zip(args[::2], args[1::2], strict=True))
    r = burstctl("decide", *[x for kv in flags.items() for x in kv], *(["--json"] if as_json else []))
    assert (r.returncode, r.stdout, r.stderr) == (2, "", f"burstctl: error: {line}\n")
    assert _written(burstctl) == []


def test_a_what_if_at_every_ceiling_is_decided_in_finite_dollars(burstctl) -> None:
    r = burstctl("decide", "--work", "1", "--s-local", "0", "--s-rented", "2", "--deadline-h", "24", "--rate", "1000",
                 "--gpus", "64", "--overhead-h", "24", "--local-usd-h", "25", "--no-record", "--json")
    assert r.returncode == 0, r.stderr

    def no_constant(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    d = json.loads(r.stdout, parse_constant=no_constant)
    assert d["verdict"] == "burst" and d["plan_cost_usd"] == pytest.approx(1000 * 64 * (1 / 128 + 24))


@pytest.mark.parametrize(("flag", "value", "line"), [
    ("--overhead-h", "25", "field '--overhead-h': 25 is more than 24: expected hours, not minutes"),
    ("--local-usd-h", "1e308", "field '--local-usd-h': 1e+308 is more than 25: expected dollars per hour, not cents"),
])
def test_decide_on_a_job_file_bounds_its_overrides_as_the_config_bounds_them(burstctl, tmp_path: Path, flag: str,
                                                                              value: str, line: str) -> None:
    (tmp_path / "train.py").touch()
    r = burstctl("decide", str(write_job(tmp_path)), flag, value)
    assert r.returncode == 2 and r.stderr.startswith(f"burstctl: error: {line}"), r.stderr
    assert len(r.stderr.splitlines()) == 1 and _written(burstctl) == []


@pytest.mark.parametrize(("fields", "field", "line"), [
    ({"local_throughput": 1e-300}, "local_throughput",
     "1 units take 1e+300 h at 1e-300 units/h; expected at least 1.14e-05 units/h, which finishes them within 10 "
     "years (87660 h), the longest deadline, or 0 if the job does not fit on the local GPU"),
    ({"rented_throughput": {"H100": 2.0, "A100": 1e-300}, "gpus": 2}, "rented_throughput.A100",
     "1 units take 5e+299 h at 1e-300 units/h per GPU on 2 GPUs; expected at least 5.7e-06 units/h per GPU, which "
     "finishes them within 10 years (87660 h), the longest deadline"),
], ids=["local", "rented"])
def test_a_gpu_too_slow_to_finish_the_work_in_10_years_is_refused_naming_its_throughput(
        burstctl, tmp_path: Path, fields: dict[str, object], field: str, line: str) -> None:
    # A local_throughput of 1e-300 was decided, in 300-digit hours and dollars; the local GPU's 0 says the job does
    # not fit there, and a GPU that finishes within 10 years (the longest deadline) is a figure.
    (tmp_path / "train.py").touch()
    path = write_job(tmp_path, "crawl", **fields)
    for command in ("enqueue", "decide"):
        r = burstctl(command, str(path))
        assert (r.returncode, r.stderr) == (2, f"burstctl: error: {path}: field '{field}': {line}\n"), command
    assert json.loads(burstctl("list", "--json").stdout) == [] and _written(burstctl) == []
    slow = write_job(tmp_path, "slow", local_throughput=1 / 80000, rented_throughput={"H100": 2.0, "A100": 1 / 80000})
    assert burstctl("decide", str(slow), "--no-record").returncode == 0


def test_decide_on_a_job_file_rejects_an_infinite_overhead(burstctl, tmp_path: Path) -> None:
    r = burstctl("decide", str(write_job(tmp_path)), "--overhead-h", "inf")
    assert (r.returncode, r.stderr) == (2, "burstctl: error: field '--overhead-h': expected a finite non-negative "
                                           "number, got inf\n")
    assert _written(burstctl) == []


def test_an_enqueue_whose_job_is_not_written_leaves_no_decision_record(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    app = App(state_dir_override=str(tmp_path / "state"))
    try:
        def refuse(*args: object, **kwargs: object) -> None:
            raise OperationalError("the database refused the write")

        monkeypatch.setattr(app.store, "insert_job", refuse)
        with pytest.raises(OperationalError):
            queue.enqueue(app, write_job(tmp_path))
        assert app.store.list_jobs() == []
    finally:
        app.close()
    assert list((tmp_path / "state").rglob("*.md")) == []


# A model validator's error once named "field '(top level)'": the line names the field it is about.
DEADLINE_EXPECTED = "expected an ISO 8601 date and time with a time zone, e.g. 2035-01-01T09:00:00Z"
BAD_DEADLINES = {
    "bare-date": ("deadline = 2026-12-03\n", "deadline", f"is a date without a time: {DEADLINE_EXPECTED}"),
    # Quoted, it had been said to have no time zone.
    "bare-date-string": ('deadline = "2026-12-03"\n', "deadline", f"is a date without a time: {DEADLINE_EXPECTED}"),
    "no-date-string": ('deadline = "2026-13-45"\n', "deadline",
                       "expected an ISO 8601 date and time with a time zone (2035-01-01T09:00:00Z)"),
    "no-time-zone": ("deadline = 2026-12-03T09:00:00\n", "deadline", f"has no time zone: {DEADLINE_EXPECTED}"),
    "no-time-zone-string": ('deadline = "2026-12-03T09:00:00"\n', "deadline", f"has no time zone: {DEADLINE_EXPECTED}"),
    "both": ("deadline = 2026-12-03T09:00:00Z\ndeadline_hours = 3\n", "deadline_hours",
             "cannot be given with 'deadline': give exactly one of them"),
    "neither": ("", "deadline", "is missing: give 'deadline', an ISO 8601 date and time with a time zone "
                                "(2035-01-01T09:00:00Z), or 'deadline_hours', hours from now"),
}


def test_the_readme_s_example_job_file_is_taken_with_either_deadline_and_its_instant_is_years_ahead(
        burstctl, tmp_path: Path) -> None:
    # Its comment's `deadline = "2026-12-01T09:00:00Z"` was in the past within a week: copied, it was refused. The
    # instant messages give as an example is the same one.
    readme = (REPO / "README.md").read_text()
    block = re.search(r"## A job file\n\n```toml\n(.*?)```", readme, re.S)
    assert block is not None
    (tmp_path / "job.toml").write_text(block.group(1))
    instant = re.search(r'^deadline_hours = 12 +# or: deadline = "([^"]+)".*$', block.group(1), re.M)
    assert instant is not None
    (tmp_path / "instant.toml").write_text(block.group(1).replace(instant.group(0), f'deadline = "{instant[1]}"'))
    for name in ("job.toml", "instant.toml"):
        r = burstctl("decide", name, "--no-record")
        assert r.returncode == 0, r.stderr
    ahead = datetime.fromisoformat(instant[1]).timestamp() - time.time()
    assert ahead > 365 * 86400, "the README's example deadline is less than a year ahead: move it on"
    assert instant[1] in jobspec.DEADLINE_EXPECTED


@pytest.mark.parametrize("case", sorted(BAD_DEADLINES))
def test_a_bad_deadline_names_the_deadline_field(burstctl, tmp_path: Path, case: str) -> None:
    text, field, expected = BAD_DEADLINES[case]
    path = tmp_path / "job.toml"
    # Written by hand: TOML's own dates and local date-times are the point.
    path.write_text('name = "job"\ncommand = ["python", "train.py"]\nlocal_throughput = 0.33\n'
                    f"rented_throughput = {{ H100 = 2.0 }}\n{text}")
    r = burstctl("enqueue", str(path))
    assert (r.returncode, r.stderr) == (2, f"burstctl: error: {path}: field '{field}': {expected}\n")
    assert json.loads(burstctl("list", "--json").stdout) == [] and _written(burstctl) == []


def test_an_unpriced_cycle_gpu_names_budget_cycle_gpu(burstctl, tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[budget]\ncycle_gpu = "B200"\n')
    r = burstctl("--config", str(cfg), "budget")
    assert (r.returncode, r.stderr) == (2, f"burstctl: error: {cfg}: field 'budget.cycle_gpu': 'B200' has no entry "
                                           "in [prices] (known: A10, A100, H100, H200, L4, L40S, T4, V100)\n")
    # One GPU priced in the file's own table: the built-in ones are gone with it, H100 (the default) too.
    cfg.write_text("[prices.RTX4090]\non_demand_usd_h = 0.7\nvram_gib = 24\n")
    r = burstctl("--config", str(cfg), "budget")
    assert r.stderr == (f"burstctl: error: {cfg}: field 'budget.cycle_gpu': 'H100' has no entry in [prices] (known: "
                        "RTX4090); the file's [prices] replaces the built-in prices whole: expected it to list this "
                        "GPU too, or budget.cycle_gpu to name one it lists\n")


def test_a_job_file_a_windows_editor_saved_with_a_byte_order_mark_is_read(burstctl, tmp_path: Path) -> None:
    path = write_job(tmp_path, "bom", local_throughput=1.0)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    r = burstctl("enqueue", str(path), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["name"] == "bom", r.stderr


def test_a_fifo_given_as_a_job_file_is_refused_not_waited_on(burstctl, tmp_path: Path) -> None:
    fifo = tmp_path / "job.toml"
    os.mkfifo(fifo)
    r = burstctl("enqueue", str(fifo))  # reading it would wait for a writer for ever
    assert (r.returncode, r.stderr.strip()) == (2, f"burstctl: error: {fifo}: is not a regular file, expected a "
                                                   "TOML file")


def test_missing_file_and_non_toml_are_bad_input(burstctl, tmp_path: Path) -> None:
    r = burstctl("enqueue", str(tmp_path / "nope.toml"))
    assert r.returncode == 2 and "file not found" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    junk = tmp_path / "junk.toml"
    junk.write_text("this is = = not toml")
    r = burstctl("enqueue", str(junk))
    assert r.returncode == 2 and "not valid TOML" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[policy]\ndefault_market = 'cheap'\n", "policy.default_market"),
        ("[providers.lambda]\napi_key = 'sk-live-123'\n", "providers.lambda.api_key"),
        ("[providers.lambda]\napi_key_env = 'sk_live_123abcdefGHIJKL456'\n", "providers.lambda.api_key_env"),
        ("[providers.gcp]\nenabled = true\n", "providers.gcp"),
        ("[local]\nvram_gib = -4\n", "local.vram_gib"),
        ("[budget]\ncycle_gpu = 'TPU'\n", "budget.cycle_gpu"),
        ("[state]\ndatabase_url = 'postgresql+psycopg://burst:sk-live-123@db/burstctl'\n", "state.database_url"),
        ("[state]\ndatabase_url = 'not a url'\n", "state.database_url"),
        ("[state]\ndatabase_url = 'mysql://burst@db/burstctl'\n", "state.database_url"),
        ("[state]\ndatabase_url = 'postgresql+pg8000://burst@db/burstctl'\n", "state.database_url"),
        ("[budget]\nmonthly_cap_usd = inf\n", "budget.monthly_cap_usd"),  # `budget` had crashed on it
        ("[providers.lambda]\nbase_url = 'http://cloud.lambda.ai/api/v1'\n", "providers.lambda.base_url"),  # clear
        ("[providers.lambda]\nbase_url = 'cloud.lambda.ai/api/v1'\n", "providers.lambda.base_url"),  # no scheme
        ("[policy]\noverhead_h = inf\n", "policy.overhead_h"),
    ],
    ids=["bad-market", "inline-secret", "secret-as-env-name", "unknown-provider", "negative-vram", "unpriced-cycle-gpu",
         "database-password-inline", "database-url-unparsable", "database-not-supported", "database-driver-missing",
         "infinite-cap", "api-key-in-the-clear", "api-url-without-scheme", "infinite-overhead"],
)
def test_bad_config_exits_2_naming_the_field(burstctl, tmp_path: Path, text: str, field: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    r = burstctl("--config", str(cfg), "budget")
    assert r.returncode == 2
    line = r.stderr.strip()
    assert "\n" not in line and str(cfg) in line and field in line, line
    assert "sk-live-123" not in line and "sk_live_123" not in line


@pytest.mark.parametrize(
    ("text", "field", "says"),
    [
        ("[local]\nvram_gib = 16303\n", "local.vram_gib", "16303 is more than 1024: expected GiB"),  # MiB typed
        ("[prices.H100]\non_demand_usd_h = 3.0\nvram_gib = 81559\n", "prices.H100.vram_gib", "not MiB"),
        ("[local]\nelectricity_usd_per_kwh = 25\n", "local.electricity_usd_per_kwh", "not cents"),
        ("[local]\nboard_power_w = 400000\n", "local.board_power_w", "expected watts"),  # mW
        ("[daemon]\ntick_s = 5000\n", "daemon.tick_s", "seconds, not milliseconds"),
        ("[local]\nsafety_margin_gib = 1024\n", "local.safety_margin_gib", "leaves nothing of the card's 15.92 GiB"),
        ("[policy]\noverhead_h = 30\n", "policy.overhead_h", "30 is more than 24: expected hours, not minutes"),
    ],
    ids=["vram-in-mib", "rented-vram-in-mib", "electricity-in-cents", "power-in-milliwatts", "tick-in-ms",
         "margin-bigger-than-the-card", "overhead-in-minutes"],
)
def test_a_value_in_the_wrong_unit_is_refused_saying_which_unit_is_expected(
        burstctl, tmp_path: Path, text: str, field: str, says: str) -> None:
    # Believed, each one misleads quietly: a 7B LoRA needing 20 GB "fits" a 16303 GiB card and runs out of memory
    # on the real one; a margin larger than the card makes every job rethink; 25 $/kWh prices 4 h at $40.
    assert_config_refused(burstctl, tmp_path, text, "budget", field, says)


@pytest.mark.parametrize(("text", "field", "says"), [
    # pydantic's own words were "Input is not a valid path for <class 'pathlib.Path'>" and "Input should be a valid
    # time": what the field takes, said as the file writes it.
    ("[state]\ndir = 5\n", "state.dir", "expected a path (a string), got 5"),
    ("[[schedule]]\njob = true\ncron = '@daily'\n", "schedule.0.job", "expected a path (a string), got true"),
    ("[local]\navailable_hours = [{start = 22, end = 8}]\n", "local.available_hours.0.start",
     "expected a time of day (a TOML time, 22:00:00), got 22"),
], ids=["a-state-dir", "a-schedule-s-job", "a-window-s-hour"])
def test_a_path_or_a_time_of_the_wrong_type_is_said_in_the_file_s_words(burstctl, tmp_path: Path, text: str,
                                                                        field: str, says: str) -> None:
    assert_config_refused(burstctl, tmp_path, text, "budget", field, says)


@pytest.mark.parametrize(("text", "field", "says"), [
    ("[daemon]\ntick_ss = 5\n", "daemon.tick_ss", "is not a known field (did you mean 'tick_s'?)"),
    ("[providers.sim]\nbase_ur = 'http://127.0.0.1:1'\n", "providers.sim.base_ur", "(did you mean 'base_url'?)"),
    ("[budget]\nmonthly_cap = 20\n[daemon]\ntick_ss = 5\n", "budget.monthly_cap",
     "(did you mean 'monthly_cap_usd'?) (also field 'daemon.tick_ss': is not a known field (did you mean 'tick_s'?))"),
    ("[providers.lamda]\nenabled = false\n", "providers.lamda", "(did you mean 'lambda'?)"),  # as the file spells it
    ("[[notify]]\nname = 'x'\nurl_evn = 'HOOK'\n", "notify.0.url_evn", "(did you mean 'url_env'?)"),
], ids=["in-a-section", "in-a-table-of-providers", "two-at-once", "a-provider", "in-a-list-of-tables"])
def test_a_misspelt_setting_is_named_with_the_one_it_meant(burstctl, tmp_path: Path, text: str, field: str,
                                                         says: str) -> None:
    assert_config_refused(burstctl, tmp_path, text, "budget", field, says)


@pytest.mark.parametrize(("text", "field", "says"), [
    # A password in the URL's query is as inline as one before the host; the line never quotes it.
    ("[state]\ndatabase_url = 'postgresql+psycopg://burst@127.0.0.1/x?password=SEKRIT99'\n", "state.database_url",
     "holds a password: secrets are never written inline"),
    # With no host, SQLAlchemy takes what follows the user's ':' for the port, and its int() error quoted it.
    ("[state]\ndatabase_url = 'postgresql+psycopg://burst:SEKRIT99/x'\n", "state.database_url",
     "is not a database URL: expected e.g. 'postgresql+psycopg://burst@db.example/burstctl'"),
    # libpq refused it only when the database was opened: exit 1, "cannot open the database".
    ("[state]\ndatabase_url = 'postgresql+psycopg://burst@127.0.0.1:99999/x'\n", "state.database_url",
     "has a port that is not one: expected a port from 1 to 65535"),
    # httpx parses the port only when the client is made: `burstctl providers` was an internal error (InvalidURL).
    ("[providers.sim]\nbase_url = 'http://127.0.0.1:SEKRIT99/api/v1'\n", "providers.sim.base_url",
     "expected the API's root as an https:// URL"),
    ("[providers.lambda]\nbase_url = 'https://[::1/api/v1'\n", "providers.lambda.base_url",  # "Invalid IPv6 URL"
     "expected the API's root as an https:// URL"),
    # botocore refused them only when `burstctl providers` or the daemon made a client: an internal error quoting it.
    ("[providers.ec2]\nendpoint_url = 'SEKRIT99@127.0.0.1:5000'\n", "providers.ec2.endpoint_url",
     "expected an http(s) URL with a host"),
    ("[providers.ec2]\ns3_endpoint_url = 'http://127.0.0.1:SEKRIT99'\n", "providers.ec2.s3_endpoint_url",
     "expected an http(s) URL with a host"),
    ("[daemon]\nlocal_concurrency = 1000000000000\n", "daemon.local_concurrency", "less than or equal to 64"),
    ("orchestrator_id = 'has space/and;semicolon'\n", "orchestrator_id",
     "expected a name of letters, digits, '.', '_' and '-', starting with a letter or digit, at most 48 characters"),
    # A price no GPU-hour has made every plan's cost inf, and `decide` an internal error.
    ("[prices.H100]\non_demand_usd_h = 1e308\nvram_gib = 80\n", "prices.H100.on_demand_usd_h",
     "1e+308 is more than 1000: expected dollars per GPU-hour"),
    # Each process would have its own queue, gone when it ends: `enqueue` fed none the daemon sees.
    ("[state]\ndatabase_url = 'sqlite:///:memory:'\n", "state.database_url", "is an in-memory database"),
    ("[state]\ndatabase_url = 'sqlite://'\n", "state.database_url", "is an in-memory database"),
    # Each crashed a command (an int of inf, APScheduler's interval, SQLite's INTEGER) instead of being refused.
    ("[state]\nevents_file_max_mb = 1e308\n", "state.events_file_max_mb",
     "1e+308 is more than 1000000: expected MB, at most a million (a terabyte)"),
    ("[daemon]\nsweep_s = 1e308\n", "daemon.sweep_s", "1e+308 is more than 604800: expected seconds, at most a week"),
    ("[policy]\nspot_preemptions_per_hour = 1e308\n", "policy.spot_preemptions_per_hour",
     "expected preemptions an hour (0.05 is one every 20 hours)"),
    ("[daemon]\nmax_cloud_attempts = 99999999999999999999999\n", "daemon.max_cloud_attempts",
     "expected a number less than or equal to 1000"),
    ("[budget]\nmonthly_cap_usd = 1e308\n", "budget.monthly_cap_usd", "expected dollars, at most a million"),
    # Path("") is the current directory: the state was made wherever the command ran.
    ("[state]\ndir = ''\n", "state.dir", "is empty: expected a path"),
], ids=["password-in-the-query", "a-password-where-the-port-goes", "a-port-no-host-has",
        "an-api-port-that-is-no-number", "an-api-host-that-does-not-parse", "an-ec2-endpoint-without-scheme",
        "an-s3-endpoint-port-that-is-no-number",
        "a-local-gpu-count-no-machine-has", "an-owner-tag-no-cloud-takes",
        "a-price-no-gpu-hour-has", "an-in-memory-database", "an-in-memory-database-by-default",
        "an-event-file-size-no-disk-has", "a-sweep-period-no-clock-holds", "a-preemption-rate-no-cloud-has",
        "more-attempts-than-sqlite-counts", "a-budget-no-lab-has", "an-empty-state-dir"])
def test_settings_found_wrong_only_at_run_time_are_refused_as_the_file_is_read(
        burstctl, tmp_path: Path, text: str, field: str, says: str) -> None:
    assert_config_refused(burstctl, tmp_path, text, "budget", field, says)
    assert "SEKRIT99" not in burstctl("--config", str(tmp_path / "burstctl.toml"), "budget").stderr


def test_a_config_file_that_cannot_be_read_and_an_empty_path_are_one_line_each(burstctl, tmp_path: Path) -> None:
    r = burstctl("--config", "/proc/1/mem", "budget")  # a file no one reads as a stream, root included
    assert r.returncode == 2 and r.stderr.startswith("burstctl: error: /proc/1/mem: cannot be read (")
    assert len(r.stderr.strip().splitlines()) == 1
    for flag in ("--config", "--state-dir"):  # a script's unset variable is not the defaults
        r = burstctl(flag, "", "budget", state_dir=None)
        assert (r.returncode, r.stderr.strip()) == (2, f"burstctl: error: field '{flag}': is empty: expected a path")


@pytest.mark.parametrize("where", ["a-directory", "under-a-file"])
def test_a_sqlite_database_url_that_names_no_file_that_can_be_made_is_bad_input_naming_the_field(
        burstctl, tmp_path: Path, where: str) -> None:
    # Each was an internal error (IsADirectoryError, FileExistsError) from making the file private before opening it.
    (tmp_path / "a-file").write_text("")
    path = tmp_path if where == "a-directory" else tmp_path / "a-file" / "burstctl.db"
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text(f"[state]\ndatabase_url = 'sqlite:///{path}'\n")
    r = burstctl("--config", str(cfg), "budget")
    said = {"a-directory": f"'{tmp_path}' is a directory",
            "under-a-file": f"'{tmp_path / 'a-file'}' is not a directory"}
    assert (r.returncode, r.stderr) == (2, f"burstctl: error: {cfg}: field 'state.database_url': {said[where]}: "
                                           "expected a SQLite database file, or a path where one can be made\n")


MISTYPED = "[budget]\nmonthy_cap_usd = 20\n"


def test_a_config_that_does_not_validate_hides_no_state_the_readers_show_it_and_end_with_its_one_line(
        burstctl_here, tmp_path: Path) -> None:
    # A typo saved while the daemon runs: the daemon keeps the settings it last read, and the commands that only
    # read the state still show it. Each ends with the file's one line (exit 2); those that act refuse, as before.
    cfg, state = tmp_path / "burstctl.toml", tmp_path / "state"
    cfg.write_text("[providers.sim]\nenabled = false\n")
    at = ("--config", str(cfg), "--state-dir", str(state))
    job = write_job(tmp_path, "queued-before", local_throughput=1.0)
    assert burstctl_here(*at, "enqueue", str(job)).returncode == 0
    cfg.write_text(MISTYPED)
    for command, shows in [(["list"], "queued-before"), (["show", "queued-before"], "queued-before"),
                           (["events"], "job.enqueued"), (["status"], "queued 1")]:
        r = burstctl_here(*at, *command)
        assert r.returncode == 2 and shows in r.stdout, (command, r.stdout, r.stderr)
        (line,) = r.stderr.strip().splitlines()
        assert line == (f"burstctl: error: {cfg}: field 'budget.monthy_cap_usd': is not a known field (did you mean "
                        "'monthly_cap_usd'?); what is above was read from the state alone"), line  # no daemon runs
    # Said of the daemon only where one runs on this very file.
    from orchestrator.daemon import CONFIG_SEEN_KEY, DaemonLock

    (tmp_path / "valid.toml").write_text("")
    app = App(config_path=str(tmp_path / "valid.toml"), state_dir_override=str(state))
    app.store.set_setting(CONFIG_SEEN_KEY, {"source": str(cfg), "sha256": "as it was"})
    app.close()
    running = DaemonLock(state)
    running.acquire()
    try:
        r = burstctl_here(*at, "list")
    finally:
        running.release()
    assert r.stderr.strip().endswith("read from the state alone, and the running daemon keeps the settings it last "
                                     "read"), r.stderr
    # status does not pass the built-in defaults off as the file's settings.
    shown = json.loads(burstctl_here(*at, "status", "--json").stdout)
    assert shown["budget_cap_usd"] is None and "budget.monthy_cap_usd" in shown["config_problem"]
    assert "of an unknown cap (the config file is not valid)" in burstctl_here(*at, "status").stdout
    for acting in (["enqueue", str(write_job(tmp_path, "after", local_throughput=1.0))], ["cancel", "queued-before"],
                   ["budget"], ["burst-enable"]):
        r = burstctl_here(*at, *acting)
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, (acting, r.stderr)
    cfg.write_text("[providers.sim]\nenabled = false\n")
    listed = json.loads(burstctl_here(*at, "list", "--json").stdout)
    assert [(j["name"], j["state"]) for j in listed] == [("queued-before", "queued")]


def test_a_config_whose_state_section_does_not_validate_opens_no_state(burstctl_here, tmp_path: Path) -> None:
    # Where the state is would be a guess: nothing is read, nothing is made.
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text("[state]\ndir = 3\n")
    r = burstctl_here("--config", str(cfg), "list")
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"burstctl: error: {cfg}: field 'state.dir': ") and "state alone" not in line
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("text", ["[stat]\ndir = 'x'\n", "database_url = 'sqlite:///x.db'\n"],
                         ids=["misspelt-section", "state-setting-at-the-top"])
def test_a_config_that_may_have_misspelt_its_state_opens_no_state(burstctl_here, tmp_path: Path, text: str) -> None:
    # The built-in defaults would open another, empty, state: `list` said "no jobs", and revert-local set a kill
    # switch no daemon reads. Each refuses the file instead, making nothing.
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text(text)
    for command in (["list"], ["status"], ["revert-local"]):
        r = burstctl_here("--config", str(cfg), *command)
        assert r.returncode == 2 and r.stdout == "", (command, r.stdout)
        (line,) = r.stderr.strip().splitlines()
        assert line.startswith(f"burstctl: error: {cfg}: field '") and "is not a known field" in line, line
    assert not (tmp_path / "state").exists()


def test_a_reader_that_fails_on_its_own_still_names_the_config_s_problem(burstctl_here, tmp_path: Path) -> None:
    cfg, state = tmp_path / "burstctl.toml", tmp_path / "state"
    cfg.write_text("[providers.sim]\nenabled = false\n")
    at = ("--config", str(cfg), "--state-dir", str(state))
    assert burstctl_here(*at, "list").returncode == 0
    cfg.write_text(MISTYPED)
    r = burstctl_here(*at, "show", "no-such-job")
    (line,) = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "no job with id or name 'no-such-job'" in line, line
    assert line.endswith(f"; also, {cfg}: field 'budget.monthy_cap_usd': is not a known field (did you mean "
                         "'monthly_cap_usd'?)"), line
    # Where the file names no state that exists, there is nothing to read: its problem alone, nothing made.
    r = burstctl_here("--config", str(cfg), "--state-dir", str(tmp_path / "elsewhere"), "list")
    assert r.returncode == 2 and r.stdout == "" and not (tmp_path / "elsewhere").exists()
    assert r.stderr.strip() == f"burstctl: error: {cfg}: field 'budget.monthy_cap_usd': is not a known field (did " \
                               "you mean 'monthly_cap_usd'?)"


def test_revert_local_on_a_config_that_does_not_validate_still_sets_the_kill_switch(
        burstctl_here, tmp_path: Path) -> None:
    # The emergency brake works whatever the file says: the switch is set (a running daemon winds its cloud
    # attempts down on the settings it last read), and it says that it swept no provider (exit 1).
    cfg, state = tmp_path / "burstctl.toml", tmp_path / "state"
    cfg.write_text("[providers.sim]\nenabled = false\n")
    at = ("--config", str(cfg), "--state-dir", str(state))
    assert burstctl_here(*at, "status").returncode == 0
    cfg.write_text(MISTYPED)
    r = burstctl_here(*at, "revert-local")
    assert r.returncode == 1 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("burstctl: error: the kill switch is set: nothing will be launched; this shell wound "
                           f"nothing down and swept no provider, because {cfg}: field 'budget.monthy_cap_usd'"), line
    assert "; no daemon is running to bring cloud attempts home: fix the file" in line, line
    cfg.write_text("[providers.sim]\nenabled = false\n")
    assert json.loads(burstctl_here(*at, "status", "--json").stdout)["mode"] == "local-only"


@pytest.mark.parametrize(("text", "field", "says"), [
    ("[policy]\ndefault_market = 'cheap'\n", "policy.default_market",
     "expected 'auto', 'spot' or 'on-demand', got another string"),
    ("[schedule]\njob = 'x.toml'\ncron = '* * * * *'\n", "schedule",
     "expected a list, got a table (a list of tables is written [[schedule]], with two brackets)"),
], ids=["one-of-its-values", "a-list-of-tables-with-one-bracket"])
def test_a_wrong_choice_or_a_table_for_a_list_is_said_in_the_file_s_words(burstctl, tmp_path: Path, text: str,
                                                                          field: str, says: str) -> None:
    assert_config_refused(burstctl, tmp_path, text, "budget", field, says)


def test_a_rethink_job_s_record_says_it_does_not_run_and_names_the_retry_s_record_once_retried(
        burstctl, tmp_path: Path) -> None:
    # It said "filled in after the run" of a job that never runs.
    job = write_job(tmp_path, "too-soon", local_throughput=0.033, rented_throughput={"H100": 0.17}, deadline_hours=0.1)
    queued = json.loads(burstctl("enqueue", str(job), "--json").stdout)
    assert queued["decision"]["verdict"] == "rethink"
    shown = json.loads(burstctl("show", queued["id"], "--json").stdout)
    first = Path(shown["record"])
    assert "- **Measured:** none: a rethink job does not run (`burstctl retry` with a later deadline" in \
        first.read_text()
    assert burstctl("retry", queued["id"], "--deadline-hours", "48").returncode == 0
    later = Path(json.loads(burstctl("show", queued["id"], "--json").stdout)["record"])
    assert later != first and f": see {later.name}" in first.read_text()
    assert "- **Measured:** _(filled in after the run)_" in later.read_text()


def test_a_job_cancelled_before_it_ran_has_a_record_that_says_so_and_names_the_retry_s_record_once_retried(
        burstctl, tmp_path: Path) -> None:
    # Its Measured line had said "filled in after the run" for ever: no attempt's end ever fills it.
    queued = json.loads(burstctl("enqueue", str(write_job(tmp_path, "never-ran")), "--json").stdout)
    first = Path(json.loads(burstctl("show", queued["id"], "--json").stdout)["record"])
    assert "- **Measured:** _(filled in after the run)_" in first.read_text()
    assert burstctl("cancel", queued["id"]).returncode == 0
    assert ("- **Measured:** none: cancelled before it ran (`burstctl retry` queues it again, and this line then "
            "names the retry's record)") in first.read_text()
    assert burstctl("retry", queued["id"]).returncode == 0
    later = Path(json.loads(burstctl("show", queued["id"], "--json").stdout)["record"])
    assert later != first and f": see {later.name}" in first.read_text()
    assert "- **Measured:** _(filled in after the run)_" in later.read_text()


def test_a_job_cancelled_between_attempts_is_measured_at_once_and_one_with_a_live_attempt_when_it_ends(
        burstctl, tmp_path: Path) -> None:
    # No attempt of it is live (its last ended: a failed launch, a preemption), so none will end to measure it.
    ids = [json.loads(burstctl("enqueue", str(write_job(tmp_path, name)), "--json").stdout)["id"]
           for name in ("between", "live")]
    app = App(state_dir_override=str(burstctl.state_dir))
    try:
        with app.store.tx() as conn:
            for job_id, state in zip(ids, ("launch_failed", "running"), strict=True):
                conn.execute(insert(s.attempts).values(
                    id=f"{job_id}-a1", job_id=job_id, n=1, where="cloud", state=state, provider="sim",
                    instance_type="h100x1", market="spot", idempotency_key=None, info={}, created_at=0.0,
                    ended_at=1.0 if state == "launch_failed" else None))
    finally:
        app.close()
    for job_id in ids:
        assert burstctl("cancel", job_id).returncode == 0
    between, live = (Path(json.loads(burstctl("show", job_id, "--json").stdout)["record"]).read_text()
                     for job_id in ids)
    assert "- **Measured:** cancelled: run 0.00 h, cost $0.00, " in between
    assert "1 attempt(s), 0 preemption(s)" in between
    assert "- **Measured:** _(filled in after the run)_" in live  # the daemon stops it, then measures it


def test_an_unreachable_database_is_one_line_naming_the_field(burstctl, tmp_path: Path) -> None:
    from tests.e2e import free_port

    cfg = tmp_path / "burstctl.toml"
    cfg.write_text(f"[state]\ndatabase_url = 'postgresql+psycopg://burst@127.0.0.1:{free_port()}/burstctl'\n")
    r = burstctl("--config", str(cfg), "list")
    line = r.stderr.strip()
    assert r.returncode == 1 and "\n" not in line, line
    assert str(cfg) in line and "state.database_url" in line and "cannot open the database" in line, line


def test_a_relative_state_dir_or_sqlite_path_in_the_config_is_read_from_the_config_file_s_directory(
        burstctl, tmp_path: Path) -> None:
    # They were read from the current directory: a daemon under systemd (started in ~) and a command run in the
    # checkout used two states without a word.
    home, elsewhere = tmp_path / "conf", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    cfg = home / "burstctl.toml"
    for state in ('dir = "relstate"', 'database_url = "sqlite:///rel/burstctl.db"'):
        cfg.write_text(f"[state]\n{state}\n")
        job = str(REPO / "examples" / "seed" / "a-grpo-smoke.toml")
        assert burstctl("--config", str(cfg), "enqueue", job, cwd=home, state_dir=None).returncode == 0
        listed = burstctl("--config", str(cfg), "list", "--json", cwd=elsewhere, state_dir=None)
        assert [j["name"] for j in json.loads(listed.stdout)] == ["a-grpo-smoke"], listed.stderr
        assert not any(elsewhere.iterdir())
        burstctl("--config", str(cfg), "cancel", "a-grpo-smoke", cwd=home, state_dir=None)
    cfg.write_text('[state]\ndir = "relstate"\n')
    shown = json.loads(burstctl("--config", str(cfg), "status", "--json", cwd=elsewhere, state_dir=None).stdout)
    assert shown["state_dir"] == str(home / "relstate")
    # A relative --state-dir is the shell's, from where the command runs.
    assert burstctl("--config", str(cfg), "--state-dir", "mine", "list", cwd=elsewhere, state_dir=None).returncode == 0
    assert (elsewhere / "mine").is_dir()


def test_a_sqlite_database_url_naming_a_file_that_is_no_database_leaves_it_as_it_was(burstctl, tmp_path: Path) -> None:
    # It was made private (0600) before SQLite found it no database: /etc/passwd, named as root, then locked every
    # other user out of the system's user names.
    other = tmp_path / "notes.txt"
    other.write_text("not a database\n")
    other.chmod(0o644)
    cfg = tmp_path / "other.toml"
    cfg.write_text(f"[state]\ndatabase_url = 'sqlite:///{other}'\n")
    expected = (f"'{other}' is not a SQLite database: expected a SQLite database file, or a path where one can be "
                "made")
    r = burstctl("--config", str(cfg), "list")
    assert (r.returncode, r.stderr.strip()) == (2, f"burstctl: error: {cfg}: field 'state.database_url': {expected}")
    r = burstctl("copy-state", "--to", f"sqlite:///{other}")
    assert (r.returncode, r.stderr.strip()) == (2, f"burstctl: error: --to: {expected}")
    assert (other.stat().st_mode & 0o777, other.read_text()) == (0o644, "not a database\n")


def test_a_sqlite_database_that_names_a_directory_is_one_line_naming_the_field(burstctl, tmp_path: Path) -> None:
    # It was an internal error (IsADirectoryError), in the config and in copy-state's --to alike.
    (tmp_path / "burstctl.db").mkdir()
    cfg = tmp_path / "dir.toml"
    cfg.write_text(f"[state]\ndatabase_url = 'sqlite:///{tmp_path / 'burstctl.db'}'\n")
    r = burstctl("--config", str(cfg), "list")
    assert (r.returncode, r.stderr.strip()) == (2, f"burstctl: error: {cfg}: field 'state.database_url': "
                                                   f"'{tmp_path / 'burstctl.db'}' is a directory: expected a SQLite "
                                                   "database file, or a path where one can be made")
    r = burstctl("copy-state", "--to", f"sqlite:///{tmp_path / 'burstctl.db'}")
    assert (r.returncode, r.stderr.strip()) == (2, f"burstctl: error: --to: '{tmp_path / 'burstctl.db'}' is a "
                                                   "directory: expected a SQLite database file, or a path where one "
                                                   "can be made")


def test_a_daemon_tick_past_the_config_s_ceiling_is_refused_before_the_daemon_starts(burstctl_subprocess) -> None:
    # A tick of 1e308 s started the daemon (its start recorded), then crashed it.
    r = burstctl_subprocess("daemon", "--tick", "1e308")
    assert r.returncode == 2 and "'--tick': 1e+308 is not in the range 0.05<=x<=600" in r.stderr, r.stderr
    assert not (burstctl_subprocess.state_dir / "burstctl.db").exists()


def test_a_daemon_whose_burstctl_config_is_set_but_empty_does_not_start_on_the_defaults(
        burstctl_subprocess) -> None:
    # A systemd env file's `BURSTCTL_CONFIG=`: the daemon ran on the built-in defaults, with another state directory
    # and the simulated cloud only. The real script: one line, exit 2, no traceback, nothing made.
    r = burstctl_subprocess("daemon", env={"BURSTCTL_CONFIG": ""})
    assert (r.returncode, r.stdout, r.stderr.splitlines()) == (2, "", [EMPTY_CONFIG_ENV]), r.stderr
    assert not burstctl_subprocess.state_dir.exists()


def test_unknown_job_is_bad_input(burstctl) -> None:
    r = burstctl("show", "no-such-job")
    assert r.returncode == 2 and "no job with id or name" in r.stderr


def test_usage_errors_are_one_line(burstctl) -> None:
    r = burstctl("decide", "--s-local", "x", "--deadline-h", "1", "--rate", "3")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    r = burstctl("decide", "--s-local", "0.1")
    assert r.returncode == 2 and "--deadline-h" in r.stderr
    # The program's name once; a near miss of a command is named, else where the list is.
    r = burstctl("enqeue", "job.toml")
    assert (r.returncode, r.stderr.strip()) == (2, "burstctl: error: No such command 'enqeue'. Did you mean 'enqueue'?")
    r = burstctl("submit", "job.toml")
    assert r.returncode == 2 and r.stderr.strip().endswith("`burstctl --help` lists the commands.")
    # Flags mode names its decision record after --name: a path there is bad input, not a traceback.
    r = burstctl("decide", "--s-local", "1", "--deadline-h", "5", "--rate", "3", "--name", "../../x")
    assert r.returncode == 2 and "field '--name'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = burstctl("events", "--follow", "--interval", "-1")
    assert r.returncode == 2 and "--interval" in r.stderr
    # The job file's ceiling: 1e11 GPUs sized a model no one can rent.
    r = burstctl("size", "--params", "7e9", "--gpus", "100000000000")
    assert r.returncode == 2 and "'--gpus': 100000000000 is not in the range 1<=x<=64" in r.stderr, r.stderr


def test_a_state_dir_that_is_a_file_is_bad_input(burstctl, tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    for where in (afile, afile / "below"):
        r = burstctl("status", state_dir=where)
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip() == (f"burstctl: error: field '--state-dir': '{afile}' is a file; expected a "
                                    "directory (or a path that does not exist yet)")
    loop = tmp_path / "loop"
    loop.symlink_to("loop")  # a path no directory can be made at: it was an internal error
    for where in (loop, loop / "below"):
        r = burstctl("status", state_dir=where)
        assert (r.returncode, r.stderr.strip()) == (2, f"burstctl: error: field '--state-dir': '{loop}' is a symbolic "
                                                       "link that leads nowhere (a loop, or to a path that is gone); "
                                                       "expected a directory (or a path that does not exist yet)")


def test_a_what_if_decide_never_overwrites_the_record_of_an_enqueued_job(burstctl, tmp_path: Path) -> None:
    job = write_job(tmp_path, "same-name")
    enqueued = json.loads(burstctl("enqueue", str(job), "--json").stdout)
    record = Path(enqueued["record"])
    before = record.read_text()
    what_ifs = [json.loads(burstctl("decide", str(job), "--json").stdout)["record"] for _ in range(2)]
    assert record.read_text() == before  # its Measured line, once filled in, survives too
    assert len({str(record), *what_ifs}) == 3 and all(Path(p).exists() for p in what_ifs)


def test_deciding_a_file_already_queued_says_the_queue_ahead_may_be_its_own_copy(burstctl, tmp_path: Path) -> None:
    job = write_job(tmp_path, "twice-weighed")  # local: 3 h of the local GPU's queue
    first = burstctl("decide", str(job))
    assert first.returncode == 0 and "note: a job of this name" not in first.stdout
    job_id = json.loads(burstctl("enqueue", str(job), "--json").stdout)["id"]
    again = burstctl("decide", str(job))
    assert "queued ahead" in again.stdout  # the first copy's 3 h, ahead of the file decided as a new job
    assert (f"note: a job of this name is in the queue already ({job_id} (queued)): this decision weighs the file "
            "as a new job beside it") in " ".join(again.stdout.split())


def test_a_name_means_its_one_job_not_yet_over_else_the_error_lists_the_ids_and_reading_takes_the_newest(
        burstctl, tmp_path: Path) -> None:
    job = write_job(tmp_path, "twice", market="on-demand")
    first, second = (json.loads(burstctl("enqueue", str(job), "--json").stdout)["id"] for _ in range(2))
    r = burstctl("cancel", "twice")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"burstctl: error: field 'JOB': 2 jobs are named 'twice': give one of their ids: {second} (queued), "
        f"{first} (queued)"]
    assert burstctl("cancel", second).returncode == 0
    assert burstctl("cancel", "twice").returncode == 0  # the one left that is not over
    assert json.loads(burstctl("show", first, "--json").stdout)["state"] == "cancelled"
    # Reading a name several finished jobs share (a schedule's cycles) shows the newest, and says so.
    r = burstctl("show", "twice", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["id"] == second
    assert r.stderr.strip() == (f"twice: the newest of 2 jobs of that name, {second} (cancelled); give an id for "
                                "another (burstctl list --all)")
    assert burstctl("approve", "twice").returncode == 2  # changing one still needs it named


def test_a_deadline_that_renting_meets_for_less_than_local_is_called_cheaper_not_a_negative_price(burstctl) -> None:
    r = burstctl("decide", "--work", "0.5", "--s-local", "0.001", "--s-rented", "0.17", "--deadline-h", "12",
                 *SEED_FLAGS)
    assert r.returncode == 0, r.stderr
    assert ("price of the deadline: none: renting, all of it on-demand, is $39.68 cheaper than local and saves "
            "496.56 h.") in r.stdout
    # The plan's figure is said as the plan's: with spot in it, it is not the on-demand one above.
    assert "the deadline costs nothing: its plan is $39.68 cheaper than local (its plan $" in r.stdout
    assert "$-" not in r.stdout
    record = next((burstctl.state_dir / "decisions").glob("*.md")).read_text()
    assert "ΔC = −$39.68 to save 496.56 h" in record and "$-" not in record


def test_a_job_file_naming_an_unpriced_gpu_type_is_refused_naming_the_priced_ones(burstctl, tmp_path: Path) -> None:
    # A typo ("H10O") or a type the config has no price for would be skipped, and the job queued to rethink.
    job = write_job(tmp_path, "b200-too", local_throughput=0.01, rented_throughput={"H100": 0.17, "B200": 1.0},
                    deadline_hours=12)
    for command in ("decide", "enqueue"):
        r = burstctl(command, str(job))
        assert (r.returncode, r.stderr) == (2, f"burstctl: error: {job}: field 'rented_throughput.B200': 'B200' is "
                                               "not a GPU type of [prices] (A10, A100, H100, H200, L4, L40S, T4, "
                                               "V100): name one of them, or add [prices.B200] to the config\n")
    assert json.loads(burstctl("list", "--json").stdout) == []


def test_a_queued_job_whose_gpu_types_lost_their_prices_is_told_to_price_them_not_to_rethink_its_scope() -> None:
    # A config reload can take a price away from a job queued with it: the decision says what to do.
    from orchestrator.core.decision import DecisionContext, JobFacts, decide

    job = JobFacts(name="b200-only", kind="train", work=1, s_local=0.01, rented={"B200": 1.0}, gpus=1, deadline_h=12)
    d = decide(job, DecisionContext(local_usd_h=0.1, offers={}, overhead_h=0.5))
    assert any(r.startswith("no GPU type in rented_throughput has a price: name a type of [prices] in the config")
               for r in d.reasons)
    assert not any("LoRA" in r for r in d.reasons)


def test_a_local_job_is_not_given_a_reason_about_rented_gpu_types(burstctl, tmp_path: Path) -> None:
    job = write_job(tmp_path, "stays-home", rented_throughput={"H100": 2.0, "A100": 1.0})
    d = json.loads(burstctl("enqueue", str(job), "--json").stdout)
    assert d["state"] == "queued" and d["decision"]["verdict"] == "local"
    assert not any(r.startswith("GPU type") for r in d["decision"]["reasons"])
    assert d["reason"].startswith("Gate 2: local finishes")


def test_status_lists_a_local_attempt_which_has_no_market(burstctl, tmp_path: Path) -> None:
    job_id = json.loads(burstctl("enqueue", str(write_job(tmp_path, "here")), "--json").stdout)["id"]
    app = App(state_dir_override=str(burstctl.state_dir))
    try:
        with app.store.tx() as conn:
            conn.execute(insert(s.attempts).values(
                id=f"{job_id}-a1", job_id=job_id, n=1, where="local", state="running", provider="local",
                instance_type="local", market=None, idempotency_key=None, info={}, created_at=0.0))
    finally:
        app.close()
    r = burstctl("status")
    assert r.returncode == 0, r.stderr
    assert f"{job_id}-a1" in r.stdout and "local" in r.stdout


def test_an_instance_s_host_key_recorded_at_first_use_is_one_of_its_job_s_events(burstctl, tmp_path: Path) -> None:
    # It carried no job or attempt id, so `events --job` left it out.
    from orchestrator.lifecycle.cloud_steps import CloudSteps

    job_id = json.loads(burstctl("enqueue", str(write_job(tmp_path, "keyed")), "--json").stdout)["id"]
    att = {"id": f"{job_id}-a1", "job_id": job_id, "provider": "sim", "instance_id": "i-1"}
    app = App(state_dir_override=str(burstctl.state_dir))
    try:
        with app.store.tx() as conn:
            conn.execute(insert(s.attempts).values(
                id=att["id"], job_id=job_id, n=1, where="cloud", state="bootstrapping", provider="sim",
                instance_type="gpu_1x_h100", market="spot", idempotency_key=None, info={}, created_at=0.0))
            conn.execute(insert(s.instances).values(provider="sim", id="i-1", attempt_id=att["id"], state="running"))
        CloudSteps(app, {}).trust(att).put("i-1", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKey")
    finally:
        app.close()
    listed = burstctl("events", "--job", job_id, "--type", "instance.", "--json").stdout
    (said,) = [json.loads(line) for line in listed.splitlines()]
    assert (said["type"], said["job"], said["attempt"]) == ("instance.host_key_recorded", job_id, att["id"])
    assert (said["provider"], said["instance"], said["key_type"]) == ("sim", "i-1", "ssh-ed25519")


def test_enqueue_notes_when_no_enabled_provider_can_be_used_from_this_shell_for_a_job_that_bursts(
        burstctl, tmp_path: Path) -> None:
    # "burst → queued" and nothing more, while no cloud could ever take it from here: said on stderr, not refused
    # (the daemon's own environment may hold the keys).
    big = str(write_job(tmp_path, "big", local_throughput=0, rented_throughput={"H100": 0.17}, deadline_hours=48))
    small = str(write_job(tmp_path, "small"))
    keyless = burstctl("enqueue", big, "--json", env={"BURSTCTL_SIM_API_KEY": ""})
    assert keyless.returncode == 0 and json.loads(keyless.stdout)["placement"] == "cloud"
    assert ("burstctl: note: no enabled provider can be used from this shell (sim: no API key: set the environment "
            "variable BURSTCTL_SIM_API_KEY)") in keyless.stderr
    assert "no enabled provider" not in burstctl("enqueue", small, env={"BURSTCTL_SIM_API_KEY": ""}).stderr  # local
    assert "no enabled provider" not in burstctl("enqueue", big, env={"BURSTCTL_SIM_API_KEY": "k"}).stderr
    cfg = tmp_path / "none.toml"
    cfg.write_text("[providers.sim]\nenabled = false\n")
    assert "no provider is enabled in the config" in burstctl("--config", str(cfg), "enqueue", big).stderr


def test_status_names_the_config_file_it_read(burstctl, tmp_path: Path) -> None:
    # None: no file, the built-in defaults. A daemon under systemd may read another file than the CLI: say which.
    assert json.loads(burstctl("status", "--json").stdout)["config"] is None
    assert "config: no file (built-in defaults)" in burstctl("status").stdout
    cfg = tmp_path / "elsewhere" / "burst.toml"
    cfg.parent.mkdir()
    cfg.write_text("[budget]\nmonthly_cap_usd = 20\n")
    assert json.loads(burstctl("--config", str(cfg), "status", "--json").stdout)["config"] == str(cfg)
    assert f"config: {cfg}" in burstctl("--config", str(cfg), "status").stdout
    (tmp_path / "burstctl.toml").write_text("")  # ./burstctl.toml, found relative: said as an absolute path
    assert json.loads(burstctl("status", "--json").stdout)["config"] == str(tmp_path / "burstctl.toml")


def test_status_says_when_the_running_daemon_read_another_config_file_than_this_command(
        burstctl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A daemon under systemd reads ~/.config/burstctl/config.toml while the CLI reads ./burstctl.toml: it plans
    # with other settings, on the same state, and nothing said so.
    from orchestrator.daemon import CONFIG_SEEN_KEY, DaemonLock, config_fingerprint

    ours = tmp_path / "burstctl.toml"
    ours.write_text("")
    # A daemon that found ./burstctl.toml records it resolved: status elsewhere compares it with its own file.
    monkeypatch.chdir(tmp_path)
    relative = App(config_path="burstctl.toml", state_dir_override=str(tmp_path / "elsewhere"))
    assert config_fingerprint(relative.config)["source"] == str(ours.resolve())
    relative.close()
    burstctl("status")  # makes the state
    app = App(config_path=str(ours), state_dir_override=str(burstctl.state_dir))
    app.store.set_setting(CONFIG_SEEN_KEY, {"source": str(tmp_path / "other.toml"), "sha256": "x"})
    lock = DaemonLock(burstctl.state_dir)
    lock.acquire()  # a daemon runs on this state
    try:
        d = json.loads(burstctl("status", "--json").stdout)
        assert d["daemon_config"] == str(tmp_path / "other.toml")
        assert f"the running daemon read {tmp_path / 'other.toml'}, not this file" in burstctl("status").stdout
        app.store.set_setting(CONFIG_SEEN_KEY, {"source": str(ours), "sha256": "x"})
        assert json.loads(burstctl("status", "--json").stdout)["daemon_config"] is None
    finally:
        lock.release()
        app.close()
    assert json.loads(burstctl("status", "--json").stdout)["daemon_config"] is None  # no daemon: nothing to say


def test_a_gpu_type_is_the_priced_one_whatever_its_case(burstctl, tmp_path: Path) -> None:
    job = write_job(tmp_path, "lower", local_throughput=0, rented_throughput={"h100": 2.0})
    d = json.loads(burstctl("decide", str(job), "--json", "--no-record").stdout)
    assert (d["verdict"], d["gpu"]) == ("burst", "H100"), d["reasons"]


def test_list_says_why_each_held_job_is_held(burstctl, tmp_path: Path) -> None:
    # Over the $15 budget: blocked, and the table alone would not say why.
    held = json.loads(burstctl("enqueue", str(write_job(tmp_path, "dear", local_throughput=0, deadline_hours=48,
                                                        rented_throughput={"H100": 0.01})), "--json").stdout)
    shown = burstctl("list").stdout
    assert held["state"] == "blocked"
    assert f"{held['id']} blocked: budget: projected rented $" in shown, shown


def test_list_draws_the_first_rows_of_a_long_queue_and_says_how_many_more(
        burstctl_here, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 10,000 queued jobs took 8.7 s to draw as one table; the first 200 rows answer what `list` is run for.
    from orchestrator.cli import jobs

    monkeypatch.setattr(jobs, "LIST_ROWS", 2)
    state = ["--state-dir", str(tmp_path / "state")]
    for n in range(3):
        assert burstctl_here(*state, "enqueue", str(write_job(tmp_path, f"q{n}", local_throughput=1.0))).returncode == 0
    shown = burstctl_here(*state, "list").stdout
    assert "q0" in shown and "q1" in shown and "q2" not in shown
    assert "1 more not shown: `burstctl status` counts them by state; --all draws every row" in shown
    assert "q2" in burstctl_here(*state, "list", "--all").stdout
    assert len(json.loads(burstctl_here(*state, "list", "--json").stdout)) == 3

"""The seed's three candidates go by one set of names: the job files in examples/seed/, the rows of `burstctl demo`'s
first table, and the README's table of the gates' verdicts, so a row of either table is matched to its file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.demo import Demo
from orchestrator.jobspec import load_job
from tests.conftest import REPO

SEED = REPO / "examples" / "seed"


def _seed_files() -> list[Path]:
    return sorted(SEED.glob("*.toml"))


def test_each_seed_file_is_named_as_the_job_it_holds() -> None:
    files = _seed_files()
    assert [f.stem for f in files] == ["a-grpo-smoke", "b-full-grpo-7b", "c-big-local-deadline"]
    for f in files:
        assert load_job(f)[0].name == f.stem


def test_the_demos_candidates_are_the_seeds_files_by_their_names_and_figures(tmp_path: Path) -> None:
    # The demo's table said A-grpo-smoke and C-big-local-job where the files say a-grpo-smoke and
    # c-big-local-deadline, from figures of its own: now it reads the files.
    rows = Demo(tmp_path / "demo", say=lambda line: None).candidates()
    assert [row["job"] for row in rows] == [f.stem for f in _seed_files()]
    assert [Path(row["file"]) for row in rows] == _seed_files()
    assert [row["verdict"] for row in rows] == ["local", "burst", "priced"]
    a, b, c = rows
    assert a["t_local_h"] == pytest.approx(3.03, abs=0.01)
    assert b["t_local_h"] is None and b["t_rented_h"] == pytest.approx(6.38, abs=0.01)
    assert c["t_local_h"] == pytest.approx(30.30, abs=0.01) and c["delta_cost_usd"] == pytest.approx(16.12, abs=0.01)
    assert c["hours_saved"] == pytest.approx(23.92, abs=0.01)


def test_the_readmes_table_names_the_seeds_files_with_their_figures() -> None:
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| [^|]+ \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) h \|", readme, re.M)
    assert [name for name, *_ in rows] == [f.stem for f in _seed_files()]
    for (name, s_local, s_rented, deadline_h), f in zip(rows, _seed_files(), strict=True):
        spec = load_job(f)[0]
        assert (float(s_local), float(s_rented), float(deadline_h)) == (
            spec.local_throughput, spec.rented_throughput["H100"], spec.deadline_hours), name

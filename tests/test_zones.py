"""Which zone a spot launch goes to when a job may move: the one whose spot has been up longest."""

from __future__ import annotations

import numpy as np

from orchestrator.core.zones import pick_zone_batch, zone_order


def test_zones_with_spot_go_longest_up_first_and_zones_without_are_left_out() -> None:
    assert zone_order([2.0, None, 30.0, 0.5]) == [2, 0, 3]


def test_equal_ages_keep_the_configured_order() -> None:
    assert zone_order([1.0, 3.0, 1.0, 3.0]) == [1, 3, 0, 2]


def test_no_zone_with_spot_gives_no_zone() -> None:
    assert zone_order([None, None]) == []


def test_the_batch_rule_is_the_scalar_rule_run_for_run() -> None:
    rng = np.random.default_rng(3)
    up = rng.random((5, 400)) < 0.5
    up[rng.integers(0, 5, 400), np.arange(400)] = True  # a spot launch is only asked for where some zone has it
    ages = rng.integers(1, 6, (5, 400)).astype(float) / 6  # coarse, so ties happen
    picked = pick_zone_batch(up, ages)
    for run in range(400):
        assert picked[run] == zone_order([float(a) if u else None for u, a in zip(up[:, run], ages[:, run],
                                                                                    strict=True)])[0]

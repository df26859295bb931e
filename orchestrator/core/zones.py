"""Which zone (region) a spot launch goes to, when the job may move between several.

A job that checkpoints may resume in any region of its provider, so spot is usable while *any* region has it. A
run on spot is preempted only when its own region loses spot; it then restarts, paying the changeover, wherever
spot is left. The choice of region is the rule below, shared by the daemon (ordering the regions it tries) and
`burstctl simulate --may-move` (replaying it), so what is measured is what runs.

The rule: of the regions with spot now, the one whose spot has been there longest. Spot's up periods are
heavy-tailed (a period that has lasted long tends to last longer: docs/simulate.md measures the hazard by age),
so the oldest up period is the one least likely to end soon. Ties keep the given (configured) order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def zone_order(up_for_h: Sequence[float | None]) -> list[int]:
    """Indices of the zones with spot now (`up_for_h[i]` is how long it has been up; None = no spot), longest
    up first, ties in the given order."""
    up = [(i, h) for i, h in enumerate(up_for_h) if h is not None]
    return [i for i, _ in sorted(up, key=lambda ih: -ih[1])]


def pick_zone_batch(up: np.ndarray, up_for_h: np.ndarray) -> np.ndarray:
    """`zone_order(...)[0]` for many runs: `up` and `up_for_h` are (zones, runs); the result is one zone per run
    (0 where no zone is up: the caller only asks for runs that start spot, which needs some zone up)."""
    score = np.where(up, up_for_h, -np.inf)
    return np.argmax(score, axis=0)  # argmax takes the first of equal maxima: the given order

"""Shared fixtures. Every test gets its own state directory and no ambient burstctl config."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("BURSTCTL_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    os.makedirs(tmp_path / "home", exist_ok=True)

"""The daemon reads its config file again when the file changes (or on SIGHUP) and applies what it can.

A reload does what a restart would, without stopping the ticks: the reconciler is built again from the new
settings (budget, policy, prices, providers, daemon timings), and it reads everything else from the database as
every tick does. What was opened once at the start stays as it was until a restart: the state directory, the
database, the event log (`[state]`) and the owner tag of instances (`orchestrator_id`). A file that does not
validate changes nothing: the daemon goes on with the settings it has and says why, once per edit.

The API key files the config names (`api_key_file`) are watched the same way: a rotated key is a change of
`providers.<name>.api_key_file`, and the rebuilt reconciler's clients read the new key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.config import Config, config_candidates, load_config
from orchestrator.errors import BadInput

# Settings the daemon opened resources from at its start; a change to them needs a restart.
RESTART_ONLY = ("state", "orchestrator_id")

Stamp = tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class ConfigChange:
    """What a changed config file means for the running daemon: the config to run on (None when the file was
    rejected), the settings it changes (dotted paths, names only: never a value), those left until a restart,
    and why the file was rejected."""

    config: Config | None
    read: Config | None = None  # the file as read (it differs from `config` in what needs a restart)
    applied: list[str] = field(default_factory=list)
    restart_needed: list[str] = field(default_factory=list)
    error: str | None = None


def changed_paths(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted paths of the settings that differ (a table's keys one by one; a list or a value as a whole)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            out += changed_paths(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [] if old == new else [prefix.rstrip(".")]


def _settings(cfg: Config) -> dict[str, Any]:
    return cfg.model_dump(mode="json", by_alias=True, exclude={"source"})


class ConfigWatch:
    """Looks at the config file's candidates each tick (a stat of each: cheap) and reads them again when one has
    changed, or when asked to (SIGHUP). `running` is what the daemon runs on: the caller sets it once it has
    taken a change."""

    def __init__(self, explicit: str | None, state_dir_override: str | None, running: Config):
        self.explicit = explicit
        self.state_dir_override = state_dir_override
        self.running = running
        # None: the first check reads the file, as the config may have been edited since `running` was read.
        self.stamp: Stamp | None = None
        self.key_stamps: dict[str, tuple[str, int, int]] | None = None  # provider → its key file's path, mtime, size

    def _key_stamps(self) -> dict[str, tuple[str, int, int]]:
        from providers.lambda_cloud import key_file_path

        out = {}
        for name, section in (("sim", self.running.providers.sim), ("lambda", self.running.providers.lambda_)):
            path = key_file_path(section)
            if path is not None:
                try:
                    st = path.stat()
                    out[name] = (str(path), st.st_mtime_ns, st.st_size)
                except OSError:
                    out[name] = (str(path), -1, -1)
        return out

    def _stamp(self) -> Stamp:
        out = []
        for path, _ in config_candidates(self.explicit):
            try:
                st = Path(path).stat()
                out.append((str(path), st.st_mtime_ns, st.st_size))
            except OSError:
                out.append((str(path), -1, -1))
        return tuple(out)

    def check(self, *, force: bool = False) -> ConfigChange | None:
        """None when nothing the daemon runs on has changed; else the change (or the rejection) to act on. Forced
        (SIGHUP), a file that has not changed is still a change with nothing applied: the reconciler is built
        again, and so reads the API key files again."""
        stamp, key_stamps = self._stamp(), self._key_stamps()
        before = self.key_stamps or {}
        # A file named anew is the config's change; only a file that is still named and changed is the key's.
        keys = sorted(n for n, s in key_stamps.items() if n in before and before[n][0] == s[0] and before[n] != s)
        self.key_stamps = key_stamps
        if stamp == self.stamp and not keys and not force:
            return None
        self.stamp = stamp
        try:
            read = load_config(self.explicit, self.state_dir_override)
        except BadInput as exc:
            return ConfigChange(None, error=str(exc))
        changed = changed_paths(_settings(self.running), _settings(read))
        changed = sorted({*changed, *(f"providers.{name}.api_key_file" for name in keys)})
        if not changed and read.source == self.running.source and not force:
            return None
        kept = [p for p in changed if p.split(".")[0] in RESTART_ONLY]
        # The settings the daemon opened resources from stay as they are; the rest is the file's.
        config = read.model_copy(update={"state": self.running.state, "orchestrator_id": self.running.orchestrator_id})
        return ConfigChange(config, read, applied=[p for p in changed if p not in kept], restart_needed=kept)

"""The shell's wiring: config, store and event log for one process, created lazily."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, TextIO

from orchestrator.config import Config, load_config_for_state
from orchestrator.errors import CONFIG_PROBLEMS, NOTES, BadInput, OperationalError

# The database layer (SQLAlchemy, ~0.2 s to import), the event log and the providers are imported where first
# used: a command that reads only the config (`size`, `simcloud serve`) never loads them.
if TYPE_CHECKING:
    from orchestrator.events import EventLog, Redactor
    from state.store import Store

# The kill switch (`revert-local` clears it, `burst-enable` sets it): a setting in the store, so the daemon and
# every command see the same answer.
BURST_ENABLED_KEY = "burst_enabled"
# The providers whose last listing the daemon asked for was refused (`OfferCache.refusals`: its key, say), and what
# each said: `status` tells them from the unreachable ones.
CLOUD_REFUSED_KEY = "cloud_refused"
# The providers that throttled the daemon's last listing (HTTP 429, Throttled), and when each is asked again (unix s).
CLOUD_THROTTLED_KEY = "cloud_throttled"
# The providers that answered the daemon's last listing that they are unavailable (HTTP 5xx, Transient) and said when
# to ask again (Retry-After), and when each is asked again (unix s): not unreachable, nor throttling the daemon.
CLOUD_UNAVAILABLE_KEY = "cloud_unavailable"
# This installation's owner tag when the config does not set one (`Config.orchestrator_id`).
ORCHESTRATOR_ID_KEY = "orchestrator_id"


def open_store(url: str, what: str) -> Store:
    """The store at `url`, migrated; an unreachable, refused or unknown database is one line naming `what`."""
    from sqlalchemy.exc import DBAPIError

    from state.store import NotADatabase, Store

    try:
        return Store(url)
    except NotADatabase as exc:  # left as it was: its mode too
        raise BadInput(f"{what}: '{exc.filename}' is not a SQLite database: expected a SQLite database file, or a "
                       "path where one can be made") from None
    except DBAPIError as exc:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else type(exc).__name__
        raise OperationalError(f"{what}: cannot open the database: {reason}") from None
    except IsADirectoryError as exc:  # a SQLite URL naming a directory
        raise BadInput(f"{what}: '{exc.filename}' is a directory: expected a SQLite database file, or a path where "
                       "one can be made") from None
    except (NotADirectoryError, FileExistsError) as exc:  # a SQLite file's path under a file
        # mkdir of its directory meeting a file says "File exists", of the file and not the directory it needed.
        raise BadInput(f"{what}: '{exc.filename}' is not a directory: expected a SQLite database file, or a path "
                       "where one can be made") from None
    except OSError as exc:  # the SQLite file (or its directory) cannot be made or opened: the disk, permissions
        where = f" ({exc.filename})" if exc.filename else ""
        raise OperationalError(f"{what}: cannot open the database: {exc.strerror or type(exc).__name__}{where}"
                               ) from None


def _new_sqlite_file(url: str) -> str | None:
    """The file a SQLite `url` names when there is none there yet (opening it makes it), else None."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    if u.get_backend_name() != "sqlite" or not u.database or u.database == ":memory:":
        return None
    return None if os.path.lexists(u.database) else u.database


@dataclass
class App:
    config_path: str | None = None
    state_dir_override: str | None = None
    console: TextIO | None = None
    routine_calls: bool = False  # the console shows every provider call (`daemon --verbose`)
    says_notes: bool = False  # the CLI's own App: what it notices is said once the command succeeds (`NOTES`)
    # The command only reads the state (or sets the kill switch): a config file that does not validate, while its
    # [state] section does, is read as that section on built-in defaults, with the file's problem kept in
    # `config_problem` for the command to say once it is done. A typo in a setting then never hides the queue, nor
    # blocks `revert-local`, while the daemon runs on the settings it last read.
    state_only: bool = False
    _closers: list = field(default_factory=list)
    _config_problem: BadInput | None = field(default=None, init=False, repr=False)

    @cached_property
    def config(self) -> Config:
        cfg, problem = load_config_for_state(self.config_path, self.state_dir_override)
        if problem is not None and not self.state_only:
            raise problem
        self._config_problem = problem
        if problem is not None and self.says_notes:
            CONFIG_PROBLEMS.append(problem)
        # --state-dir (or state.dir) naming a file, or a path under one: said once here, before any command
        # reaches for its lock or database there and fails with a traceback.
        for p in (cfg.state_dir, *cfg.state_dir.parents):
            if p.exists() and not p.is_dir():
                what = "is a file"
            elif p.is_symlink() and not p.exists():  # a loop, or its target gone: nothing can be made there
                what = "is a symbolic link that leads nowhere (a loop, or to a path that is gone)"
            else:
                continue
            raise BadInput(f"'{p}' {what}; expected a directory (or a path that does not exist yet)",
                           source=None if self.state_dir_override else cfg.source,
                           field="--state-dir" if self.state_dir_override else "state.dir")
        return cfg

    @property
    def config_problem(self) -> BadInput | None:
        """Why the config file does not validate, when `state_only` let the command run on its [state] alone."""
        _ = self.config
        return self._config_problem

    def use_config(self, cfg: Config) -> None:
        """Run on `cfg` from now on (the daemon's reload). The store and event log opened from the old one stay:
        `config_watch` keeps their settings as they were."""
        from providers.registry import key_file_secrets

        self.__dict__["config"] = cfg
        self.redactor.add_env_names(cfg.secret_env_names())
        self.redactor.add_values(key_file_secrets(cfg))  # a rotated key file's new key, before any client uses it

    @cached_property
    def store(self) -> Store:
        if self.config_problem is not None and not self.config.state_dir.exists():
            raise self.config_problem  # no state to show there: the file's problem, not a new empty state
        if self.says_notes and not self.config.state_dir.exists():
            # A mistyped --state-dir otherwise shows an empty queue, or queues a job no daemon will ever see, without
            # a word.
            NOTES.append(f"{self.config.state_dir} did not exist: made it, a new and empty state directory")
        elif self.says_notes and (made := _new_sqlite_file(self.config.database_url)):
            # The same for a mistyped state.database_url: a SQLite file is made wherever it points.
            NOTES.append(f"{made} did not exist: made it, a new and empty database (state.database_url)")
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.config.state_dir, 0o700)
        where = f"{self.config.source}: " if self.config.source else ""
        st = open_store(self.config.database_url, f"{where}field 'state.database_url'")
        self._closers.append(st.close)
        return st

    @cached_property
    def redactor(self) -> Redactor:
        from orchestrator.events import Redactor
        from providers.registry import key_file_secrets

        redactor = Redactor(self.config.secret_env_names())
        redactor.add_values(key_file_secrets(self.config))
        return redactor

    @cached_property
    def events(self) -> EventLog:
        from orchestrator.events import EventLog

        state = self.config.state
        log = EventLog(self.store, self.config.state_dir, self.redactor, console=self.console,
                       max_bytes=int(state.events_file_max_mb * 2**20), kept=state.events_files_kept,
                       routine_calls=self.routine_calls)
        self._closers.append(log.close)
        return log

    @cached_property
    def orchestrator_id(self) -> str:
        """The owner tag of this installation's instances: the config's, else the one kept in the state."""
        from sqlalchemy import select

        from state import schema as s

        if self.config.orchestrator_id:
            return self.config.orchestrator_id
        kept = self.store.get_setting(ORCHESTRATOR_ID_KEY)
        if kept:
            return str(kept)
        with self.store.engine.connect() as c:  # a state from before ids were per installation tagged "burstctl"
            used = c.execute(select(s.attempts.c.id).where(s.attempts.c.where == "cloud").limit(1)).first()
        self.store.set_setting(ORCHESTRATOR_ID_KEY, "burstctl" if used else f"burstctl-{secrets.token_hex(4)}")
        return str(self.store.get_setting(ORCHESTRATOR_ID_KEY))

    def close(self) -> None:
        for c in reversed(self._closers):
            c()
        self._closers.clear()


def burst_enabled(app: App) -> bool:
    return bool(app.store.get_setting(BURST_ENABLED_KEY, True))

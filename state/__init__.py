"""The persistent store: SQLite (WAL) by default, PostgreSQL by URL. The daemon keeps nothing only in memory."""

from state.store import Store, open_store

__all__ = ["Store", "open_store"]

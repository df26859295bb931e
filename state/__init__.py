"""The persistent store: SQLite (WAL) by default, PostgreSQL by URL. The daemon keeps nothing only in memory."""

from state.store import Store

__all__ = ["Store"]

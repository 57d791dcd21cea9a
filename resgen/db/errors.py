"""Errors of the dispatch database: one base class the runtime catches to fall back safely."""

from __future__ import annotations

__all__ = ["DatabaseError", "MissingDatabaseError", "CorruptDatabaseError",
           "ForeignDatabaseError", "NewerSchemaError"]


class DatabaseError(Exception):
    """Any problem with a tuning database file (the runtime catches this and falls back)."""


class MissingDatabaseError(DatabaseError):
    """The file does not exist (and was not to be created)."""


class CorruptDatabaseError(DatabaseError):
    """Not a readable SQLite file, or SQLite reports damage."""


class ForeignDatabaseError(DatabaseError):
    """A valid SQLite file that is not a resgen tuning database."""


class NewerSchemaError(DatabaseError):
    """Written by a newer resgen whose schema this version cannot read."""

"""The SQLite dispatch database: tuning results per (workload, variant, fingerprint,
environment), read back by the runtime. See store.py for the schema."""

from .errors import (CorruptDatabaseError, DatabaseError, ForeignDatabaseError,
                     MissingDatabaseError, NewerSchemaError)
from .store import APP, SCHEMA_VERSION, TuningDB, VerifyReport, row_checksum, warm_start_rows

__all__ = ["TuningDB", "VerifyReport", "SCHEMA_VERSION", "APP", "row_checksum", "DatabaseError",
           "MissingDatabaseError", "CorruptDatabaseError", "ForeignDatabaseError",
           "NewerSchemaError", "warm_start_rows"]

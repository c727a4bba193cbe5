"""Results: the export file (schema, write, read), the export of studies, `bench` (re-verify and
time an export against the vendors) and `report` (tables and plots).

`schema` and `entries` need no Optuna (the runtime loader reads exports through them); the
other modules are imported where they are used.
"""

from tuner.results.entries import EntryBuild, entry_build
from tuner.results.schema import (
    SCHEMA_VERSION,
    check_output,
    read_json,
    read_text,
    validate,
    write_export,
    write_json,
)

__all__ = ["SCHEMA_VERSION", "EntryBuild", "check_output", "entry_build", "read_json", "read_text", "validate",
           "write_export", "write_json"]

"""Small helpers shared by tests."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def finished_rows(db: Path) -> int:
    """Finished trials in an Optuna SQLite file, read without touching the schema (opening
    it through Optuna would create tables and race the process under test)."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            return conn.execute("SELECT COUNT(*) FROM trials WHERE state IN ('COMPLETE', 'FAIL')").fetchone()[0]
    except sqlite3.Error:
        return 0

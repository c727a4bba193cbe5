"""Small helpers shared by tests."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import time
from pathlib import Path


def finished_rows(db: Path) -> int:
    """Finished trials in an Optuna SQLite file, read without touching the schema (opening
    it through Optuna would create tables and race the process under test)."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            return conn.execute("SELECT COUNT(*) FROM trials WHERE state IN ('COMPLETE', 'FAIL')").fetchone()[0]
    except sqlite3.Error:
        return 0


def kill9_after(args: list[str], cwd: Path, db: Path, rows: int, timeout_s: float = 120) -> None:
    """Start `args`, wait until `db` holds `rows` finished trials, then SIGKILL it."""
    proc = subprocess.Popen(args, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout_s
    while time.time() < deadline and finished_rows(db) < rows:
        time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def trial_states(db: Path) -> dict[str, int]:
    """Trials per state (COMPLETE, FAIL, RUNNING, ...) in an Optuna SQLite file, read only."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        return dict(conn.execute("SELECT state, COUNT(*) FROM trials GROUP BY state").fetchall())


def user_attr_counts(db: Path, key: str) -> dict[str, int]:
    """How many trials hold each value (JSON text) of user attribute `key`, read only."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        return dict(conn.execute("SELECT value_json, COUNT(*) FROM trial_user_attributes WHERE key = ? "
                                 "GROUP BY value_json", (key,)).fetchall())

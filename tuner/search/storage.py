"""Optuna storages by URL, with heartbeats so a dead worker's trials are failed and retried.

- sqlite:///runs/hgemm.db (default), postgresql://user@host/db, mysql://...: RDB storage
  with heartbeats; several processes or machines can share one study.
- journal:PATH: Optuna's journal file, for several processes on one host without a
  database (no heartbeats: a killed worker's running trial stays RUNNING, never counted).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import optuna
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.storages._heartbeat import BaseHeartbeat

from tuner.errors import UserError

# A worker beats every HEARTBEAT_S / 2 seconds; a trial unbeaten for GRACE_S is failed and
# re-queued. The environment may shorten both (tests kill a worker and wait out the grace).
HEARTBEAT_S = int(os.environ.get("HGEMM_TUNE_HEARTBEAT_S", "10"))
GRACE_S = int(os.environ.get("HGEMM_TUNE_GRACE_S", "45"))


def storage_file(url: str) -> Path | None:
    """The file a SQLite or journal URL names (None for servers and in-memory SQLite)."""
    if url.startswith("journal:"):
        return Path(url.removeprefix("journal:"))
    if url.split(":", 1)[0].split("+")[0] != "sqlite":
        return None
    from sqlalchemy.engine import make_url

    try:
        database = make_url(url).database
    except Exception:  # noqa: BLE001 - a malformed URL: open_storage says so
        return None
    return Path(database) if database and database != ":memory:" else None


def open_storage(url: str, create: bool = True) -> optuna.storages.BaseStorage:
    """create=False (read-only commands, joining a study): a SQLite or journal file that does
    not exist is an error, not a new empty storage."""
    path = storage_file(url)
    if not create and path is not None and not path.is_file():
        raise UserError(f"cannot open storage {url!r}: no such file {path} (nothing was tuned there; "
                        "check the path, or run `hgemm-tune tune` with this --storage first)")
    try:
        if url.startswith("journal:"):
            from optuna.storages.journal import JournalFileBackend

            return optuna.storages.JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
        if url.split(":", 1)[0].split("+")[0] not in ("sqlite", "postgresql", "mysql"):
            raise UserError(f"unsupported storage URL {url!r}: use sqlite:///FILE, postgresql://..., "
                            "mysql://... or journal:FILE")
        kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            # A trial whose worker stopped beating is failed and re-queued once.
            return optuna.storages.RDBStorage(
                url, engine_kwargs=kwargs, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1))
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - sqlalchemy/driver errors: bad URL, no server, no driver
        raise UserError(f"cannot open storage {url!r}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None


class Heartbeat:
    """Records a heartbeat for every trial this process holds, from a background thread
    (ask/tell has no heartbeat of its own; `study.optimize` would start one per trial)."""

    def __init__(self, storage: optuna.storages.BaseStorage, held: Callable[[], list[int]]):
        self.storage, self.held = storage, held
        self.enabled = isinstance(storage, BaseHeartbeat) and storage.get_heartbeat_interval() is not None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="optuna-heartbeat")

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S / 2):
            try:
                held = self.held()
            except RuntimeError:  # the queue changed while we copied it: beat next time
                continue
            for trial_id in held:
                # A missed beat only risks a retry, never data.
                with contextlib.suppress(Exception):
                    self.storage.record_heartbeat(trial_id)

    def __enter__(self) -> Heartbeat:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

"""Optuna storages by URL, with heartbeats so a dead worker's trials are failed and retried.

- sqlite:///runs/hgemm.db (default), postgresql://user@host/db, mysql://...: RDB storage
  with heartbeats; several processes or machines can share one study.
- journal:PATH: Optuna's journal file, for several processes on one host without a
  database (no heartbeats).

Heartbeats only catch a dead worker after the grace period, and the journal has none: so each
trial also records the process that holds it (`tuner.search.owners`), and a search fails, at its
start and every STALE_CHECK_S, the running trials whose owner process is gone on this host, and
re-queues their configs (`requeue_failed`), on every kind of storage.

Commands that only read (studies, export, show, report, record) open a storage read-only: a
missing or empty file, or a database that is not an Optuna storage, is an error, never a new
schema written into it. Every SQLite or journal file is checked when it is opened (a corrupt
file is one line naming it, before any work).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import optuna
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


def open_storage(url: str, create: bool = True, read_only: bool = False) -> optuna.storages.BaseStorage:
    """create=False (read-only commands, joining a study): a SQLite or journal file that does
    not exist is an error, not a new empty storage. read_only=True (commands that only read):
    neither is the file changed in any way (an empty file gets no schema; SQLite is opened
    read-only)."""
    path = storage_file(url)
    create = create and not read_only
    if path is not None and path.exists() and not path.is_file():
        raise UserError(f"cannot open storage {url!r}: {path} is a folder, not a storage file")
    if not create and path is not None and not path.is_file():
        raise UserError(f"cannot open storage {url!r}: no such file {path} (nothing was tuned there; "
                        "check the path, or run `hgemm-tune tune` with this --storage first)")
    if path is not None and path.is_file():
        if url.startswith("journal:"):
            _check_journal(url, path)
        else:
            _check_sqlite(url, path, read_only)
    try:
        if url.startswith("journal:"):
            from optuna.storages.journal import JournalFileBackend

            file = url.removeprefix("journal:")
            return optuna.storages.JournalStorage(JournalFileBackend(file, lock_obj=_flock_lock(file)))
        if url.split(":", 1)[0].split("+")[0] not in ("sqlite", "postgresql", "mysql"):
            raise UserError(f"unsupported storage URL {url!r}: use sqlite:///FILE, postgresql://..., "
                            "mysql://... or journal:FILE")
        kwargs: dict = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
        if read_only and path is not None:
            # SQLite's own read-only mode: nothing this process does can write the file.
            uri = f"file:{path.resolve()}?mode=ro"
            kwargs = {"creator": lambda: sqlite3.connect(uri, uri=True, timeout=60, check_same_thread=False)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            # A trial whose worker stopped beating is failed and re-queued once.
            return optuna.storages.RDBStorage(
                url, engine_kwargs=kwargs, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                heartbeat_stale_trial_callback=requeue_failed)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - sqlalchemy/driver errors: bad URL, no server, no driver
        raise UserError(f"cannot open storage {url!r}: {type(exc).__name__}: {_first_line(exc)}") from None


def _flock_lock(file: str):
    """The journal's write lock as an flock: the kernel drops it when its holder dies, where
    Optuna's default (a symlink) outlives a process killed with SIGKILL mid-write and stalls every
    other process for its 30 s grace. Every hgemm-tune process on one journal uses this lock."""
    try:
        import fcntl
    except ImportError:  # not POSIX: Optuna's default lock
        return None
    from optuna.storages.journal._file import BaseJournalFileLock

    class FlockLock(BaseJournalFileLock):
        def __init__(self) -> None:
            self.path, self.fd = file + ".flock", None

        def acquire(self) -> bool:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            self.fd = fd
            return True

        def release(self) -> None:
            fd, self.fd = self.fd, None
            if fd is not None:
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    return FlockLock()


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0]


def _check_sqlite(url: str, path: Path, read_only: bool) -> None:
    """A SQLite file is a healthy Optuna storage (or, for a writing command, empty): checked
    read-only before Optuna opens it, so a corrupt file is one line naming it, before any work."""
    where = f"cannot open storage {url!r}: {path}"
    size = path.stat().st_size
    if size == 0:
        if read_only:
            raise UserError(f"{where} is empty: nothing was tuned there (the file is left as it is)")
        return  # a new storage: Optuna writes its schema
    try:
        with path.open("rb") as fh:
            header = fh.read(16)
    except OSError as exc:
        raise UserError(f"{where}: {exc.strerror}") from None
    if header != b"SQLite format 3\x00":
        raise UserError(f"{where} is not a SQLite database (a journal file? pass it as journal:{path})"
                        if header.startswith(b"{") else f"{where} is not a SQLite database")
    try:
        conn = sqlite3.connect(f"file:{path.resolve()}?mode=ro", uri=True, timeout=60)
        try:
            check = conn.execute("PRAGMA quick_check").fetchone()
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise UserError(f"{where} is corrupt or unreadable ({exc}); restore it from a backup or use a new "
                        "--storage") from None
    if not check or check[0] != "ok":
        raise UserError(f"{where} is corrupt ({check[0] if check else 'no answer'}); restore it from a backup "
                        "or use a new --storage")
    if "studies" not in tables and (tables or read_only):
        raise UserError(f"{where} is a SQLite database but not an Optuna storage (no studies table); "
                        "it is left as it is")


def _check_journal(url: str, path: Path) -> None:
    """Every line of a journal file is an Optuna log record (Optuna would append to a broken one
    and fail minutes later): one line naming the file and line, before any work."""
    try:
        with path.open("rb") as fh:
            for lineno, line in enumerate(fh, 1):
                try:
                    rec = json.loads(line)
                except ValueError as exc:  # JSON errors, and bytes that are not UTF-8
                    why = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else "not a journal record"
                    raise UserError(f"cannot open storage {url!r}: {path}:{lineno}: {why} "
                                    "(not an Optuna journal file, or a damaged one)") from None
                if not isinstance(rec, dict) or "op_code" not in rec:
                    raise UserError(f"cannot open storage {url!r}: {path}:{lineno}: not a journal record "
                                    "(not an Optuna journal file)")
    except OSError as exc:
        raise UserError(f"cannot open storage {url!r}: {path}: {exc.strerror}") from None


def requeue_failed(study: optuna.Study, trial: optuna.trial.FrozenTrial, max_retry: int = 1) -> int | None:
    """Queue a failed trial's parameters again (a WAITING trial, asked first), once: what Optuna's
    RetryHeartbeatStaleTrialCallback does (the same `failed_trial` / `retry_history` system
    attributes), without copying the dead trial's user attributes (its owner, its status).
    An enqueued trial's fixed parameters (system attributes) go with it. Returns the new trial's
    id; None when it was retried `max_retry` times already, or holds no parameters to repeat."""
    history = [*trial.system_attrs.get("retry_history", []), trial.number]
    if (max_retry is not None and len(history) > max_retry) or not (trial.params or
                                                                    trial.system_attrs.get("fixed_params")):
        return None
    system_attrs = {**trial.system_attrs, "failed_trial": trial.system_attrs.get("failed_trial", trial.number),
                    "retry_history": history}
    return study._storage.create_new_trial(
        study._study_id,
        template_trial=optuna.trial.create_trial(state=optuna.trial.TrialState.WAITING, params=trial.params,
                                                 distributions=trial.distributions, system_attrs=system_attrs))


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

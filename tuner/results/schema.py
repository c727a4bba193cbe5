"""The export file: its JSON Schema, validation, atomic writing and reading.

The contract between the tuner and whatever loads its winners (the runtime loader, `bench`,
other programs). Imports nothing of the search: reading an export needs no Optuna.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from tuner.errors import UserError

SCHEMA_VERSION = 1


SCHEMA_PATH = Path(str(resources.files("tuner.results") / "export_schema.json"))


def validate(data: dict[str, Any], where: str = "export") -> None:
    """Check an export against export_schema.json; a UserError names the first problem."""
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(data), key=lambda e: list(e.path))
    if errors:
        err = errors[0]
        at = "/".join(str(p) for p in err.path) or "(top level)"
        raise UserError(f"{where}: {at}: {err.message}")


def check_output(path: str | Path) -> None:
    """Before any work: an export can be written at `path` (not a folder, under a folder that
    exists or can be made and is writable), and a file already there is an hgemm-tune export,
    never anything else (which would be lost)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"cannot write {path}: it is a folder; give a file name such as {path / 'best.json'}")
    check_writable_folder(path.parent, f"cannot write {path}")
    if path.exists() and _entries_in(path) is None:
        raise UserError(f"{path} exists and is not an hgemm-tune export: it is not overwritten "
                        "(choose another output file, or move it away)")


def _entries_in(path: Path) -> int | None:
    """How many entries the export at `path` holds; None if it is not an export."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    entries = data.get("entries") if isinstance(data, dict) else None
    return len(entries) if isinstance(entries, list) else None


def write_export(data: dict[str, Any], path: str | Path) -> tuple[Path | None, str | None]:
    """Write an export without losing an earlier one: (the path written or None, a note to show).

    An export that holds no entry is not written (a file already there is kept). An existing
    export that held more entries, or that cannot be read as one, is kept as NAME.prev.json."""
    path = Path(path)
    new = len(data["entries"])
    if not new:
        return None, (f"{path} not written: the export holds no verified kernel"
                      + (" (the file there is kept as it was)" if path.exists() else ""))
    note = None
    if path.is_file():
        old = _entries_in(path)
        if old is None or old > new:
            prev = path.with_name(f"{path.stem}.prev{path.suffix or '.json'}")
            try:
                shutil.copy2(path, prev)
            except OSError as exc:
                raise UserError(f"cannot keep a copy of {path} as {prev} before replacing it: "
                                f"{exc.strerror or exc}; nothing written") from None
            note = (f"{path} held {old if old is not None else 'unreadable'} entries, this export {new}: "
                    f"the previous one is kept as {prev}")
    return write_json(data, path), note


def write_json(data: dict[str, Any], path: str | Path) -> Path:
    """Validate, then write atomically: a crash never leaves half a JSON file behind."""
    validate(data, str(path))
    path = Path(path)
    if path.is_dir():
        raise UserError(f"cannot write {path}: it is a folder; give a file name such as {path / 'best.json'}")
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
    except OSError as exc:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def read_text(path: str | Path, what: str = "file") -> str:
    """A text file as UTF-8; bytes that are not UTF-8 are one line naming the file, line and byte."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except IsADirectoryError:
        raise UserError(f"cannot read {path}: it is a folder, not a {what}") from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if raw.startswith(b"SQLite format 3\x00"):
            raise UserError(f"{path}: not a {what} but a SQLite database (pass it as sqlite:///{path})") from None
        line = raw[:exc.start].count(b"\n") + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {column}); "
                        f"is it a {what}?") from None


def read_json(path: str | Path) -> dict[str, Any]:
    text = read_text(path, "JSON file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    if not isinstance(data, dict) or "entries" not in data:
        raise UserError(f"{path}: not an hgemm-tune export (no 'entries')")
    validate(data, str(path))
    return data


def check_writable_folder(folder: Path, what: str) -> None:
    """The folder exists or can be made: its nearest existing ancestor is a writable folder.
    `what` starts the one-line error ("cannot write X")."""
    parent = folder
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{what}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{what}: the folder {parent} is not writable")

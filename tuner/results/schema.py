"""The export file: its JSON Schema, validation, atomic writing and reading.

The contract between the tuner and whatever loads its winners (the runtime loader, `bench`,
other programs). Imports nothing of the search: reading an export needs no Optuna.
"""

from __future__ import annotations

import json
import os
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


def read_json(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    except ValueError:  # not text at all, e.g. a SQLite file
        raise UserError(f"{path}: not a JSON file (a database? pass it as sqlite:///{path})") from None
    if not isinstance(data, dict) or "entries" not in data:
        raise UserError(f"{path}: not an hgemm-tune export (no 'entries')")
    validate(data, str(path))
    return data

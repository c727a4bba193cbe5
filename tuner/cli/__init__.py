"""The `hgemm-tune` command: `tuner.cli.app` holds the commands, `options` every option
(declared once), `views` the progress bars and tables."""

from __future__ import annotations

import sys


def main() -> None:
    from tuner.cli.app import app
    from tuner.errors import UserError

    # `hgemm-tune --shape ...` is `hgemm-tune tune --shape ...`.
    argv = sys.argv[1:]
    if argv and argv[0].startswith("-") and argv[0] not in ("--help", "-h"):
        sys.argv.insert(1, "tune")
    try:
        app(standalone_mode=True)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)  # one plain line: no wrapping, no markup
        sys.exit(2)

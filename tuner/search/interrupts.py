"""SIGINT and SIGTERM as one KeyboardInterrupt, raised only between storage transactions."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class _Interrupts:
    """SIGINT and SIGTERM (how `tune --workers` stops its workers) as one KeyboardInterrupt, raised
    outside the `deferred()` sections that ask and tell trials; further signals are ignored while
    the process tells the trials it holds as FAIL ("interrupted") and exits."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending = self.stopping = False

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stopping:
            return
        self.stopping = True
        if self.depth:
            self.pending = True  # raised when the section ends
        else:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.pending and not self.depth:
                self.pending = False
                raise KeyboardInterrupt

    @contextlib.contextmanager
    def handled(self) -> Iterator[None]:
        """Handle SIGINT and SIGTERM this way inside the block (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        self.pending = self.stopping = False
        for sig in old:
            signal.signal(sig, self._on_signal)
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)


INTERRUPTS = _Interrupts()

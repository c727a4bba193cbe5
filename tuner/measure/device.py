"""The GPU side's lowest layer: cupy on demand, and CUDA errors as KernelFault."""

from __future__ import annotations

import contextlib


class KernelFault(Exception):
    """A CUDA error during a candidate's launch: the context is unusable afterwards."""


def cp():
    """cupy, imported on first use: the parent process never needs it."""
    import cupy

    return cupy


def sync_or_fault(stream) -> None:
    try:
        stream.synchronize()
    except cp().cuda.runtime.CUDARuntimeError as exc:
        raise KernelFault(str(exc)) from None


def abandon_capture(stream) -> None:
    """End a capture that a launch broke, so the stream is usable again (the error itself
    has already been raised to the caller; an invalidated capture ends with one more)."""
    with contextlib.suppress(Exception):
        if getattr(stream, "is_capturing", lambda: True)():
            stream.end_capture()

"""Our contenders: a cubin's `hgemm` kernel (fixed 1-D launch) or a library family's
`hgemm_run` (host code builds TMA descriptors and the scheduler's parameters)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tuner.measure.buffers import Buffers
from tuner.measure.device import KernelFault
from tuner.measure.device import cp as _cp
from tuner.measure.protocol import LaunchSpec


class LaunchRefused(Exception):
    """A library kernel's host code refused the arguments (no GPU work was done)."""


class Candidate:
    """One cubin's `hgemm` entry, launched with a fixed geometry and a run-time variant."""

    def __init__(self, cubin: str, launch: LaunchSpec):
        cp = _cp()
        self.module = cp.RawModule(path=cubin)
        self.fn = self.module.get_function("hgemm")
        self.grid, self.block, self.smem = launch.grid, launch.block, launch.smem
        if self.smem > 48 * 1024:
            self.fn.max_dynamic_shared_size_bytes = self.smem

    def run(self, A, B, C, M: int, N: int, K: int, variant: dict[str, Any], stream) -> None:
        self.fn((self.grid,), (self.block,),
                (A, B, C, np.int32(M), np.int32(N), np.int32(K), np.int32(variant.get("SWIZZLE_LOG", 0))),
                shared_mem=self.smem, stream=stream)

    def launcher(self, variant: dict[str, Any]):
        def launch(buf: Buffers, stream) -> None:
            self.run(buf.A, buf.B, buf.C, buf.M, buf.N, buf.K, variant, stream)
        return launch


class LibraryCandidate(Candidate):
    """A host+device shared library (cute_sm90): its `hgemm_run` builds the TMA descriptors
    and scheduler parameters on the host and launches on our stream (graph-capturable)."""

    RASTER = {"heuristic": 0, "along_m": 1, "along_n": 2}
    # DECOMP -> the library's `splits`: 0 stream-K, 1 data-parallel, n > 1 split-K in n.
    DECOMP = {"stream_k": 0, "data_parallel": 1} | {f"split_{n}": n for n in (2, 3, 4, 8, 16)}
    REDUCTION = {"deterministic": 0, "nondeterministic": 1}

    def __init__(self, path: str, launch: LaunchSpec):
        i, p = ctypes.c_int, ctypes.c_void_p
        self.lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL)
        self.lib.hgemm_run.argtypes = [p, p, p, i, i, i, i, i, i, i, i, i, p, p]
        self.lib.hgemm_run.restype = i
        self.lib.hgemm_workspace.argtypes = [i] * 8
        self.lib.hgemm_workspace.restype = ctypes.c_size_t
        self.sm_count = int(launch.sm_count)
        # Programmatic dependent launch: how the caller launches (launch spec), not a knob.
        self.pdl = int(launch.pdl)
        self.workspace = None

    def _args(self, variant: dict[str, Any]) -> tuple[int, int, int, int]:
        return (self.RASTER[variant.get("RASTER", "heuristic")], int(variant.get("SWIZZLE", 1)),
                self.DECOMP[variant.get("DECOMP", "data_parallel")],
                self.REDUCTION[variant.get("REDUCTION", "deterministic")])

    def reserve(self, M: int, N: int, K: int, variants: list[dict[str, Any]]) -> None:
        """One workspace (stream-K / split-K partials) big enough for every variant."""
        need = max([int(self.lib.hgemm_workspace(M, N, K, *self._args(v), self.sm_count)) for v in variants] + [0])
        if need and (self.workspace is None or self.workspace.nbytes < need):
            self.workspace = _cp().empty(need, dtype=_cp().uint8)

    def run(self, A, B, C, M: int, N: int, K: int, variant: dict[str, Any], stream) -> None:
        self.reserve(M, N, K, [variant])
        ws = self.workspace.data.ptr if self.workspace is not None else 0
        rc = self.lib.hgemm_run(A.data.ptr, B.data.ptr, C.data.ptr, M, N, K, *self._args(variant),
                                self.pdl, self.sm_count, ctypes.c_void_p(ws), ctypes.c_void_p(stream.ptr))
        if rc == 3:
            raise KernelFault(f"launch failed (library code {rc})")
        if rc:
            raise LaunchRefused(f"the kernel's host code refused {M}x{N}x{K} {variant} (code {rc})")


def load_candidate(path: str, launch: LaunchSpec, digest: str | None) -> Candidate:
    """A cubin family's kernel or a library family's, by what space.yaml said it builds.

    The binary must be the one that was built: its sha256 must equal the digest recorded at
    build time (a file planted or changed in the cache is refused, never loaded: a library's
    constructors would run). It is loaded from a private copy of the bytes checked."""
    data = Path(path).read_bytes()
    if digest is None or hashlib.sha256(data).hexdigest() != digest:
        raise BinaryRefused(f"{path} is not the binary that was built (its sha256 is not the one recorded "
                            "when it was built)" if digest else f"{path} has no recorded digest")
    fd, copy = tempfile.mkstemp(prefix="hgemm-kernel-", suffix=Path(path).suffix)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        # Loaded now (the module's function is looked up, the library dlopen'ed): the copy can go.
        return LibraryCandidate(copy, launch) if launch.artifact == "library" else Candidate(copy, launch)
    finally:
        os.unlink(copy)


class BinaryRefused(Exception):
    """A binary whose bytes are not the ones built: never loaded."""

"""The GPU worker: a subprocess that loads cubins with cupy, verifies and times them.

Run as `python -m tuner.gpu_worker`. It reads one JSON request per line on stdin and
writes one JSON reply per line on its original stdout (everything else goes to stderr).
A kernel that faults poisons the CUDA context, so after a fault the worker replies and
exits; the parent (tuner.bench.GpuBackend) starts a new one. A hang is handled by the
parent's timeout. Nothing here decides what to try next: it measures what it is told.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import json
import os
import random
import sys
import time
import traceback
from typing import Any

import numpy as np

from tuner import verify

GUARD = 4096          # elements of guard band on each side of every buffer
POISON = 0x7E5A       # a NaN bit pattern: unwritten outputs stay NaN, guards are compared bitwise
REPLAYS = 7           # timed graph replays per contender (median taken)
GRAPH_TARGET_MS = 3.0  # each graph replay runs about this long
SERVER_LAUNCHES = 100  # server mode: single launches per contender (median taken) ...
SERVER_MIN_LAUNCHES = 15  # ... at least this many, however slow the kernel ...
SERVER_BUDGET_MS = 2000.0  # ... and no more than this much kernel time per contender
SERVER_GAP_US = (20.0, 500.0)  # server mode: idle gap before each launch, uniform in this range
BASELINES = ("cublas", "cublaslt", "cublaslt_auto", "torch")  # vendor contenders of the `compare` op


class KernelFault(Exception):
    """A CUDA error during a candidate's launch: the context is unusable afterwards."""


def _cp():
    import cupy

    return cupy


class Buffers:
    """A, B, C with guard bands, for one shape; reused across candidates of that shape."""

    def __init__(self, M: int, N: int, K: int):
        cp = _cp()
        self.M, self.N, self.K = M, N, K
        self.a_flat = cp.empty(M * K + 2 * GUARD, dtype=cp.float16)
        self.b_flat = cp.empty(N * K + 2 * GUARD, dtype=cp.float16)
        self.c_flat = cp.empty(M * N + 2 * GUARD, dtype=cp.float16)
        self.A = self.a_flat[GUARD:GUARD + M * K].reshape(M, K)
        self.B = self.b_flat[GUARD:GUARD + N * K].reshape(N, K)
        self.C = self.c_flat[GUARD:GUARD + M * N].reshape(M, N)
        for flat in (self.a_flat, self.b_flat, self.c_flat):
            flat.view(cp.uint16).fill(POISON)

    def guards_intact(self) -> list[str]:
        cp = _cp()
        bad = []
        for name, flat in (("A", self.a_flat), ("B", self.b_flat), ("C", self.c_flat)):
            bits = flat.view(cp.uint16)
            if bool((bits[:GUARD] != POISON).any()) or bool((bits[-GUARD:] != POISON).any()):
                bad.append(name)
        return bad

    def poison_c(self) -> None:
        self.c_flat.view(_cp().uint16).fill(POISON)


@functools.cache
def _libcublas() -> ctypes.CDLL:
    """The libcublas cupy already loaded (same library and version cupy itself uses).

    Resolved once, at the first call (the Worker's cuBLAS handle, before torch is ever
    imported): torch brings its own libcublas, and /proc/self/maps is in address order."""
    _cp().cuda.device.get_cublas_handle()  # makes cupy load libcublas
    with open("/proc/self/maps") as fh:
        for line in fh:
            path = line.split()[-1]
            if "/libcublas.so" in path:
                return ctypes.CDLL(path)
    return ctypes.CDLL("libcublas.so")


class Cublas:
    """cublasGemmEx, fp16 in/out, fp32 compute, TN row-major as column-major C^T = B A^T.

    Called through ctypes on a handle of our own: cupy's wrapper refuses to run inside a
    stream capture, while cuBLAS itself captures fine with a fixed workspace.
    """

    def __init__(self, stream, compute: str = "fp32"):
        cp = _cp()
        lib = self.lib = _libcublas()
        self.handle = ctypes.c_void_p()
        self._check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self._check(lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream.ptr)), "cublasSetStream")
        self.workspace = cp.empty(32 << 20, dtype=cp.uint8)
        self._check(lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                                              ctypes.c_size_t(self.workspace.nbytes)), "cublasSetWorkspace")
        lib.cublasGemmEx.restype = ctypes.c_int
        i, p = ctypes.c_int, ctypes.c_void_p
        lib.cublasGemmEx.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
        self.stream_ptr = stream.ptr
        self.compute = compute
        # cublasComputeType_t: CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_16F = 64
        self.compute_type = 68 if compute == "fp32" else 64
        self.alpha = np.array(1.0, dtype=np.float32 if compute == "fp32" else np.float16)
        self.beta = np.array(0.0, dtype=self.alpha.dtype)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def __call__(self, buf: Buffers, stream) -> None:
        assert stream.ptr == self.stream_ptr, "cuBLAS is bound to the worker's stream"
        r16f = 2  # CUDA_R_16F
        status = self.lib.cublasGemmEx(
            self.handle, 1, 0, buf.N, buf.M, buf.K,  # CUBLAS_OP_T, CUBLAS_OP_N
            self.alpha.ctypes.data, buf.B.data.ptr, r16f, buf.K, buf.A.data.ptr, r16f, buf.K,
            self.beta.ctypes.data, buf.C.data.ptr, r16f, buf.N, self.compute_type, -1)
        self._check(status, "cublasGemmEx")


class _LtHeuristic(ctypes.Structure):
    # cublasLtMatmulHeuristicResult_t: algo (8 x uint64), workspaceSize, state, wavesCount, reserved[4]
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLt:
    """cublasLtMatmul, fp16 in/out, fp32 compute, same TN mapping as Cublas, on our stream.

    `heuristic` runs the library's first choice for the shape; `autotuned` times its top
    candidates (up to TOP) on this shape and keeps the fastest, as nvmath-python's
    Matmul.autotune does. Called through ctypes with fixed descriptors and workspace, so
    it captures into the same CUDA graphs as every other contender.
    """

    TOP = 16

    def __init__(self, stream, buf: Buffers, workspace_bytes: int = 32 << 20):
        cp = _cp()
        path = _libcublas()._name.replace("libcublas.so", "libcublasLt.so")
        lib = self.lib = ctypes.CDLL(path)
        p, u64, i64 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64
        self.handle, self.desc, self.pref = p(), p(), p()
        self._check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self._check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), 68, 0), "MatmulDescCreate")  # 32F, R_32F
        for attr, op in ((3, 1), (4, 0)):  # TRANSA = T (B is N x K row-major), TRANSB = N
            v = ctypes.c_int32(op)
            self._check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "DescSetAttribute")
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(p), ctypes.c_int, u64, u64, i64]
        M, N, K = buf.M, buf.N, buf.K
        self.a_desc, self.b_desc, self.c_desc = p(), p(), p()
        for d, rows, cols, ld in ((self.a_desc, K, N, K), (self.b_desc, K, M, K), (self.c_desc, N, M, N)):
            self._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(d), 2, rows, cols, ld), "LayoutCreate")  # R_16F
        self.workspace = cp.empty(workspace_bytes, dtype=cp.uint8)
        self._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "PreferenceCreate")
        ws = ctypes.c_uint64(workspace_bytes)
        self._check(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, 1, ctypes.byref(ws), 8), "PrefSetAttribute")
        results = (_LtHeuristic * self.TOP)()
        count = ctypes.c_int(0)
        self._check(lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, self.desc, self.a_desc, self.b_desc, self.c_desc, self.c_desc, self.pref,
            self.TOP, results, ctypes.byref(count)), "AlgoGetHeuristic")
        self.algos = [results[i] for i in range(count.value) if results[i].state == 0]
        if not self.algos:
            raise RuntimeError("cuBLASLt has no algorithm for this shape")
        self.alpha = np.array(1.0, dtype=np.float32)
        self.beta = np.array(0.0, dtype=np.float32)
        self.stream_ptr = stream.ptr

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"cuBLASLt {what} failed with status {status}")

    def run(self, algo: _LtHeuristic, buf: Buffers, stream) -> None:
        self._check(self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.c_void_p(self.alpha.ctypes.data),
            ctypes.c_void_p(buf.B.data.ptr), self.a_desc, ctypes.c_void_p(buf.A.data.ptr), self.b_desc,
            ctypes.c_void_p(self.beta.ctypes.data), ctypes.c_void_p(buf.C.data.ptr), self.c_desc,
            ctypes.c_void_p(buf.C.data.ptr), self.c_desc, ctypes.byref(algo.algo),
            ctypes.c_void_p(self.workspace.data.ptr), ctypes.c_size_t(self.workspace.nbytes),
            ctypes.c_void_p(stream.ptr)), "Matmul")

    def heuristic(self):
        return lambda b, s: self.run(self.algos[0], b, s)

    def autotuned(self, buf: Buffers, stream, reps: int = 5):
        """The fastest of the heuristic's candidates on this shape (events, median of reps)."""
        cp = _cp()
        best, best_ms = self.algos[0], float("inf")
        for algo in self.algos:
            try:
                self.run(algo, buf, stream)  # warm-up; an algorithm may refuse at run time
            except RuntimeError:
                continue
            times = []
            for _ in range(reps):
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(stream)
                self.run(algo, buf, stream)
                end.record(stream)
                end.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, end))
            ms = float(np.median(times))
            if ms < best_ms:
                best, best_ms = algo, ms
        return lambda b, s: self.run(best, b, s)


class LaunchRefused(Exception):
    """A library kernel's host code refused the arguments (no GPU work was done)."""


class Candidate:
    """One cubin's `hgemm` entry, launched with a fixed geometry and a run-time variant."""

    def __init__(self, cubin: str, launch: dict[str, Any]):
        cp = _cp()
        self.module = cp.RawModule(path=cubin)
        self.fn = self.module.get_function("hgemm")
        self.grid, self.block, self.smem = launch["grid"], launch["block"], launch["smem"]
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

    def __init__(self, path: str, launch: dict[str, Any]):
        i, p = ctypes.c_int, ctypes.c_void_p
        self.lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL)
        self.lib.hgemm_run.argtypes = [p, p, p, i, i, i, i, i, i, i, i, i, p, p]
        self.lib.hgemm_run.restype = i
        self.lib.hgemm_workspace.argtypes = [i] * 8
        self.lib.hgemm_workspace.restype = ctypes.c_size_t
        self.sm_count = int(launch["sm_count"])
        # Programmatic dependent launch: how the caller launches (launch spec), not a knob.
        self.pdl = int(bool(launch.get("pdl", False)))
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


def load_candidate(path: str, launch: dict[str, Any]) -> Candidate:
    """A cubin family's kernel or a library family's, by what space.yaml said it builds."""
    if launch.get("artifact") == "library":
        return LibraryCandidate(path, launch)
    return Candidate(path, launch)


def _sync_or_fault(stream) -> None:
    cp = _cp()
    try:
        stream.synchronize()
    except cp.cuda.runtime.CUDARuntimeError as exc:
        raise KernelFault(str(exc)) from None


def _abandon_capture(stream) -> None:
    """End a capture that a launch broke, so the stream is usable again (the error itself
    has already been raised to the caller; an invalidated capture ends with one more)."""
    with contextlib.suppress(Exception):
        if getattr(stream, "is_capturing", lambda: True)():
            stream.end_capture()


def capture_launches(launch, buf: Buffers, stream, n: int):
    """`n` back-to-back launches of one contender as a replayable graph (`.launch(stream)`).

    A contender that cannot be captured into a cupy graph carries its own `capture`
    attribute (a torch CUDA graph, or eager replays); everything else is one cupy graph."""
    custom = getattr(launch, "capture", None)
    if custom is not None:
        return custom(buf, stream, n)
    stream.begin_capture()
    try:
        for _ in range(n):
            launch(buf, stream)
    except BaseException:
        _abandon_capture(stream)
        raise
    return stream.end_capture()


def _dropped(name: str, mode: str, exc: Exception, stream, notes: dict[str, str] | None) -> None:
    """A contender whose set-up failed in one timing mode: with `notes`, drop it and say why
    (after surfacing any CUDA error as a fault); without, raise as before."""
    if notes is None or isinstance(exc, KernelFault):
        raise exc
    _sync_or_fault(stream)
    notes[name] = f"not measured ({mode}): {type(exc).__name__}: {exc}"


def time_graphs(contenders: dict[str, Any], buf: Buffers, stream, rng: random.Random,
                notes: dict[str, str] | None = None) -> dict[str, float]:
    """Offline mode: per contender a CUDA graph of back-to-back launches; replays of all
    contenders interleaved in random order; median replay time / launches, in us.

    With `notes`, a contender that cannot be set up is left out and `notes[name]` says why."""
    cp = _cp()
    graphs = {}
    for name, launch in contenders.items():
        try:
            # Estimate one launch to size the graph (warms the kernel up as well).
            start, end = cp.cuda.Event(), cp.cuda.Event()
            launch(buf, stream)
            start.record(stream)
            for _ in range(3):
                launch(buf, stream)
            end.record(stream)
            _sync_or_fault(end)
            est_ms = max(cp.cuda.get_elapsed_time(start, end) / 3, 1e-3)
            n = int(min(max(GRAPH_TARGET_MS / est_ms, 2), 2000))
            graph = capture_launches(launch, buf, stream, n)
            graph.launch(stream)  # warm-up replay
        except Exception as exc:  # noqa: BLE001 - see _dropped: noted or re-raised
            _dropped(name, "offline", exc, stream, notes)
            continue
        graphs[name] = (graph, n)
    _sync_or_fault(stream)
    samples: dict[str, list[float]] = {name: [] for name in graphs}
    order = list(graphs)
    events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(REPLAYS * len(order))]
    pending = []
    for r in range(REPLAYS):
        rng.shuffle(order)
        for i, name in enumerate(order):
            graph, n = graphs[name]
            start, end = events[r * len(order) + i]
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            pending.append((name, n, start, end))
    _sync_or_fault(stream)
    for name, n, start, end in pending:
        samples[name].append(cp.cuda.get_elapsed_time(start, end) * 1000.0 / n)
    return {name: float(np.median(v)) for name, v in samples.items()}


class L2Flush:
    """A buffer of at least twice the L2 size, allocated once; overwriting all of it before a
    launch evicts A, B and C from L2, so the launch reads its inputs from DRAM."""

    def __init__(self, l2_bytes: int | None = None):
        cp = _cp()
        if l2_bytes is None:
            l2_bytes = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["l2CacheSize"])
        mib = 1 << 20
        self.nbytes = -(-max(2 * int(l2_bytes), 8 * mib) // mib) * mib  # >= 2x L2, in whole MiB
        self.buf = cp.empty(self.nbytes, dtype=cp.uint8)
        self.value = 0

    def __call__(self, stream) -> None:
        self.value = (self.value + 1) & 0xFF  # a new byte every time: every line is really rewritten
        _cp().cuda.runtime.memsetAsync(self.buf.data.ptr, self.value, self.nbytes, stream.ptr)


def _idle(seconds: float) -> None:
    """Leave the GPU idle this long. A host spin, not time.sleep: sleep overshoots short gaps
    by tens of microseconds (timer slack)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def time_server(contenders: dict[str, Any], buf: Buffers, stream, rng: random.Random,
                launches: int = SERVER_LAUNCHES, flush=None, gap_us: tuple[float, float] = SERVER_GAP_US,
                budget_ms: float = SERVER_BUDGET_MS, notes: dict[str, str] | None = None) -> dict[str, float]:
    """Server mode: many single launches, each cold and from an idle GPU; median in us.

    Before every launch: overwrite the L2 flush buffer (`flush(stream)`: >= 2x the L2 size),
    synchronize, then leave the GPU idle for a random gap (uniform in `gap_us`), then time one
    launch with CUDA events. Contenders are interleaved in a new random order every round.
    Each launch is a one-launch CUDA graph, so the host-side cost of issuing it is one
    cudaGraphLaunch for every contender alike (cuBLAS's and torch's host overhead and
    Python's call overhead are not timed, as in offline mode). `launches` rounds at most,
    fewer when the slowest contender would exceed `budget_ms` of kernel time (never fewer
    than SERVER_MIN_LAUNCHES)."""
    cp = _cp()
    flush = flush if flush is not None else L2Flush()
    singles, est = {}, {}
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for name, launch in contenders.items():
        try:
            launch(buf, stream)  # warm-up: module load, library heuristics, workspaces
            graph = capture_launches(launch, buf, stream, 1)
            graph.launch(stream)  # the first replay uploads the graph
            flush(stream)
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            _sync_or_fault(end)
            est[name] = max(cp.cuda.get_elapsed_time(start, end), 1e-3)
        except Exception as exc:  # noqa: BLE001 - see _dropped: noted or re-raised
            _dropped(name, "server", exc, stream, notes)
            continue
        singles[name] = graph
    _sync_or_fault(stream)
    if not singles:
        return {}
    rounds = min(launches, max(SERVER_MIN_LAUNCHES, int(budget_ms / max(est.values()))))
    samples: dict[str, list[float]] = {name: [] for name in singles}
    order = list(singles)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            flush(stream)
            _sync_or_fault(stream)
            _idle(rng.uniform(*gap_us) * 1e-6)
            start.record(stream)
            singles[name].launch(stream)
            end.record(stream)
            _sync_or_fault(end)
            samples[name].append(cp.cuda.get_elapsed_time(start, end) * 1000.0)
    return {name: float(np.median(v)) for name, v in samples.items() if v}


def outputs_match(ref, got, xp=np) -> tuple[bool, dict[str, Any]]:
    """Does `got` equal `ref` (both M x N fp16 results of the same inputs) within fp16
    tolerance? |got - ref| <= 2^-8 |ref| + 2^-8 rms(ref) elementwise: two fp32-accumulating
    GEMMs differ by an ulp or two of rounding (a split-K with fp16 partials by a few), a
    different computation (a transposed operand or output, unwritten NaN) by O(rms)."""
    r = ref.astype(xp.float32)
    g = got.astype(xp.float32)
    n_nan = int(xp.isnan(g).sum())
    diff = xp.abs(g - r)
    rms = float(xp.sqrt(xp.mean(r * r))) if r.size else 0.0
    tol = 2.0 ** -8 * xp.abs(r) + 2.0 ** -8 * rms
    bad = int((~(diff <= tol)).sum())  # NaN counts as bad
    stats = {"bitwise_equal": float((g == r).astype(xp.float32).mean()) if r.size else 1.0,
             "max_abs_diff": float(xp.nanmax(diff)) if r.size and n_nan < r.size else float("nan"),
             "rms": rms, "outside_tolerance": bad, "nan": n_nan}
    return bad == 0, stats


class _TorchGraph:
    """n back-to-back torch calls captured by torch itself (its allocator and capture mode),
    replayed on our stream: the fallback when torch does not capture into a cupy graph."""

    def __init__(self, torch, ext, launch, buf: Buffers, stream, n: int):
        self.torch, self.ext = torch, ext
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=ext):
            for _ in range(n):
                launch(buf, stream)

    def launch(self, stream) -> None:
        with self.torch.cuda.stream(self.ext):
            self.graph.replay()


class _EagerReplay:
    """n back-to-back eager calls: the last resort when no graph captures the contender."""

    def __init__(self, launch, buf: Buffers, n: int):
        self.call, self.buf, self.n = launch, buf, n

    def launch(self, stream) -> None:
        for _ in range(self.n):
            self.call(self.buf, stream)


def gpu_state() -> dict[str, Any]:
    """SM clock, power and temperature right after timing: to tell throttling from slowness."""
    try:
        import pynvml

        pynvml.nvmlInit()
        index = int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        return {"sm_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "temp_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)}
    except Exception:  # noqa: BLE001 - NVML is optional: no state is better than a failed trial
        return {}


class Worker:
    def __init__(self):
        cp = _cp()
        self.cp = cp
        self.device = cp.cuda.Device()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.stream.use()  # every cupy op (inputs, references, checks) is ordered with the kernels
        self.buffers: Buffers | None = None
        self.cublas = Cublas(self.stream, "fp32")
        self.rng = random.Random(int.from_bytes(os.urandom(4), "little"))
        self._l2_flush: L2Flush | None = None
        self._cublas16: Cublas | None = None

    def buffers_for(self, shape: list[int]) -> Buffers:
        M, N, K = shape
        if self.buffers is None or (self.buffers.M, self.buffers.N, self.buffers.K) != (M, N, K):
            self.buffers = None
            gc.collect()  # the last shape's contenders (torch's tensors, graphs) may hold its buffers in cycles
            self.cp.get_default_memory_pool().free_all_blocks()
            self.buffers = Buffers(M, N, K)
        return self.buffers

    def hello(self, _req: dict) -> dict:
        cp = self.cp
        props = cp.cuda.runtime.getDeviceProperties(self.device.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        keep = ("major", "minor", "multiProcessorCount", "sharedMemPerBlockOptin", "maxThreadsPerBlock",
                "l2CacheSize", "totalGlobalMem")
        return {"status": "ok", "name": name, "props": {k: int(props[k]) for k in keep if k in props},
                "cupy": cp.__version__, "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
                "driver": cp.cuda.runtime.driverGetVersion(),
                "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}

    def cublas_for(self, accumulate: str) -> Cublas:
        """cuBLAS in the problem's compute mode: fp32 (the default), or fp16 for an fp16-accumulate
        study, whose kernels are verified against and timed with cuBLAS's own fp16 compute."""
        if accumulate == "fp32":
            return self.cublas
        if self._cublas16 is None:
            self._cublas16 = Cublas(self.stream, "fp16")
        return self._cublas16

    def baseline(self, req: dict) -> dict:
        buf = self.buffers_for(req["shape"])
        verify.fill_normal(buf)
        cublas = self.cublas_for(req.get("accumulate", "fp32"))
        times = time_graphs({"cublas": lambda b, s: cublas(b, s)}, buf, self.stream, self.rng)
        return {"status": "ok", "baselines": times}

    def evaluate(self, req: dict) -> dict:
        """Verify then time one cubin (all its run-time variants) against cuBLAS."""
        buf = self.buffers_for(req["shape"])
        try:
            cand = load_candidate(req["cubin"], req["launch"])
        except Exception as exc:  # noqa: BLE001 - a binary that will not load is a failed trial
            return {"status": "failed", "kind": "load", "reason": f"binary does not load: {exc}"}
        variants = req["variants"]
        accumulate = req.get("accumulate", "fp32")
        cublas = self.cublas_for(accumulate)
        launchers = {json.dumps(v, sort_keys=True): cand.launcher(v) for v in variants}
        try:
            if isinstance(cand, LibraryCandidate):
                cand.reserve(buf.M, buf.N, buf.K, variants)  # allocate before any graph capture
            # Verify the first variant fully and every variant on fresh random data:
            # run-time knobs change the tile order, so each must still be right.
            first = next(iter(launchers.values()))
            report = verify.full_check(first, cublas, buf, self.stream, accumulate)
            if report["ok"]:
                for key, launch in list(launchers.items())[1:]:
                    sub = verify.random_check(launch, cublas, buf, self.stream, accumulate)
                    if not sub["ok"]:
                        report = sub | {"variant": json.loads(key)}
                        break
            if not report["ok"]:
                return {"status": "failed", "kind": report.get("kind", "wrong"), "reason": report["reason"],
                        "verify": report}
            if not req.get("time", True):
                return {"status": "ok", "verify": report, "times": {}, "baselines": {}}
            verify.fill_normal(buf)
            contenders = dict(launchers)
            contenders["cublas"] = cublas
            times = time_graphs(contenders, buf, self.stream, self.rng)
        except KernelFault as exc:
            return {"status": "fault", "kind": "fault", "reason": f"CUDA error: {exc}", "fatal": True}
        except LaunchRefused as exc:
            return {"status": "failed", "kind": "refused", "reason": str(exc)}
        baselines = {"cublas": times.pop("cublas")}
        return {"status": "ok", "verify": report, "times": dict(times), "baselines": baselines,
                "gpu_state": gpu_state()}


    def l2_flush(self) -> L2Flush:
        """The server mode's flush buffer: allocated once per worker, outside any shape's pool churn."""
        if self._l2_flush is None:
            self._l2_flush = L2Flush()
        return self._l2_flush

    def _torch_matmul(self, buf: Buffers, notes: dict[str, str]):
        """torch.matmul as a contender: zero-copy tensors over our A, B, C, on our stream.

        Returns a launch(buf, stream) computing exactly cuBLAS's C (checked against it
        here), able to go into the shared cupy graphs (or carrying a `capture` fallback that
        notes say); None with notes["torch"] = "not measured: why" when it cannot be timed."""
        try:
            import torch
        except ImportError:
            notes["torch"] = "not measured: torch is not installed in the GPU worker's Python"
            return None
        except Exception as exc:  # noqa: BLE001 - a broken torch install is a note, not a failed run
            notes["torch"] = f"not measured: import torch failed: {type(exc).__name__}: {exc}"
            return None
        try:
            if not torch.cuda.is_available():
                notes["torch"] = f"not measured: torch {torch.__version__} sees no CUDA device (a CPU-only build?)"
                return None
            dev = torch.device("cuda", self.device.id)
            tensors = []
            for arr in (buf.A, buf.B, buf.C):
                t = torch.as_tensor(arr, device=dev)  # __cuda_array_interface__: shares the memory
                if t.data_ptr() != arr.data.ptr:
                    t = torch.from_dlpack(arr)
                if (t.data_ptr() != arr.data.ptr or tuple(t.shape) != arr.shape or t.dtype != torch.float16
                        or not t.is_contiguous()):
                    notes["torch"] = "not measured: torch could not wrap the worker's buffers without a copy"
                    return None
                tensors.append(t)
            ta, tb, tc = tensors
            # A is M x K, B is N x K (both row-major), C = A B^T is M x N row-major: the same
            # C that cublasGemmEx(OP_T, OP_N, N, M, K, B, A) writes. B.t() is a view (no copy).
            tbt = tb.t()
            ext = torch.cuda.ExternalStream(self.stream.ptr, device=dev)
            stream_ptr = self.stream.ptr

            def launch(b: Buffers, s) -> None:
                assert b is buf and s.ptr == stream_ptr, "torch's tensors are bound to this shape's buffers"
                with torch.cuda.stream(ext):
                    torch.matmul(ta, tbt, out=tc)

            notes["torch_version"] = (f"torch {torch.__version__} (CUDA {torch.version.cuda}), "
                                      "torch.matmul(A, B.t(), out=C) on the worker's buffers and stream")
            # Same inputs, cuBLAS then torch into a NaN-poisoned C: torch must write our C and match.
            verify.fill_normal(buf)
            buf.poison_c()
            self.cublas(buf, self.stream)
            _sync_or_fault(self.stream)
            ref = buf.C.copy()
            buf.poison_c()
            launch(buf, self.stream)
            _sync_or_fault(self.stream)
            ok, stats = outputs_match(ref, buf.C, self.cp)
            bad_guards = buf.guards_intact()
            if not ok or bad_guards:
                why = (f"guard band around {', '.join(bad_guards)} overwritten" if bad_guards else
                       f"{stats['outside_tolerance']} of {buf.C.size} outputs differ from cuBLAS beyond fp16 "
                       f"tolerance ({stats['nan']} unwritten, max |diff| {stats['max_abs_diff']:.3g})")
                notes["torch"] = f"not measured: torch.matmul's C does not equal cuBLAS's: {why}"
                return None
            notes["torch_check"] = (f"equals cuBLAS on random inputs: {stats['bitwise_equal']:.1%} bitwise, "
                                    f"max |diff| {stats['max_abs_diff']:.3g}")
        except KernelFault:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever torch refuses, the table says so
            _sync_or_fault(self.stream)
            notes["torch"] = f"not measured: {type(exc).__name__}: {exc}"
            return None
        # Does it capture into a cupy graph like every other contender? If not: a torch graph, else eager.
        try:
            graph = capture_launches(launch, buf, self.stream, 2)
            graph.launch(self.stream)
            _sync_or_fault(self.stream)
            return launch
        except KernelFault:
            raise
        except Exception as exc:  # noqa: BLE001 - fall back below, and say so
            _sync_or_fault(self.stream)
            why = f"{type(exc).__name__}: {exc}"
        try:
            probe = _TorchGraph(torch, ext, launch, buf, self.stream, 2)
            probe.launch(self.stream)
            _sync_or_fault(self.stream)
            launch.capture = lambda b, s, n: _TorchGraph(torch, ext, launch, b, s, n)
            notes["torch_timing"] = ("timed from a torch.cuda.CUDAGraph (the same launches, replayed on our "
                                     f"stream): capturing it into the shared cupy graph failed: {why}")
        except KernelFault:
            raise
        except Exception as exc:  # noqa: BLE001 - last resort: eager
            _sync_or_fault(self.stream)
            launch.capture = lambda b, s, n: _EagerReplay(launch, b, n)
            notes["torch_timing"] = ("timed EAGERLY (back-to-back calls, torch's host dispatch included where "
                                     f"the GPU outruns it): cupy graph capture failed: {why}; torch graph capture "
                                     f"failed: {type(exc).__name__}: {exc}")
        return launch

    def compare(self, req: dict) -> dict:
        """Benchmark: verify several candidates, then time them and the vendor baselines
        (cuBLAS, cuBLASLt heuristic and autotuned, torch.matmul when installed) interleaved
        in random order in one run, in each requested mode (`modes`: offline, server).

        Replies `times_by_mode` {mode: {name: us}} and `times` (offline if requested, else
        the first mode). A baseline that could not be measured is named in `notes`."""
        modes = list(req.get("modes") or ["offline"])
        unknown = [m for m in modes if m not in ("offline", "server")]
        if unknown or len(set(modes)) != len(modes):
            return {"status": "error", "reason": f"bad timing modes {modes}: each of offline, server at most once"}
        clash = sorted(set(req["candidates"]) & set(BASELINES))
        if clash:
            return {"status": "error", "reason": f"candidate names {clash} clash with the baselines' names"}
        buf = self.buffers_for(req["shape"])
        contenders, reports, notes = {}, {}, {}
        keep = []  # the candidates' modules must outlive the timing
        for name, cand_req in req["candidates"].items():
            try:
                cand = load_candidate(cand_req["cubin"], cand_req["launch"])
            except Exception as exc:  # noqa: BLE001 - a binary that will not load fails its row only
                reports[name] = {"ok": False, "kind": "load", "reason": f"binary does not load: {exc}"}
                continue
            keep.append(cand)
            try:
                if isinstance(cand, LibraryCandidate):
                    cand.reserve(buf.M, buf.N, buf.K, [cand_req["variant"]])
                launch = cand.launcher(cand_req["variant"])
                report = verify.full_check(launch, lambda b, s: self.cublas(b, s), buf, self.stream)
            except LaunchRefused as exc:
                report = {"ok": False, "kind": "refused", "reason": str(exc)}
            reports[name] = report
            if report["ok"]:
                contenders[name] = launch
        contenders["cublas"] = lambda b, s: self.cublas(b, s)
        try:
            lt = CublasLt(self.stream, buf)
            contenders["cublaslt"] = lt.heuristic()
            contenders["cublaslt_auto"] = lt.autotuned(buf, self.stream)
            notes["cublaslt_algos"] = str(len(lt.algos))
        except (OSError, RuntimeError) as exc:  # no cuBLASLt here: the table says so, cuBLAS still counts
            notes["cublaslt"] = notes["cublaslt_auto"] = f"not measured: {exc}"
        if req.get("torch", True):
            torch_launch = self._torch_matmul(buf, notes)
            if torch_launch is not None:
                contenders["torch"] = torch_launch
        else:
            notes["torch"] = "not measured: not requested"
        verify.fill_normal(buf)
        times_by_mode, states = {}, {}
        for mode in modes:
            if mode == "offline":
                times_by_mode[mode] = time_graphs(contenders, buf, self.stream, self.rng, notes=notes)
            else:
                times_by_mode[mode] = time_server(contenders, buf, self.stream, self.rng, flush=self.l2_flush(),
                                                  notes=notes)
                notes["server"] = (f"single launches, each a 1-launch CUDA graph after an L2 flush "
                                   f"({self.l2_flush().nbytes >> 20} MiB overwritten), a synchronize and an idle "
                                   f"gap of {SERVER_GAP_US[0]:g}-{SERVER_GAP_US[1]:g} us; median")
            states[mode] = gpu_state()
            for name in BASELINES:
                if name not in times_by_mode[mode] and name not in notes:
                    notes[name] = f"not measured ({mode}): no time came back"
        first = "offline" if "offline" in modes else modes[0]
        return {"status": "ok", "modes": modes, "times": times_by_mode[first], "times_by_mode": times_by_mode,
                "verify": reports, "gpu_state": states[first], "gpu_state_by_mode": states, "notes": notes}


def main() -> None:
    # Replies go to the real stdout; anything a library prints goes to stderr.
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(reply_fd, "w", buffering=1)
    try:
        worker = Worker()
    except Exception as exc:  # noqa: BLE001 - no GPU, no cupy: tell the parent in one line
        out.write(json.dumps({"status": "error", "kind": "no_gpu", "reason": f"GPU worker cannot start: {exc}"}) + "\n")
        return
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        op = req.get("op")
        started = time.perf_counter()
        try:
            reply = getattr(worker, op)(req) if op in ("hello", "baseline", "evaluate", "compare") else {
                "status": "error", "reason": f"unknown op {op!r}"}
        except KernelFault as exc:
            reply = {"status": "fault", "kind": "fault", "reason": f"CUDA error: {exc}", "fatal": True}
        except Exception as exc:  # noqa: BLE001 - report, then let the parent decide
            traceback.print_exc()
            # A CUDA error surfacing outside a launch (e.g. in a later cupy call) is still the kernel's fault.
            cuda = "CUDA" in type(exc).__name__ or "cudaError" in str(exc)
            reply = {"status": "fault" if cuda else "error", "kind": "fault" if cuda else "worker",
                     "reason": f"{type(exc).__name__}: {exc}", "fatal": True}
        reply["worker_s"] = time.perf_counter() - started
        out.write(json.dumps(reply) + "\n")
        if reply.get("fatal"):
            return


if __name__ == "__main__":
    main()

"""The vendor contenders, each a launch(buf, stream) that captures into our CUDA graphs:
cuBLAS (cublasGemmEx), cuBLASLt (heuristic pick and autotuned), torch.matmul."""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from tuner.measure.buffers import Buffers
from tuner.measure.device import KernelFault, sync_or_fault
from tuner.measure.device import cp as _cp
from tuner.measure.timing import EagerReplay, TorchGraph, capture_launches
from tuner.measure.verify import fill_normal, outputs_match

BASELINES = ("cublas", "cublaslt", "cublaslt_auto", "torch")  # vendor contenders of the `compare` op


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


def torch_contender(buf: Buffers, stream, cublas, device_id: int, notes: dict[str, str]):
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
        dev = torch.device("cuda", device_id)
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
        ext = torch.cuda.ExternalStream(stream.ptr, device=dev)
        stream_ptr = stream.ptr

        def launch(b: Buffers, s) -> None:
            assert b is buf and s.ptr == stream_ptr, "torch's tensors are bound to this shape's buffers"
            with torch.cuda.stream(ext):
                torch.matmul(ta, tbt, out=tc)

        notes["torch_version"] = (f"torch {torch.__version__} (CUDA {torch.version.cuda}), "
                                  "torch.matmul(A, B.t(), out=C) on the worker's buffers and stream")
        # Same inputs, cuBLAS then torch into a NaN-poisoned C: torch must write our C and match.
        fill_normal(buf)
        buf.poison_c()
        cublas(buf, stream)
        sync_or_fault(stream)
        ref = buf.C.copy()
        buf.poison_c()
        launch(buf, stream)
        sync_or_fault(stream)
        ok, stats = outputs_match(ref, buf.C, _cp())
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
        sync_or_fault(stream)
        notes["torch"] = f"not measured: {type(exc).__name__}: {exc}"
        return None
    # Does it capture into a cupy graph like every other contender? If not: a torch graph, else eager.
    try:
        graph = capture_launches(launch, buf, stream, 2)
        graph.launch(stream)
        sync_or_fault(stream)
        return launch
    except KernelFault:
        raise
    except Exception as exc:  # noqa: BLE001 - fall back below, and say so
        sync_or_fault(stream)
        why = f"{type(exc).__name__}: {exc}"
    try:
        probe = TorchGraph(torch, ext, launch, buf, stream, 2)
        probe.launch(stream)
        sync_or_fault(stream)
        launch.capture = lambda b, s, n: TorchGraph(torch, ext, launch, b, s, n)
        notes["torch_timing"] = ("timed from a torch.cuda.CUDAGraph (the same launches, replayed on our "
                                 f"stream): capturing it into the shared cupy graph failed: {why}")
    except KernelFault:
        raise
    except Exception as exc:  # noqa: BLE001 - last resort: eager
        sync_or_fault(stream)
        launch.capture = lambda b, s, n: EagerReplay(launch, b, n)
        notes["torch_timing"] = ("timed EAGERLY (back-to-back calls, torch's host dispatch included where "
                                 f"the GPU outruns it): cupy graph capture failed: {why}; torch graph capture "
                                 f"failed: {type(exc).__name__}: {exc}")
    return launch

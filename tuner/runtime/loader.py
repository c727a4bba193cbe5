"""Run exported kernels from Python: `gemm = load("best.json"); C = gemm(A, B)`.

A is M x K, B is N x K (TN, like a torch Linear weight), both fp16 on the GPU, as cupy
arrays or torch tensors (anything with __cuda_array_interface__ or DLPack). C comes back
in the input's framework. Shapes in the file run their tuned kernel (compiled from the
template on first use, cached on disk); other shapes, and entries whose pick is the
vendor library, fall back to cuBLAS.

With `package=DIR` (made by `hgemm-tune package`) every call goes through the packaged
library instead: no compile, and any M of a tuned (N, K) runs the kernel of its nearest M
bucket (the library's dispatch); what the library answers "use the vendor" runs cuBLAS.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

from tuner.build import compile_source
from tuner.errors import UserError
from tuner.results.entries import entry_build
from tuner.results.schema import read_json
from tuner.space import Shape, arch_for_cc, load_space, target_from_device


class Packaged:
    """The C entry of a packaged library, for cupy arrays on cupy's current stream."""

    def __init__(self, package_dir: str | Path):
        from tuner.runtime.codegen import STATUS
        from tuner.runtime.package import open_library

        self.status = STATUS
        self.lib = open_library(Path(package_dir))
        self.workspace = None

    def run(self, a, b, c, shape: Shape) -> bool:
        """True when the library ran it; False when it answers "use the vendor"."""
        import cupy

        M, N, K = shape.M, shape.N, shape.K
        need = int(self.lib.hgemm_tuned_workspace_size(M, N, K))
        if need and (self.workspace is None or self.workspace.nbytes < need):
            self.workspace = cupy.empty(need, dtype=cupy.uint8)
        ws = self.workspace.data.ptr if need else None
        rc = self.lib.hgemm_tuned_run(M, N, K, a.data.ptr, K, b.data.ptr, K, c.data.ptr, N, ws, need,
                                      cupy.cuda.get_current_stream().ptr)
        if rc == 1:
            return False
        if rc:
            raise UserError(f"the packaged library failed on {shape}: {self.status.get(rc, rc)} (status {rc})")
        return True


class Gemm:
    def __init__(self, path: str | Path | None, space_file: str | Path | None = None, accumulate: str = "fp32",
                 pdl: bool = False, package: str | Path | None = None):
        if path is None and package is None:
            raise UserError("load(...) needs an export JSON or a package folder (package=DIR)")
        self.packaged = Packaged(package) if package is not None else None
        if self.packaged is not None and accumulate != "fp32":
            raise UserError("a package holds fp32-accumulation kernels only")
        self.data = read_json(path) if path is not None else {"entries": []}
        self.pdl = pdl
        self.space = load_space(space_file)
        # fp16-accumulate entries answer only a loader asked for fp16 accumulation.
        self.accumulate = accumulate
        self.entries = {(e["shape"], e["arch"]): e for e in self.data["entries"]
                        if e.get("accumulate", "fp32") == accumulate}
        self._kernels: dict[tuple[str, str], Any] = {}

    def _arch(self) -> str:
        import cupy

        cc = cupy.cuda.Device().compute_capability  # e.g. "90"
        return arch_for_cc(int(cc[:-1]), int(cc[-1]))

    def kernel_for(self, shape: Shape):
        """(function, launch) for this shape on this GPU, or None for the cuBLAS fallback."""
        import cupy

        from tuner.measure.candidates import load_candidate

        arch = self._arch()
        key = (str(shape), arch)
        if key in self._kernels:
            return self._kernels[key]
        entry = self.entries.get(key)
        if entry is None or entry.get("pick") != entry["family"]:
            self._kernels[key] = None
            return None
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        target = target_from_device(props, "gpu")
        build = entry_build(self.space, entry, target)
        if build.template_changed:
            warnings.warn(f"{build.template} changed since {shape} was tuned: running today's template",
                          stacklevel=3)
        res = compile_source(build.source, target.arch, artifact=build.artifact)
        if not res.ok:
            raise UserError(f"exported kernel for {shape} does not compile: {res.error}")
        # pdl: library kernels launch with programmatic dependent launch (cubin kernels ignore it)
        kernel = load_candidate(res.cubin, dataclasses.replace(build.launch, pdl=self.pdl), res.digest)
        self._kernels[key] = (kernel, build.variant)
        return self._kernels[key]

    def __call__(self, A, B, out=None):
        import cupy

        torch_in = type(A).__module__.startswith("torch")
        a, b = cupy.asarray(A), cupy.asarray(B)
        if a.dtype != cupy.float16 or b.dtype != cupy.float16 or a.ndim != 2 or b.ndim != 2:
            raise UserError("gemm(A, B) takes 2-D fp16 arrays: A is M x K, B is N x K")
        if a.shape[1] != b.shape[1]:
            raise UserError(f"K mismatch: A is {a.shape}, B is {b.shape} (B must be N x K)")
        a, b = cupy.ascontiguousarray(a), cupy.ascontiguousarray(b)
        shape = Shape(a.shape[0], b.shape[0], a.shape[1])
        c = out if out is not None else cupy.empty((shape.M, shape.N), dtype=cupy.float16)
        if self.packaged is not None:
            ran = self.packaged.run(a, b, c, shape)
        else:
            kern = self.kernel_for(shape)
            if kern is not None:
                kernel, variant = kern
                kernel.run(a, b, c, shape.M, shape.N, shape.K, variant, cupy.cuda.get_current_stream())
            ran = kern is not None
        if not ran:
            c[...] = cupy.matmul(a, b.T)  # cuBLAS
        if torch_in:
            import torch

            return torch.from_dlpack(c)
        return c


def load(path: str | Path | None = None, space_file: str | Path | None = None, accumulate: str = "fp32",
         pdl: bool = False, package: str | Path | None = None) -> Gemm:
    """The exported kernels of `path` as a callable: gemm(A, B) -> C = A @ B.T (fp16).
    space_file: the space the kernels' families come from (default: the packaged space.yaml).
    accumulate="fp16" picks the file's fp16-accumulate entries instead. pdl=True launches the
    Hopper (cute_sm90) kernels with programmatic dependent launch: each may be scheduled while
    the kernel before it on the stream drains, and waits for that kernel's writes before it
    touches memory, so it is safe after any kernel. Measure before keeping it: on an H200 it
    made some pingpong kernels slower (128x16384x16384 by a third; docs/decisions).
    package=DIR: run through a packaged library (`hgemm-tune package`) instead of compiling:
    dynamic-M dispatch, no nvcc or CUTLASS needed; `path` may then be None."""
    return Gemm(path, space_file, accumulate, pdl, package)

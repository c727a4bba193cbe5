"""Run exported kernels from Python: `gemm = load("best.json"); C = gemm(A, B)`.

A is M x K, B is N x K (TN, like a torch Linear weight), both fp16 on the GPU, as cupy
arrays or torch tensors (anything with __cuda_array_interface__ or DLPack). C comes back
in the input's framework. Shapes in the file run their tuned kernel (compiled from the
template on first use, cached on disk); other shapes, and entries whose pick is the
vendor library, fall back to cuBLAS.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.errors import UserError
from tuner.export import read_json
from tuner.render import render, template_hash
from tuner.shapes import Shape, parse_shape
from tuner.space import Space, load_space

DEFAULT_SPACE = Path(__file__).resolve().parent.parent / "space.yaml"


@dataclass
class EntryBuild:
    """What one export entry needs to run on a target: the CUDA source to compile, the kind of
    binary, how the GPU worker launches it, and the run-time knobs it passes."""

    family: str
    template: str
    config: dict[str, Any]      # every knob, compile-time and run-time
    variant: dict[str, Any]     # the run-time knobs (kernel arguments)
    source: str
    artifact: str               # cubin | library
    launch: dict[str, Any]      # tuner.search.launch_spec for the entry's shape on the target
    template_changed: bool      # the template differs from the one the entry was tuned with


def entry_build(space: Space, entry: dict[str, Any], target) -> EntryBuild:
    """An export entry (tuner.export.entry) -> source, launch and variant for `target`.

    Shared by the loader (`load(...)`) and `hgemm-tune bench`. Raises UserError when the
    family or a knob is not in the space any more."""
    from tuner.search import launch_spec

    fam = space.family(entry["family"])
    config = fam.complete_stored(entry["knobs"])  # older exports carry ACCUM: it is `accumulate` now
    shape = parse_shape(entry["shape"])
    changed = bool(entry.get("template_hash")) and template_hash(fam) != entry["template_hash"]
    return EntryBuild(family=fam.name, template=fam.template, config=config,
                      variant=fam.runtime_config(config),
                      source=render(fam, config, target.arch, accumulate=entry.get("accumulate", "fp32")),
                      artifact=fam.artifact,
                      launch=launch_spec(fam, config, shape, target), template_changed=changed)


class Gemm:
    def __init__(self, path: str | Path, space_file: str | Path = DEFAULT_SPACE, accumulate: str = "fp32",
                 pdl: bool = False):
        self.data = read_json(path)
        self.pdl = pdl
        self.space = load_space(space_file)
        # fp16-accumulate entries answer only a loader asked for fp16 accumulation.
        self.accumulate = accumulate
        self.entries = {(e["shape"], e["arch"]): e for e in self.data["entries"]
                        if e.get("accumulate", "fp32") == accumulate}
        self._kernels: dict[tuple[str, str], Any] = {}

    def _arch(self) -> str:
        import cupy

        from tuner.target import arch_for_cc

        cc = cupy.cuda.Device().compute_capability  # e.g. "90"
        return arch_for_cc(int(cc[:-1]), int(cc[-1]))

    def kernel_for(self, shape: Shape):
        """(function, launch) for this shape on this GPU, or None for the cuBLAS fallback."""
        import cupy

        from tuner.compile import compile_source
        from tuner.gpu_worker import load_candidate
        from tuner.target import target_from_device

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
        kernel = load_candidate(res.cubin, build.launch | {"pdl": self.pdl})
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
        kern = self.kernel_for(shape)
        if kern is None:
            c[...] = cupy.matmul(a, b.T)  # cuBLAS
        else:
            kernel, variant = kern
            kernel.run(a, b, c, shape.M, shape.N, shape.K, variant, cupy.cuda.get_current_stream())
        if torch_in:
            import torch

            return torch.from_dlpack(c)
        return c


def load(path: str | Path, space_file: str | Path = DEFAULT_SPACE, accumulate: str = "fp32",
         pdl: bool = False) -> Gemm:
    """The exported kernels of `path` as a callable: gemm(A, B) -> C = A @ B.T (fp16).
    accumulate="fp16" picks the file's fp16-accumulate entries instead. pdl=True launches the
    Hopper (cute_sm90) kernels with programmatic dependent launch: each may be scheduled while
    the kernel before it on the stream drains, and waits for that kernel's writes before it
    touches memory, so it is safe after any kernel. Measure before keeping it: on an H200 it
    made some pingpong kernels slower (128x16384x16384 by a third; NOTES.md, session 6)."""
    return Gemm(path, space_file, accumulate, pdl)

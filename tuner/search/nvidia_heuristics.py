"""NVIDIA's nvMatmulHeuristics as an optional signal for ranking a catalogue (`--rank-by nvidia`).

The `nvidia-matmul-heuristics` wheel (extra `heuristics`) is a closed-source shared library with a
ctypes wrapper: for a problem (M, N, K, layout, precision) and a predefined GPU (H100 SXM, H200
SXM, ...) it proposes ranked CUTLASS 3 kernel configurations, and it estimates the runtime of any
configuration we give it, without a GPU. It is NVIDIA's own license, not ours (BSD): we never
ship it, only import it when installed, and the import is lazy so nothing else needs it.

What one of its configurations holds, and how a cute_sm90 config maps onto it (`nv_config`):

* CTA tile M x N x K           <- TILE_M x TILE_N x TILE_K
* cluster M x N                <- CLUSTER_M x CLUSTER_N
* load stages                  <- STAGES
* split-K factor               <- DECOMP data_parallel: 1, split_N: N (estimated with the backend's
                                  split-K kind set to in-place: CUTLASS 3's stream-K scheduler adds
                                  the partials in a workspace inside the same kernel, no second
                                  reduction kernel as out-of-place split-K has)
* CTA order (0: row major)     <- RASTER along_n: 0, along_m: 1
* grid swizzle                 <- SWIZZLE
* warp / instruction tiles     <- the consumer warpgroups' share of the tile / the wgmma shape the
                                  heuristic itself proposes for this target (it ignores both here)

What it cannot say: DECOMP stream_k (stream-K is a backend-wide split-K kind there, not a
per-config choice, and a config under it is not estimated sensibly), REDUCTION, SCHEDULE
(cooperative / pingpong / basic) and SCHEDULER persistent, EPILOGUE, EPI_TILE_N, L2_HINT,
TMA_L2_PROMOTION, PROLOGUE; and no family but cute_sm90 (the cubin families, a proposer's). Those
configs are estimated by our cost model instead (tuner.search.rank combines the two scales).
Measured on the 0.1.0.27 wheel: its estimate moves with the tile, the cluster (slightly) and the
split count, not with the stages, raster or swizzle; with fp32 accumulation ("HSH") its absolute
times are about twice what the datasheet rate gives (4096^3: 267 us on an H200 descriptor), so only its order
is used.

NVIDIA's notice for the library follows verbatim: its headers ask that software using it carry
it in its code comments and user documentation.
"""

# ---- NVIDIA's notice for nvMatmulHeuristics (from its nvMatmulHeuristics/__init__.py) -----------
#
# NOTWITHSTANDING ANY TERMS OR CONDITIONS TO THE CONTRARY IN THE
# LICENSE AGREEMENT, NVIDIA MAKES NO REPRESENTATION ABOUT THE
# SUITABILITY OF THESE LICENSED DELIVERABLES FOR ANY PURPOSE.  IT IS
# PROVIDED "AS IS" WITHOUT EXPRESS OR IMPLIED WARRANTY OF ANY KIND.
# NVIDIA DISCLAIMS ALL WARRANTIES WITH REGARD TO THESE LICENSED
# DELIVERABLES, INCLUDING ALL IMPLIED WARRANTIES OF MERCHANTABILITY,
# NONINFRINGEMENT, AND FITNESS FOR A PARTICULAR PURPOSE.
# NOTWITHSTANDING ANY TERMS OR CONDITIONS TO THE CONTRARY IN THE
# LICENSE AGREEMENT, IN NO EVENT SHALL NVIDIA BE LIABLE FOR ANY
# SPECIAL, INDIRECT, INCIDENTAL, OR CONSEQUENTIAL DAMAGES, OR ANY
# DAMAGES WHATSOEVER RESULTING FROM LOSS OF USE, DATA OR PROFITS,
# WHETHER IN AN ACTION OF CONTRACT, NEGLIGENCE OR OTHER TORTIOUS
# ACTION, ARISING OUT OF OR IN CONNECTION WITH THE USE OR PERFORMANCE
# OF THESE LICENSED DELIVERABLES.
#
# U.S. Government End Users.  These Licensed Deliverables are a
# "commercial item" as that term is defined at 48 C.F.R. 2.101 (OCT
# 1995), consisting of "commercial computer software" and "commercial
# computer software documentation" as such terms are used in 48
# C.F.R. 12.212 (SEPT 1995) and is provided to the U.S. Government
# only as a commercial end item.  Consistent with 48 C.F.R.12.212 and
# 48 C.F.R. 227.7202-1 through 227.7202-4 (JUNE 1995), all
# U.S. Government End Users acquire the Licensed Deliverables with
# only those rights set forth herein.

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from typing import Any

from tuner.errors import UserError
from tuner.space import Shape, Target

EXTRA = "pip install 'hgemm-tune[heuristics]'"
MISSING = (f"--rank-by nvidia needs NVIDIA's nvidia-matmul-heuristics wheel (NVIDIA's own license): {EXTRA}")

# Our problem: A row-major M x K, B stored N x K (read transposed), C row-major; in the library's
# terms NT_ROW_MAJOR (B transposed while loading, row-major memory), CUTLASS's "TN" (both K-major).
LAYOUT = "NT_ROW_MAJOR"
PRECISION = {"fp32": "HSH", "fp16": "HHH"}  # A/B fp16, compute fp32 or fp16, C/D fp16
METRIC = "RUNTIME_RELATIVE_FAST_S"  # its runtime estimate tuned for ordering kernels (its docs)
SPLIT_K_KIND = "IN_PLACE"
INSTR = (64, 8, 16)  # the instruction tile it proposes for every sm_90 CUTLASS 3 config


@dataclass(frozen=True)
class NvConfig:
    """One kernel configuration as the heuristic describes it."""

    cta: tuple[int, int, int]
    warp: tuple[int, int, int]
    stages: int
    split_k: int
    cta_order: int        # 0: row major (tiles along N fastest), 1: column major
    swizzle: int
    cluster: tuple[int, int]


def nv_config(full: dict[str, Any]) -> NvConfig | None:
    """The heuristic's configuration for a full cute_sm90 config (compile and run-time knobs);
    None where it cannot express it (another family, stream-K)."""
    if not {"TILE_M", "TILE_N", "TILE_K", "STAGES", "CLUSTER_M", "CLUSTER_N", "SCHEDULE"} <= set(full):
        return None
    decomp = str(full.get("DECOMP", "data_parallel"))
    if decomp == "data_parallel":
        split = 1
    elif decomp.startswith("split_"):
        split = int(decomp.split("_")[1])
    else:
        return None  # stream_k
    m, n, k = int(full["TILE_M"]), int(full["TILE_N"]), int(full["TILE_K"])
    groups = 2 if full["SCHEDULE"] == "cooperative" else 1  # consumer warpgroups sharing one tile
    return NvConfig((m, n, k), (m // groups, n, k), int(full["STAGES"]), split,
                    1 if full.get("RASTER") == "along_m" else 0, int(full.get("SWIZZLE", 1)),
                    (int(full["CLUSTER_M"]), int(full["CLUSTER_N"])))


def load() -> Any:
    """The wheel's module; a one-line UserError when it is not installed or will not load."""
    try:
        import nvMatmulHeuristics  # type: ignore[import-not-found]
    except (ImportError, OSError) as e:  # OSError: the shared library would not load
        raise UserError(MISSING + (f" ({e})" if isinstance(e, OSError) else "")) from None
    return nvMatmulHeuristics


def available() -> bool:
    try:
        load()
    except UserError:
        return False
    return True


# Predefined GPUs of the library by the device name's model (the first that the name holds);
# a target none matches falls back to the arch's datasheet card. Never the library's own
# hardware detection: that would open a CUDA context in the ranking process.
GPUS = (("H200", "H200_SXM"), ("H100 NVL", "H100_NVL"), ("H100 PCIE", "H100_PCIE"), ("H100", "H100_SXM"),
        ("H20", "H20_SXM"), ("A100", "A100_SXM_80GB"), ("L40S", "L40S"))
ARCH_GPU = {"sm_90a": "H100_SXM", "sm_90": "H100_SXM", "sm_80": "A100_SXM_80GB", "sm_89": "L40S"}


def gpu_for(target: Target) -> str | None:
    """The library's predefined GPU for a target; None when it has none that fits."""
    name = target.name.upper()
    for model, gpu in GPUS:
        if model in name:
            return gpu
    return ARCH_GPU.get(target.arch)


class Heuristic:
    """One library handle for one GPU: runtime estimates of our configs, and its own proposals."""

    def __init__(self, gpu: str):
        nv = load()
        self.nv = nv
        try:
            self.iface = nv.NvMatmulHeuristicsInterfaceEx(
                backend=nv.NvMatmulHeuristicsTarget.CUTLASS3, load_discovery_implicitly=False,
                flags=nv.NvMatmulHeuristicsFlags.PERF_MODEL_BASED_AUTO_TUNING,
                gpu=nv.NvMatmulHeuristicsNvidiaGpu[gpu])
        except (AssertionError, KeyError, OSError, RuntimeError) as e:  # its wrapper asserts the library's version
            raise UserError(f"nvidia-matmul-heuristics would not start ({e or 'unsupported library version'}); "
                            f"the ranking was written against 0.1.0.27") from None
        self.layout = nv.NvMatmulHeuristicsMatmulLayout[LAYOUT]
        self.loaded: set[str] = set()
        self.backend = self.iface.createBackend(nv.NvMatmulHeuristicsTarget.CUTLASS3)
        kind = ctypes.c_int32(int(nv.NvMatmulHeuristicsSplitKKind[SPLIT_K_KIND]))
        self.iface.setBackendValueProperty(self.backend, nv.NvMatmulHeuristicsBackendProperty.SPLIT_K_KIND,
                                           ctypes.byref(kind), ctypes.sizeof(kind))

    def _precision(self, accumulate: str) -> bytes:
        precision = PRECISION.get(accumulate, PRECISION["fp32"])
        if precision not in self.loaded:  # its measured profile for this layout: before any estimate
            self.iface.loadInternalDiscoverySet(self.layout, precision)
            self.loaded.add(precision)
        return precision.encode("ascii")

    def _problem(self, shape: Shape) -> Any:
        return self.iface.makeNvMatmulHeuristicsProblem(shape.M, shape.N, shape.K, self.layout)

    def estimate_us(self, cfg: NvConfig, shape: Shape, accumulate: str = "fp32") -> float | None:
        """Its estimated time of one config at one shape, in us; None where it declines (0)."""
        precision = self._precision(accumulate)
        kc = self.iface.nvmmhKernelConfiguration()
        kc.cta[:] = cfg.cta
        kc.warp[:] = cfg.warp
        kc.instr[:] = INSTR
        kc.splitK, kc.loadStages = cfg.split_k, cfg.stages
        kc.gridSwizzle, kc.ctaOrder = cfg.swizzle, cfg.cta_order
        kc.cluster[:] = cfg.cluster
        problem = self._problem(shape)
        seconds = self.iface.nvMatmulHeuristicsEstimateSiliconMetricEx(
            self.iface.handle, precision, self.backend, ctypes.byref(problem), ctypes.byref(kc),
            ctypes.c_int(int(self.nv.NvMatmulHeuristicsSiliconMetric[METRIC])), self.iface.hardware_descriptor)
        return seconds * 1e6 if seconds > 0 and math.isfinite(seconds) else None

    def proposals(self, shape: Shape, count: int = 8, accumulate: str = "fp32") -> list[tuple[NvConfig, float]]:
        """Its own ranked configs for the shape (best first) with their estimated times in us."""
        precision = self._precision(accumulate).decode("ascii")
        out = []
        for r in self.iface.getEx(self._problem(shape), count, self.backend, precision=precision):
            k = r["kernel"]
            out.append((NvConfig((k.cta_tile_m, k.cta_tile_n, k.cta_tile_k), (k.warp_tile_m, k.warp_tile_n,
                                 k.warp_tile_k), k.stages, k.split_k, k.cta_order, k.swizzle_factor,
                                 (k.cluster_m, k.cluster_n)), r["runtime"] * 1e6))
        return out


@functools.lru_cache(maxsize=4)
def heuristic(gpu: str) -> Heuristic:
    """The process's handle for this GPU (the library's handle is thread-safe)."""
    return Heuristic(gpu)

"""`hgemm-tune check-package DIR`: a package, checked on this GPU as a program would use it.

For each tuned (N, K) of the package (or those asked for), every M from 1 to --m-max runs
through the C entry point (`hgemm_tuned_run`, by ctypes) and through `torch.ops.hgemm.linear`,
each against an fp32 reference; cuBLAS's fp16 result (`torch.nn.functional.linear`) on the
same inputs sets the error allowed (twice cuBLAS's own, plus a hair). Rows of the output are
independent, so one reference of M = m_max rows serves every M (its first M rows). Then a
CUDA graph captures the operator at a few M and its replay must equal the eager result,
`torch.compile` (one graph, dynamic M) must give the eager result too, and the host time per
call of the operator is set beside F.linear's (tiny M, where the host is what
one waits for). Needs torch with CUDA; never nvcc or CUTLASS (the report says whether they are
reachable, so a run that hides them shows it).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.errors import UserError
from tuner.runtime.package import open_library, package_info


@dataclass
class LayerCheck:
    N: int
    K: int
    ms: int                               # Ms checked (1..m_max)
    ours: int                             # Ms the package ran with its own kernel
    vendor: int                           # Ms it sent to the vendor (status 1)
    failed_c: list[int] = field(default_factory=list)      # M whose C-entry result was wrong or errored
    failed_op: list[int] = field(default_factory=list)     # M whose torch-op result was wrong or errored
    worst_ratio: float = 0.0              # max over M of our max error / cuBLAS's max error
    picks: dict[int, int] = field(default_factory=dict)    # pick id -> Ms it served
    graph_ok: bool = False
    graph_ms: list[int] = field(default_factory=list)
    compiled: str = ""                    # torch.compile(fullgraph, dynamic) of the operator: "ok" or why not


@dataclass
class CheckReport:
    gpu: str
    package: str
    torch: str
    nvcc_reachable: bool
    cutlass_importable: bool
    layers: list[LayerCheck]
    host_us: dict[str, float]             # "hgemm.linear" and "F.linear": host time per call
    host_shape: str
    seconds: float

    @property
    def ok(self) -> bool:
        return all(not lc.failed_c and not lc.failed_op and lc.graph_ok and lc.compiled == "ok" for lc in self.layers)


def _cutlass_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("cutlass_library") is not None or importlib.util.find_spec("cutlass") is not None


def _host_time_per_call(fn, n: int = 500) -> float:
    """Microseconds of host time per call: n calls issued after a sync, fewer than the launch queue
    holds, so the host never waits for the GPU and the loop times the calls alone."""
    import torch

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / n * 1e6


def check_package(package_dir: str | Path, layers: list[tuple[int, int]] | None = None, m_max: int = 4096,
                  graph_ms: tuple[int, ...] = (1, 7, 64, 333, 4096), on_layer=None) -> CheckReport:
    import torch
    import torch.nn.functional as F

    from tuner.runtime import torch_op

    start = time.perf_counter()
    package_info(Path(package_dir))   # not a package: said before anything else
    if not torch.cuda.is_available():
        raise UserError("check-package needs a CUDA GPU visible to torch")
    package_dir = Path(package_dir).resolve()
    info = torch_op.load(package_dir)
    lib = open_library(package_dir)
    graph_ms = tuple(m for m in graph_ms if m <= m_max)
    tuned = [(la["N"], la["K"]) for la in info["layers"]]
    if layers is None:
        layers = tuned
    for n, k in layers:
        if (n, k) not in tuned:
            raise UserError(f"(N, K) = ({n}, {k}) is not a layer of {package_dir}; its layers: "
                            + ", ".join(f"{a}x{b}" for a, b in tuned))
    gen = torch.Generator(device="cuda").manual_seed(0)
    checks = []
    for n, k in layers:
        a = torch.empty(m_max, k, device="cuda", dtype=torch.float16).uniform_(-1, 1, generator=gen)
        w = torch.empty(n, k, device="cuda", dtype=torch.float16).uniform_(-1, 1, generator=gen)
        ref = a.float() @ w.float().T
        vendor_out = F.linear(a, w)
        lc = LayerCheck(n, k, m_max, 0, 0)
        stream = torch.cuda.current_stream()
        for m in range(1, m_max + 1):
            ref_m = ref[:m]
            cublas_err = float((vendor_out[:m].float() - ref_m).abs().max())
            allowed = 2 * cublas_err + 1e-3
            pick = lib.hgemm_tuned_lookup(m, n, k)
            c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
            need = lib.hgemm_tuned_workspace_size(m, n, k)
            ws = torch.empty(max(need, 1), device="cuda", dtype=torch.uint8)
            status = lib.hgemm_tuned_run(m, n, k, a.data_ptr(), k, w.data_ptr(), k, c.data_ptr(), n,
                                         ws.data_ptr(), need, stream.cuda_stream)
            if status == 1:
                lc.vendor += 1
            elif status == 0:
                lc.ours += 1
                lc.picks[pick] = lc.picks.get(pick, 0) + 1
                err = float((c.float() - ref_m).abs().max())   # NaN (an unwritten element) fails too
                if not err <= allowed:
                    lc.failed_c.append(m)
                lc.worst_ratio = max(lc.worst_ratio, err / max(cublas_err, 1e-6))
            else:
                lc.failed_c.append(m)
            try:
                y = torch.ops.hgemm.linear(a[:m], w)
                err = float((y.float() - ref_m).abs().max())
                if not err <= allowed:
                    lc.failed_op.append(m)
            except RuntimeError:
                lc.failed_op.append(m)
        lc.graph_ok, lc.graph_ms = _graph_check(a, w, graph_ms), list(graph_ms)
        lc.compiled = _compile_check(a, w, graph_ms)
        checks.append(lc)
        if on_layer:
            on_layer(lc)
    # Host overhead: the smallest M of the first layer, where the package runs its own kernel if any.
    n, k = layers[0]
    m = next((m for m in range(1, 65) if lib.hgemm_tuned_lookup(m, n, k) >= 0), 1)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16)
    host = {"hgemm.linear": _host_time_per_call(lambda: torch.ops.hgemm.linear(x, w)),
            "F.linear": _host_time_per_call(lambda: F.linear(x, w))}
    return CheckReport(torch.cuda.get_device_name(), str(package_dir), torch.__version__,
                       shutil.which("nvcc") is not None, _cutlass_importable(), checks, host,
                       f"{m}x{n}x{k}", time.perf_counter() - start)


def _graph_check(a, w, ms: tuple[int, ...]) -> bool:
    """The operator captured in one CUDA graph at several M; the replay equals the eager result."""
    import torch

    from tuner.runtime.torch_op import graphed

    eager = [torch.ops.hgemm.linear(a[:m], w) for m in ms]
    replay, outs = graphed(lambda: [torch.ops.hgemm.linear(a[:m], w) for m in ms])
    for o in outs:
        o.zero_()
    replay()
    torch.cuda.synchronize()
    # not bit-equal: a nondeterministic split-K pick may add its partials in another order
    return all(torch.allclose(o, e, rtol=1e-3, atol=1e-2) for o, e in zip(outs, eager, strict=True))


def _compile_check(a, w, ms: tuple[int, ...]) -> str:
    """torch.compile (one graph, dynamic M) of a function around the operator; its results at
    several M must match eager. "ok", or the first line of what went wrong."""
    import torch

    def f(x, weight):
        return torch.relu(torch.ops.hgemm.linear(x, weight)) * 2

    try:
        compiled = torch.compile(f, fullgraph=True, dynamic=True)
        for m in ms:
            if not torch.allclose(compiled(a[:m], w), f(a[:m], w), rtol=1e-3, atol=1e-2):
                return f"differs from eager at M={m}"
    except Exception as exc:  # noqa: BLE001 - the report says why compiling failed
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
    return "ok"


def summary_rows(report: CheckReport) -> list[dict[str, Any]]:
    return [{"N": lc.N, "K": lc.K, "M": f"1-{lc.ms}", "ours": lc.ours, "vendor": lc.vendor,
             "picks": len(lc.picks), "worst_err_vs_cublas": round(lc.worst_ratio, 2),
             "failed_c": len(lc.failed_c), "failed_op": len(lc.failed_op),
             "graph": "ok" if lc.graph_ok else "FAILED", "torch.compile": lc.compiled} for lc in report.layers]

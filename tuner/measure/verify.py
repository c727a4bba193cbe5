"""Correctness checks a candidate must pass before any of its times counts (runs in the GPU worker).

Each check draws fresh inputs, poisons C with NaN, launches, then checks:
- exact:      0/1 inputs; every output whose true value is below 2048 must match exactly;
- random:     N(0,1) inputs; error against an fp32 reference within a small factor of
              cuBLAS's own error on the same inputs (with fp16 accumulation: or within the
              error model of an fp16 accumulator, whichever is larger; see random_tolerance);
- accumulate: A = 1, B = 1 + 2^-10, K >= 2048: the exact sum is only reachable with fp32
              accumulation (fp16 accumulation drops the 2^-10 terms once the sum passes 2048);
- every check: no NaN left in C (all of it written), guard bands around A, B, C unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from tuner.measure.device import cp as _cp
from tuner.measure.device import sync_or_fault

RANDOM_FACTOR = 2.0     # candidate normwise error may be this many times cuBLAS's
RANDOM_MAX_FACTOR = 4.0  # and its worst element error this many times cuBLAS's worst
EXACT_LIMIT = 2048       # fp16 represents every integer up to 2048
MMA_K = 16               # one wgmma / mma.sync step sums 16 products before rounding into C


def _run(launch: Callable, buf, stream) -> None:
    buf.poison_c()
    launch(buf, stream)
    sync_or_fault(stream)


def _reference(buf):
    cp = _cp()
    return buf.A.astype(cp.float32) @ buf.B.astype(cp.float32).T


def fill_normal(buf) -> None:
    cp = _cp()
    buf.A[...] = cp.random.standard_normal(buf.A.shape, dtype=cp.float32).astype(cp.float16)
    buf.B[...] = cp.random.standard_normal(buf.B.shape, dtype=cp.float32).astype(cp.float16)


def _common_failures(buf) -> dict[str, Any] | None:
    cp = _cp()
    bad_guards = buf.guards_intact()
    if bad_guards:
        return {"ok": False, "kind": "out_of_bounds",
                "reason": f"guard band around {', '.join(bad_guards)} overwritten (out-of-bounds write)"}
    nan = int(cp.isnan(buf.C).sum())
    if nan:
        return {"ok": False, "kind": "unwritten", "reason": f"{nan} of {buf.C.size} outputs left unwritten (NaN)"}
    return None


def exact_check(launch: Callable, buf, stream) -> dict[str, Any]:
    cp = _cp()
    p = 0.5 if buf.K <= 2048 else 1.0 / 3.0  # keep most sums under 2048 when K is large
    buf.A[...] = (cp.random.random(buf.A.shape, dtype=cp.float32) < p).astype(cp.float16)
    buf.B[...] = (cp.random.random(buf.B.shape, dtype=cp.float32) < p).astype(cp.float16)
    _run(launch, buf, stream)
    fail = _common_failures(buf)
    if fail:
        return fail
    ref = _reference(buf)
    mask = ref < EXACT_LIMIT
    wrong = int(((buf.C.astype(cp.float32) != ref) & mask).sum())
    checked = int(mask.sum())
    if wrong:
        idx = cp.argwhere((buf.C.astype(cp.float32) != ref) & mask)[0].get().tolist()
        return {"ok": False, "kind": "wrong",
                "reason": f"0/1 inputs: {wrong} of {checked} exact outputs differ, first at (m,n)={tuple(idx)}: "
                          f"got {float(buf.C[idx[0], idx[1]])}, want {float(ref[idx[0], idx[1]])}"}
    return {"ok": True, "exact_checked": checked}


def _errors(c, ref) -> tuple[float, float]:
    cp = _cp()
    diff = c.astype(cp.float32) - ref
    norm = float(cp.linalg.norm(ref)) or 1.0
    return float(cp.linalg.norm(diff)) / norm, float(cp.abs(diff).max()) / (float(cp.abs(ref).max()) or 1.0)


def random_tolerance(cublas_rel: float, cublas_max: float, K: int, accumulate: str = "fp32") -> tuple[float, float]:
    """(normwise, worst-element) relative error a candidate may have on N(0,1) inputs.

    fp32 accumulation: a small factor of cuBLAS's own error; the floor keeps a bit-exact
    cuBLAS (error 0 on tiny K) from failing every candidate.

    fp16 accumulation: cuBLAS's fp16-compute kernels are not a plain fp16 accumulator (on the
    H200 at 512x384x4096 cuBLAS erred 0.00112, a correct wgmma fp16-accumulating kernel
    0.00235), so the bound is also allowed to reach the error model of one: ceil(K/16)
    roundings of the running sum to fp16, a random walk of sqrt(ceil(K/16)) * 2^-11
    (0.0078 at K = 4096). A kernel that skips one k-tile in 64 still errs ~0.125."""
    tol_rel = RANDOM_FACTOR * max(cublas_rel, 2.0 ** -12)
    tol_max = RANDOM_MAX_FACTOR * max(cublas_max, 2.0 ** -11)
    if accumulate == "fp16":
        model = math.sqrt(-(-K // MMA_K)) * 2.0 ** -11
        tol_rel, tol_max = max(tol_rel, model), max(tol_max, RANDOM_MAX_FACTOR * model)
    return tol_rel, tol_max


def random_check(launch: Callable, cublas: Callable, buf, stream, accumulate: str = "fp32") -> dict[str, Any]:
    fill_normal(buf)
    ref = _reference(buf)
    _run(cublas, buf, stream)
    base_rel, base_max = _errors(buf.C, ref)
    _run(launch, buf, stream)
    fail = _common_failures(buf)
    if fail:
        return fail
    rel, worst = _errors(buf.C, ref)
    tol_rel, tol_max = random_tolerance(base_rel, base_max, buf.K, accumulate)
    stats = {"rel_err": rel, "max_err": worst, "cublas_rel_err": base_rel, "cublas_max_err": base_max}
    if not np.isfinite(rel) or rel > tol_rel or worst > tol_max:
        return {"ok": False, "kind": "wrong",
                "reason": f"random inputs: relative error {rel:.3g} (max {worst:.3g}) vs cuBLAS "
                          f"{base_rel:.3g} (max {base_max:.3g})", **stats}
    return {"ok": True, **stats}


def accumulate_check(launch: Callable, buf, stream) -> dict[str, Any]:
    cp = _cp()
    buf.A[...] = cp.float16(1.0)
    buf.B[...] = cp.float16(1.0 + 2.0 ** -10)
    _run(launch, buf, stream)
    fail = _common_failures(buf)
    if fail:
        return fail
    want = float(np.float16(buf.K * (1.0 + 2.0 ** -10)))
    wrong = int((buf.C.astype(cp.float32) != want).sum())
    if wrong:
        got = float(buf.C.ravel()[int(cp.argmax(buf.C.astype(cp.float32) != want))])
        return {"ok": False, "kind": "accumulate",
                "reason": f"fp32-accumulation check: {wrong} outputs differ from {want} (e.g. {got}); "
                          "looks like fp16 accumulation"}
    return {"ok": True}


def full_check(launch: Callable, cublas: Callable, buf, stream, accumulate: str = "fp32") -> dict[str, Any]:
    """Every check in order; the first failure is the report. With fp16 accumulation
    `cublas` computes in fp16 (the random bound then also admits fp16 accumulation's error) and the
    accumulate check, which exists to catch fp16 accumulators, is skipped."""
    report: dict[str, Any] = {"ok": True, "checks": []}
    steps = [("exact", lambda: exact_check(launch, buf, stream)),
             ("random", lambda: random_check(launch, cublas, buf, stream, accumulate))]
    if buf.K >= 2048 and accumulate == "fp32":
        steps.append(("accumulate", lambda: accumulate_check(launch, buf, stream)))
    for name, step in steps:
        result = step()
        if not result["ok"]:
            return result | {"check": name, "checks": report["checks"]}
        report["checks"].append(name)
        report.update({k: v for k, v in result.items() if k != "ok"})
    report["guards"] = "intact"
    return report


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

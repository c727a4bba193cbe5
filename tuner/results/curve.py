"""The catalogue-size curve: how good a sweep's results stay with only k of the kernels it measured.

From the studies of a storage (one GPU model), every shape's steady time of every kernel it
timed in full, and its cuBLAS time from the same sections. A greedy pass adds, one at a time,
the kernel that lifts the geomean most; at each size it reports what an export would reach
(our best kernel of the set, or cuBLAS where that is faster) and how many shapes stay within a
tolerance of their best. The smallest set that keeps every shape within the tolerance is the
distilled catalogue (`catalogue build --kernels`).

Only full (steady) times count: a kernel a batch's screen left behind (0040) was timed in the
screen's short pass alone, so it counts as not measured at that shape. The curve is therefore a
lower bound on what a set of k kernels reaches.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna

from tuner.errors import UserError
from tuner.measure import config_key
from tuner.search.records import StudyMeta, TrialRecord
from tuner.search.studies import current_ok, gpu_model, study_gpu

KERNEL_LIST_KIND = "hgemm-tune kernel list"


@dataclass
class Measured:
    """The times a storage holds: shape -> kernel key -> best steady us, and each shape's cuBLAS us."""

    gpu: str | None
    times: dict[str, dict[str, float]] = field(default_factory=dict)
    cublas: dict[str, float] = field(default_factory=dict)
    kernels: dict[str, tuple[str, dict[str, Any], str]] = field(default_factory=dict)  # key -> family, config, acc


@dataclass
class CurvePoint:
    size: int                  # kernels in the set
    added: str                 # the kernel this step added (key)
    geomean_vs_cublas: float   # what an export reaches: our best of the set, or cuBLAS where faster
    geomean_of_best: float     # geomean over shapes of (best reachable with all kernels) / (with this set)
    within: int                # shapes within the tolerance of their best


@dataclass
class Curve:
    gpu: str | None
    shapes: int
    kernels: int
    tolerance: float
    full_geomean_vs_cublas: float
    points: list[CurvePoint]
    keep: int | None           # the smallest size with every shape within the tolerance (None: never)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measured(studies: list[optuna.Study]) -> Measured:
    """Every shape's steady times per kernel (family + compile config) and its median cuBLAS time,
    from the studies' current verified trials. One curve is one problem: studies of several GPU
    models (picks do not carry between cards, 0010), accumulations or objectives (their times are
    of another problem or regime) cannot share it, and a UserError says to pick studies."""
    ours = []  # (study, its meta, the GPU model it last ran on)
    for st in studies:
        try:
            ours.append((st, StudyMeta.of(st), study_gpu(st)))
        except UserError:
            continue  # not a study of ours
    for what, values in (("GPU models", {gpu for *_, gpu in ours} - {None}),
                         ("accumulations", {meta.accumulate for _, meta, _ in ours}),
                         ("objectives", {meta.objective for _, meta, _ in ours})):
        if len(values) > 1:
            raise UserError(f"the studies span {len(values)} {what} ({', '.join(sorted(map(str, values)))}): a "
                            "catalogue curve needs studies of one problem (pass their names with --study)")
    out = Measured(gpu=next((gpu for *_, gpu in ours if gpu), None))
    cublas: dict[str, list[float]] = {}
    for st, meta, gpu in ours:
        for t in current_ok(st.get_trials(deepcopy=False), gpu):
            rec = TrialRecord.of(t)
            if rec.time_us is None or gpu_model(rec.gpu) != out.gpu:
                continue
            key = config_key(rec.family, rec.config)
            out.kernels.setdefault(key, (rec.family, dict(rec.config), meta.accumulate))
            row = out.times.setdefault(meta.shape, {})
            row[key] = min(rec.time_us, row.get(key, math.inf))
            if rec.cublas_us:
                cublas.setdefault(meta.shape, []).append(rec.cublas_us)
    for shape in list(out.times):
        if shape in cublas:
            out.cublas[shape] = statistics.median(cublas[shape])
        else:
            del out.times[shape]  # no vendor time to compare with: left out
    return out


def greedy_curve(m: Measured, tolerance: float = 0.01) -> Curve:
    """Add kernels greedily by the geomean they lift (ties: the key's order), until none helps."""
    if not 0 <= tolerance < 1:
        raise UserError(f"--tolerance {tolerance}: must be at least 0 and below 1 (0.01: within 1%)")
    shapes = sorted(m.times)
    if not shapes:
        raise UserError("no shape with a verified, fully timed kernel and a cuBLAS time in these studies")
    # What an export reaches with every kernel: its best, or cuBLAS where that is faster.
    full = {s: min(min(m.times[s].values()), m.cublas[s]) for s in shapes}
    reach = {s: m.cublas[s] for s in shapes}  # the empty set: cuBLAS everywhere

    def log_quality(r: dict[str, float]) -> float:
        return sum(math.log(full[s] / r[s]) for s in shapes)

    def point(size: int, added: str) -> CurvePoint:
        n = len(shapes)
        return CurvePoint(size, added,
                          math.exp(sum(math.log(m.cublas[s] / reach[s]) for s in shapes) / n),
                          math.exp(log_quality(reach) / n),
                          sum(1 for s in shapes if reach[s] <= full[s] * (1 + tolerance)))

    points: list[CurvePoint] = [point(0, "")]
    left = sorted(m.kernels)
    where = {k: [s for s in shapes if k in m.times[s]] for k in left}  # the shapes each kernel was timed at
    while left:
        gains = {k: sum(math.log(reach[s] / m.times[s][k]) for s in where[k] if m.times[s][k] < reach[s])
                 for k in left}
        best = max(left, key=lambda k: gains[k])  # max keeps the first of equal gains: key order
        if gains[best] <= 0:
            break  # every kernel left is nowhere faster than what the set reaches
        left.remove(best)
        for s in shapes:
            reach[s] = min(reach[s], m.times[s].get(best, math.inf))
        points.append(point(len(points), best))
    keep = next((p.size for p in points if p.within == len(shapes)), None)
    return Curve(m.gpu, len(shapes), len(m.kernels), tolerance, points[-1].geomean_vs_cublas, points, keep)


def kernel_list(m: Measured, curve: Curve, size: int | None = None) -> dict[str, Any]:
    """The first `size` kernels of the curve (default: the distilled set, `curve.keep`) as a kernel
    list for `catalogue build --kernels`."""
    size = curve.keep if size is None else size
    if size is None:
        raise UserError("no set of these kernels keeps every shape within the tolerance: pass a size")
    if size == 0:
        raise UserError("the curve's set is empty (cuBLAS alone keeps every shape within the tolerance): "
                        "no kernel list to write; pass --size N for the first N kernels")
    chosen = [p.added for p in curve.points[1:size + 1]]
    return {"kind": KERNEL_LIST_KIND, "gpu": curve.gpu, "tolerance": curve.tolerance,
            "kernels": [{"family": m.kernels[k][0], "config": m.kernels[k][1], "accumulate": m.kernels[k][2],
                         "why": f"catalogue curve: kernel {i} of {len(chosen)}"}
                        for i, k in enumerate(chosen, 1)]}


def read_kernel_list(raw: bytes | str, where: str) -> list[dict[str, Any]]:
    """A kernel list's entries (family, config, accumulate, why), shape-checked; an untrusted file:
    every problem is a one-line UserError naming the entry."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except (ValueError, RecursionError) as exc:  # not UTF-8; nested past the parser's stack
        raise UserError(f"{where}: not a JSON kernel list ({type(exc).__name__})") from None
    if not isinstance(data, dict) or data.get("kind") != KERNEL_LIST_KIND or not isinstance(data.get("kernels"), list):
        raise UserError(f"{where}: not a kernel list (a JSON object with \"kind\": \"{KERNEL_LIST_KIND}\" and "
                        "\"kernels\": [...], as `catalogue curve --kernels-out` writes)")
    out = []
    for i, k in enumerate(data["kernels"]):
        if (not isinstance(k, dict) or not isinstance(k.get("family"), str) or not isinstance(k.get("config"), dict)
                or k.get("accumulate", "fp32") not in ("fp32", "fp16")):
            raise UserError(f"{where}: kernels/{i}: needs a family (string), a config (object) and an "
                            "accumulate of fp32 or fp16")
        out.append({"family": k["family"], "config": k["config"], "accumulate": k.get("accumulate", "fp32"),
                    "why": str(k.get("why", ""))[:200] or f"kernel list {where}"})
    return out

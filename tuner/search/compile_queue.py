"""The compile queue: a config is checked against the constraints, rendered and handed to the
nvcc pool when it is asked (`prepare`); when its turn on the GPU comes, the build is awaited
and the binary measured (`finish`). Asking ahead keeps every nvcc job busy while the GPU
measures the oldest."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna

from tuner.build import CompilePool, CompileResult, RenderError, render, source_hash
from tuner.errors import UserError
from tuner.measure import Backend, EvalRequest, Measurement, evaluate_many, launch_spec
from tuner.measure.regimes import SUSTAINED
from tuner.search.records import Status, TrialRecord
from tuner.search.sampler import full_config
from tuner.space import Family, Shape


@dataclass
class Pending:
    trial: optuna.Trial | None
    family: Family
    config: dict[str, Any]
    record: TrialRecord
    future: Any = None                # Future[CompileResult] or None (replay / cached)
    request: EvalRequest | None = None


def prepare(fam: Family, config: dict[str, Any], shape: Shape, backend: Backend, pool: CompilePool | None,
            accumulate: str = "fp32", objective: str = SUSTAINED) -> Pending:
    """Validate, render and (if the backend runs real code) start compiling one config, to be
    timed in the regime `objective` (tuner.measure.regimes)."""
    full = full_config(fam, config)
    rec = TrialRecord(family=fam.name, config=fam.compile_config(full), status=Status.PENDING, objective=objective)
    why = fam.violations(full, shape, backend.target)
    if why:
        rec.status, rec.kind, rec.reason = Status.INVALID, "invalid", "; ".join(why)
        return Pending(None, fam, rec.config, rec)
    # Every run-time variant must satisfy the constraints too.
    variants = [v for v in fam.runtime_variants() if not fam.violations(full | v, shape, backend.target)]
    try:
        source = render(fam, full, backend.target.arch, accumulate=accumulate)
    except RenderError as exc:
        # This config's failure, like a compile error (a proposed template may fail at some knob
        # combinations only): the trial records why, the study goes on.
        rec.status, rec.kind, rec.reason = Status.RENDER_ERROR, "render", str(exc)
        return Pending(None, fam, rec.config, rec)
    rec.source_hash = source_hash(source)
    req = EvalRequest(fam.name, rec.config, shape, None, launch_spec(fam, full, shape, backend.target), variants,
                      accumulate, mode=objective)
    pending = Pending(None, fam, rec.config, rec, request=req)
    if backend.needs_cubin:
        if pool is None:
            raise UserError("a compile pool is needed for a real GPU backend")
        pending.future = pool.submit(source, backend.target.arch, fam.artifact)
    return pending


def built(p: Pending) -> bool:
    """Wait for the compile; True if the binary is ready to measure (False: the record says why not)."""
    rec = p.record
    if rec.status in (Status.INVALID, Status.RENDER_ERROR):
        return False
    assert p.request is not None
    if p.future is not None:
        cres: CompileResult = p.future.result()
        rec.cache_key, rec.compile_s, rec.cached = cres.key, cres.seconds, cres.cached
        rec.registers, rec.spill_bytes = cres.registers, cres.spill_bytes
        if not cres.ok:
            rec.status, rec.kind, rec.reason = Status.COMPILE_ERROR, "compile", cres.error
            return False
        p.request.cubin, p.request.digest = cres.cubin, cres.digest
    return True


def ready(p: Pending) -> bool:
    """Measurable without waiting: rendered, and its build finished (or nothing to build)."""
    return p.request is not None and p.record.status == Status.PENDING and (p.future is None or p.future.done())


def finish(p: Pending, shape: Shape, backend: Backend, timeout_s: float,
           recorder: Callable[[EvalRequest, Measurement], None] | None = None) -> TrialRecord:
    """Wait for the compile, then measure on the backend."""
    if not built(p):
        return p.record
    assert p.request is not None
    m = backend.evaluate(p.request, timeout_s=timeout_s)
    if recorder is not None and not m.simulated:
        recorder(p.request, m)
    return p.record.apply(m, shape, backend.target.peak_tflops)


def finish_many(ps: list[Pending], shape: Shape, backend: Backend, timeout_s: float,
                recorder: Callable[[EvalRequest, Measurement], None] | None = None) -> list[TrialRecord]:
    """Wait for each compile, then measure the built ones together (measure.evaluate_many: one
    shared screen and section on a GPU). `timeout_s` is per binary."""
    measurable = [p for p in ps if built(p)]
    if measurable:
        reqs = [p.request for p in measurable]
        for p, m in zip(measurable, evaluate_many(backend, reqs, timeout_s), strict=True):  # type: ignore[arg-type]
            assert p.request is not None
            if recorder is not None and not m.simulated:
                recorder(p.request, m)
            p.record.apply(m, shape, backend.target.peak_tflops)
    return [p.record for p in ps]


def hang_timeout_s(cublas_us: float) -> float:
    """Seconds before an evaluation counts as a hang: verification plus timing of all
    variants take a few hundred kernel-lengths; allow 200,000 cuBLAS times, at least 20 s."""
    return max(20.0, cublas_us * 1e-6 * 200_000)

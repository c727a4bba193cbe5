"""Judging a proposal that built: full verification on the targets and a tail, a short tune of
parent and child, a head-to-head timing, and publishing the child as a family version only if
it wins on every target shape. The outcome records what happened and why."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from proposer.validate import candidate_errors, terminal_safe
from tuner.build import CompilePool
from tuner.space import Family, Shape, Space, parse_shape

MIN_GAIN = 0.01                    # a child must be this much faster than its parent on every target shape
TAIL_SHAPE = parse_shape("333x200x1000")  # verified besides the targets: a tail in M, N and K
MAX_REASON_CHARS = 4000

@dataclass
class Outcome:
    id: str
    round: int
    # accepted | rejected | not_evaluated | bad_reply | bad_edit | too_large | render_error | sandbox
    # | static | compile_error | verify_error | error | endpoint_error
    status: str
    reason: str
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # Reasons quote the reply and the endpoint: no escape sequence reaches a terminal or a prompt.
        self.reason = terminal_safe(self.reason)[:MAX_REASON_CHARS]

@dataclass
class _Ctx:
    space: Space
    fam: Family
    parent: str
    pid: str
    round: int
    folder: Path
    shapes: list[Shape]
    backend: Any
    arch: str
    trials: int
    say: Callable[[str], None]
    versions_dir: Path
    prompt: str
    reply: str

    def out(self, status: str, reason: str, metrics: dict[str, Any] | None = None) -> Outcome:
        return Outcome(self.pid, self.round, status, reason, metrics or {})

def _changed(fam: Family, cfg: dict[str, Any]) -> str:
    """A config named by what differs from the family's defaults ('defaults' if nothing)."""
    diff = {k: v for k, v in cfg.items() if k not in fam.knobs or fam.knobs[k].default != v}
    return ", ".join(f"{k}={v}" for k, v in diff.items()) or "defaults"


def _verify(ctx: _Ctx, child: Family, configs: list[dict[str, Any]], pool: CompilePool) -> str | None:
    """The pipeline's full verification (exact, random, accumulate, NaN poison, guard bands; every
    run-time variant) of each validated config on every target shape and a tail shape."""
    from tuner.search.compile_queue import finish, prepare

    for shape in [*ctx.shapes, TAIL_SHAPE]:
        for cfg in configs:
            p = prepare(child, child.compile_config(cfg), shape, ctx.backend, pool)
            if p.record.status == "invalid":
                continue  # outside the family's constraints for this shape
            rec = finish(p, shape, ctx.backend, 60.0)
            ctx.say(f"verify {shape} {_changed(child, cfg)}: {rec.status}"
                    + (f" ({rec.kind}: {(rec.reason or '')[:200]})" if rec.status != "ok" else ""))
            if rec.status != "ok":
                reason = candidate_errors(rec.reason or "") if rec.status == "compile_error" else rec.reason
                return f"{shape} {_changed(child, cfg)}: {rec.status}/{rec.kind}: {reason}"
    return None


def _tune_against_parent(ctx: _Ctx, child: Family, new: dict[str, list[Any]], template: str, pool: CompilePool,
                         metrics: dict[str, Any]) -> Outcome:
    from tuner.search import TrialRecord, best_trial, tune

    fam, backend = ctx.fam, ctx.backend
    trial_space = Space(ctx.space.path, {fam.name: fam, child.name: child}, {})
    storage = f"sqlite:///{ctx.folder}/study.db"  # the short tunes' own studies, beside the proposal
    wins, rows = 0, []
    for shape in ctx.shapes:
        pst = tune(trial_space, [fam.name], shape, backend, trials=ctx.trials, storage=storage, pool=pool)
        pbest = best_trial(pst)
        # The child starts from the parent's best config with each new knob value, then searches.
        base = TrialRecord.of(pbest).config if pbest else fam.compile_config(fam.defaults())
        warm = [(child.name, base | {k: v}) for k, vs in new.items() for v in vs]
        cst = tune(trial_space, [child.name], shape, backend, trials=ctx.trials, storage=storage, pool=pool,
                   warm_start=warm)
        cbest = best_trial(cst)
        row: dict[str, Any] = {"shape": str(shape), "parent_config": pbest and TrialRecord.of(pbest).config,
                               "child_config": cbest and TrialRecord.of(cbest).config,
                               "parent_tune_us": pbest and pbest.value, "child_tune_us": cbest and cbest.value}
        ctx.say(f"tune {shape} ({ctx.trials} trials each): parent best {_us(row['parent_tune_us'])} "
                f"{json.dumps(row['parent_config'])}; child best {_us(row['child_tune_us'])} "
                f"{json.dumps(row['child_config'])}")
        rows.append(row)
        if cbest is None:
            continue
        if pbest is None:
            wins += 1
            continue
        times, why = _head_to_head(ctx, {"parent": (fam, pbest), "child": (child, cbest)}, shape, pool)
        if times is None:
            row["head_to_head"] = why
            ctx.say(f"head-to-head {shape}: {why}")
            continue
        p_us, c_us, cublas = times["parent"], times["child"], times.get("cublas")
        roof = backend.target.roofline_us(shape.flops, shape.min_bytes)
        row.update(parent_us=p_us, child_us=c_us, cublas_us=cublas, gain=p_us / c_us - 1,
                   child_tflops=shape.tflops(c_us), child_roofline_fraction=roof / c_us,
                   child_vs_cublas=cublas / c_us if cublas else None)
        ctx.say(f"head-to-head {shape} (one run, interleaved CUDA graphs): parent {p_us:.2f} us, child {c_us:.2f} us "
                f"({100 * row['gain']:+.1f}%, {row['child_tflops']:.1f} TFLOP/s, "
                f"{100 * row['child_roofline_fraction']:.1f}% of roofline)"
                + (f", cuBLAS {cublas:.2f} us (child {row['child_vs_cublas']:.3f}x)" if cublas else ""))
        if c_us < p_us * (1 - MIN_GAIN):
            wins += 1
    metrics["shapes"] = rows
    summary = "; ".join(f"{r['shape']}: parent {_us(r.get('parent_us', r['parent_tune_us']))}, child "
                        f"{_us(r.get('child_us', r['child_tune_us']))}" for r in rows)
    if wins < len(ctx.shapes):
        return ctx.out("rejected", f"beats {fam.name} by >= {100 * MIN_GAIN:.0f}% on {wins} of {len(ctx.shapes)} "
                                   f"shapes ({summary})", metrics)
    name = _publish(ctx, child, new, template, metrics)
    return ctx.out("accepted", f"beats {fam.name} on all {len(ctx.shapes)} shapes ({summary}); new family version "
                               f"{name} in {ctx.versions_dir}", metrics)


def _us(value: float | None) -> str:
    return f"{value:.2f} us" if value is not None else "none verified"


def _head_to_head(ctx: _Ctx, contenders: dict[str, tuple[Family, Any]], shape: Shape, pool: CompilePool):
    """Times of the parent's and the child's best, verified again and timed interleaved with cuBLAS
    in one worker run (a backend without `compare` answers with the tuning times)."""
    from tuner.build import render
    from tuner.measure import CandidateSpec, launch_spec
    from tuner.search import TrialRecord

    backend = ctx.backend
    if not hasattr(backend, "compare"):
        return {name: t.value for name, (_, t) in contenders.items()}, None
    cands = {}
    for name, (f, t) in contenders.items():
        rec = TrialRecord.of(t)
        full = f.complete(rec.kernel)
        cubin = digest = None
        if backend.needs_cubin:
            res = pool.submit(render(f, full, backend.target.arch), backend.target.arch, f.artifact).result()
            cubin, digest = res.cubin, res.digest
        cands[name] = CandidateSpec(cubin or "", launch_spec(f, full, shape, backend.target), rec.variant, digest)
    reply = backend.compare(shape, cands, torch=False)
    if not reply.ok:
        return None, f"head-to-head failed: {reply.reason}"
    bad = {n: v.get("reason") for n, v in reply.verify.items() if not v.get("ok")}
    if bad or any(n not in reply.times for n in cands):
        return None, f"head-to-head: not verified or not timed: {bad}"
    return reply.times, None


def _publish(ctx: _Ctx, child: Family, new: dict[str, list[Any]], template: str, metrics: dict[str, Any]) -> str:
    """Write the accepted child as a family version: templates/<root>_vN.cu.j2, a space file
    declaring it (`hgemm-tune --space templates/<root>_vN.yaml ...`) and its lineage record."""
    fam, out = ctx.fam, ctx.versions_dir
    out.mkdir(parents=True, exist_ok=True)
    root = re.sub(r"_v\d+$", "", fam.name)
    n = 2
    while (out / f"{root}_v{n}.cu.j2").exists():
        n += 1
    name = f"{root}_v{n}"
    (out / f"{name}.cu.j2").write_text(template)
    raw = yaml.safe_load(ctx.space.path.read_text())["families"][fam.name]
    raw = dict(raw, template=f"../{name}.cu.j2",  # load_space looks in <space dir>/templates/
               description=f"{fam.description} [version {n}: proposal {ctx.pid}]",
               untrusted=True)  # an LLM wrote it: the tuner renders it only in the bounded child
    raw["knobs"] = {k.name: {"values": list(k.values), "default": k.default, "kind": k.kind}
                    for k in child.knobs.values()}
    (out / f"{name}.yaml").write_text(f"# Family version {name}, accepted from proposal {ctx.pid} "
                                      f"(parent {fam.name}); see {name}.lineage.json.\n"
                                      + yaml.safe_dump({"version": 1, "families": {name: raw}}, sort_keys=False,
                                                     default_flow_style=None, width=120))
    metrics["version"] = name
    lineage = {"family": name, "parent": fam.name, "parent_template": str(fam.templates_dir / fam.template),
               "proposal": ctx.pid, "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "template": f"{name}.cu.j2", "space": f"{name}.yaml", "new_knob_values": new,
               "prompt": ctx.prompt, "reply": ctx.reply, "metrics": metrics}
    (out / f"{name}.lineage.json").write_text(json.dumps(lineage, indent=2, default=str))
    return name

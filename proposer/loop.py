"""Propose rounds: prompt -> reply -> edits -> sandbox render -> static checks -> nvcc ->
(on a GPU) verification and a short tune against the parent. Every step is recorded."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proposer.edits import EditError, apply, parse_reply
from proposer.validate import render_sandboxed, static_check
from tuner.compile import DEFAULT_CACHE, compile_source
from tuner.errors import UserError
from tuner.shapes import Shape
from tuner.space import Family, Knob, Space

SYSTEM = ("You improve CUDA fp16 GEMM kernel templates (Jinja2). Keep the extern \"C\" hgemm entry point and "
          "its arguments exactly. Reply with SEARCH/REPLACE blocks against the template, and optionally one "
          "```yaml block `knobs: {NAME: {values: [...], default: v, kind: compile}}` for new knobs.")


@dataclass
class Outcome:
    id: str
    round: int
    # accepted | rejected | not_evaluated | bad_reply | bad_edit | render_error | sandbox | static
    # | compile_error | endpoint_error
    status: str
    reason: str
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)


def build_prompt(fam: Family, template: str, evidence: list[str], feedback: list[str]) -> str:
    knobs = "\n".join(f"- {k.name}: {list(k.values)} (default {k.default}, {k.kind})" for k in fam.knobs.values())
    constraints = "\n".join(f"- {c.expr.text}  # {c.why}" for c in fam.constraints)
    parts = [f"Family {fam.name}: {fam.description}", f"Knobs:\n{knobs}", f"Constraints:\n{constraints}",
             "Results so far:\n" + ("\n".join(evidence) or "- none yet"),
             "Last attempts and why they failed:\n" + ("\n".join(feedback[-5:]) or "- none"),
             f"The template:\n```jinja\n{template}\n```",
             "Propose one new trick (a new knob if it is a choice). Reply with SEARCH/REPLACE blocks."]
    return "\n\n".join(parts)


def _new_knobs(fam: Family, raw: dict[str, Any]) -> dict[str, Knob]:
    knobs = dict(fam.knobs)
    for name, spec in raw.items():
        if not (isinstance(name, str) and name.isidentifier() and name.isupper()):
            raise EditError(f"knob name {name!r} must be an UPPER_CASE identifier")
        if not isinstance(spec, dict) or not isinstance(spec.get("values"), list) or not spec["values"]:
            raise EditError(f"knob {name}: needs a non-empty 'values' list")
        if not all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in spec["values"]):
            raise EditError(f"knob {name}: values must be integers or strings")
        default = spec.get("default", spec["values"][0])
        if default not in spec["values"]:
            raise EditError(f"knob {name}: default {default!r} not among its values")
        knobs[name] = Knob(name, tuple(spec["values"]), default, "compile")
    return knobs


def run_rounds(space: Space, family: str, shapes: list[Shape], client, *, rounds: int, candidates: int,
               out_dir: Path, backend=None, arch: str = "sm_90a", trials: int = 12, storage: str | None = None,
               evidence: list[str] | None = None) -> list[Outcome]:
    fam = space.family(family)
    parent = (fam.templates_dir / fam.template).read_text()
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    outcomes: list[Outcome] = []
    feedback: list[str] = []
    for r in range(rounds):
        for c in range(candidates):
            pid = f"{family}-{stamp}-r{r}c{c}"
            folder = out_dir / pid
            folder.mkdir(parents=True, exist_ok=True)
            prompt = build_prompt(fam, parent, evidence or [], feedback)
            (folder / "prompt.txt").write_text(prompt)
            try:
                reply = client.chat(SYSTEM, prompt)
            except UserError as exc:
                outcome = Outcome(pid, r, "endpoint_error", str(exc))
                _save(folder, outcome)
                outcomes.append(outcome)
                return outcomes  # no endpoint: nothing more to ask this run
            (folder / "reply.txt").write_text(reply)
            outcome = _evaluate(space, fam, parent, reply, pid, r, folder, shapes, backend, arch, trials, storage)
            _save(folder, outcome)
            outcomes.append(outcome)
            feedback.append(f"- attempt {pid}: {outcome.status}: {outcome.reason[:400]}")
    return outcomes


def _evaluate(space, fam, parent, reply, pid, r, folder, shapes, backend, arch, trials, storage) -> Outcome:
    try:
        prop = parse_reply(reply)
    except EditError as exc:
        return Outcome(pid, r, "bad_reply", str(exc))
    try:
        template = apply(parent, prop)
        knobs = _new_knobs(fam, prop.knobs)
    except EditError as exc:
        return Outcome(pid, r, "bad_edit", str(exc))
    (folder / fam.template).write_text(template)
    defaults = {k.name: k.default for k in knobs.values() if k.kind == "compile"}
    try:
        source = render_sandboxed(template, {"family": fam.name, "entry": "hgemm", "arch": arch, **defaults})
    except ValueError as exc:
        status = "sandbox" if "sandbox" in str(exc) else "render_error"
        return Outcome(pid, r, status, str(exc))
    (folder / "kernel.cu").write_text(source)
    why = static_check(source)
    if why:
        return Outcome(pid, r, "static", why)
    res = compile_source(source, arch, cache_dir=DEFAULT_CACHE)
    if not res.ok:
        return Outcome(pid, r, "compile_error", res.error or "nvcc failed")
    metrics: dict[str, Any] = {"registers": res.registers, "spill_bytes": res.spill_bytes, "compile_s": res.seconds}
    if backend is None:
        return Outcome(pid, r, "not_evaluated", "not evaluated: no GPU (compiled fine)", metrics)
    return _tune_against_parent(space, fam, knobs, folder, pid, r, shapes, backend, trials, storage, metrics)


def _tune_against_parent(space, fam, knobs, folder, pid, r, shapes, backend, trials, storage, metrics) -> Outcome:
    from tuner.compile import CompilePool
    from tuner.export import best_trial
    from tuner.search import tune

    child = dataclasses.replace(fam, name=f"{fam.name}_{pid.split('-', 1)[1]}", knobs=knobs, templates_dir=folder)
    trial_space = Space(space.path, {fam.name: fam, child.name: child}, {})
    storage = storage or f"sqlite:///{folder}/study.db"
    pool = CompilePool()
    wins, rows = 0, []
    try:
        for shape in shapes:
            best = {}
            for f in (fam.name, child.name):
                st = tune(trial_space, [f], shape, backend, trials=trials, storage=storage, pool=pool)
                b = best_trial(st)
                best[f] = b.value if b else None
            rows.append({"shape": str(shape), "parent_us": best[fam.name], "child_us": best[child.name]})
            if best[child.name] is not None and (best[fam.name] is None or best[child.name] < best[fam.name]):
                wins += 1
    finally:
        pool.close()
    metrics["shapes"] = rows
    if wins == len(shapes):
        lineage = {"parent": fam.name, "child": child.name, "template": str(folder / fam.template),
                   "knobs": {k.name: list(k.values) for k in knobs.values()}, "metrics": metrics}
        (folder / "lineage.json").write_text(json.dumps(lineage, indent=2))
        return Outcome(pid, r, "accepted", f"beats {fam.name} on all {len(shapes)} shapes", metrics)
    return Outcome(pid, r, "rejected", f"beats {fam.name} on {wins} of {len(shapes)} shapes", metrics)


def _save(folder: Path, outcome: Outcome) -> None:
    (folder / "outcome.json").write_text(json.dumps(dataclasses.asdict(outcome), indent=2))


def list_proposals(out_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("*/outcome.json"))]

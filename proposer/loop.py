"""Propose rounds: prompt -> reply -> edits -> sandbox render -> static checks -> nvcc ->
(on a GPU) verification, a short tune of parent and child and a head-to-head timing.
Every step is recorded under the proposal's folder (prompt, reply, template, log, outcome)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from proposer.client import BadReply, EndpointError
from proposer.edits import EditError, apply, parse_reply
from proposer.judge import Outcome, _changed, _Ctx, _tune_against_parent, _verify
from proposer.validate import candidate_errors, dependency_check, sass_traps, static_check, terminal_safe
from tuner.build import CompilePool, CompileResult, cache_key, compile_source, template_vars
from tuner.build.sandbox import render_sandboxed
from tuner.errors import UserError
from tuner.space import Family, Knob, Shape, Space
from tuner.space.model import RESERVED_KNOB_NAMES

SYSTEM = ("You improve CUDA fp16 GEMM kernel templates (Jinja2). Keep the extern \"C\" hgemm entry point and "
          "its arguments exactly, and keep every M, N, K tail correct. Reply with SEARCH/REPLACE blocks against "
          "the template (or one ```jinja block holding the whole new template), and optionally one ```yaml block "
          "`knobs: {NAME: {values: [...], default: v, kind: compile}}` declaring the knobs your template uses.")
MAX_KNOB_VALUES = 32
MAX_CONFIGS = 16                   # configs one proposal renders and compiles (the default and each new value)
MAX_SOURCE_CHARS = 128 << 10       # a rendered candidate (the shipped templates render to about 13 K)


def build_prompt(fam: Family, template: str, evidence: list[str], feedback: list[str]) -> str:
    knobs = "\n".join(f"- {k.name}: {list(k.values)} (default {k.default}, {k.kind})" for k in fam.knobs.values())
    derived = "\n".join(f"- {name} = {e.text}" for name, e in fam.derived.items()) or "- none"
    launch = ", ".join(f"{k} = {e.text}" for k, e in fam.launch.items()) or "set by the library's host code"
    constraints = "\n".join(f"- {c.expr.text}  # {c.why}" for c in fam.constraints)
    # The newest failure in full (nvcc's first errors, the verifier's reason), older ones short.
    last = [f[:1500] if i == len(feedback[-5:]) - 1 else f[:300] for i, f in enumerate(feedback[-5:])]
    parts = [f"Family {fam.name}: {fam.description}",
             "Contract: extern \"C\" __global__ void hgemm(const __half* A, const __half* B, __half* C, int M, "
             "int N, int K, int swizzle_log); C = A * B^T, A M x K, B N x K, C M x N, all row-major fp16, fp32 "
             "accumulation; every element of C written exactly once, nothing outside it; tails handled in the "
             f"kernel. Launch (fixed, your knobs cannot change it): {launch}. Device code only: no host code, "
             "no library calls (cuBLAS, ...), no printf; includes: cute/, cutlass/, cuda_fp16.h, mma.h, cstdint.",
             f"Knobs (template variables; run-time knobs are kernel arguments):\n{knobs}",
             f"Derived values:\n{derived}", f"Constraints:\n{constraints}",
             "Results so far:\n" + ("\n".join(evidence) or "- none yet"),
             "Last attempts and why they failed:\n" + ("\n".join(last) or "- none"),
             f"The template:\n```jinja\n{template}\n```",
             "Propose one new trick; make it a new compile-time knob (default: the current behaviour) when it is "
             "a choice. Reply with SEARCH/REPLACE blocks that match the template exactly."]
    return "\n\n".join(parts)


def _new_knobs(fam: Family, raw: dict[str, Any]) -> tuple[dict[str, Knob], dict[str, list[Any]]]:
    """The child's knobs, and per new or extended knob the values the parent does not have."""
    knobs = dict(fam.knobs)
    new: dict[str, list[Any]] = {}
    for name, spec in raw.items():
        if not (isinstance(name, str) and name.isidentifier() and name.isupper()):
            raise EditError(f"knob name {_brief(name)} must be an UPPER_CASE identifier")
        if name in RESERVED_KNOB_NAMES:
            raise EditError(f"knob name {name} is reserved (the template's ACCUM, the shape's M, N, K): choose another")
        if not isinstance(spec, dict) or not isinstance(spec.get("values"), list) or not spec["values"]:
            raise EditError(f"knob {name}: needs a non-empty 'values' list")
        values = spec["values"]
        if len(values) > MAX_KNOB_VALUES:
            raise EditError(f"knob {name}: {len(values)} values; at most {MAX_KNOB_VALUES} (each one is compiled)")
        if not all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in values):
            raise EditError(f"knob {name}: values must be integers or strings")
        if len(set(map(repr, values))) != len(values):
            raise EditError(f"knob {name}: duplicate values")
        if spec.get("kind", "compile") != "compile":
            raise EditError(f"knob {name}: only compile-time knobs can be added (the entry point is fixed)")
        default = spec.get("default", values[0])
        if default not in values:
            raise EditError(f"knob {name}: default {_brief(default)} not among its values")
        old = fam.knobs.get(name)
        if old is not None:
            # Redeclaring a knob may only add values: every parent config stays a child config.
            if old.kind != "compile" or not set(old.values) <= set(values):
                raise EditError(f"knob {name} exists ({old.kind}, {list(old.values)}): a redeclaration must be "
                                "a compile-time knob keeping all of its values")
            added = [v for v in values if v not in old.values]
        else:
            added = [v for v in values if v != default]
        knobs[name] = Knob(name, tuple(values), default, "compile")
        if added:
            new[name] = added
    return knobs, new


def _brief(value: Any) -> str:
    """A short repr of a value from the reply (a YAML alias bomb's repr is exponential)."""
    return repr(value)[:80] if isinstance(value, (int, str)) and not isinstance(value, bool) else type(value).__name__


def proposable(space: Space, family: str) -> Family:
    """The family an LLM may rewrite: device code (cubin) only. A library family's host half
    would run in our processes (tuner.build.render refuses to build one from an untrusted
    template in any case)."""
    fam = space.family(family)
    if fam.artifact != "cubin":
        raise UserError(f"propose rewrites device-code (cubin) families; {family} is a host+device library")
    return fam


def run_rounds(space: Space, family: str, shapes: list[Shape], client, *, rounds: int, candidates: int,
               out_dir: Path, backend=None, arch: str = "sm_90a", trials: int = 12,
               evidence: list[str] | None = None, versions_dir: Path | None = None,
               log: Callable[[str], None] | None = None) -> list[Outcome]:
    """Ask, validate and (with a backend) evaluate `rounds` x `candidates` proposals against the
    family's template. An accepted child is written to `versions_dir` (default: the family's
    templates folder) as a new family version with its lineage."""
    fam = proposable(space, family)
    parent = (fam.templates_dir / fam.template).read_text()
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    outcomes: list[Outcome] = []
    feedback: list[str] = []
    for r in range(rounds):
        for c in range(candidates):
            pid = f"{family}-{stamp}-r{r}c{c}"
            folder = out_dir / pid
            folder.mkdir(parents=True, exist_ok=True)
            say = _logger(folder, pid, log)
            prompt = build_prompt(fam, parent, evidence or [], feedback)
            (folder / "prompt.txt").write_text(prompt)
            say(f"round {r} candidate {c}: asking {getattr(client, 'model', '?')} ({len(prompt)} prompt chars)")
            try:
                reply = client.chat(SYSTEM, prompt)
            except BadReply as exc:  # a completion whose text cannot be used (too large, not Unicode)
                if exc.text:
                    (folder / "reply.txt").write_text(exc.text)
                reply = None
                outcome = Outcome(pid, r, "bad_reply", str(exc))
            except Exception as exc:  # noqa: BLE001 - whatever the endpoint did, it is an outcome, not a crash
                fatal = getattr(exc, "fatal", True) or not isinstance(exc, EndpointError)
                why = str(exc) if isinstance(exc, UserError) else f"the request failed: {type(exc).__name__}: {exc}"
                outcome = Outcome(pid, r, "endpoint_error", terminal_safe(why, one_line=True)[:500])
                _save(folder, outcome, say)
                outcomes.append(outcome)
                if fatal:
                    return outcomes  # no endpoint: nothing more to ask this run
                feedback.append(f"- attempt {pid}: endpoint_error: the answer was not a chat completion")
                continue
            if reply is None:
                _save(folder, outcome, say)
                outcomes.append(outcome)
                feedback.append(f"- attempt {pid}: {outcome.status}: {outcome.reason}")
                continue
            (folder / "reply.txt").write_text(reply)
            ctx = _Ctx(space, fam, parent, pid, r, folder, shapes, backend, arch, trials, say,
                       versions_dir or fam.templates_dir, prompt, reply)
            outcome = _evaluate(ctx)
            _save(folder, outcome, say)
            outcomes.append(outcome)
            feedback.append(f"- attempt {pid}: {outcome.status}: {outcome.reason}")
    return outcomes

def _logger(folder: Path, pid: str, log: Callable[[str], None] | None) -> Callable[[str], None]:
    def say(line: str) -> None:
        line = terminal_safe(line)
        with open(folder / "log.txt", "a") as f:
            f.write(line + "\n")
        if log:
            log(f"[{pid}] {line}")
    return say


def _evaluate(ctx: _Ctx) -> Outcome:
    fam, say = ctx.fam, ctx.say
    try:
        prop = parse_reply(ctx.reply)
    except EditError as exc:
        return ctx.out("bad_reply", str(exc))
    try:
        template = apply(ctx.parent, prop)
        knobs, new = _new_knobs(fam, prop.knobs)
    except EditError as exc:
        return ctx.out("bad_edit", str(exc))
    (ctx.folder / fam.template).write_text(template)
    what = "a whole template" if prop.whole is not None else f"{len(prop.edits)} SEARCH/REPLACE block(s)"
    say(f"reply: {what} applied; new knob values {new or 'none'}")
    child = dataclasses.replace(fam, name=f"{fam.name}_{ctx.pid.split('-', 1)[1].replace('-', '_')}",
                                knobs=knobs, templates_dir=ctx.folder, untrusted=True)
    # The default config, then each new knob value on top of it: all must render, pass and compile.
    count = 1 + sum(len(vs) for vs in new.values())
    if count > MAX_CONFIGS:  # each one is rendered and compiled: refused before any of that
        return ctx.out("too_large", f"the new knob values make {count} configs to render and compile; at most "
                                    f"{MAX_CONFIGS} per proposal: propose fewer values")
    configs = [child.defaults()] + [child.defaults() | {k: v} for k, vs in new.items() for v in vs]
    sources = []
    for cfg in configs:
        # fp32 accumulation: the problem proposals are judged on.
        try:
            source = render_sandboxed(template, template_vars(child, cfg, ctx.arch, "fp32"))
        except ValueError as exc:
            status = "sandbox" if "sandbox" in str(exc) else "render_error"
            return ctx.out(status, f"{_changed(child, cfg)}: {exc}")
        if len(source) > MAX_SOURCE_CHARS:
            return ctx.out("too_large", f"{_changed(child, cfg)}: renders to {len(source)} characters of CUDA; at "
                                        f"most {MAX_SOURCE_CHARS} per config")
        why = static_check(source)
        if why:
            return ctx.out("static", f"{_changed(child, cfg)}: {why}")
        sources.append(source)
    # What the preprocessor really reads (macro-built includes and the like): all of it allowed headers.
    for cfg, source in zip(configs, sources, strict=True):
        why = dependency_check(source, ctx.arch, fam.artifact)
        if why:
            return ctx.out("static", f"{_changed(child, cfg)}: {why}")
    (ctx.folder / "kernel.cu").write_text(sources[0])
    say(f"sandbox render, static and include checks: {len(sources)} config(s) ok")
    pool = _CheckedPool(min(len(sources), 16) if ctx.backend is None else None)
    pool.cleared.update(_digest(s) for s in sources)
    try:
        results = [f.result() for f in [pool.submit(s, ctx.arch, fam.artifact) for s in sources]]
        for cfg, res in zip(configs, results, strict=True):
            if not res.ok:
                why = candidate_errors(res.error or "nvcc failed")  # never another file's lines
                return ctx.out("compile_error", f"{_changed(child, cfg)}: {why}")
        for cfg, res in zip(configs, results, strict=True):
            traps = sass_traps(res.cubin)
            if traps:  # what the source check cannot see: `"tr" "ap;"`, __trap(), __brkpt(), macros
                return ctx.out("static", f"{_changed(child, cfg)}: the kernel traps ({traps} BPT instruction(s) "
                                         "in its SASS): a trap only takes the GPU worker down")
        metrics: dict[str, Any] = {"compiled": [{"config": _changed(child, cfg), "registers": res.registers,
                                                 "spill_bytes": res.spill_bytes, "compile_s": round(res.seconds, 1)}
                                                for cfg, res in zip(configs, results, strict=True)]}
        say(f"nvcc {ctx.arch}: " + "; ".join(f"{m['config']}: {m['registers']} registers, {m['spill_bytes']} B "
                                              f"spilled, {m['compile_s']} s" for m in metrics["compiled"]))
        if ctx.backend is None:
            return ctx.out("not_evaluated", f"not evaluated: no GPU (rendered, checked and compiled "
                                            f"{len(sources)} config(s) for {ctx.arch})", metrics)
        try:
            failed = _verify(ctx, child, configs, pool)
            if failed:
                return ctx.out("verify_error", failed, metrics)
            return _tune_against_parent(ctx, child, new, template, pool, metrics)
        except UserError as exc:
            return ctx.out("error", str(exc), metrics)
    finally:
        pool.close()


def _digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


class _CheckedPool(CompilePool):
    """The compile pool of a proposal: every source it builds, the parent's and the child's at any
    knob values the short tune picks, passes the static and include checks before nvcc sees it."""

    def __init__(self, jobs: int | None = None):
        super().__init__(jobs)
        self.cleared: set[str] = set()  # sources already checked

    def submit(self, source: str, arch: str, artifact: str = "cubin"):
        if _digest(source) in self.cleared:
            return super().submit(source, arch, artifact)
        return self._pool.submit(self._checked, source, arch, artifact)

    def _checked(self, source: str, arch: str, artifact: str) -> CompileResult:
        why = static_check(source) or dependency_check(source, arch, artifact)
        if why:
            return CompileResult(False, cache_key(source, arch, artifact), None, 0.0, False,
                                 f"rejected before nvcc: {why}")
        self.cleared.add(_digest(source))
        return compile_source(source, arch, self.cache_dir, self.timeout_s, artifact)

def _save(folder: Path, outcome: Outcome, say: Callable[[str], None]) -> None:
    say(f"outcome: {outcome.status}: {outcome.reason[:600]}")
    (folder / "outcome.json").write_text(json.dumps(dataclasses.asdict(outcome), indent=2, default=str))


def list_proposals(out_dir: Path) -> list[dict[str, Any]]:
    """Every recorded outcome; a damaged outcome.json is listed as such, not a crash."""
    out = []
    for p in sorted(out_dir.glob("*/outcome.json")):
        try:
            rec = json.loads(p.read_text())
            if not isinstance(rec, dict) or not {"id", "round", "status", "reason"} <= set(rec):
                raise ValueError("missing id, round, status or reason")
        except (OSError, ValueError) as exc:
            rec = {"id": p.parent.name, "round": "-", "status": "unreadable", "reason": f"{p}: {exc}"}
        out.append(rec)
    return out

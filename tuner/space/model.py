"""The search space as data: kernel families, their knobs, constraints and launch geometry.

`tuner.space.loader` builds these from space.yaml; every later stage reads them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.errors import UserError
from tuner.space.expr import Expr
from tuner.space.shapes import Shape
from tuner.space.target import Target

SHAPE_NAMES = ("M", "N", "K")
TARGET_NAMES = ("max_smem", "max_threads", "sm_count", "cc")
KNOB_KINDS = ("compile", "runtime")
# fp32: fp32 accumulators (the default problem); fp16: fp16 accumulators, a different problem
# compared only with cuBLAS in fp16 compute mode.
ACCUMULATE = ("fp32", "fp16")
# Knobs that studies and exports written before 2026-12-03 may hold: ACCUM became the
# problem's --accumulate (an export entry's `accumulate`).
RETIRED_KNOBS = ("ACCUM",)
# Names a knob may not take: the template's own variables (tuner.build.render.template_vars
# passes family, entry, arch and the problem's ACCUM beside the knobs) and the names every
# expression sees (the shape and the target).
RESERVED_KNOB_NAMES = ("ACCUM", "family", "entry", "arch") + SHAPE_NAMES + TARGET_NAMES


def same_value(value: Any, allowed: Any) -> bool:
    """`value` is `allowed`, type included: 128.0 and True are not the knob value 128, nor False 0."""
    return type(value) is type(allowed) and value == allowed


def is_knob_value(value: Any, values: tuple[Any, ...] | list[Any]) -> bool:
    return any(same_value(value, v) for v in values)


def _brief(value: Any) -> str:
    """A value from a file as an error message shows it: short."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 1000 else f"<{value.bit_length()}-bit int>"
    return text if len(text) <= 80 else text[:80] + "..."


@dataclass(frozen=True)
class Knob:
    name: str
    values: tuple[Any, ...]
    default: Any
    kind: str  # "compile" | "runtime"


@dataclass(frozen=True)
class Constraint:
    expr: Expr
    why: str


@dataclass(frozen=True)
class Launch:
    grid: int
    block: int
    smem: int


@dataclass
class Family:
    name: str
    template: str
    description: str
    min_arch: int
    knobs: dict[str, Knob]
    derived: dict[str, Expr]
    constraints: list[Constraint]
    launch: dict[str, Expr]          # empty for library families: their host code picks the geometry
    templates_dir: Path = Path("templates")  # beside the space file that declared the family
    artifact: str = "cubin"          # cubin (device code, 1-D launch from `launch`) | library (host+device .so)
    seeds: list[dict[str, Any]] = field(default_factory=list)  # partial configs a fresh study tries first
    # seed index -> its `when` (an expression over M, N, K); a seed without one is for every shape
    seed_when: dict[int, Expr] = field(default_factory=dict)
    # Accumulator types the template can build (rendered as ACCUM); the problem picks one.
    accumulate: tuple[str, ...] = ("fp32",)
    # An LLM wrote the template (a proposal, or a version accepted from one): it is rendered in
    # a child process bounded in time and memory, never in the tuner's own.
    untrusted: bool = False

    @property
    def compile_knobs(self) -> list[Knob]:
        return [k for k in self.knobs.values() if k.kind == "compile"]

    @property
    def runtime_knobs(self) -> list[Knob]:
        return [k for k in self.knobs.values() if k.kind == "runtime"]

    def seeds_for(self, shape: Shape) -> list[dict[str, Any]]:
        """The seeds whose `when` holds for this shape (a seed found for M = 64 is not worth a
        compile at 4096x4096x8192)."""
        env = {"M": shape.M, "N": shape.N, "K": shape.K}
        return [seed for i, seed in enumerate(self.seeds) if i not in self.seed_when or self.seed_when[i].eval(env)]

    def defaults(self) -> dict[str, Any]:
        return {k.name: k.default for k in self.knobs.values()}

    def complete(self, config: dict[str, Any]) -> dict[str, Any]:
        """Fill unset knobs with defaults; reject unknown knobs and values outside the lists."""
        unknown = set(config) - set(self.knobs)
        if unknown:
            raise UserError(f"family {self.name}: unknown knob(s) {', '.join(sorted(unknown))}; "
                            f"knobs are {', '.join(self.knobs)}")
        full = self.defaults() | config
        for name, value in full.items():
            values = self.knobs[name].values
            if not is_knob_value(value, values):
                # Exact types: an export's 128.0 or true would pass `==` and render as such.
                alike = next((v for v in values if v == value), None)
                kind = (f" ({type(value).__name__}, not {type(alike).__name__}: the type must match too)"
                        if alike is not None else "")
                raise UserError(f"family {self.name}: {name}={_brief(value)} is not one of {_brief(list(values))}"
                                f"{kind}")
        return full

    def complete_stored(self, config: dict[str, Any]) -> dict[str, Any]:
        """`complete` for a config read back from a study or an export, which may hold a knob
        the space has since retired (RETIRED_KNOBS); any other unknown knob is still an error."""
        return self.complete({k: v for k, v in config.items() if k not in RETIRED_KNOBS})

    def env(self, config: dict[str, Any], shape: Shape, target: Target) -> dict[str, Any]:
        env: dict[str, Any] = dict(config)
        env.update(M=shape.M, N=shape.N, K=shape.K, max_smem=target.max_smem,
                   max_threads=target.max_threads, sm_count=target.sm_count, cc=target.cc)
        for name, expr in self.derived.items():
            env[name] = expr.eval(env)
        return env

    def violations(self, config: dict[str, Any], shape: Shape, target: Target) -> list[str]:
        """Why this config cannot run this shape on this target (empty list: it can)."""
        if target.cc < self.min_arch:
            return [f"family {self.name} needs compute capability >= {self.min_arch}"]
        env = self.env(config, shape, target)
        return [c.why for c in self.constraints if not c.expr.eval(env)]

    def launch_geometry(self, config: dict[str, Any], shape: Shape, target: Target) -> Launch | None:
        """Grid, block and shared memory of a cubin family (None for a library family)."""
        if not self.launch:
            return None
        env = self.env(config, shape, target)
        return Launch(*(int(self.launch[k].eval(env)) for k in ("grid", "block", "smem")))

    def compile_config(self, config: dict[str, Any]) -> dict[str, Any]:
        return {k.name: config[k.name] for k in self.compile_knobs}

    def runtime_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The run-time knobs of a full config: the `variant` a library build is launched with."""
        return {k.name: config[k.name] for k in self.runtime_knobs}

    def runtime_variants(self) -> list[dict[str, Any]]:
        """Every combination of run-time knob values (one cubin serves them all)."""
        knobs = self.runtime_knobs
        return [dict(zip((k.name for k in knobs), combo, strict=False))
                for combo in itertools.product(*(k.values for k in knobs))]


@dataclass
class Space:
    path: Path
    families: dict[str, Family]
    shapes: dict[str, list[Shape]] = field(default_factory=dict)

    def family(self, name: str) -> Family:
        if name not in self.families:
            raise UserError(f"{self.path}: no family {name!r}; families are {', '.join(self.families)}")
        return self.families[name]

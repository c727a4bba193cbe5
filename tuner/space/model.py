"""space.yaml: kernel families, their knobs, constraints and launch geometry.

Loading validates everything up front and reports problems as `file:line: key: reason`.
Expressions (constraints, derived values, launch geometry) are a small, safe subset of
Python evaluated by walking the AST: names, numbers, strings, arithmetic, comparisons,
boolean logic, `a if c else b` and the functions ceil_div/min/max/abs. Nothing else.
"""

from __future__ import annotations

import ast
import itertools
import operator
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tuner.errors import UserError
from tuner.shapes import Shape, parse_shape
from tuner.target import Target

SHAPE_NAMES = ("M", "N", "K")
TARGET_NAMES = ("max_smem", "max_threads", "sm_count", "cc")
KNOB_KINDS = ("compile", "runtime")
# fp32: fp32 accumulators (the default problem); fp16: fp16 accumulators, a different problem
# compared only with cuBLAS in fp16 compute mode.
ACCUMULATE = ("fp32", "fp16")
# Knobs that studies and exports written before 2026-12-03 may hold: ACCUM became the
# problem's --accumulate (an export entry's `accumulate`).
RETIRED_KNOBS = ("ACCUM",)

def _bounded(op, limit: int = 64):
    """`**` and `<<` with the exponent or shift capped: an expression (perhaps written by an
    LLM) must not be able to build a number that exhausts memory or time."""
    def apply(a, b):
        if isinstance(b, (int, float)) and abs(b) > limit:
            raise ValueError(f"exponent or shift {b} is over {limit}")
        return op(a, b)
    return apply


def _mul(a, b):
    """`*`, refusing to repeat a string or list into a memory bomb ("x" * 2**60)."""
    if isinstance(a, (str, list, tuple)) or isinstance(b, (str, list, tuple)):
        raise ValueError("repeating a string or list is not allowed")
    return a * b


_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: _mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: _bounded(operator.pow),
    ast.Div: operator.truediv, ast.LShift: _bounded(operator.lshift), ast.RShift: operator.rshift,
}
_CMPOPS = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
}
_FUNCS = {"ceil_div": lambda a, b: -(-a // b), "min": min, "max": max, "abs": abs}


class Expr:
    """A parsed, checked expression; `eval(env)` computes it."""

    def __init__(self, text: str | int | float):
        self.text = str(text)
        try:
            self.tree = ast.parse(self.text.strip(), mode="eval").body
        except SyntaxError as exc:
            raise ValueError(f"syntax error in expression {self.text!r}: {exc.msg}") from None
        self.names: set[str] = set()
        self._check(self.tree)

    def _check(self, node: ast.AST) -> None:
        if isinstance(node, ast.Name):
            self.names.add(node.id)
        elif isinstance(node, ast.Constant):
            if not isinstance(node.value, (int, float, str, bool)):
                raise ValueError(f"constant {node.value!r} not allowed in {self.text!r}")
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            self._check(node.left)
            self._check(node.right)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not, ast.UAdd)):
            self._check(node.operand)
        elif isinstance(node, ast.BoolOp):
            for value in node.values:
                self._check(value)
        elif isinstance(node, ast.Compare) and all(type(op) in _CMPOPS for op in node.ops):
            self._check(node.left)
            for comp in node.comparators:
                self._check(comp)
        elif isinstance(node, ast.IfExp):
            for sub in (node.test, node.body, node.orelse):
                self._check(sub)
        elif isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                self._check(elt)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in _FUNCS and not node.keywords):
            for arg in node.args:
                self._check(arg)
        else:
            raise ValueError(f"{type(node).__name__} not allowed in expression {self.text!r}")

    def eval(self, env: dict[str, Any]) -> Any:
        try:
            return self._eval(self.tree, env)
        except (ArithmeticError, TypeError, KeyError, ValueError) as exc:
            raise UserError(f"expression {self.text!r} failed: {type(exc).__name__}: {exc}") from None

    def _eval(self, node: ast.AST, env: dict[str, Any]) -> Any:
        ev = self._eval
        if isinstance(node, ast.Name):
            return env[node.id]
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.BinOp):
            return _BINOPS[type(node.op)](ev(node.left, env), ev(node.right, env))
        if isinstance(node, ast.UnaryOp):
            value = ev(node.operand, env)
            return (not value) if isinstance(node.op, ast.Not) else (-value if isinstance(node.op, ast.USub) else value)
        if isinstance(node, ast.BoolOp):
            if isinstance(node.op, ast.And):
                return all(ev(v, env) for v in node.values)
            return any(ev(v, env) for v in node.values)
        if isinstance(node, ast.Compare):
            left = ev(node.left, env)
            for op, comp in zip(node.ops, node.comparators, strict=False):
                right = ev(comp, env)
                if not _CMPOPS[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            return ev(node.body, env) if ev(node.test, env) else ev(node.orelse, env)
        if isinstance(node, (ast.Tuple, ast.List)):
            return tuple(ev(e, env) for e in node.elts)
        if isinstance(node, ast.Call):
            return _FUNCS[node.func.id](*(ev(a, env) for a in node.args))  # type: ignore[union-attr]
        raise AssertionError(node)  # _check rejected everything else


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
            if value not in self.knobs[name].values:
                raise UserError(f"family {self.name}: {name}={value!r} is not one of {list(self.knobs[name].values)}")
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


def _line_map(node: yaml.Node, path: tuple = ()) -> dict[tuple, int]:
    """(key, key, ...) -> 1-based line, from the composed YAML tree."""
    lines = {path: node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            lines.update(_line_map(value, path + (key.value,)))
    elif isinstance(node, yaml.SequenceNode):
        for i, value in enumerate(node.value):
            lines.update(_line_map(value, path + (i,)))
    return lines


class _Loader:
    """Turns the raw YAML into a Space, naming file, line and key on every error."""

    def __init__(self, path: Path, lines: dict[tuple, int]):
        self.path, self.lines = path, lines

    def fail(self, keys: tuple, reason: str) -> UserError:
        probe = keys
        while probe and probe not in self.lines:
            probe = probe[:-1]
        line = self.lines.get(probe, 1)
        where = ".".join(str(k) for k in keys) or "(top level)"
        return UserError(f"{self.path}:{line}: {where}: {reason}")

    def mapping(self, value: Any, keys: tuple) -> dict:
        if not isinstance(value, dict):
            raise self.fail(keys, f"expected a mapping, got {type(value).__name__}")
        return value

    def expr(self, text: Any, keys: tuple, known: set[str]) -> Expr:
        if not isinstance(text, (str, int, float)) or isinstance(text, bool):
            raise self.fail(keys, f"expected an expression string, got {text!r}")
        try:
            expr = Expr(text)
        except ValueError as exc:
            raise self.fail(keys, str(exc)) from None
        unknown = expr.names - known
        if unknown:
            raise self.fail(keys, f"unknown name(s) {', '.join(sorted(unknown))} in {expr.text!r}")
        return expr

    def family(self, name: str, raw: Any) -> Family:
        keys = ("families", name)
        raw = self.mapping(raw, keys)
        allowed = {"template", "description", "min_arch", "knobs", "derived", "constraints", "launch", "artifact",
                   "seeds", "accumulate", "untrusted"}
        extra = set(raw) - allowed
        if extra:
            raise self.fail(keys + (sorted(extra)[0],), f"unknown key; allowed: {', '.join(sorted(allowed))}")
        artifact = raw.get("artifact", "cubin")
        if artifact not in ("cubin", "library"):
            raise self.fail(keys + ("artifact",), f"artifact must be 'cubin' or 'library', got {artifact!r}")
        untrusted = raw.get("untrusted", False)
        if not isinstance(untrusted, bool):
            raise self.fail(keys + ("untrusted",), f"expected true or false, got {untrusted!r}")
        accumulate = raw.get("accumulate", ["fp32"])
        if (not isinstance(accumulate, list) or not accumulate
                or any(a not in ACCUMULATE for a in accumulate) or len(set(accumulate)) != len(accumulate)):
            raise self.fail(keys + ("accumulate",),
                            f"expected a list drawn from {list(ACCUMULATE)}, got {accumulate!r}")
        # A library family's host code sets its own launch; a cubin family must say how to launch it.
        for required in ("template", "knobs") + (("launch",) if artifact == "cubin" else ()):
            if required not in raw:
                raise self.fail(keys, f"missing required key {required!r}")
        knobs: dict[str, Knob] = {}
        for kname, kraw in self.mapping(raw["knobs"], keys + ("knobs",)).items():
            kkeys = keys + ("knobs", kname)
            kraw = self.mapping(kraw, kkeys)
            values = kraw.get("values")
            if not isinstance(values, list) or not values:
                raise self.fail(kkeys + ("values",), "expected a non-empty list of allowed values")
            if len(set(map(repr, values))) != len(values):
                raise self.fail(kkeys + ("values",), "duplicate values")
            default = kraw.get("default", values[0])
            if default not in values:
                raise self.fail(kkeys + ("default",), f"default {default!r} is not one of {values}")
            kind = kraw.get("kind", "compile")
            if kind not in KNOB_KINDS:
                raise self.fail(kkeys + ("kind",), f"kind must be one of {KNOB_KINDS}, got {kind!r}")
            knobs[str(kname)] = Knob(str(kname), tuple(values), default, kind)
        known = set(knobs) | set(SHAPE_NAMES) | set(TARGET_NAMES)
        derived: dict[str, Expr] = {}
        for dname, dtext in self.mapping(raw.get("derived", {}) or {}, keys + ("derived",)).items():
            derived[str(dname)] = self.expr(dtext, keys + ("derived", dname), known)
            known.add(str(dname))
        constraints = []
        craw = raw.get("constraints", []) or []
        if not isinstance(craw, list):
            raise self.fail(keys + ("constraints",), "expected a list of {expr, why}")
        for i, item in enumerate(craw):
            ckeys = keys + ("constraints", i)
            item = self.mapping(item, ckeys)
            if "expr" not in item:
                raise self.fail(ckeys, "constraint needs an 'expr'")
            constraints.append(Constraint(self.expr(item["expr"], ckeys + ("expr",), known),
                                          str(item.get("why", item["expr"]))))
        launch_raw = self.mapping(raw["launch"], keys + ("launch",)) if "launch" in raw else {}
        launch = {}
        for lkey in ("grid", "block", "smem") if launch_raw or artifact == "cubin" else ():
            if lkey not in launch_raw:
                raise self.fail(keys + ("launch",), f"missing {lkey!r}")
            launch[lkey] = self.expr(launch_raw[lkey], keys + ("launch", lkey), known)
        seeds, seed_when = [], {}
        seeds_raw = raw.get("seeds", []) or []
        if not isinstance(seeds_raw, list):
            raise self.fail(keys + ("seeds",), "expected a list of partial configs ({KNOB: value, ...})")
        min_arch = raw.get("min_arch", 70)
        if not isinstance(min_arch, int) or isinstance(min_arch, bool) or not 10 <= min_arch <= 200:
            raise self.fail(keys + ("min_arch",), f"expected a compute capability such as 80 or 90, got {min_arch!r}")
        for i, seed in enumerate(seeds_raw):
            skeys = keys + ("seeds", i)
            seed = dict(self.mapping(seed, skeys))
            # `when: "M <= 64"`: try this seed first only for shapes where the expression holds
            if "when" in seed:
                seed_when[i] = self.expr(seed.pop("when"), skeys + ("when",), {"M", "N", "K"})
            for kname, value in seed.items():
                if kname not in knobs or knobs[kname].kind != "compile":
                    raise self.fail(skeys + (kname,), "seeds set compile-time knobs of this family only")
                if value not in knobs[kname].values:
                    raise self.fail(skeys + (kname,), f"{value!r} is not one of {list(knobs[kname].values)}")
            seeds.append(seed)
        # Relative to the space file's templates/ folder; may point elsewhere ("../x/y.cu.j2").
        template_path = Path(os.path.normpath(self.path.parent / "templates" / str(raw["template"])))
        if not template_path.is_file():
            raise self.fail(keys + ("template",), f"template file {template_path} not found")
        return Family(name=str(name), template=template_path.name, description=str(raw.get("description", "")),
                      min_arch=min_arch, knobs=knobs, derived=derived,
                      constraints=constraints, launch=launch, templates_dir=template_path.parent,
                      artifact=artifact, seeds=seeds, seed_when=seed_when, accumulate=tuple(accumulate),
                      untrusted=untrusted)

    def shapes(self, raw: Any) -> dict[str, list[Shape]]:
        """Named shape lists: MxNxK strings, {grid: {M: [...], N: [...], K: [...]}},
        {layers: [[N, K], ...], tokens: [M, ...]} or {preset: cuda_l2}."""
        out: dict[str, list[Shape]] = {}
        for lname, items in self.mapping(raw, ("shapes",)).items():
            keys = ("shapes", lname)
            if isinstance(items, list):
                parsed = []
                for i, text in enumerate(items):
                    try:
                        parsed.append(parse_shape(text))
                    except UserError as exc:
                        raise self.fail(keys + (i,), str(exc)) from None
            elif isinstance(items, dict) and "preset" in items:
                if not isinstance(items["preset"], str) or items["preset"] not in SHAPE_PRESETS:
                    raise self.fail(keys + ("preset",), f"unknown preset {items['preset']!r}; "
                                                        f"presets: {', '.join(SHAPE_PRESETS)}")
                parsed = list(SHAPE_PRESETS[items["preset"]])
            elif isinstance(items, dict) and "grid" in items:
                grid = self.mapping(items["grid"], keys + ("grid",))
                dims = [self.dims(grid.get(d), keys + ("grid", d)) for d in SHAPE_NAMES]
                parsed = [Shape(m, n, k) for m, n, k in itertools.product(*dims)]
            elif isinstance(items, dict) and "layers" in items:
                tokens = self.dims(items.get("tokens"), keys + ("tokens",))
                layers = items["layers"]
                if not isinstance(layers, list) or not layers:
                    raise self.fail(keys + ("layers",), "expected a list of [N, K] pairs")
                nk = []
                for i, pair in enumerate(layers):
                    if not (isinstance(pair, list) and len(pair) == 2):
                        raise self.fail(keys + ("layers", i), f"expected [N, K], got {pair!r}")
                    nk.append(tuple(self.dims(pair, keys + ("layers", i))))
                parsed = [Shape(m, n, k) for m in tokens for n, k in nk]
            else:
                raise self.fail(keys, "expected a list of MxNxK strings or a mapping with grid, layers or preset")
            out[str(lname)] = list(dict.fromkeys(parsed))  # drop repeats, keep order
        return out

    def dims(self, values: Any, keys: tuple) -> list[int]:
        if (not isinstance(values, list) or not values
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values)):
            raise self.fail(keys, f"expected a non-empty list of integers >= 1, got {values!r}")
        return values


_CUDA_L2 = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 12288, 16384]
SHAPE_PRESETS: dict[str, tuple[Shape, ...]] = {
    # The CUDA-L2 paper's grid: {64..16384}^3, 1000 shapes.
    "cuda_l2": tuple(Shape(m, n, k) for m, n, k in itertools.product(_CUDA_L2, _CUDA_L2, _CUDA_L2)),
}


def load_space(path: str | Path = "space.yaml") -> Space:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"cannot read space file {path}: {exc.strerror}") from None
    try:
        node = yaml.compose(text)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise UserError(f"{path}{line}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    loader = _Loader(path, _line_map(node) if node is not None else {})
    raw = loader.mapping(raw, ())
    if raw.get("version", 1) != 1:
        raise loader.fail(("version",), f"unsupported version {raw.get('version')!r} (this tool reads version 1)")
    extra = set(raw) - {"version", "families", "shapes"}
    if extra:
        raise loader.fail((sorted(extra)[0],), "unknown top-level key; allowed: version, families, shapes")
    families_raw = loader.mapping(raw.get("families"), ("families",))
    if not families_raw:
        raise loader.fail(("families",), "no families defined")
    families = {str(name): loader.family(str(name), fraw) for name, fraw in families_raw.items()}
    shapes = loader.shapes(raw.get("shapes", {}) or {})
    return Space(path=path, families=families, shapes=shapes)

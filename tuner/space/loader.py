"""space.yaml -> Space: everything validated up front, each problem reported as
`file:line: key: reason`."""

from __future__ import annotations

import itertools
import os
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from tuner.errors import UserError
from tuner.space.expr import Expr
from tuner.space.model import (
    ACCUMULATE,
    KNOB_KINDS,
    SHAPE_NAMES,
    TARGET_NAMES,
    Constraint,
    Family,
    Knob,
    Space,
)
from tuner.space.shapes import Shape, parse_shape


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
        if untrusted and artifact != "cubin":
            raise self.fail(keys + ("artifact",), "an untrusted (LLM-written) family builds device code only "
                                                  "(artifact: cubin): a library's host code runs in our processes")
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


def default_space_path() -> Path:
    """The space.yaml shipped with the package (its templates/ beside it), wherever the package
    is installed: a wheel holds copies, a source checkout links to the top-level files."""
    path = Path(str(resources.files("tuner.space") / "data" / "space.yaml"))
    if not path.is_file():
        raise UserError(f"the packaged space file is missing ({path}): reinstall hgemm-tune")
    return path


def load_space(path: str | Path | None = None) -> Space:
    """Load and validate a space file (default: the packaged one, `default_space_path`)."""
    path = Path(path) if path is not None else default_space_path()
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

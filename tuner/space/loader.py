"""space.yaml -> Space: everything validated up front, each problem reported as
`file:line: key: reason`."""

from __future__ import annotations

import itertools
import math
import os
import stat
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from tuner.errors import UserError
from tuner.space.expr import Expr
from tuner.space.model import (
    ACCUMULATE,
    KNOB_KINDS,
    RESERVED_KNOB_NAMES,
    SHAPE_NAMES,
    TARGET_NAMES,
    Constraint,
    Family,
    Knob,
    Space,
    is_knob_value,
)
from tuner.space.shapes import MAX_DIM, Shape, parse_shape

# A space file may come from anyone: everything about it is bounded before it is expanded.
MAX_SPACE_BYTES = 4 << 20       # the shipped one is about 20 KB
MAX_YAML_NODES = 100_000        # scalars, lists and mappings, counted while composing
MAX_YAML_DEPTH = 64             # nesting of lists and mappings
MAX_INT_CHARS = 100             # a YAML integer's digits (Python refuses over 4300 with a traceback)
MAX_FAMILIES = 64
MAX_KNOBS = 64                  # per family
MAX_KNOB_VALUES = 1024          # per knob
MAX_VALUE_CHARS = 256           # a string knob value (it is pasted into the CUDA source)
MAX_RUNTIME_VARIANTS = 4096     # run-time knob combinations: every build is timed at each
MAX_SHAPES = 100_000            # per shape list and in all the lists together
_MAX_MESSAGE_CHARS = 500        # of a reason quoting the file's values
_INT_TAG = "tag:yaml.org,2002:int"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _SpaceYaml(yaml.SafeLoader):
    """The safe loader, composing under bounds: no aliases (a "billion laughs" file expands
    exponentially in anything that walks it), at most MAX_YAML_NODES nodes, at most
    MAX_YAML_DEPTH deep (the composer recurses)."""

    def __init__(self, stream: str, path: Path):
        super().__init__(stream)
        self.path = path
        self.nodes = 0
        self.depth = 0

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
        event = self.peek_event()
        where = f"{self.path}:{event.start_mark.line + 1}"
        if isinstance(event, yaml.AliasEvent):
            raise UserError(f"{where}: YAML aliases (*{str(event.anchor)[:40]}) are not allowed in a space file: "
                            "write the value out")
        self.nodes += 1
        if self.nodes > MAX_YAML_NODES:
            raise UserError(f"{where}: more than {MAX_YAML_NODES} YAML values in one space file")
        if self.depth >= MAX_YAML_DEPTH:
            raise UserError(f"{where}: YAML nested more than {MAX_YAML_DEPTH} deep")
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _where(keys: tuple) -> str:
    where = ".".join(str(k) for k in keys) or "(top level)"
    return where if len(where) <= 200 else where[:200] + "..."


def _line_map(node: yaml.Node, loader: _SpaceYaml, path: Path) -> dict[tuple, int]:
    """(key, key, ...) -> 1-based line, from the composed YAML tree (walked without recursion),
    refusing duplicate keys and over-long integers on the way, before anything is constructed."""
    lines: dict[tuple, int] = {}
    stack: list[tuple[yaml.Node, tuple]] = [(node, ())]
    while stack:
        item, keys = stack.pop()
        line = item.start_mark.line + 1
        lines[keys] = line
        if isinstance(item, yaml.ScalarNode):
            if item.tag == _INT_TAG and len(item.value) > MAX_INT_CHARS:
                raise UserError(f"{path}:{line}: {_where(keys)}: an integer of {len(item.value)} characters")
        elif isinstance(item, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, value in item.value:
                key: Any = "(key)"  # a list or mapping as a key: construction refuses it
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag == _MERGE_TAG:
                    key = "<<"
                elif isinstance(key_node, yaml.ScalarNode):
                    kline = key_node.start_mark.line + 1
                    if key_node.tag == _INT_TAG and len(key_node.value) > MAX_INT_CHARS:
                        raise UserError(f"{path}:{kline}: {_where(keys)}: a key of {len(key_node.value)} digits")
                    key = loader.construct_object(key_node)  # a scalar: hashable
                    if key in first:
                        shown = repr(key) if len(repr(key)) <= 80 else repr(key)[:80] + "..."
                        raise UserError(f"{path}:{kline}: {_where(keys)}: duplicate key {shown} "
                                        f"(first on line {first[key]})")
                    first[key] = kline
                else:
                    stack.append((key_node, keys + (key,)))
                stack.append((value, keys + (key,)))
        elif isinstance(item, yaml.SequenceNode):
            stack.extend((value, keys + (i,)) for i, value in enumerate(item.value))
    return lines


def _read_text(path: Path) -> str:
    """The file's text: a regular file (a FIFO would block), at most MAX_SPACE_BYTES, UTF-8."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise UserError(f"cannot read space file {path}: not a regular file")
        with open(path, "rb") as f:
            data = f.read(MAX_SPACE_BYTES + 1)
    except OSError as exc:
        raise UserError(f"cannot read space file {path}: {exc.strerror}") from None
    if len(data) > MAX_SPACE_BYTES:
        raise UserError(f"{path}: over {MAX_SPACE_BYTES} bytes; a space file is a few kilobytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


class _Loader:
    """Turns the raw YAML into a Space, naming file, line and key on every error."""

    def __init__(self, path: Path, lines: dict[tuple, int]):
        self.path, self.lines = path, lines

    def location(self, keys: tuple) -> str:
        """`file:line: key.key`: the line of the deepest key the file has."""
        probe = keys
        while probe and probe not in self.lines:
            probe = probe[:-1]
        return f"{self.path}:{self.lines.get(probe, 1)}: {_where(keys)}"

    def fail(self, keys: tuple, reason: str) -> UserError:
        if len(reason) > _MAX_MESSAGE_CHARS:  # reasons quote the file's values
            reason = reason[:_MAX_MESSAGE_CHARS] + "..."
        return UserError(f"{self.location(keys)}: {reason}")

    def mapping(self, value: Any, keys: tuple) -> dict:
        if not isinstance(value, dict):
            raise self.fail(keys, f"expected a mapping, got {type(value).__name__}")
        return value

    def expr(self, text: Any, keys: tuple, known: set[str]) -> Expr:
        if not isinstance(text, (str, int, float)) or isinstance(text, bool):
            raise self.fail(keys, f"expected an expression string, got {text!r}")
        try:
            expr = Expr(text, where=self.location(keys))
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
        knobs_raw = self.mapping(raw["knobs"], keys + ("knobs",))
        if len(knobs_raw) > MAX_KNOBS:
            raise self.fail(keys + ("knobs",), f"{len(knobs_raw)} knobs; at most {MAX_KNOBS}")
        for kname, kraw in knobs_raw.items():
            kkeys = keys + ("knobs", kname)
            if not isinstance(kname, str) or not kname.isidentifier():
                raise self.fail(kkeys, "a knob's name must be an identifier (letters, digits, _)")
            if kname in RESERVED_KNOB_NAMES:
                raise self.fail(kkeys, f"{kname!r} is a reserved name (the names {', '.join(RESERVED_KNOB_NAMES)} "
                                       "are the template's own variables or the shape and target); rename the knob")
            kraw = self.mapping(kraw, kkeys)
            values = kraw.get("values")
            if not isinstance(values, list) or not values:
                raise self.fail(kkeys + ("values",), "expected a non-empty list of allowed values")
            if len(values) > MAX_KNOB_VALUES:
                raise self.fail(kkeys + ("values",), f"{len(values)} values; at most {MAX_KNOB_VALUES}")
            for v in values:
                if not isinstance(v, (bool, int, float, str)):
                    raise self.fail(kkeys + ("values",), f"values must be numbers, strings or true/false, "
                                                         f"not {type(v).__name__}")
                if isinstance(v, float) and not math.isfinite(v):
                    raise self.fail(kkeys + ("values",), f"value {v} is not a finite number")
                if isinstance(v, str) and len(v) > MAX_VALUE_CHARS:
                    raise self.fail(kkeys + ("values",), f"a string value of {len(v)} characters; "
                                                         f"at most {MAX_VALUE_CHARS}")
            if len(set(map(repr, values))) != len(values):
                raise self.fail(kkeys + ("values",), "duplicate values")
            default = kraw.get("default", values[0])
            if not is_knob_value(default, values):  # the type too: 64.0 is not the value 64
                raise self.fail(kkeys + ("default",), f"default {default!r} ({type(default).__name__}) is not one "
                                                      f"of {values}")
            kind = kraw.get("kind", "compile")
            if kind not in KNOB_KINDS:
                raise self.fail(kkeys + ("kind",), f"kind must be one of {KNOB_KINDS}, got {kind!r}")
            knobs[str(kname)] = Knob(str(kname), tuple(values), default, kind)
        variants = math.prod(len(k.values) for k in knobs.values() if k.kind == "runtime")
        if variants > MAX_RUNTIME_VARIANTS:
            raise self.fail(keys + ("knobs",), f"the run-time knobs make {variants} variants; at most "
                                               f"{MAX_RUNTIME_VARIANTS} (every build is timed at each)")
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
                if not is_knob_value(value, knobs[kname].values):  # the type too
                    raise self.fail(skeys + (kname,), f"{value!r} ({type(value).__name__}) is not one of "
                                                      f"{list(knobs[kname].values)}")
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
        total = 0
        for lname, items in self.mapping(raw, ("shapes",)).items():
            keys = ("shapes", lname)
            if isinstance(items, list):
                if len(items) > MAX_SHAPES:
                    raise self.fail(keys, f"{len(items)} shapes; at most {MAX_SHAPES} in a list")
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
                self.count(math.prod(len(d) for d in dims), keys)  # before expanding
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
                self.count(len(tokens) * len(nk), keys)  # before expanding
                parsed = [Shape(m, n, k) for m in tokens for n, k in nk]
            else:
                raise self.fail(keys, "expected a list of MxNxK strings or a mapping with grid, layers or preset")
            out[str(lname)] = list(dict.fromkeys(parsed))  # drop repeats, keep order
            total += len(out[str(lname)])
            if total > MAX_SHAPES:
                raise self.fail(keys, f"the shape lists hold over {MAX_SHAPES} shapes in all")
        return out

    def count(self, n: int, keys: tuple) -> None:
        if n > MAX_SHAPES:
            raise self.fail(keys, f"expands to {n} shapes; at most {MAX_SHAPES} in a list")

    def dims(self, values: Any, keys: tuple) -> list[int]:
        if (not isinstance(values, list) or not values
                or not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_DIM for v in values)):
            raise self.fail(keys, f"expected a non-empty list of integers from 1 to {MAX_DIM}, got {values!r}")
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
    text = _read_text(path)
    yml = None
    try:
        # Composed once under bounds, checked (duplicate keys, long integers), then constructed.
        yml = _SpaceYaml(text, path)  # the reader refuses control characters here
        node = yml.get_single_node()
        lines = _line_map(node, yml, path) if node is not None else {}
        raw = yml.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        problem = str(getattr(exc, "problem", None) or exc).replace("\n", " ")[:_MAX_MESSAGE_CHARS]
        raise UserError(f"{path}{line}: not valid YAML: {problem}") from None
    except (RecursionError, MemoryError, ValueError) as exc:  # the bounds above should keep these out
        raise UserError(f"{path}: not a usable space file: {type(exc).__name__}: {str(exc)[:200]}") from None
    finally:
        if yml is not None:
            yml.dispose()
    loader = _Loader(path, lines)
    raw = loader.mapping(raw, ())
    if raw.get("version", 1) != 1:
        raise loader.fail(("version",), f"unsupported version {raw.get('version')!r} (this tool reads version 1)")
    extra = set(raw) - {"version", "families", "shapes"}
    if extra:
        raise loader.fail((sorted(extra)[0],), "unknown top-level key; allowed: version, families, shapes")
    families_raw = loader.mapping(raw.get("families"), ("families",))
    if not families_raw:
        raise loader.fail(("families",), "no families defined")
    if len(families_raw) > MAX_FAMILIES:
        raise loader.fail(("families",), f"{len(families_raw)} families; at most {MAX_FAMILIES}")
    families = {str(name): loader.family(str(name), fraw) for name, fraw in families_raw.items()}
    shapes = loader.shapes(raw.get("shapes", {}) or {})
    return Space(path=path, families=families, shapes=shapes)

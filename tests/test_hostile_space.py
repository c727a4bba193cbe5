"""Hostile input to the space loader, the expression evaluator, --shape, exports, the GPU
worker's start and the proposer's fan-out. Every case must end as one line (`error: FILE:LINE:
KEY: reason` where there is a file) with exit code 2, or a recorded outcome, never a traceback,
in bounded time and memory: cases that could hang or blow up run in a child process with a
timeout and an address-space limit."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tuner.errors import UserError
from tuner.space import Expr, load_space, parse_shape

ROOT = Path(__file__).resolve().parent.parent
LIMIT_S = 10.0                # every hostile case, on a 2-core machine
MEMORY_BYTES = 2 << 30        # the child's address space: a bomb fails, it does not take the machine

# A small valid space (the shipped wmma family); `{extra_knobs}`, `{extra_derived}` and `{shapes}`
# take the hostile parts. Line numbers below count from this text.
BASE = """\
version: 1
families:
  wmma:
    template: wmma.cu.j2
    description: a small space
    min_arch: 70
    knobs:
      BM:          {{values: [16, 32, 64, 128], default: 64, kind: compile}}
      BN:          {{values: [16, 32, 64, 128], default: 64, kind: compile}}
      BK:          {{values: [16, 32, 64], default: 32, kind: compile}}
      WARP_M:      {{values: [1, 2, 4], default: 2, kind: compile}}
      WARP_N:      {{values: [1, 2, 4], default: 2, kind: compile}}
      STAGES:      {{values: [1, 2], default: 2, kind: compile}}
      PAD:         {{values: [0, 8], default: 8, kind: compile}}
      SWIZZLE_LOG: {{values: [0, 1, 2, 3], default: 1, kind: runtime}}
{extra_knobs}
    derived:
      threads: WARP_M * WARP_N * 32
      smem_bytes: "max(STAGES * (BM + BN) * (BK + PAD) * 2, WARP_M * WARP_N * 16 * 20 * 4)"
{extra_derived}
    constraints:
      - {{expr: "threads <= max_threads", why: "too many threads per block"}}
    launch:
      block: threads
      smem: smem_bytes
      grid: ceil_div(M, BM) * ceil_div(N, BN)
{shapes}
"""
EXTRA_LINE = BASE.splitlines().index("{extra_knobs}") + 1      # where the extra knobs go (line 16)
DERIVED_LINE = BASE.splitlines().index("{extra_derived}") + 1  # where the extra derived values go (line 20)


def space_text(extra_knobs: str = "", extra_derived: str = "", shapes: str = "") -> str:
    return BASE.format(extra_knobs=extra_knobs, extra_derived=extra_derived, shapes=shapes)


def write_space(tmp_path: Path, text: str | bytes) -> Path:
    templates = tmp_path / "templates"
    if not templates.exists():
        templates.symlink_to(ROOT / "templates")
    path = tmp_path / "space.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


def cli(*args: str, cwd: Path = ROOT) -> tuple[subprocess.CompletedProcess, float]:
    """The command line in a child bounded in time and memory; a hang fails the test."""
    start = time.perf_counter()
    try:
        res = subprocess.run([sys.executable, "-m", "tuner.cli", *args], cwd=cwd, capture_output=True, text=True,
                             timeout=LIMIT_S, preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung: still running after {LIMIT_S:g} s")
    return res, time.perf_counter() - start


def one_line_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit code 2, no traceback, one `error: ...` line holding every needle."""
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-3000:]
    assert len(lines[0]) < 2000, lines[0][:300]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0][:500])
    return lines[0]


def render_space(tmp_path: Path, text: str | bytes, *needles: str) -> str:
    path = write_space(tmp_path, text)
    res, took = cli("render", "--family", "wmma", "--shape", "256x256x256", "--space", str(path))
    line = one_line_error(res, *needles)
    assert took < LIMIT_S
    return line


def test_the_base_space_is_valid(tmp_path):
    """The cases below break a space that is otherwise fine."""
    path = write_space(tmp_path, space_text())
    res, _ = cli("render", "--family", "wmma", "--shape", "256x256x256", "--space", str(path))
    assert res.returncode == 0, res.stderr
    assert "constexpr int BM      = 64;" in res.stdout


# ---- A. expressions: huge numbers, deep nesting, long text ----------------------------------------

@pytest.mark.parametrize("expr", [
    "9**64**64",                                   # right-associative: the exponent is capped, fine
    "((((2**64)**64)**64)**64)**64",               # ... the base was not: 2**(64**5) bits
    "((2**64)**64)**64 * ((2**64)**64)**64",
    "(((1 << 64) << 64) << 64) ** 64",
    "(2**64)**3 * (2**64)**3",                     # `*` on big ints
    "(2**64)**3 * 2**63 * 4",
    "1 << 64 << 64 << 64 << 64 << 64",             # `<<` the same way
    "1 << 300",
    "BM ** 64",                                    # a knob value as the base
    "max(2**64, 3) ** 64",                         # through a function
    "-(2**64)**64",
    "1e308 * 10",                                  # floats: not finite
    "2.0 ** 64 ** 1.0 * 1e300",
    "(-8) ** 0.5",                                 # complex
    "1" * 400,                                     # a 400-digit constant
])
def test_huge_numbers_are_refused(tmp_path, expr):
    render_space(tmp_path, space_text(extra_derived=f'      bomb: "{expr}"'),
                 f"{tmp_path / 'space.yaml'}:{DERIVED_LINE}: families.wmma.derived.bomb:")


@pytest.mark.parametrize("expr", [
    "(" * 10_000 + "1" + ")" * 10_000,
    "-" * 10_000 + "1",
    "not " * 3_000 + "1",
    "1+" * 10_000 + "1",
    "2**" * 5_000 + "1",
    "[" * 5_000 + "1" + "]" * 5_000,
    "min(" * 2_000 + "1" + ")" * 2_000,
    "1 if " * 3_000 + "1" + " else 1" * 3_000,
    "M + " * 50_000 + "1",                         # long
    "-" * 1_900 + "1",                             # short enough, too deep
    "not " * 400 + "1",
    "(" * 250 + "1" + ")" * 250,                   # past the parser's own limit
    "+".join(["(1+1)"] * 300),                     # under the length cap, deep on the left
])
def test_deep_or_long_expressions_are_refused(tmp_path, expr):
    render_space(tmp_path, space_text(extra_derived=f'      bomb: "{expr}"'),
                 f"{tmp_path / 'space.yaml'}:{DERIVED_LINE}: families.wmma.derived.bomb:")


def test_expression_bounds_in_process():
    """The evaluator alone (the proposer and the tests use it directly)."""
    with pytest.raises(ValueError):
        Expr("(" * 10_000 + "1" + ")" * 10_000)
    with pytest.raises(ValueError):
        Expr("-" * 1_500 + "1")
    with pytest.raises(ValueError):
        Expr("1" * 5_000)                          # over Python's own digit limit, and ours
    start = time.perf_counter()
    with pytest.raises(UserError, match="bits"):
        Expr("((((2**64)**64)**64)**64)**64").eval({})
    with pytest.raises(UserError):
        Expr("(-8) ** 0.5").eval({})
    assert time.perf_counter() - start < 1.0
    # Ordinary arithmetic still works, up to the bound.
    assert Expr("(2**64)**3 * 2**63 + ((2**64)**3 * 2**63 - 1)").eval({}) == 2 ** 256 - 1
    assert Expr("ceil_div(M, 128) * 2 if M > 0 else 0").eval({"M": 300}) == 6
    assert Expr("max(1.5, 2) * 2").eval({}) == 4


# ---- A. the YAML itself: alias bombs, duplicate keys, deep nesting, size, encoding ------------------

BILLION_LAUGHS = """\
lol: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""


def test_billion_laughs_is_refused(tmp_path):
    render_space(tmp_path, BILLION_LAUGHS + space_text(), f"{tmp_path / 'space.yaml'}:2:", "alias")


def test_alias_bomb_inside_a_family_is_refused(tmp_path):
    text = space_text(extra_knobs="      BOMB: {values: [1, 2], default: 1}").replace(
        "    description: a small space", "    description: &d [x, x, x, x, x, x, x, x]")
    text = text.replace("    min_arch: 70", "    min_arch: 70\n    seeds: [*d, *d, *d, *d, *d, *d, *d, *d]")
    render_space(tmp_path, text, "alias")


def test_a_harmless_alias_is_refused_too(tmp_path):
    text = space_text().replace("BM:          {values: [16, 32, 64, 128]", "BM:          {values: &v [16, 32, 64, 128]")
    text = text.replace("BN:          {values: [16, 32, 64, 128]", "BN:          {values: *v")
    render_space(tmp_path, text, f"{tmp_path / 'space.yaml'}:9:", "alias")


def test_merge_keys_through_aliases_are_refused(tmp_path):
    text = space_text().replace("BM:          {values: [16, 32, 64, 128], default: 64, kind: compile}",
                                "BM: &k {values: [16, 32, 64, 128], default: 64, kind: compile}")
    text = text.replace("BN:          {values: [16, 32, 64, 128], default: 64, kind: compile}", "BN: {<<: *k}")
    render_space(tmp_path, text, "alias")


@pytest.mark.parametrize("extra, line, key", [
    ("      BM: {values: [16], default: 16}", EXTRA_LINE, "families.wmma.knobs: duplicate key 'BM' (first on line 8)"),
    ("      EXTRA: {values: [0], values: [8]}", EXTRA_LINE, "families.wmma.knobs.EXTRA: duplicate key 'values'"),
])
def test_duplicate_keys_are_refused(tmp_path, extra, line, key):
    render_space(tmp_path, space_text(extra_knobs=extra), f"{tmp_path / 'space.yaml'}:{line}: {key}")


def test_duplicate_top_level_and_family_keys_are_refused(tmp_path):
    text = space_text() + "families: {}\n"
    line = len(text.splitlines())
    render_space(tmp_path, text, f"{tmp_path / 'space.yaml'}:{line}: (top level): duplicate key 'families'")
    text = space_text().replace("    min_arch: 70", "    min_arch: 70\n    min_arch: 80")
    render_space(tmp_path, text, f"{tmp_path / 'space.yaml'}:7: families.wmma: duplicate key 'min_arch'")


@pytest.mark.parametrize("text", [
    "version: 1\nfamilies: " + "[" * 50_000 + "\n",
    "version: 1\nfamilies: " + "{a: " * 20_000 + "1" + "}" * 20_000 + "\n",
    "version: 1\nfamilies:\n" + "".join(" " * i + f"k{i}:\n" for i in range(1, 2000)),
])
def test_deep_yaml_is_refused(tmp_path, text):
    render_space(tmp_path, text, str(tmp_path / "space.yaml"))


def test_too_many_nodes_and_huge_files_are_refused(tmp_path):
    text = space_text(shapes="shapes:\n  many: [" + ", ".join(["64x64x64"] * 300_000) + "]")
    render_space(tmp_path, text, str(tmp_path / "space.yaml"))
    render_space(tmp_path, space_text() + "#" * (20 << 20) + "\n", str(tmp_path / "space.yaml"), "bytes")


def test_a_5000_digit_yaml_integer_is_refused(tmp_path):
    render_space(tmp_path, space_text(extra_knobs="      BIG: {values: [" + "9" * 5000 + "]}"),
                 f"{tmp_path / 'space.yaml'}:{EXTRA_LINE}:")


@pytest.mark.parametrize("data, line", [
    (b"version: 1\nfamilies:\n  wmma: \xff\xfe\n", 3),
    ("\ufeffversion: 1\n".encode("utf-16"), 1),
    (b"\x80" * 10, 1),
])
def test_non_utf8_space_files_are_refused(tmp_path, data, line):
    render_space(tmp_path, data, f"{tmp_path / 'space.yaml'}:{line}:", "UTF-8")


def test_control_characters_are_one_line(tmp_path):
    render_space(tmp_path, "version: 1\nfamilies:\n  wmma: \x00\x01\n", str(tmp_path / "space.yaml"))


# ---- A. sizes: shape lists, dimensions, knob values, families -------------------------------------

@pytest.mark.parametrize("shapes, needle", [
    ("shapes:\n  big: {grid: {M: [2097152], N: [64], K: [64]}}", "shapes.big.grid.M:"),
    ("shapes:\n  big: {grid: {M: [" + "9" * 30 + "], N: [64], K: [64]}}", "shapes.big.grid.M:"),
    ("shapes:\n  big: {layers: [[64, 4194304]], tokens: [1]}", "shapes.big.layers.0:"),
    ("shapes:\n  big: {layers: [[64, 64]], tokens: [99999999]}", "shapes.big.tokens:"),
    ("shapes:\n  big: {grid: {M: " + str(list(range(1, 1001))) + ", N: " + str(list(range(1, 1001)))
     + ", K: " + str(list(range(1, 1001))) + "}}", "shapes.big:"),  # 10**9 shapes
    ("shapes:\n  big: {layers: " + str([[n, 64] for n in range(1, 2001)]) + ", tokens: "
     + str(list(range(1, 2001))) + "}", "shapes.big:"),  # 4 million shapes
    ("shapes:\n" + "".join(f"  l{i}: {{grid: {{M: {list(range(1, 51))}, N: {list(range(1, 51))}, K: [64]}}}}\n"
                           for i in range(60)), "shapes"),  # 60 lists of 2500: 150,000 in all
    ("shapes:\n  big: ['" + "9" * 5000 + "x1x1']", "shapes.big.0:"),
])
def test_shape_lists_are_bounded(tmp_path, shapes, needle):
    line = render_space(tmp_path, space_text(shapes=shapes), str(tmp_path / "space.yaml"), needle)
    assert "9" * 200 not in line


def test_too_many_knob_values_or_knobs_or_families(tmp_path):
    render_space(tmp_path, space_text(extra_knobs="      MANY: {values: " + str(list(range(5_000))) + "}"),
                 f"{tmp_path / 'space.yaml'}:{EXTRA_LINE}: families.wmma.knobs.MANY.values:")
    knobs = "".join(f"      K{i}: {{values: [1, 2]}}\n" for i in range(300))
    render_space(tmp_path, space_text(extra_knobs=knobs.rstrip("\n")), "families.wmma.knobs:")
    runtime = "".join(f"      R{i}: {{values: [0, 1, 2, 3], kind: runtime}}\n" for i in range(20))
    render_space(tmp_path, space_text(extra_knobs=runtime.rstrip("\n")), "families.wmma.knobs:", "run-time")
    fams = "".join(f"  f{i}: {{template: wmma.cu.j2, knobs: {{BM: {{values: [64]}}}}}}\n" for i in range(2000))
    render_space(tmp_path, space_text().replace("families:\n", "families:\n" + fams), "families:")


@pytest.mark.parametrize("values", ["[[1, 2], [3]]", "[{a: 1}]", "[null]", "['" + "x" * 5000 + "']"])
def test_knob_values_are_plain_scalars(tmp_path, values):
    render_space(tmp_path, space_text(extra_knobs=f"      ODD: {{values: {values}}}"),
                 f"{tmp_path / 'space.yaml'}:{EXTRA_LINE}: families.wmma.knobs.ODD.values:")


# ---- B. reserved knob names, long --shape digits, strict export types, the worker's cwd ----------

@pytest.mark.parametrize("name", ["ACCUM", "M", "K", "family", "entry", "arch", "max_smem", "sm_count", "cc"])
def test_reserved_knob_names_are_refused(tmp_path, name):
    render_space(tmp_path, space_text(extra_knobs=f"      {name}: {{values: [1, 2], default: 1}}"),
                 f"{tmp_path / 'space.yaml'}:{EXTRA_LINE}: families.wmma.knobs.{name}:", "reserved")


@pytest.mark.parametrize("name", ["ACCUM", "M", "N", "CC"])
def test_the_proposer_refuses_reserved_knob_names(name):
    from proposer.edits import EditError
    from proposer.loop import _new_knobs

    fam = load_space(ROOT / "space.yaml").family("wmma")
    if name == "CC":  # not reserved: upper case, not the target's `cc`
        knobs, new = _new_knobs(fam, {name: {"values": [0, 1], "default": 0}})
        assert new == {name: [1]}
        return
    with pytest.raises(EditError, match=f"{name}.*reserved"):
        _new_knobs(fam, {name: {"values": [0, 1], "default": 0}})


@pytest.mark.parametrize("shape", ["9" * 5000 + "x64x64", "64x64x" + "0" * 5000 + "64", "64x" + "1" * 40 + "x64",
                                   "4096x4096x" + "\u0664" * 3, "\uff14\uff10\uff19\uff16x64x64"])
def test_over_long_or_odd_shape_digits(shape):
    with pytest.raises(UserError, match="bad shape") as err:
        parse_shape(shape)
    assert len(str(err.value)) < 300
    res, took = cli("render", "--family", "wmma", "--shape", shape)
    one_line_error(res, "bad shape")
    assert took < LIMIT_S


@pytest.mark.parametrize("knobs, name", [
    ({"BM": 128.0}, "BM"), ({"BM": True}, "BM"), ({"PAD": False}, "PAD"), ({"BM": "128"}, "BM"),
    ({"STAGES": 1.0}, "STAGES"), ({"SWIZZLE_LOG": 1.0}, "SWIZZLE_LOG"), ({"BM": [128]}, "BM"),
    ({"BM": "x" * 100_000}, "BM"),
])
def test_export_values_must_have_the_spaces_type(knobs, name):
    from tuner.results.entries import entry_build
    from tuner.space import target_for_arch

    space = load_space(ROOT / "space.yaml")
    fam = space.family("wmma")
    with pytest.raises(UserError, match=f"family wmma: {name}=") as err:
        fam.complete_stored(knobs)
    assert "type" in str(err.value) or "not one of" in str(err.value)
    assert len(str(err.value)) < 500
    entry = {"family": "wmma", "shape": "256x256x256", "knobs": knobs, "accumulate": "fp32"}
    with pytest.raises(UserError, match=name):
        entry_build(space, entry, target_for_arch("sm_90a"))
    # The right types still pass (and a retired ACCUM is still dropped).
    assert fam.complete_stored({"BM": 128, "ACCUM": "fp32"})["BM"] == 128


def test_seeds_and_defaults_must_have_the_knobs_type(tmp_path):
    render_space(tmp_path, space_text().replace("default: 64, kind: compile}", "default: 64.0, kind: compile}", 1),
                 f"{tmp_path / 'space.yaml'}:8: families.wmma.knobs.BM.default:")
    text = space_text().replace("    min_arch: 70", "    min_arch: 70\n    seeds: [{BM: true}]")
    render_space(tmp_path, text, "families.wmma.seeds.0.BM:")


def test_the_gpu_worker_cannot_be_shadowed_from_the_working_directory(tmp_path, monkeypatch):
    """A `tuner/` planted in the caller's working directory is not what the worker imports."""
    from tuner.measure import gpu

    planted = tmp_path / "tuner" / "measure"
    planted.mkdir(parents=True)
    marker = tmp_path / "PLANTED_RAN"
    (tmp_path / "tuner" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    (planted / "__init__.py").write_text("")
    (planted / "worker.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/tmp/site-that-does-not-exist", str(tmp_path / "elsewhere")]))
    seen: dict = {}
    real_popen = subprocess.Popen

    def spy(args, **kwargs):
        seen.update(kwargs, args=args)
        return real_popen(args, **kwargs)

    monkeypatch.setattr(gpu.subprocess, "Popen", spy)
    start = time.perf_counter()
    try:
        backend = gpu.GpuBackend()  # no GPU here: the real worker says so in one line
    except UserError:
        backend = None
    if backend is not None:  # a machine with a GPU: the real worker started, which is the point
        backend.close()
    assert time.perf_counter() - start < 120
    assert not marker.exists(), "the planted tuner/ package ran in the worker"
    cwd = Path(seen["cwd"])
    assert cwd != tmp_path and not (cwd / "tuner").exists()
    path = seen["env"]["PYTHONPATH"].split(os.pathsep)
    assert path[0] == str(ROOT) or Path(path[0]) == Path(gpu.__file__).resolve().parents[2]
    assert "/tmp/site-that-does-not-exist" in path  # the caller's PYTHONPATH still follows


# ---- C. the proposer's fan-out ------------------------------------------------------------------------

class _Client:
    model = "stub"

    def __init__(self, reply: str):
        self.reply = reply

    def chat(self, system: str, prompt: str) -> str:
        return self.reply


def _propose(tmp_path: Path, reply: str):
    from proposer.loop import run_rounds

    start = time.perf_counter()
    (out,) = run_rounds(load_space(ROOT / "space.yaml"), "wmma", [parse_shape("256x256x256")], _Client(reply),
                        rounds=1, candidates=1, out_dir=tmp_path / "p", versions_dir=tmp_path / "v")
    assert time.perf_counter() - start < LIMIT_S
    assert "\n" not in out.reason and len(out.reason) < 1000, out.reason
    return out


WMMA = (ROOT / "templates" / "wmma.cu.j2").read_text()
PAD_LINE = next(line for line in WMMA.splitlines() if line.startswith("constexpr int PAD"))


def _after_pad(lines: str, knobs: str = "") -> str:
    reply = f"<<<<<<< SEARCH\n{PAD_LINE}\n=======\n{PAD_LINE}\n{lines}\n>>>>>>> REPLACE\n"
    return reply + (f"```yaml\nknobs:\n{knobs}```\n" if knobs else "")


@pytest.mark.parametrize("knobs", [
    "".join(f"  NEW{i}: {{values: {list(range(8))}, default: 0}}\n" for i in range(4)),   # 28 new configs
    "  WIDE: {values: " + str(list(range(32))) + ", default: 0}\n",                         # 31: one knob at its cap
    "  BM: {values: " + str([16, 32, 64, 128, *range(200, 228)]) + "}\n",                  # redeclared, 28 added
])
def test_a_proposal_compiles_a_bounded_number_of_configs(tmp_path, knobs):
    out = _propose(tmp_path, _after_pad("// more", knobs))
    assert out.status == "too_large" and "configs" in out.reason and "16" in out.reason, out
    assert not list((tmp_path / "p").glob("*/kernel.cu"))  # nothing rendered, nothing compiled


@pytest.mark.parametrize("lines", [
    "// " + "x" * (200 << 10),                                                   # literally large
    "{% for i in range(20000) %}// padding line {{ i }} xxxxxxxxxxxxxxxxxxxxxxx\n{% endfor %}",  # rendered large
])
def test_a_proposal_renders_a_bounded_source(tmp_path, lines):
    out = _propose(tmp_path, _after_pad(lines))
    assert out.status in ("too_large", "bad_reply"), out
    assert "characters" in out.reason, out
    assert not list((tmp_path / "p").glob("*/kernel.cu"))

import shutil
from pathlib import Path

import pytest

from tuner.errors import UserError
from tuner.space import Expr, load_space, parse_shape

ROOT = Path(__file__).resolve().parent.parent


def test_shipped_space_loads(space):
    assert {"cute_sm80", "wmma"} <= set(space.families)
    fam = space.family("cute_sm80")
    assert [k.name for k in fam.runtime_knobs] == ["SWIZZLE_LOG"]
    assert "SWIZZLE_LOG" not in fam.compile_config(fam.defaults())
    assert fam.runtime_config(fam.defaults() | {"SWIZZLE_LOG": 2}) == {"SWIZZLE_LOG": 2}
    assert len(fam.runtime_variants()) == len(fam.knobs["SWIZZLE_LOG"].values)
    assert space.shapes["default"][0] == parse_shape("4096x4096x8192")


def test_defaults_are_valid_for_a_big_shape(space, h200):
    shape = parse_shape("4096x4096x8192")
    for fam in space.families.values():
        assert fam.violations(fam.defaults(), shape, h200) == [], fam.name


def test_constraints_reject_before_nvcc(space, h200):
    fam = space.family("cute_sm80")
    shape = parse_shape("4096x4096x8192")
    too_much_smem = fam.complete({"BM": 256, "BN": 256, "BK": 64, "STAGES": 5, "WARP_M": 4, "WARP_N": 4})
    assert any("shared memory" in w for w in fam.violations(too_much_smem, shape, h200))
    bad_mma = fam.complete({"BM": 96, "WARP_M": 4})
    assert any("multiple of 16 x WARP_M" in w for w in fam.violations(bad_mma, shape, h200))
    unaligned = parse_shape("4096x4095x8192")
    assert any("divisible by 8" in w for w in fam.violations(fam.defaults(), unaligned, h200))
    # wmma takes any shape: it is the fallback for unaligned problems.
    wmma = space.family("wmma")
    assert wmma.violations(wmma.defaults(), unaligned, h200) == []


def test_launch_geometry(space, h200):
    fam = space.family("cute_sm80")
    launch = fam.launch_geometry(fam.complete({"BM": 128, "BN": 256, "WARP_N": 4}), parse_shape("1000x1000x64"), h200)
    assert launch.grid == 8 * 4 and launch.block == 256
    assert launch.smem == max(3 * (128 + 256) * 32 * 2, 128 * (256 + 8) * 2)


def test_complete_rejects_unknown_and_bad_values(space):
    fam = space.family("cute_sm80")
    with pytest.raises(UserError, match="unknown knob"):
        fam.complete({"BQ": 1})
    with pytest.raises(UserError, match="BM=100 is not one of"):
        fam.complete({"BM": 100})


def test_expressions_are_sandboxed():
    assert Expr("ceil_div(M, 128) * 2 if M > 0 else 0").eval({"M": 300}) == 6
    for evil in ["__import__('os')", "M.__class__", "open('x')", "[x for x in M]", "lambda: 1"]:
        with pytest.raises(ValueError):
            Expr(evil)


def _write_space(tmp_path, text):
    (tmp_path / "templates").mkdir(exist_ok=True)
    shutil.copy(ROOT / "templates" / "wmma.cu.j2", tmp_path / "templates" / "wmma.cu.j2")
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path


GOOD = """version: 1
families:
  wmma:
    template: wmma.cu.j2
    knobs:
      BM: {values: [64], kind: compile}
    launch: {block: 128, smem: 0, grid: "ceil_div(M, BM)"}
"""


@pytest.mark.parametrize("broken, needle", [
    (GOOD.replace("ceil_div(M, BM)", "ceil_div(M, BX)"), "space.yaml:7: families.wmma.launch.grid: unknown name(s) BX"),
    (GOOD.replace("kind: compile", "kind: sometimes"), "kind must be one of"),
    (GOOD.replace("values: [64]", "values: []"), "non-empty list"),
    (GOOD.replace("wmma.cu.j2", "nope.cu.j2"), "not found"),
    (GOOD.replace('launch: {block: 128, smem: 0, grid: "ceil_div(M, BM)"}', "launch: {block: 128}"), "missing 'grid'"),
    (GOOD + "  extra: [\n", "not valid YAML"),
    (GOOD.replace("version: 1", "version: 7"), "unsupported version"),
    (GOOD.replace('grid: "ceil_div(M, BM)"', "grid: \"__import__('os')\""), "not allowed"),
    (GOOD + "shapes:\n  mine: [4096x4096]\n", "shapes.mine.0"),
    (GOOD.replace("    template: wmma.cu.j2", "    template: wmma.cu.j2\n    min_arch: abc"),
     "families.wmma.min_arch: expected a compute capability"),
    (GOOD.replace("    template: wmma.cu.j2", "    template: wmma.cu.j2\n    seeds: 5"),
     "families.wmma.seeds: expected a list"),
    (GOOD + "shapes:\n  mine: {preset: [1]}\n", "unknown preset"),
    (GOOD.replace("    template: wmma.cu.j2", '    template: wmma.cu.j2\n    seeds: [{BM: 64, when: "BM < 9"}]'),
     "families.wmma.seeds.0.when: unknown name(s) BM"),
])
def test_broken_space_files_name_file_line_and_key(tmp_path, broken, needle):
    path = _write_space(tmp_path, broken)
    with pytest.raises(UserError) as err:
        load_space(path)
    assert str(path) in str(err.value)
    assert needle in str(err.value)


def test_seed_when_keeps_a_seed_to_the_shapes_it_names(tmp_path):
    from tuner.space import parse_shape

    text = GOOD.replace("    template: wmma.cu.j2",
                        '    template: wmma.cu.j2\n    seeds: [{BM: 64, when: "M <= 64 and N > K"}]')
    fam = load_space(_write_space(tmp_path, text)).family("wmma")
    assert fam.seeds == [{"BM": 64}]  # `when` is not a knob
    assert fam.seeds_for(parse_shape("64x8192x4096")) == [{"BM": 64}]
    assert fam.seeds_for(parse_shape("4096x4096x8192")) == []
    assert fam.seeds_for(parse_shape("64x1024x4096")) == []


def test_shipped_seeds_for_one_shape_stay_with_it():
    """space.yaml's M = 64 seeds are tried first at 64x8192x4096 and its M <= 128 ones
    there and at 128x16384x16384, none of them at 4096^3."""
    from tuner.search.sampler import seed_configs
    from tuner.space import parse_shape

    fam = load_space("space.yaml").family("cute_sm90")
    m64 = seed_configs(fam, parse_shape("64x8192x4096"))
    m128 = seed_configs(fam, parse_shape("128x16384x16384"))
    square = seed_configs(fam, parse_shape("4096x4096x8192"))

    def stream_b(seeds):
        return [(c["TILE_M"], c["TILE_N"]) for c in seeds if c["L2_HINT"] == "stream_b"]

    assert sorted(stream_b(m64)) == [(64, 64)] * 3 + [(64, 256)] * 3
    assert stream_b(m128) == [(64, 256)] * 3 and stream_b(square) == []
    # the 2x1 build with 256-byte L2 promotion is one of them
    assert [c["TMA_L2_PROMOTION"] for c in m128 if c["L2_HINT"] == "stream_b"].count(256) == 1
    assert len(square) < len(m128) < len(m64) < len(fam.seeds) + 1


def test_good_minimal_space(tmp_path):
    space = load_space(_write_space(tmp_path, GOOD))
    assert space.family("wmma").defaults() == {"BM": 64}


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SHIPPED = (ROOT / "space.yaml").read_text().splitlines()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drop=st.sets(st.integers(0, len(SHIPPED) - 1), max_size=4),
       junk=st.lists(st.tuples(st.integers(0, len(SHIPPED) - 1), st.text(max_size=12)), max_size=3))
def test_mangled_space_files_load_or_fail_cleanly(tmp_path, drop, junk):
    """Any damage to space.yaml gives a loaded space or a UserError naming the file: never a crash."""
    lines = [ln for i, ln in enumerate(SHIPPED) if i not in drop]
    for at, text in junk:
        lines.insert(min(at, len(lines)), text)
    path = _write_space(tmp_path, "\n".join(lines))
    shutil.copy(ROOT / "templates" / "cute_sm80.cu.j2", tmp_path / "templates" / "cute_sm80.cu.j2")
    try:
        space = load_space(path)
    except UserError as exc:
        assert str(path) in str(exc)
        return
    from tuner.space import target_for_arch

    for fam in space.families.values():
        try:
            fam.violations(fam.defaults(), parse_shape("4096x4096x8192"), target_for_arch("sm_90a"))
        except UserError as exc:
            assert "expression" in str(exc)


def test_accumulate_is_a_problem_choice_not_a_knob(space):
    from tuner.build import render

    sm90, wmma = space.family("cute_sm90"), space.family("wmma")
    assert sm90.accumulate == ("fp32", "fp16") and wmma.accumulate == ("fp32",)
    assert "ACCUM" not in sm90.knobs
    assert "using Accum = float;" in render(sm90, sm90.complete({}), "sm_90a")
    assert "using Accum = cutlass::half_t;" in render(sm90, sm90.complete({}), "sm_90a", accumulate="fp16")
    with pytest.raises(UserError, match="wmma builds fp32 accumulation only, not fp16"):
        render(wmma, wmma.complete({}), "sm_90a", accumulate="fp16")


def test_bad_accumulate_list_names_the_key(tmp_path):
    text = (ROOT / "space.yaml").read_text().replace("accumulate: [fp32, fp16]", "accumulate: [fp32, fp64]")
    (tmp_path / "templates").symlink_to(ROOT / "templates")
    (tmp_path / "space.yaml").write_text(text)
    with pytest.raises(UserError, match=r"families\.cute_sm90\.accumulate.*fp64"):
        load_space(tmp_path / "space.yaml")


@pytest.mark.parametrize("bomb", ["1 << 10**12", "BM ** 9999999999999", "'x' * 2**60", "(1,) * 2**40"])
def test_expressions_cannot_exhaust_memory_or_time(bomb):
    with pytest.raises(UserError, match="failed"):
        Expr(bomb).eval({"BM": 64})


def test_stored_configs_drop_the_retired_accum_knob_only(space):
    """Studies and exports from before ACCUM became --accumulate still load; any other
    unknown knob is still refused."""
    sm90 = space.family("cute_sm90")
    assert sm90.complete_stored({"ACCUM": "fp32", "TILE_N": 128}) == sm90.complete({"TILE_N": 128})
    with pytest.raises(UserError, match="unknown knob"):
        sm90.complete_stored({"ACCUM": "fp32", "BOGUS": 1})


def test_basic_split_k_is_deterministic_and_fits_one_wave(space, h200):
    """SCHEDULE basic runs split-K in our kernel body (docs/decisions/0039): deterministic reduction
    only, 1x1 clusters only, and tiles x splits within the SM count (a tile's splits wait for each
    other, so all must be resident at once). Stream-K still needs the stream-K scheduler, and split-K
    on the other schedules too."""
    import dataclasses

    fam = space.family("cute_sm90")
    shape = parse_shape("256x256x8192")  # 16 tiles of 64x64
    basic = fam.complete({"TILE_M": 64, "TILE_N": 64, "SCHEDULE": "basic", "STAGES": 6, "CLUSTER_M": 1})
    for decomp in ("data_parallel", "split_2", "split_4", "split_8"):  # up to 128 CTAs on 132 SMs
        assert fam.violations(basic | {"DECOMP": decomp}, shape, h200) == [], decomp
    why = fam.violations(basic | {"DECOMP": "split_16"}, shape, h200)  # 256 CTAs
    assert why == ["basic split-K waits for every split of a tile: tiles x splits must fit one wave (sm_count CTAs)"]
    # the SM count is the target's: on 66 SMs split_4 (64 CTAs) fits, split_8 (128) does not
    half = dataclasses.replace(h200, sm_count=66)
    assert fam.violations(basic | {"DECOMP": "split_4"}, shape, half) == []
    assert any("one wave" in w for w in fam.violations(basic | {"DECOMP": "split_8"}, shape, half))
    nondet = fam.violations(basic | {"DECOMP": "split_4", "REDUCTION": "nondeterministic"}, shape, h200)
    assert nondet == ["basic's split-K reduction is deterministic only (a fixed-order sum, in parallel)"]
    assert any("stream-K scheduler" in w for w in fam.violations(basic | {"DECOMP": "stream_k"}, shape, h200))
    cluster = basic | {"CLUSTER_N": 2}
    assert fam.violations(cluster, shape, h200) == []  # data-parallel in a cluster, as before
    assert fam.violations(cluster | {"DECOMP": "split_4"}, shape, h200) == ["basic split-K runs in 1x1 clusters only"]
    pingpong = fam.complete({"TILE_M": 64, "TILE_N": 64, "SCHEDULE": "pingpong", "STAGES": 6, "CLUSTER_M": 1})
    assert any("stream-K scheduler" in w for w in fam.violations(pingpong | {"DECOMP": "split_4"}, shape, h200))
    streamk = fam.complete({"TILE_N": 64, "SCHEDULER": "streamk", "STAGES": 8, "CLUSTER_M": 1})
    assert fam.violations(streamk | {"DECOMP": "split_4", "REDUCTION": "nondeterministic"}, shape, h200) == []


def test_expression_memo_keeps_values_apart_by_value_and_type():
    """Expr.eval memoizes on the values it reads: a new value, or the same value of another type
    (1.0 is not 1), is computed afresh, and a missing name is still an error."""
    from tuner.errors import UserError
    from tuner.space.expr import Expr

    e = Expr("A + B")
    assert e.eval({"A": 1, "B": 2}) == 3 and e.eval({"A": 1, "B": 3, "unused": 9}) == 4
    one = Expr("A")
    assert type(one.eval({"A": 1.0})) is float and type(one.eval({"A": 1})) is int
    with pytest.raises(UserError, match="KeyError"):
        e.eval({"A": 1})


def test_expression_memo_leaves_containers_out():
    """A tuple equals one of other element types ((1, 2.0) == (1, 2)): never a memo key."""
    from tuner.space.expr import Expr

    e = Expr("max(T)")
    assert type(e.eval({"T": (1, 2.0)})) is float and type(e.eval({"T": (1, 2)})) is int

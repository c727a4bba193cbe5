"""Every family renders for sampled knob values, and sampled configs compile with the real nvcc."""

import random
import re
from pathlib import Path

import pytest

from tuner.build import compile_source, render, source_hash
from tuner.errors import UserError
from tuner.space import parse_shape

BIG = parse_shape("4096x4096x8192")


def valid_configs(fam, target, shape, n, seed=0):
    rng = random.Random(seed)
    out, tries = [], 0
    while len(out) < n and tries < 20000:
        tries += 1
        cfg = {k.name: rng.choice(k.values) for k in fam.knobs.values()}
        if not fam.violations(cfg, shape, target) and cfg not in out:
            out.append(cfg)
    return out


@pytest.mark.parametrize("family", ["cute_sm80", "wmma"])
def test_render_sampled_configs(space, h200, family):
    fam = space.family(family)
    configs = valid_configs(fam, h200, BIG, 25)
    assert len(configs) == 25
    hashes = set()
    for cfg in configs:
        src = render(fam, cfg, "sm_90a")
        assert 'extern "C" __global__' in src and "hgemm(" in src
        # The compile-time knobs are baked in; run-time knobs are not template variables.
        for k in fam.compile_knobs:
            if isinstance(cfg[k.name], int) and k.name in ("BM", "BN", "BK"):
                assert re.search(rf"constexpr int {k.name}\s*=\s*{cfg[k.name]};", src), k.name
        hashes.add(source_hash(src))
    assert len(hashes) == len({tuple(fam.compile_config(c).items()) for c in configs})


def test_runtime_knobs_do_not_change_the_source(space):
    fam = space.family("cute_sm80")
    a = render(fam, fam.complete({"SWIZZLE_LOG": 0}), "sm_90a")
    b = render(fam, fam.complete({"SWIZZLE_LOG": 3}), "sm_90a")
    assert a == b


def test_cute_sm90_l2_hint_swaps_in_our_producer_loop_only_when_asked(space):
    """L2_HINT=normal renders CUTLASS's own mainloop untouched; stream_a / stream_b render our
    producer loop with the hints on the right operands; every build waits on its predecessor
    (PDL-safe) and the stream-K build, which CUTLASS cannot signal early, only waits."""
    fam = space.family("cute_sm90")
    plain = render(fam, fam.complete({}), "sm_90a")
    assert "using CollectiveMainloop = BuiltMainloop;" in plain and "TunedLoadMainloop" not in plain
    assert "#define CUTLASS_ENABLE_GDC_FOR_SM90 1" in plain
    for hint, a, b in (("stream_a", "EVICT_FIRST", "EVICT_LAST"), ("stream_b", "EVICT_LAST", "EVICT_FIRST")):
        src = render(fam, fam.complete({"L2_HINT": hint}), "sm_90a")
        assert "using CollectiveMainloop = TunedLoadMainloop<BuiltMainloop>;" in src
        assert f"kHintA = TMA::CacheHintSm90::{a};" in src and f"kHintB = TMA::CacheHintSm90::{b};" in src
    streamk = render(fam, fam.complete({"SCHEDULER": "streamk"}), "sm_90a")
    assert "#define CUTLASS_GDC_ENABLED" in streamk and "CUTLASS_ENABLE_GDC_FOR_SM90 1" not in streamk


def test_cute_sm90_tma_l2_promotion_reroutes_cutes_descriptor_call_only_when_asked(space):
    """TMA_L2_PROMOTION=128 is CuTe's own encoding (no wrapper); every other value routes CuTe's
    cuTensorMapEncodeTiled through our wrapper, before CuTe's headers, with that promotion."""
    fam = space.family("cute_sm90")
    plain = render(fam, fam.complete({}), "sm_90a")
    assert "hgemm_tma_promotion" not in plain
    for value, enum in ((256, "L2_256B"), (64, "L2_64B"), (0, "NONE")):
        src = render(fam, fam.complete({"TMA_L2_PROMOTION": value}), "sm_90a")
        assert f"CU_TENSOR_MAP_L2_PROMOTION_{enum}, oob_fill" in src
        redirect = src.index("#define CUTLASS_CUDA_DRIVER_WRAPPER_CALL(func) hgemm_tma_promotion::call_##func")
        assert redirect < src.index("#include <cute/tensor.hpp>")


def test_cute_sm90_our_kernel_body_renders_only_when_asked_and_where_it_applies(space, h200):
    """PROLOGUE=cutlass launches CUTLASS's GemmUniversal as it is; early_load launches our body,
    which reallocates registers (setmaxnreg) as CUTLASS's does. Our body is the cooperative
    persistent kernel with the TMA epilogue: space.yaml refuses it elsewhere."""
    fam = space.family("cute_sm90")
    plain = render(fam, fam.complete({}), "sm_90a")
    assert "EarlyLoadKernel" not in plain and "using LaunchedKernel = GemmKernel;" in plain
    own = fam.complete({"PROLOGUE": "early_load"})
    src = render(fam, own, "sm_90a")
    assert "using LaunchedKernel = EarlyLoadKernel<GemmKernel>;" in src
    assert "warpgroup_reg_dealloc" in src and "warpgroup_reg_alloc" in src
    shape = parse_shape("4096x4096x8192")
    for other in ({"SCHEDULE": "pingpong"}, {"SCHEDULER": "streamk"}, {"EPILOGUE": "nosmem"}):
        violations = fam.violations(fam.complete({"PROLOGUE": "early_load"} | other), shape, h200)
        assert any("our kernel body" in v for v in violations), (other, violations)


def test_cute_sm90_basic_split_k_kernel_renders_beside_cutlass_kernel_in_1x1_clusters_only(space):
    """SCHEDULE=basic in a 1x1 cluster adds our split-K kernel (SplitKBasicKernel, launched for
    splits > 1) beside CUTLASS's, which still serves splits == 1 (LaunchedKernel unchanged); a basic
    build in a cluster and every other schedule render no split-K code, so their source is as before."""
    fam = space.family("cute_sm90")
    basic = fam.complete({"TILE_M": 64, "TILE_N": 64, "SCHEDULE": "basic", "STAGES": 6, "CLUSTER_M": 1})
    src = render(fam, basic, "sm_90a")
    assert "struct SplitKBasicKernel" in src and "device_kernel<SplitKKernel>" in src
    assert "using LaunchedKernel = GemmKernel;" in src and "cudaMemsetAsync" in src
    for other in (basic | {"CLUSTER_N": 2}, fam.complete({}), fam.complete({"SCHEDULE": "pingpong", "TILE_M": 64})):
        assert "SplitK" not in render(fam, other, "sm_90a"), other


def test_cute_sm90_wider_epilogue_subtiles_render_only_when_asked(space, h200):
    """EPI_TILE_N=32 leaves CUTLASS's EpilogueTileAuto (and so every stored study's code) as it was;
    64/128 pass an explicit subtile of the schedule's epilogue rows, count its two shared-memory
    buffers against the budget, and must divide TILE_N on the TMA epilogue."""
    fam = space.family("cute_sm90")
    plain = render(fam, fam.complete({}), "sm_90a")
    assert "collective::EpilogueTileAuto, Accum" in plain and "EPI_TILE_N" not in plain
    coop = render(fam, fam.complete({"EPI_TILE_N": 64}), "sm_90a")
    assert "using EpilogueTile = Shape<_128, Int<64>>;" in coop and "    EpilogueTile, Accum" in coop
    ping = render(fam, fam.complete({"SCHEDULE": "pingpong", "TILE_N": 128, "EPI_TILE_N": 128}), "sm_90a")
    assert "using EpilogueTile = Shape<_64, Int<128>>;" in ping
    shape = parse_shape("8192x512x2048")
    base = {"TILE_M": 128, "TILE_N": 256, "STAGES": 4, "CLUSTER_M": 1, "CLUSTER_N": 2}
    assert fam.violations(fam.complete(base | {"EPI_TILE_N": 64}), shape, h200) == []
    # 4 stages of 128x256x64 (192 KB) leave no room for two 128x128 buffers (64 KB); 3 stages do
    assert any("shared memory" in v for v in fam.violations(fam.complete(base | {"EPI_TILE_N": 128}), shape, h200))
    assert fam.violations(fam.complete(base | {"EPI_TILE_N": 128, "STAGES": 3}), shape, h200) == []
    for bad in ({"TILE_N": 96, "EPI_TILE_N": 64}, {"EPILOGUE": "nosmem", "EPI_TILE_N": 64}):
        assert any("epilogue subtile" in v for v in fam.violations(fam.complete(base | bad), shape, h200)), bad


def test_cute_sm90_four_cta_clusters_ask_the_driver_how_many_fit(space):
    """CUTLASS's persistent grid guesses 18 SMs per GPC: exact for clusters of 1 and 2 CTAs, 116
    CTAs (29 clusters) for clusters of 4 on 132 SMs. 4-CTA builds pass the driver's count
    (cudaOccupancyMaxActiveClusters) instead; smaller clusters render without the query."""
    fam = space.family("cute_sm90")
    for cm, cn in ((2, 2), (4, 1), (1, 4)):
        src = render(fam, fam.complete({"CLUSTER_M": cm, "CLUSTER_N": cn}), "sm_90a")
        assert "hw.max_active_clusters = max_active_clusters();" in src
        assert f"config.gridDim = dim3({cm}, {cn}, 1);" in src
    for cm, cn in ((1, 1), (2, 1), (1, 2)):
        src = render(fam, fam.complete({"CLUSTER_M": cm, "CLUSTER_N": cn}), "sm_90a")
        assert "max_active_clusters" not in src and "cudaOccupancyMaxActiveClusters" not in src


def test_cute_sm90_timeline_stamps_render_only_for_the_probe(space):
    """TIMELINE (a diagnostic build, never a tuned kernel) wraps the kernel in per-CTA clock stamps and
    our producer loop; no tuned kernel ever carries them: the plain render launches CUTLASS's
    kernel as it is."""
    fam = space.family("cute_sm90")
    full = fam.complete({})
    plain = render(fam, full, "sm_90a")
    assert "using LaunchedKernel = GemmKernel;" in plain and "using CollectiveMainloop = BuiltMainloop;" in plain
    assert "timeline" not in plain and "globaltimer" not in plain
    stamped = render(fam, full, "sm_90a", probe={"TIMELINE": True})
    assert "using LaunchedKernel = TimedKernel;" in stamped
    assert "using CollectiveMainloop = TunedLoadMainloop<BuiltMainloop>;" in stamped  # stamps the loads
    assert 'extern "C" int hgemm_timeline(' in stamped and "%%globaltimer" in stamped


def test_broken_template_is_a_user_error(space, tmp_path):
    (tmp_path / "wmma.cu.j2").write_text("{{ NOT_A_KNOB }}")
    with pytest.raises(UserError, match="does not render"):
        render(space.family("wmma"), space.family("wmma").defaults(), "sm_90a", templates_dir=tmp_path)


def test_python_error_inside_a_template_is_a_render_error(space, tmp_path):
    """A Python exception raised while rendering (here ZeroDivisionError at PAD=0) is a RenderError
    naming the knob values, not a crash; other values still render."""
    from tuner.build import RenderError

    (tmp_path / "wmma.cu.j2").write_text("{{ 64 // PAD }}\n")
    fam = space.family("wmma")
    with pytest.raises(RenderError, match="PAD=0.*ZeroDivisionError"):
        render(fam, fam.defaults() | {"PAD": 0}, "sm_90a", templates_dir=tmp_path)
    assert render(fam, fam.defaults() | {"PAD": 8}, "sm_90a", templates_dir=tmp_path) == "8\n"


def test_untrusted_template_renders_in_the_bounded_child(space, tmp_path):
    """An LLM-written family (untrusted) whose template builds a 10 GB string fails to render
    with a clear reason instead of exhausting the tuner (Jinja folds the constant when it
    compiles the template, so in-process even other knob values would blow up); a benign one
    gives the same source as an in-process render."""
    import dataclasses

    from tuner.build import RenderError

    bomb, benign = tmp_path / "bomb", tmp_path / "benign"
    bomb.mkdir()
    benign.mkdir()
    (bomb / "wmma.cu.j2").write_text("{% if PAD == 0 %}{{ 'x' * 10**10 }}{% endif %}pad {{ PAD }}\n")
    (benign / "wmma.cu.j2").write_text("{{ family }} {{ entry }} {{ arch }} pad {{ PAD }} {{ ACCUM }}\n")
    fam = dataclasses.replace(space.family("wmma"), untrusted=True)
    with pytest.raises(RenderError, match="PAD=0.*memory"):
        render(dataclasses.replace(fam, templates_dir=bomb), fam.defaults() | {"PAD": 0}, "sm_90a")
    child, trusted = (dataclasses.replace(fam, templates_dir=benign, untrusted=u) for u in (True, False))
    assert render(child, fam.defaults(), "sm_90a") == render(trusted, fam.defaults(), "sm_90a") == \
        f"wmma hgemm sm_90a pad {fam.defaults()['PAD']} fp32\n"


@pytest.mark.nvcc
@pytest.mark.parametrize("family, n", [("wmma", 3), ("cute_sm80", 2)])
def test_sampled_configs_compile(space, h200, tmp_path, family, n):
    fam = space.family(family)
    configs = [fam.defaults()] + valid_configs(fam, h200, BIG, n - 1, seed=7)
    for cfg in configs:
        res = compile_source(render(fam, cfg, "sm_90a"), "sm_90a", cache_dir=tmp_path)
        assert res.ok, res.error
        assert res.registers and res.registers <= 255
        assert res.spill_bytes == 0, f"{cfg} spills {res.spill_bytes} bytes"
        again = compile_source(render(fam, cfg, "sm_90a"), "sm_90a", cache_dir=tmp_path)
        assert again.cached and again.cubin == res.cubin and again.seconds == 0.0


@pytest.mark.nvcc
def test_compile_error_is_kept(tmp_path):
    res = compile_source('extern "C" __global__ void hgemm() { this is not cuda; }', "sm_90a", cache_dir=tmp_path)
    assert not res.ok and "error" in res.error and not res.cached


@pytest.mark.nvcc
def test_broken_family_compile_error_is_a_failed_trial(tmp_path):
    """A kernel that does not compile fails its trial with nvcc's message; nothing stops."""
    from pathlib import Path

    from tuner.build import CompilePool
    from tuner.search.compile_queue import finish, prepare
    from tuner.space import load_space, target_for_arch

    space = load_space(Path(__file__).parent / "data" / "space_broken.yaml")
    fam = space.family("broken")

    class CompileOnly:  # enough of a backend to reach nvcc; evaluation must not be reached
        target, needs_cubin, simulated = target_for_arch("sm_90a"), True, False

        def evaluate(self, *a, **k):
            raise AssertionError("a kernel that does not compile must never be run")

    pool = CompilePool(1, cache_dir=tmp_path)
    shape = parse_shape("64x64x64")
    rec = finish(prepare(fam, {"MODE": "compile_error"}, shape, CompileOnly(), pool), shape, CompileOnly(), 10)
    pool.close()
    assert rec.status == "compile_error" and "this_does_not_compile" in rec.reason


def test_compile_pool_runs_one_job_for_one_source_in_flight(tmp_path, monkeypatch):
    """Two submits of the same source while its build runs share one job (configs that differ
    only in run-time knobs); another arch is another job; once done, a submit starts anew."""
    import threading

    from tuner.build import compile as compile_mod

    release, calls = threading.Event(), []

    def fake_compile(source, arch, cache_dir, timeout_s, artifact):
        calls.append((source, arch))
        release.wait(10)
        return arch

    monkeypatch.setattr(compile_mod, "compile_source", fake_compile)
    pool = compile_mod.CompilePool(2, cache_dir=tmp_path)
    try:
        first, twin = pool.submit("src", "sm_90a"), pool.submit("src", "sm_90a")
        other = pool.submit("src", "sm_80")
        assert twin is first and other is not first
        release.set()
        assert (first.result(), other.result()) == ("sm_90a", "sm_80")
        again = pool.submit("src", "sm_90a")
        assert again is not first and again.result() == "sm_90a"
        assert sorted(calls) == [("src", "sm_80"), ("src", "sm_90a"), ("src", "sm_90a")]
    finally:
        pool.close()


def test_render_memo_follows_the_template_bytes(tmp_path):
    """A repeated render comes from the memo, but an edited template is rendered afresh."""
    import shutil

    from tuner.space import load_space

    space = load_space(Path(__file__).parent.parent / "space.yaml")
    fam = space.family("wmma")
    shutil.copy(fam.templates_dir / fam.template, tmp_path / fam.template)
    cfg = fam.defaults()
    first = render(fam, cfg, "sm_90a", templates_dir=tmp_path)
    assert render(fam, cfg, "sm_90a", templates_dir=tmp_path) == first
    (tmp_path / fam.template).write_text((tmp_path / fam.template).read_text() + "\n// edited\n")
    assert render(fam, cfg, "sm_90a", templates_dir=tmp_path) == first + "\n// edited\n"

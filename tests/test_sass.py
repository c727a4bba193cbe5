"""The kernels are what they claim, proven without a GPU: compile, then read the SASS.

cute_sm90 must issue wgmma (HGMMA) fed by TMA loads (UTMALDG); the shipped default and
seed configs (the non-persistent `basic` schedule among them) must not spill to local memory
(no LDL/STL). A basic library also holds our split-K kernel (SplitKBasicKernel): TMA-fed wgmma too,
its arrival counter's red.add (REDG), no spills. cute_sm80 must use mma.sync
(HMMA), cp.async (LDGSTS) and ldmatrix (LDSM)."""

from __future__ import annotations

import ctypes
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tuner.build import compile_source, render
from tuner.build.sass import dump_sass, kernels_sass, opcode_counts, static_shared_bytes
from tuner.space import parse_shape

pytestmark = pytest.mark.nvcc
BIG = parse_shape("4096x4096x8192")


def _compile_all(fam, configs, cache):
    with ThreadPoolExecutor(max_workers=2) as pool:  # CI has 2 cores
        futures = [pool.submit(compile_source, render(fam, c, "sm_90a"), "sm_90a", cache, 600.0, fam.artifact)
                   for c in configs]
        return [f.result() for f in futures]


def test_cute_sm90_issues_wgmma_and_tma_without_spills(space, h200, tmp_path):
    fam = space.family("cute_sm90")
    default = fam.complete({})
    pingpong = fam.complete(fam.seeds[0])
    assert pingpong["SCHEDULE"] == "pingpong"
    rng = random.Random(7)  # one sampled valid config besides the shipped ones
    while True:
        # with an L2 hint, so that our own producer loop (TunedLoadMainloop) is built and read too,
        # and with our TMA-descriptor wrapper (TMA_L2_PROMOTION != 128)
        sampled = fam.complete({k.name: rng.choice(k.values) for k in fam.compile_knobs}
                               | {"L2_HINT": "stream_a", "TMA_L2_PROMOTION": 256})
        if not fam.violations(sampled, BIG, h200) and sampled not in (default, pingpong):
            break
    # our kernel body (PROLOGUE), on the default tile and cluster
    own_body = default | {"PROLOGUE": "early_load"}
    assert not fam.violations(own_body, BIG, h200)
    # the non-persistent kernel (SCHEDULE basic) on a small-shape seed's tile
    basic = fam.complete(next(s for s in fam.seeds if s.get("SCHEDULE") == "basic"))
    assert not fam.violations(basic, parse_shape("1024x1024x1024"), h200)
    # and its largest split-K seed tile (128x128: 128 fp32 accumulators per consumer thread)
    basic_big = fam.complete({"TILE_M": 128, "TILE_N": 128, "SCHEDULE": "basic", "STAGES": 3, "CLUSTER_M": 1})
    assert basic_big in [fam.complete(s) for s in fam.seeds_for(parse_shape("256x256x8192"))]
    assert not fam.violations(basic_big | {"DECOMP": "split_16"}, parse_shape("256x256x8192"), h200)
    configs = [default, pingpong, sampled, own_body, basic, basic_big]
    results = _compile_all(fam, configs, tmp_path)
    for cfg, res in zip(configs, results, strict=True):
        assert res.ok, f"{fam.compile_config(cfg)}: {res.error}"
        ops = opcode_counts(dump_sass(res.cubin))
        assert ops["HGMMA"] > 0, f"no wgmma in {fam.compile_config(cfg)}: {dict(ops)}"
        assert ops["UTMALDG"] > 0, f"no TMA load in {fam.compile_config(cfg)}: {dict(ops)}"
        assert ops["HMMA"] == 0, "a Hopper kernel fell back to mma.sync"
        # hgemm_run(pdl=1) is safe only if the kernel waits for its predecessor's memory
        assert ops["ACQBULK"] > 0, f"no griddepcontrol.wait in {fam.compile_config(cfg)}: PDL would race"
    # The TMA epilogue converts the accumulators with no alpha multiply (alpha is always 1): the
    # default's 128x256 tile has 128 fp32 accumulators per consumer thread, so a multiply would be
    # at least 128 FMULs (134 with CUTLASS's LinearCombination; docs/decisions/0041).
    assert default["EPILOGUE"] == "tma" and default["TILE_M"] * default["TILE_N"] == 128 * 256
    assert opcode_counts(dump_sass(results[0].cubin))["FMUL"] < 64
    # The promotion knob is real only if CuTe's descriptor encoding goes through our wrapper:
    # its symbol is in the library that asked for 256, and absent from CuTe's own 128.
    assert b"hgemm_tma_promotion" in Path(results[2].cubin).read_bytes()
    assert b"hgemm_tma_promotion" not in Path(results[0].cubin).read_bytes()
    # Our kernel body declares no static shared memory: it would move CUTLASS's dynamic buffer off
    # the 1024-byte alignment (a 4-byte __shared__ word -> misaligned address on the GPU).
    system_reserve = set(static_shared_bytes(results[0].cubin).values())
    assert set(static_shared_bytes(results[3].cubin).values()) == system_reserve, "static shared memory in our body"
    # PDL both ways in the basic kernel: it waits for its predecessor and lets its dependents start early
    assert opcode_counts(dump_sass(results[4].cubin))["PREEXIT"] > 0, "basic: no griddepcontrol.launch_dependents"
    for cfg, res in zip([default, pingpong, own_body, basic, basic_big], [*results[:2], *results[3:]], strict=True):
        ops = opcode_counts(dump_sass(res.cubin))
        assert ops["LDL"] == 0 and ops["STL"] == 0, f"local-memory spills in {fam.compile_config(cfg)}: {dict(ops)}"
        assert res.spill_bytes == 0
    # A basic library holds two kernels: CUTLASS's (data-parallel, TMA store) and our split-K one, which
    # loads by TMA into wgmma, waits for its predecessor before its first global access (PDL), counts
    # its split in with a red.add and stores no tile by TMA (its reduction writes C from registers).
    for res in results[4:]:
        kernels = kernels_sass(dump_sass(res.cubin))
        split = [sass for name, sass in kernels.items() if "SplitKBasicKernel" in name]
        plain = [sass for name, sass in kernels.items() if "SplitKBasicKernel" not in name]
        assert len(split) == 1 and len(plain) == 1, list(kernels)
        ops, cutlass_ops = opcode_counts(split[0]), opcode_counts(plain[0])
        assert ops["HGMMA"] > 0 and ops["UTMALDG"] > 0 and ops["ACQBULK"] > 0 and ops["PREEXIT"] > 0, dict(ops)
        assert ops["REDG"] > 0 and ops["UTMASTG"] == 0 and cutlass_ops["UTMASTG"] > 0, (dict(ops), dict(cutlass_ops))
        assert ops["LDL"] == 0 and ops["STL"] == 0, dict(ops)
    # hgemm_run's split-K guards return before any CUDA call, so they run here: a grid of more CTAs than
    # SMs is refused (1: a tile's splits wait for each other, all must be resident), a split-K call
    # without a workspace too (2). hgemm_workspace: 16 tiles x 8 splits x 64x64 fp32, 256 B of counters.
    i, p = ctypes.c_int, ctypes.c_void_p
    lib = ctypes.CDLL(results[4].cubin)
    lib.hgemm_run.argtypes = [p, p, p, i, i, i, i, i, i, i, i, i, p, p]
    lib.hgemm_workspace.argtypes = [i] * 8
    lib.hgemm_workspace.restype = ctypes.c_size_t
    assert lib.hgemm_workspace(256, 256, 8192, 2, 1, 8, 0, 132) == 16 * 8 * 64 * 64 * 4 + 256
    assert lib.hgemm_workspace(256, 256, 8192, 2, 1, 1, 0, 132) == 0
    assert lib.hgemm_run(None, None, None, 256, 256, 8192, 2, 1, 16, 0, 0, 132, None, None) == 1  # 256 CTAs
    assert lib.hgemm_run(None, None, None, 256, 256, 8192, 2, 1, 8, 0, 0, 100, None, None) == 1   # 128 > 100
    assert lib.hgemm_run(None, None, None, 256, 256, 8192, 2, 1, 8, 0, 0, 132, None, None) == 2   # no workspace


def test_cute_sm80_uses_mma_sync_cp_async_and_ldmatrix(space, tmp_path):
    fam = space.family("cute_sm80")
    (res,) = _compile_all(fam, [fam.complete({})], tmp_path)
    assert res.ok, res.error
    ops = opcode_counts(dump_sass(res.cubin))
    assert ops["HMMA"] > 0 and ops["LDGSTS"] > 0 and ops["LDSM"] > 0, dict(ops)
    assert ops["HGMMA"] == 0 and ops["LDL"] == 0 and ops["STL"] == 0, dict(ops)


def test_cute_sm90_fp16_accumulate_issues_f16_wgmma(space, tmp_path):
    """`--accumulate fp16` renders a kernel whose wgmma accumulates in fp16 (HGMMA ... .F16)."""
    fam = space.family("cute_sm90")
    src = render(fam, fam.complete({}), "sm_90a", accumulate="fp16")
    res = compile_source(src, "sm_90a", tmp_path, 600.0, fam.artifact)
    assert res.ok, res.error
    sass = dump_sass(res.cubin)
    hgmma = [line for line in sass.splitlines() if "HGMMA." in line]
    assert hgmma and all(".F16" in line and ".F32" not in line for line in hgmma), hgmma[:3]


def test_cute_sm90_wgmma_is_as_wide_as_the_tile(space, h200, tmp_path):
    """One wgmma spans the tile's N (HGMMA.64xTILE_Nx16) for widths outside CUTLASS's short list of
    8/16/32/64/96/128/192/256 too: without the extended shapes a 144-wide tile ran as nine 64x16x16
    wgmmas per k-step, 1.3-3.5x slower on the GPU (docs/decisions)."""
    fam = space.family("cute_sm90")
    cfg = fam.complete({"TILE_M": 128, "TILE_N": 144, "STAGES": 5, "CLUSTER_M": 1, "CLUSTER_N": 1})
    assert not fam.violations(cfg, BIG, h200)
    (res,) = _compile_all(fam, [cfg], tmp_path)
    assert res.ok, res.error
    widths = {int(n) for n in re.findall(r"HGMMA\.64x(\d+)x16", dump_sass(res.cubin))}
    assert widths == {144}, f"wgmma N {widths} in a 144-wide tile"

"""GPU tests: the worker verifies, times and survives broken kernels. Marked `gpu`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tuner.build import compile_source, render
from tuner.measure import EvalRequest, GpuBackend, LaunchSpec
from tuner.search.compile_queue import finish, prepare
from tuner.space import parse_shape

pytestmark = pytest.mark.gpu

# Deliberately broken kernels: each must fail verification with the right kind.
BROKEN = {
    "wrong": "C[i] = __float2half(acc + 1.0f);",
    "out_of_bounds": "C[i] = __float2half(acc); if (i == 0) C[M * N + 7] = C[i];",
    "unwritten": "if (i % 97 != 5) C[i] = __float2half(acc);",
    "fault": "C[i] = __float2half(acc); if (i == 0) ((volatile __half*)0x10)[0] = C[i];",
}
NAIVE = r"""
#include <cuda_fp16.h>
extern "C" __global__ void hgemm(const __half* A, const __half* B, __half* C, int M, int N, int K, int swz) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i >= (long)M * N) return;
  int m = i / N, n = i % N;
  float acc = 0.f;
  for (int k = 0; k < K; ++k) acc += __half2float(A[(long)m * K + k]) * __half2float(B[(long)n * K + k]);
  BODY
}
"""


@pytest.fixture(scope="module")
def backend():
    be = GpuBackend()
    yield be
    be.close()


def _naive_request(body: str, shape, tmp_path, arch: str) -> EvalRequest:
    res = compile_source(NAIVE.replace("BODY", body), arch, cache_dir=tmp_path)
    assert res.ok, res.error
    grid = (shape.M * shape.N + 127) // 128
    return EvalRequest("naive", {}, shape, res.cubin, LaunchSpec(grid=grid, block=128), [{"SWIZZLE_LOG": 0}],
                       digest=res.digest)


def test_naive_kernel_passes_every_check(backend, tmp_path):
    shape = parse_shape("67x45x2100")
    m = backend.evaluate(_naive_request("C[i] = __float2half(acc);", shape, tmp_path, backend.target.arch))
    assert m.ok, m.reason
    assert m.verify["checks"] == ["exact", "random", "accumulate"]
    assert m.times_us and m.baselines_us["cublas"] > 0


@pytest.mark.parametrize("kind", list(BROKEN))
def test_broken_kernels_fail_with_their_kind(backend, tmp_path, kind):
    shape = parse_shape("67x45x2100")
    restarts = backend.restarts
    m = backend.evaluate(_naive_request(f"C[i] = __float2half(acc); {{ {BROKEN[kind]} }}"
                                        if kind == "fault" else BROKEN[kind], shape, tmp_path, backend.target.arch))
    assert not m.ok
    assert m.kind == kind, m.reason
    if kind == "fault":
        assert backend.restarts == restarts + 1
    # The worker is usable afterwards.
    ok = backend.evaluate(_naive_request("C[i] = __float2half(acc);", shape, tmp_path, backend.target.arch))
    assert ok.ok, ok.reason


def test_gpu_worker_killed_from_outside(backend, tmp_path):
    """The GPU worker SIGKILLed by someone else mid-evaluation: the trial fails as
    worker_died with the reason, a new worker starts, and the next trial measures."""
    import os
    import signal
    import threading

    shape = parse_shape("67x45x2100")
    spin = "for (;;) { __nanosleep(1000); }"  # keeps the worker busy until the kill
    req = _naive_request(spin, shape, tmp_path, backend.target.arch)
    pid = backend.proc.pid
    timer = threading.Timer(3.0, os.kill, (pid, signal.SIGKILL))
    timer.start()
    try:
        m = backend.evaluate(req, timeout_s=120)
    finally:
        timer.cancel()
    assert not m.ok and m.kind == "worker_died", (m.kind, m.reason)
    assert "exited" in m.reason or "gone" in m.reason
    assert backend.proc.pid != pid, "a fresh worker was started"
    ok = backend.evaluate(_naive_request("C[i] = __float2half(acc);", shape, tmp_path, backend.target.arch))
    assert ok.ok, ok.reason


def test_evaluate_many_screens_binaries_together_and_fails_the_wrong_one(backend, tmp_path):
    """A batch: each binary verified (the wrong one fails alone), every variant of the verified
    ones in one shared screen, the survivors (3 to 6 of 9) timed in full with cuBLAS; the others
    come back screened, with their screen times and no trial time."""
    shape = parse_shape("67x45x2100")
    arch = backend.target.arch
    variants = [{"SWIZZLE_LOG": s} for s in range(3)]  # the naive kernel ignores it: 3 tied variants
    good = dataclasses.replace(_naive_request("C[i] = __float2half(acc);", shape, tmp_path, arch), variants=variants)
    wrong = _naive_request(BROKEN["wrong"], shape, tmp_path, arch)
    ms = backend.evaluate_many([good, good, wrong, good])
    assert ms[2].status == "failed" and ms[2].kind == "wrong", ms[2].reason
    mine = [ms[0], ms[1], ms[3]]
    assert {m.status for m in mine} <= {"ok", "screened"} and any(m.ok for m in mine)
    keys = {json.dumps(v, sort_keys=True) for v in variants}
    for m in mine:
        assert m.regime["batch"] == 4 and m.regime["screened"] == 9 and set(m.regime["screen_us"]) == keys
        if m.ok:
            assert set(m.times_us) <= keys and m.baselines_us["cublas"] > 0 and m.regime["steady"] is not None
        else:
            assert not m.times_us and "screened out" in m.reason
    assert 3 <= sum(len(m.times_us) for m in mine) <= 6


def test_evaluate_many_finds_a_faulting_binary_one_by_one(backend, tmp_path):
    """A fault poisons the batch's context, so which binary faulted is unknown: the binaries are
    measured one by one in fresh workers, and only the culprit fails."""
    shape = parse_shape("67x45x2100")
    arch = backend.target.arch
    good = _naive_request("C[i] = __float2half(acc);", shape, tmp_path, arch)
    fault = _naive_request(f"C[i] = __float2half(acc); {{ {BROKEN['fault']} }}", shape, tmp_path, arch)
    restarts = backend.restarts
    ms = backend.evaluate_many([good, fault, good])
    assert [m.status for m in ms] == ["ok", "fault", "ok"], [m.reason for m in ms]
    assert backend.restarts == restarts + 2  # the batch's fault, then the culprit's own


def test_fp16_accumulation_is_caught(backend, tmp_path):
    shape = parse_shape("64x64x4096")
    src = NAIVE.replace("float acc = 0.f;", "__half acc = 0;").replace(
        "acc += __half2float(A[(long)m * K + k]) * __half2float(B[(long)n * K + k]);",
        "acc = __hadd(acc, __hmul(A[(long)m * K + k], B[(long)n * K + k]));").replace("BODY", "C[i] = acc;")
    res = compile_source(src, backend.target.arch, cache_dir=tmp_path)
    assert res.ok, res.error
    m = backend.evaluate(EvalRequest("naive16", {}, shape, res.cubin, LaunchSpec(grid=32, block=128),
                                     [{"SWIZZLE_LOG": 0}], digest=res.digest))
    assert not m.ok and m.kind in ("wrong", "accumulate"), m.reason


@pytest.mark.parametrize("family", ["cute_sm80", "wmma", "cute_sm90"])
@pytest.mark.parametrize("shape_s", ["1x8x8", "127x136x72", "333x200x1000", "256x256x4096"])
def test_family_defaults_verify_on_tails(space, backend, family, shape_s):
    fam = space.family(family)
    shape = parse_shape(shape_s)
    from tuner.build import CompilePool

    config = fam.compile_config(fam.defaults())
    if fam.violations(fam.complete(config), shape, backend.target):  # cute_sm90's 2x1 cluster over one
        config |= {"CLUSTER_M": 1}                                   # row of tiles is rejected (space.yaml)
    pool = CompilePool(2)
    rec = finish(prepare(fam, config, shape, backend, pool), shape, backend, 60)
    pool.close()
    assert rec.status == "ok", rec.reason
    assert rec.tflops and rec.tflops < backend.target.peak_tflops


@pytest.mark.parametrize("shape_s", ["127x136x72", "333x200x1000", "1001x520x336"])
def test_cute_sm90_basic_schedule_verifies_on_tails(space, backend, shape_s):
    """SCHEDULE=basic (non-persistent, a grid of one CTA per tile, two CTAs per SM) passes the full
    check on tail shapes: M, N and K not multiples of the 64x128x64 tile."""
    from tuner.build import CompilePool

    fam = space.family("cute_sm90")
    config = fam.compile_config(fam.complete(next(s for s in fam.seeds if s.get("SCHEDULE") == "basic")))
    shape = parse_shape(shape_s)
    assert not fam.violations(fam.complete(config), shape, backend.target)
    pool = CompilePool(2)
    rec = finish(prepare(fam, config, shape, backend, pool), shape, backend, 60)
    pool.close()
    assert rec.status == "ok", rec.reason
    assert rec.tflops and rec.tflops < backend.target.peak_tflops


def test_cute_sm90_split_k_variants_verify_on_tails(space, backend):
    """Every stream-K / split-K variant of one library, both reduction orders, passes the
    random check on a tail shape (the worker checks each run-time variant) and is timed."""
    from tuner.build import CompilePool

    fam = space.family("cute_sm90")
    config = fam.compile_config(fam.complete({"TILE_N": 64, "SCHEDULER": "streamk", "STAGES": 8, "CLUSTER_M": 1}))
    shape = parse_shape("333x200x4096")  # 3x4 tiles of 128x64: split-K up to 16 is allowed
    pool = CompilePool(2)
    rec = finish(prepare(fam, config, shape, backend, pool), shape, backend, 120)
    pool.close()
    assert rec.status == "ok", rec.reason
    # every variant was verified and timed: in full, or in the trial's screen (regime screen_us)
    timed = [json.loads(k) for k in set(rec.variant_times_us) | set(rec.regime_report.get("screen_us") or {})]
    for decomp in ("stream_k", "split_2", "split_16"):
        for reduction in ("deterministic", "nondeterministic"):
            assert any(v["DECOMP"] == decomp and v["REDUCTION"] == reduction for v in timed), (decomp, reduction)


@pytest.mark.parametrize(("tile", "shape_s"), [((64, 64, 6), "127x136x2120"), ((128, 128, 3), "333x200x4096")])
def test_cute_sm90_basic_split_k_verifies_on_tails_at_every_split_count(space, backend, tile, shape_s):
    """SCHEDULE=basic's split-K (our SplitKBasicKernel, docs/decisions/0039): every split count passes the
    random check (the worker checks each run-time variant) on shapes with M, N and K tails (K = 2120:
    33 full k-tiles and one of 8 columns, split 16 ways into k-ranges of 2 or 3 tiles), and is timed."""
    from tuner.build import CompilePool

    fam = space.family("cute_sm90")
    tm, tn, stages = tile
    config = fam.compile_config(fam.complete({"TILE_M": tm, "TILE_N": tn, "SCHEDULE": "basic", "STAGES": stages,
                                              "CLUSTER_M": 1}))
    shape = parse_shape(shape_s)  # 6 output tiles: 96 CTAs at 16 splits, one wave
    for decomp in ("split_2", "split_4", "split_8", "split_16"):
        assert not fam.violations(fam.complete(config | {"DECOMP": decomp}), shape, backend.target), decomp
    pool = CompilePool(2)
    rec = finish(prepare(fam, config, shape, backend, pool), shape, backend, 120)
    pool.close()
    assert rec.status == "ok", rec.reason
    timed = {json.loads(k)["DECOMP"] for k in set(rec.variant_times_us) | set(rec.regime_report.get("screen_us") or {})}
    assert timed == {"data_parallel", "split_2", "split_4", "split_8", "split_16"}, timed


def test_cute_sm90_basic_split_k_is_bitwise_reproducible_in_graphs_and_with_pdl(space, backend):
    """The basic split-K's reduction adds the splits in a fixed order, so repeated calls give the same
    bits whatever order the splits finish in: plain launches, PDL launches back to back (no sync in
    between: the next call's counter memset and kernel queue behind this one), and replays of a CUDA
    graph that captured one call (the memset node zeroes the counters on every replay). Each result is
    near an fp32 reference. A grid larger than the SM count is refused by hgemm_run (code 1), not run."""
    import cupy

    from tuner.measure import launch_spec
    from tuner.measure.candidates import LaunchRefused, load_candidate

    fam = space.family("cute_sm90")
    full = fam.complete({"TILE_M": 64, "TILE_N": 64, "SCHEDULE": "basic", "STAGES": 6, "CLUSTER_M": 1})
    shape = parse_shape("256x256x8192")  # 16 tiles of 64x64
    M, N, K = shape.M, shape.N, shape.K
    built = compile_source(render(fam, full, "sm_90a"), "sm_90a", artifact=fam.artifact)
    assert built.ok, built.error
    launch = launch_spec(fam, full, shape, backend.target)
    plain = load_candidate(built.cubin, launch, built.digest)
    pdl = load_candidate(built.cubin, dataclasses.replace(launch, pdl=True), built.digest)
    rng = cupy.random.default_rng(7)
    a = rng.standard_normal((M, K), dtype=cupy.float32).astype(cupy.float16)
    b = rng.standard_normal((N, K), dtype=cupy.float32).astype(cupy.float16)
    ref = a.astype(cupy.float32) @ b.astype(cupy.float32).T
    stream = cupy.cuda.Stream(non_blocking=True)
    for decomp in ("split_2", "split_4", "split_8"):
        variant = fam.runtime_config(full) | {"DECOMP": decomp}
        assert not fam.violations(full | variant, shape, backend.target)
        outs = [cupy.full((M, N), cupy.nan, dtype=cupy.float16) for _ in range(12)]
        plain.reserve(M, N, K, [variant])
        pdl.reserve(M, N, K, [variant])
        with stream:
            for c in outs[:4]:
                plain.run(a, b, c, M, N, K, variant, stream)
            for c in outs[4:8]:
                pdl.run(a, b, c, M, N, K, variant, stream)
            stream.begin_capture()
            pdl.run(a, b, outs[8], M, N, K, variant, stream)
            graph = stream.end_capture()
            for c in outs[9:]:
                graph.launch(stream)
                c[...] = outs[8]
        stream.synchronize()
        for i, c in enumerate(outs[1:], 1):
            assert bool(cupy.array_equal(c, outs[0])), f"{decomp}: call {i} differs from call 0"
        err = float(cupy.abs(outs[0].astype(cupy.float32) - ref).max())
        assert err < 2.0 ** -8 * float(cupy.abs(ref).max()) + 0.1, (decomp, err)
    with pytest.raises(LaunchRefused):  # 16 tiles x 16 splits = 256 CTAs > the SM count
        plain.run(a, b, outs[0], M, N, K, fam.runtime_config(full) | {"DECOMP": "split_16"}, stream)


def test_cute_sm90_l2_hints_in_a_2x2_cluster_and_pdl_launch_verify_on_a_tail(space, backend):
    """Our producer loop (L2_HINT) computes the multicast masks itself: in a 2x2 cluster both
    operands are multicast. It must pass the full check on a tail shape, launched plainly and
    with programmatic dependent launch (same library, same process). The TMA descriptors are
    encoded through our L2-promotion wrapper (TMA_L2_PROMOTION=256) at the same time."""
    from tuner.measure import CandidateSpec, launch_spec

    fam = space.family("cute_sm90")
    full = fam.complete({"TILE_N": 64, "STAGES": 6, "CLUSTER_M": 2, "CLUSTER_N": 2, "L2_HINT": "stream_b",
                         "TMA_L2_PROMOTION": 256})
    shape = parse_shape("333x200x1000")
    assert not fam.violations(full, shape, backend.target)
    built = compile_source(render(fam, full, "sm_90a"), "sm_90a", artifact=fam.artifact)
    assert built.ok, built.error
    variant = fam.runtime_config(full)
    launch = launch_spec(fam, full, shape, backend.target)
    plain = CandidateSpec(built.cubin, launch, variant, built.digest)
    pdl = CandidateSpec(built.cubin, dataclasses.replace(launch, pdl=True), variant, built.digest)
    reply = backend.compare(shape, {"plain": plain, "pdl": pdl}, torch=False)
    assert reply.status == "ok", reply
    for name in ("plain", "pdl"):
        assert reply.verify[name]["ok"], reply.verify[name]
        assert reply.times[name] > 0


def test_cute_sm90_our_kernel_body_verifies_in_clusters_with_pdl_on_a_tail(space, backend):
    """PROLOGUE=early_load: our kernel body (producer loads before the consumers' set-up, idle
    producer warps leave early) must pass the full check on a tail shape where some CTAs take
    two tiles (144 tiles on 132 SMs), alone and in 2x1 / 1x2 clusters (multicast into peers
    whose barriers only the cluster barrier orders), launched plainly and with PDL."""
    from concurrent.futures import ThreadPoolExecutor

    from tuner.measure import CandidateSpec, launch_spec

    fam = space.family("cute_sm90")
    shape = parse_shape("1111x1000x1000")  # 9 x 16 tiles of 128x64, M tail
    configs = {f"{prologue}_{cm}x{cn}": fam.complete({"TILE_N": 64, "STAGES": 6, "CLUSTER_M": cm, "CLUSTER_N": cn,
                                                       "SCHEDULER": "persistent", "PROLOGUE": prologue})
               for prologue, cm, cn in [("early_load", 1, 1), ("early_load", 2, 1), ("early_load", 1, 2)]}
    for full in configs.values():
        assert not fam.violations(full, shape, backend.target)
    with ThreadPoolExecutor() as pool:
        built = dict(zip(configs, pool.map(lambda c: compile_source(render(fam, c, "sm_90a"), "sm_90a",
                                                                     artifact=fam.artifact), configs.values()),
                         strict=True))
    contenders = {}
    for name, full in configs.items():
        assert built[name].ok, built[name].error
        launch = launch_spec(fam, full, shape, backend.target)
        contenders[name] = CandidateSpec(built[name].cubin, launch, fam.runtime_config(full), built[name].digest)
        contenders[f"{name}_pdl"] = CandidateSpec(built[name].cubin, dataclasses.replace(launch, pdl=True),
                                                  fam.runtime_config(full), built[name].digest)
    reply = backend.compare(shape, contenders, torch=False)
    assert reply.status == "ok", reply
    for name in contenders:
        assert reply.verify[name]["ok"], (name, reply.verify[name])
        assert reply.times[name] > 0


@pytest.mark.parametrize("shape_s", ["333x200x1000", "512x384x4096"])
def test_cute_sm90_fp16_accumulate_verifies_against_cublas_fp16(space, backend, shape_s):
    """--accumulate fp16: the kernel passes exact and random checks against cuBLAS's fp16
    compute (the fp32-accumulation check is skipped) and is timed against it."""
    from tuner.build import CompilePool

    fam = space.family("cute_sm90")
    shape = parse_shape(shape_s)
    pool = CompilePool(2)
    rec = finish(prepare(fam, fam.compile_config(fam.defaults()), shape, backend, pool, "fp16"), shape, backend, 60)
    pool.close()
    assert rec.status == "ok", rec.reason
    assert rec.verify["checks"] == ["exact", "random"], rec.verify
    assert rec.cublas_us and rec.cublas_us > 0


def test_render_matches_what_was_measured(space):
    fam = space.family("wmma")
    assert render(fam, fam.defaults(), "sm_90a") == render(fam, fam.defaults(), "sm_90a")


def test_study_with_broken_family_survives_every_failure(backend, tmp_path):
    """Each planted fault ends as a failed trial of its own kind; the study completes."""
    from tuner.build import CompilePool
    from tuner.search import tune
    from tuner.space import load_space

    space = load_space(Path(__file__).parent / "data" / "space_broken.yaml")
    pool = CompilePool(4, cache_dir=tmp_path)
    study = tune(space, ["broken"], parse_shape("256x256x512"), backend, trials=7, sampler="grid",
                 storage=f"sqlite:///{tmp_path}/b.db", pool=pool, eval_timeout_s=15)
    pool.close()
    kinds = {t.params["broken.MODE"]: (t.user_attrs["status"], t.user_attrs.get("kind"))
             for t in study.get_trials() if t.user_attrs.get("status") not in (None, "duplicate")}
    assert kinds["ok"][0] == "ok"
    assert kinds["wrong"][1] == "wrong"
    assert kinds["oob"][1] == "out_of_bounds"
    assert kinds["unwritten"][1] == "unwritten"
    assert kinds["fault"][1] == "fault"
    assert kinds["hang"][1] == "hang"
    assert kinds["compile_error"][1] == "compile"


@pytest.mark.parametrize("family", ["wmma", "cute_sm90"])
def test_loader_matches_the_tuned_kernel_on_cupy_and_torch(tmp_path, backend, family):
    """The exported kernel (a cubin or a library), run through `tuner.load`, gives the tuner's result."""
    import cupy

    from tuner import load
    from tuner.build import CompilePool
    from tuner.results import write_json
    from tuner.results.export import export_studies
    from tuner.search import tune
    from tuner.space import load_space

    space = load_space(Path(__file__).parent.parent / "space.yaml")
    shape = parse_shape("512x384x256")
    pool = CompilePool(4)
    study = tune(space, [family], shape, backend, trials=3, storage=f"sqlite:///{tmp_path}/l.db", pool=pool)
    pool.close()
    data = export_studies([study])
    data["entries"][0]["pick"] = data["entries"][0]["family"]  # run our kernel even where cuBLAS wins
    path = write_json(data, tmp_path / "best.json")
    gemm = load(path)
    a = cupy.random.standard_normal((512, 256), dtype=cupy.float32).astype(cupy.float16)
    b = cupy.random.standard_normal((384, 256), dtype=cupy.float32).astype(cupy.float16)
    assert gemm.kernel_for(shape) is not None
    c = gemm(a, b)
    ref = a.astype(cupy.float32) @ b.astype(cupy.float32).T
    assert float(cupy.abs(c.astype(cupy.float32) - ref).max()) < 0.05
    torch = pytest.importorskip("torch")
    ta, tb = torch.from_dlpack(a), torch.from_dlpack(b)
    tc = gemm(ta, tb)
    assert isinstance(tc, torch.Tensor) and torch.equal(tc, torch.from_dlpack(c))
    # A shape not in the file falls back to cuBLAS.
    assert gemm.kernel_for(parse_shape("64x64x64")) is None


@pytest.mark.parametrize("family", ["wmma", "cute_sm90"])
def test_confirm_retimes_the_best_kernels_in_fresh_workers(tmp_path, backend, family):
    """`tune`'s confirmation on the GPU: the best kernels rebuilt, re-verified and timed with the
    vendors in fresh workers; export takes the median winner (tails in M, N and K)."""
    from tuner.build import CompilePool
    from tuner.results import write_json
    from tuner.results.export import export_studies
    from tuner.search import tune
    from tuner.search.confirm import confirm
    from tuner.space import load_space

    space = load_space(Path(__file__).parent.parent / "space.yaml")
    shape = parse_shape("1001x520x336")  # odd M; K, N multiples of 8 (TMA strides)
    pool = CompilePool(4)
    try:
        study = tune(space, [family], shape, backend, trials=4, storage=f"sqlite:///{tmp_path}/c.db", pool=pool)
        rec = confirm(space, study, backend, pool, top=2, runs=2)
    finally:
        pool.close()
    assert rec is not None and rec["runs"] == 2 and rec["winner"] is not None, rec
    for k in rec["kernels"]:
        assert k["verified"], k["reason"]
        assert len(k["times_us"]) == 2 and all(t > 0 for t in k["times_us"])
        assert k["cublas_us"] > 0 and k["speedup_cublas"] > 0
    (e,) = export_studies([study])["entries"]
    winner = next(k for k in rec["kernels"] if k["trial"] == rec["winner"])
    assert e["trial"] == rec["winner"] and e["time_us"] == pytest.approx(winner["median_us"])
    assert e["confirm"]["verified"] and e["baselines_us"]["cublas"] == pytest.approx(winner["cublas_us"])
    write_json(export_studies([study]), tmp_path / "best.json")

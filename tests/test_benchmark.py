"""`hgemm-tune bench`: rows, speedups, geomeans, CSV and markdown from canned timings (CPU);
the worker's timing loops on a simulated GPU clock (CPU); bad input (exit 2); and, on a GPU,
the whole command on a freshly tuned export."""

from __future__ import annotations

import csv
import json
import math
import os
import random
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tuner.errors import UserError
from tuner.measure import CandidateSpec, CompareReply, LaunchSpec, timing
from tuner.measure.protocol import decode_reply
from tuner.measure.verify import outputs_match
from tuner.results import bench as bm
from tuner.results import validate
from tuner.space import target_for_arch

ROOT = Path(__file__).resolve().parent.parent
H200 = target_for_arch("sm_90a")
WMMA_KNOBS = {"BM": 64, "BN": 64, "BK": 32, "WARP_M": 2, "WARP_N": 2, "STAGES": 2, "PAD": 8, "SWIZZLE_LOG": 1}


def make_entry(shape: str, family: str = "wmma", gpu: str = "NVIDIA H200", arch: str = "sm_90a",
               time_us: float = 10.0, knobs: dict | None = None) -> dict:
    M, N, K = (int(x) for x in shape.split("x"))
    return {"gpu": gpu, "arch": arch, "shape": shape, "M": M, "N": N, "K": K, "layout": "TN",
            "accumulate": "fp32", "family": family, "template_hash": None,
            "knobs": dict(knobs or WMMA_KNOBS), "source_hash": None, "time_us": time_us,
            "tflops": 2 * M * N * K / time_us / 1e6, "roofline_fraction": 0.5,
            "baselines_us": {"cublas": 5.0}, "speedup": {"cublas": 0.5}, "beats_vendor": False,
            "pick": "cublas", "verification": {"ok": True}, "simulated": False, "study": f"s-{shape}", "trial": 0}


def make_export(entries: list[dict]) -> dict:
    data = {"schema_version": 1, "tool": "hgemm-tune", "tool_version": "0.1.0", "created": "2026-12-03T00:00:00+00:00",
            "simulated": False, "entries": entries}
    validate(data)
    return data


def ok_reply(times: dict[str, dict[str, float]], verify: dict[str, dict] | None = None,
             notes: dict[str, str] | None = None) -> CompareReply:
    return CompareReply(modes=list(times), times=times.get("sustained", times.get("offline", {})), times_by_mode=times,
                        verify=verify if verify is not None else {"ours0": {"ok": True, "checks": ["exact", "random"]}},
                        notes=notes or {})


class FakeBackend:
    """Answers `compare` with canned replies per shape (a dict, or a function of the candidates)."""

    name = "fake"
    simulated = False

    def __init__(self, replies: dict):
        self.target = H200
        self.replies = replies
        self.calls: list[tuple] = []

    def compare(self, shape, candidates, timeout_s=300.0, modes=None, torch=True, autotune=True):
        self.calls.append((str(shape), sorted(candidates), list(modes or []), torch))
        self.autotuned = getattr(self, "autotuned", []) + ([str(shape)] if autotune else [])
        reply = self.replies[str(shape)]
        reply = reply(candidates) if callable(reply) else reply
        # A canned dict is what a worker writes: decoded as GpuBackend decodes it.
        return decode_reply(CompareReply, reply) if isinstance(reply, dict) else reply

    def close(self):
        self.closed = True


class FakeBuilder:
    def __init__(self, broken: set[str] = frozenset()):
        self.broken = broken

    def submit(self, entry):
        def wait():
            if entry["shape"] in self.broken:
                raise UserError("does not compile: kernel.cu(12): error: identifier undefined")
            return {"cubin": f"/cache/{entry['shape']}.cubin", "launch": {}, "variant": {"SWIZZLE_LOG": 1}}, []
        return wait


A, B, C, E = "1024x1024x1024", "2048x2048x512", "4096x4096x4096", "512x512x512"
REPLIES = {
    A: ok_reply({"offline": {"ours0": 10.0, "cublas": 5.0, "cublaslt": 6.0, "cublaslt_auto": 4.0, "torch": 5.5},
                 "server": {"ours0": 20.0, "cublas": 30.0, "cublaslt": 25.0, "cublaslt_auto": 24.0, "torch": 32.0}}),
    B: ok_reply({"offline": {"ours0": 8.0, "cublas": 10.0, "cublaslt": 12.0, "cublaslt_auto": 8.0},
                 "server": {"ours0": 16.0, "cublas": 20.0, "cublaslt": 24.0, "cublaslt_auto": 20.0}},
                notes={"torch": "not measured: torch is not installed in the GPU worker's Python"}),
    C: ok_reply({"offline": {"cublas": 120.0, "cublaslt": 121.0, "cublaslt_auto": 119.0, "torch": 122.0},
                 "server": {"cublas": 150.0, "cublaslt": 151.0, "cublaslt_auto": 149.0, "torch": 152.0}},
                verify={"ours0": {"ok": False, "kind": "wrong",
                                  "reason": "0/1 inputs: 3 of 100 exact outputs differ"}}),
}


@pytest.fixture
def result():
    data = make_export([make_entry(A), make_entry(B), make_entry(C), make_entry(E),
                        make_entry("8192x8192x8192", gpu="NVIDIA A100-SXM4-80GB", arch="sm_80")])
    backend = FakeBackend(REPLIES)
    seen = []
    res = bm.run_benchmark(data, backend, FakeBuilder(broken={E}), ["offline", "server"],
                           on_shape=lambda i, n, shape, rows: seen.append((i, n, shape, len(rows))))
    res["_calls"], res["_seen"] = backend.calls, seen
    return res


def _row(result, shape, mode):
    (row,) = [r for r in result["rows"] if r["shape"] == shape and r["mode"] == mode]
    return row


def test_rows_carry_times_speedups_and_tflops(result):
    r = _row(result, A, "sustained")
    assert r["status"] == "ok" and r["verified"] is True and r["family"] == "wmma"
    assert r["ours_us"] == 10.0 and r["cublas_us"] == 5.0 and r["torch_us"] == 5.5
    assert r["ours_tflops"] == pytest.approx(2 * 1024 ** 3 / 10e-6 / 1e12)  # 214.7
    assert r["roofline_pct"] == pytest.approx(100 * (2 * 1024 ** 3 / 989.4e12 * 1e6) / 10.0)
    assert (r["speedup_cublas"], r["speedup_cublaslt"], r["speedup_cublaslt_auto"], r["speedup_torch"]) == \
        pytest.approx((0.5, 0.6, 0.4, 0.55))
    s = _row(result, A, "isolated")
    assert s["ours_us"] == 20.0 and s["cublas_us"] == 30.0
    assert (s["speedup_cublas"], s["speedup_cublaslt"], s["speedup_cublaslt_auto"], s["speedup_torch"]) == \
        pytest.approx((1.5, 1.25, 1.2, 1.6))
    b = _row(result, B, "sustained")
    assert b["speedup_cublas"] == pytest.approx(1.25) and b["torch_us"] is None and b["speedup_torch"] is None
    assert "torch: not measured: torch is not installed" in b["notes"]


def test_failed_kernels_are_reported_never_timed(result):
    for mode in ("sustained", "isolated"):
        c = _row(result, C, mode)
        assert c["status"] == "failed" and c["verified"] is False
        assert c["reason"] == "wrong: 0/1 inputs: 3 of 100 exact outputs differ"
        assert c["ours_us"] is None and all(c[f"speedup_{b}"] is None for b in bm.BASELINES)
        assert c["cublas_us"] == (120.0 if mode == "sustained" else 150.0)  # the baselines still show
        e = _row(result, E, mode)
        assert e["status"] == "failed" and e["reason"].startswith("build: does not compile")
        assert e["ours_us"] is None and e["cublas_us"] is None
    # The unbuildable shape never reached the GPU; the others were compared once, in both regimes
    # (asked for by their older names, offline and server: the worker is sent the regimes').
    assert sorted(call[0] for call in result["_calls"]) == sorted([A, B, C])
    assert all(call[1] == ["ours0"] and call[2] == ["sustained", "isolated"] and call[3] for call in result["_calls"])
    # Shapes run cheapest first, one progress callback each.
    assert [s[2] for s in result["_seen"]] == [E, A, B, C] and all(s[1] == 4 and s[3] == 2 for s in result["_seen"])


def test_other_gpus_entries_are_skipped_with_the_reason(result):
    assert result["skipped"] == [{"shape": "8192x8192x8192", "family": "wmma", "gpu": "NVIDIA A100-SXM4-80GB",
                                  "reason": "tuned on NVIDIA A100-SXM4-80GB, this GPU is NVIDIA H200"}]
    assert len(result["rows"]) == 8 and not any(r["shape"] == "8192x8192x8192" for r in result["rows"])


def test_geomean_per_baseline_and_mode(result):
    geo = {(g["mode"], g["baseline"]): g for g in result["geomeans"]}
    expect = {("sustained", "cublas"): (math.sqrt(0.5 * 1.25), 2, 1),
              ("sustained", "cublaslt"): (math.sqrt(0.6 * 1.5), 2, 1),
              ("sustained", "cublaslt_auto"): (math.sqrt(0.4 * 1.0), 2, 0),
              ("sustained", "torch"): (0.55, 1, 0),
              ("isolated", "cublas"): (math.sqrt(1.5 * 1.25), 2, 2),
              ("isolated", "cublaslt"): (math.sqrt(1.25 * 1.5), 2, 2),
              ("isolated", "cublaslt_auto"): (math.sqrt(1.2 * 1.25), 2, 2),
              ("isolated", "torch"): (1.6, 1, 1)}
    assert set(geo) == set(expect)
    for key, (value, n, wins) in expect.items():
        assert geo[key]["geomean_speedup"] == pytest.approx(value), key
        assert (geo[key]["n"], geo[key]["wins"], geo[key]["ok_rows"]) == (n, wins, 2), key
    assert bm.geomean([]) is None and bm.geomean([2.0, 8.0]) == pytest.approx(4.0)


def test_csv_markdown_and_json_files(result, tmp_path):
    files = bm.write_outputs(result, tmp_path, "best.json")
    assert [f.name for f in files] == ["bench.csv", "bench_geomean.csv", "bench_contenders.csv", "bench.md",
                                       "bench.json"]
    with open(tmp_path / "bench.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == bm.ROW_FIELDS and len(rows) == 8
    a = next(r for r in rows if r["shape"] == A and r["mode"] == "sustained")
    assert (float(a["ours_us"]), float(a["speedup_cublas"]), float(a["speedup_torch"])) == (10.0, 0.5, 0.55)
    assert a["status"] == "ok" and a["verified"] == "True" and json.loads(a["knobs"]) == WMMA_KNOBS
    c = next(r for r in rows if r["shape"] == C and r["mode"] == "isolated")
    assert c["ours_us"] == "" and c["speedup_cublas"] == "" and c["status"] == "failed" and c["verified"] == "False"
    with open(tmp_path / "bench_geomean.csv") as fh:
        geo = {(g["mode"], g["baseline"]): g for g in csv.DictReader(fh)}
    assert float(geo[("isolated", "cublas")]["geomean_speedup"]) == pytest.approx(math.sqrt(1.5 * 1.25), rel=1e-5)

    md = (tmp_path / "bench.md").read_text()
    assert "| 1024x1024x1024 | sustained | wmma | 10.00 | 214.7 | 21.7 | 5.00 | 6.00 | 4.00 | 5.50 " \
           "| 0.500 | 0.600 | 0.400 | 0.550 | yes |" in md
    assert "| 2048x2048x512 | isolated | wmma | 16.00 | 268.4 |" in md
    assert "| 4096x4096x4096 | sustained | wmma | - | - | - | 120.00 |" in md
    assert "FAILED: wrong: 0/1 inputs: 3 of 100 exact outputs differ |" in md
    assert "| cuBLAS | 0.791x (1/2 faster) | 1.369x (2/2 faster) |" in md
    assert "| torch | 0.550x (0/1 faster) | 1.600x (1/1 faster) |" in md
    assert "tuned on NVIDIA A100-SXM4-80GB, this GPU is NVIDIA H200" in md
    assert "- torch: not measured: torch is not installed in the GPU worker's Python (2048x2048x512)" in md
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["modes"] == ["sustained", "isolated"] and len(data["rows"]) == 8 and data["source"] == "best.json"


def test_one_mode_and_an_older_worker_reply():
    data = make_export([make_entry(A)])
    reply = {"status": "ok", "times": {"ours0": 10.0, "cublas": 5.0}, "verify": {"ours0": {"ok": True}}, "notes": {}}
    res = bm.run_benchmark(data, FakeBackend({A: reply}), FakeBuilder(), ["offline"])
    (row,) = res["rows"]
    assert row["mode"] == "sustained" and row["speedup_cublas"] == pytest.approx(0.5)
    assert [g["mode"] for g in res["geomeans"]] == ["sustained"] * 4
    md = bm.markdown(res)
    assert "| baseline | sustained |" in md and "isolated" not in md.split("## Geomean")[1]
    # an older worker sent no regime report: steady state is unknown, never assumed
    assert row["steady"] is None and bm.steady_cell(row) == "unknown"


def test_a_time_under_the_roofline_is_rejected_not_a_win():
    shape = "4096x4096x8192"  # 274.9 GFLOP: at least 277.9 us on an H200
    data = make_export([make_entry(shape)])
    reply = ok_reply({"offline": {"ours0": 100.0, "cublas": 350.0}})
    res = bm.run_benchmark(data, FakeBackend({shape: reply}), FakeBuilder(), ["offline"])
    (row,) = res["rows"]
    assert row["status"] == "rejected" and "under the roofline" in row["reason"]
    assert row["speedup_cublas"] is None and res["geomeans"][0]["geomean_speedup"] is None


def test_a_faulting_kernel_is_isolated_from_the_others_of_its_shape():
    data = make_export([make_entry(A), make_entry(A, family="cute_sm80", knobs={"BM": 128})])

    def reply(cands):
        if "ours1" in cands:  # the cute_sm80 kernel takes its worker down, alone or with others
            return {"status": "fault", "kind": "fault", "reason": "CUDA error: an illegal memory access", "fatal": True}
        return ok_reply({"offline": {"ours0": 10.0, "cublas": 5.0}})

    backend = FakeBackend({A: reply})
    res = bm.run_benchmark(data, backend, FakeBuilder(), ["offline"])
    rows = {r["family"]: r for r in res["rows"]}
    assert rows["wmma"]["status"] == "ok" and rows["wmma"]["speedup_cublas"] == pytest.approx(0.5)
    assert rows["cute_sm80"]["status"] == "failed" and "illegal memory access" in rows["cute_sm80"]["reason"]
    assert [c[1] for c in backend.calls] == [["ours0", "ours1"], ["ours0"], ["ours1"]]


def test_parse_modes():
    assert bm.parse_modes("both") == ["sustained", "isolated"]
    assert bm.parse_modes("Isolated") == ["isolated"] and bm.parse_modes("sustained") == ["sustained"]
    # the older names are still accepted, as the regimes they were
    assert bm.parse_modes("Server") == ["isolated"] and bm.parse_modes("offline") == ["sustained"]
    with pytest.raises(UserError, match="sustained, isolated or both"):
        bm.parse_modes("fast")


def test_builder_turns_an_entry_into_a_worker_candidate(space):
    from tuner.build import CompileResult

    class Pool:
        def __init__(self):
            self.jobs = []

        def submit(self, source, arch, artifact="cubin"):
            self.jobs.append((source, arch, artifact))
            f = Future()
            f.set_result(CompileResult(True, "k", "/cache/k.cubin", 0.0, True, digest="d"))
            return f

    pool = Pool()
    builder = bm.Builder(space, H200, pool)
    cand, warnings = builder.submit(make_entry("512x384x256"))()
    assert cand == CandidateSpec("/cache/k.cubin", LaunchSpec(artifact="cubin", grid=8 * 6, block=128,
                                                              smem=2 * (64 + 64) * (32 + 8) * 2),
                                 {"SWIZZLE_LOG": 1}, "d")
    assert warnings == [] and pool.jobs[0][1:] == ("sm_90a", "cubin") and "hgemm" in pool.jobs[0][0]
    with pytest.raises(UserError, match="unknown knob"):
        builder.submit(make_entry("512x384x256", knobs={"BQ": 3}))()
    with pytest.raises(UserError, match="warp tile"):
        builder.submit(make_entry("512x384x256", knobs=WMMA_KNOBS | {"BM": 16}))()


# ---- the worker's timing loops, on a simulated GPU clock -------------------------------------

class _Stream:
    ptr = 7

    def __init__(self):
        self.clock_ms, self.log, self.capture = 0.0, [], None

    def run(self, name: str, ms: float) -> None:
        self.clock_ms += ms
        self.log.append(f"launch:{name}")

    def begin_capture(self):
        self.capture = []

    def is_capturing(self):
        return self.capture is not None

    def end_capture(self):
        ops, self.capture = self.capture, None
        return SimpleNamespace(launch=lambda stream: [op(stream) for op in ops])

    def synchronize(self):
        self.log.append("sync")


class _Event:
    def record(self, stream):
        self.t = stream.clock_ms
        stream.log.append("record")

    def synchronize(self):
        pass


def _fake_cp():
    return SimpleNamespace(cuda=SimpleNamespace(Event=_Event, get_elapsed_time=lambda s, e: e.t - s.t,
                                                runtime=SimpleNamespace(CUDARuntimeError=RuntimeError)))


def _contender(name: str, ms: float):
    def launch(buf, stream):
        if stream.capture is not None:
            stream.capture.append(lambda s: s.run(name, ms))
        else:
            stream.run(name, ms)
    return launch


def test_isolated_regime_flushes_syncs_and_idles_before_every_timed_launch(monkeypatch):
    monkeypatch.setattr(timing, "_cp", _fake_cp)
    gaps = []
    monkeypatch.setattr(timing, "_idle", gaps.append)
    stream = _Stream()

    def flush(s):
        s.log.append("flush")
        s.clock_ms += 0.05  # the flush's own time must not be in anyone's sample

    contenders = {"ours": _contender("ours", 0.010), "cublas": _contender("cublas", 0.020),
                  "torch": _contender("torch", 0.030)}
    times, report = timing.time_isolated(contenders, None, stream, random.Random(0), launches=20, flush=flush)
    assert times == pytest.approx({"ours": 10.0, "cublas": 20.0, "torch": 30.0})
    log = stream.log
    timed = [log[i + 3] for i in range(len(log) - 3) if log[i:i + 3] == ["flush", "sync", "record"]]
    assert sorted(set(timed)) == ["launch:cublas", "launch:ours", "launch:torch"]
    assert all(timed.count(f"launch:{n}") == 20 for n in contenders)
    rounds = [tuple(timed[i:i + 3]) for i in range(0, 60, 3)]
    assert all(len(set(r)) == 3 for r in rounds) and len(set(rounds)) > 1  # each round all, in random orders
    # equal warm-up: the same flush, sync and idle gap before untimed launches, interleaved in rounds
    warm = timing.ISOLATED_PLAN.warmup_rounds
    untimed = [log[i + 2] for i in range(len(log) - 2) if log[i:i + 2] == ["flush", "sync"]
               and log[i + 2].startswith("launch:")]
    assert all(untimed.count(f"launch:{n}") == warm for n in contenders)
    assert len(gaps) == 3 * (20 + warm) and all(20e-6 <= g <= 500e-6 for g in gaps)
    # constant times: steady, checked on block medians; no energy per contender from single launches
    assert report.regime == "isolated" and report.rounds == 20 and report.warmup_rounds == warm
    assert report.steady is True and report.steady_after == timing.ISOLATED_PLAN.window * timing.ISOLATED_PLAN.block
    assert report.launches == {"ours": 20, "cublas": 20, "torch": 20} and report.energy_mj == {}
    assert "no energy per GEMM" in report.energy_note


def test_isolated_launch_count_follows_the_time_budget(monkeypatch):
    monkeypatch.setattr(timing, "_cp", _fake_cp)
    monkeypatch.setattr(timing, "_idle", lambda s: None)
    stream = _Stream()
    _, report = timing.time_isolated({"slow": _contender("slow", 500.0)}, None, stream, random.Random(0),
                                     launches=100, flush=lambda s: None, budget_ms=2000.0)
    # 2000 ms / 500 ms = 4 launches, raised to the minimum; plus set-up (eager, graph upload,
    # estimate) and the warm-up rounds.
    warm = timing.ISOLATED_PLAN.warmup_rounds
    assert stream.log.count("launch:slow") == timing.SERVER_MIN_LAUNCHES + 3 + warm
    assert report.rounds == timing.SERVER_MIN_LAUNCHES


def test_sustained_graphs_and_the_capture_fallbacks(monkeypatch):
    monkeypatch.setattr(timing, "_cp", _fake_cp)
    stream = _Stream()
    own = _contender("torch", 0.030)
    own.capture = lambda buf, s, n: timing.EagerReplay(own, buf, n)  # e.g. torch timed eagerly

    def broken(buf, s):
        if s.capture is not None:
            raise RuntimeError("operation not permitted when stream is capturing")

    contenders = {"ours": _contender("ours", 0.010), "torch": own, "cublaslt": broken}
    notes: dict[str, str] = {}
    times, report = timing.time_sustained(contenders, None, stream, random.Random(1), notes=notes)
    assert times == pytest.approx({"ours": 10.0, "torch": 30.0})
    assert notes == {"cublaslt": "not measured (sustained): RuntimeError: operation not permitted when stream is "
                                 "capturing"}
    assert stream.capture is None  # the broken capture was ended
    # constant times settle at once: steady after the minimum of rounds
    assert report.steady is True and report.rounds == report.steady_after == timing.SUSTAINED_BENCH.min_rounds
    assert set(report.spread) == {"ours", "torch"} and all(v == 0 for v in report.spread.values())
    with pytest.raises(RuntimeError):  # without notes (the tuner's path) a failure still raises
        timing.time_sustained(contenders, None, _Stream(), random.Random(1))


def test_outputs_match_tolerates_rounding_not_a_different_product():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 256)).astype(np.float16)
    b = rng.standard_normal((64, 256)).astype(np.float16)
    exact = a.astype(np.float64) @ b.astype(np.float64).T
    ref = exact.astype(np.float16)
    ok, stats = outputs_match(ref, ref.copy())
    assert ok and stats["bitwise_equal"] == 1.0 and stats["max_abs_diff"] == 0.0
    # Another fp32 accumulation order: an ulp here and there.
    other = (a.astype(np.float32)[:, ::-1] @ b.astype(np.float32)[:, ::-1].T).astype(np.float16)
    bumped = np.nextafter(ref, np.float16(np.inf)).astype(np.float16)
    assert outputs_match(ref, other)[0] and outputs_match(ref, bumped)[0]
    # A transposed operand or output, an unwritten element: not the same C.
    assert not outputs_match(ref, ref.T.copy())[0]
    assert not outputs_match(ref, (a.astype(np.float32) @ a.astype(np.float32).T).astype(np.float16))[0]
    holed = ref.copy()
    holed[3, 5] = np.nan
    ok, stats = outputs_match(ref, holed)
    assert not ok and stats["nan"] == 1 and stats["outside_tolerance"] == 1


def test_notes_are_listed_once_with_their_shapes():
    notes = {A: {"server": "L2 flushed", "torch": "not measured: x", "torch_check": "100% bitwise",
                 "ours0": "not measured (server): boom"},
             B: {"server": "L2 flushed", "torch": "not measured: y"}}
    assert bm.note_lines(notes) == ["- server: L2 flushed (all shapes)", f"- torch: not measured: x ({A})",
                                    f"- torch: not measured: y ({B})"]


# ---- the command line --------------------------------------------------------------------------

def test_bench_command_on_a_fake_gpu(tmp_path, monkeypatch):
    """The command itself (progress, tables, files, exit code) with the GPU and nvcc faked."""
    from typer.testing import CliRunner

    from tuner.api import results as api_results
    from tuner.cli.app import app

    backend = FakeBackend(REPLIES)
    monkeypatch.setattr(api_results, "make_backend", lambda *a: backend)
    monkeypatch.setattr(bm, "Builder", lambda space, target, pool: FakeBuilder(broken={E}))
    monkeypatch.setattr(api_results, "nvcc_path", lambda: "/usr/bin/nvcc")
    monkeypatch.setattr(api_results, "cutlass_include", lambda: tmp_path)
    path = tmp_path / "best.json"
    path.write_text(json.dumps(make_export([make_entry(A), make_entry(B), make_entry(C), make_entry(E),
                                            make_entry(A, gpu="NVIDIA A100-SXM4-80GB", arch="sm_80")])))
    res = CliRunner().invoke(app, ["bench", str(path), "--out", str(tmp_path / "out"),
                                       "--space", str(ROOT / "space.yaml")])
    assert res.exit_code == 1, res.output  # two kernels did not verify / build
    assert backend.closed and sorted(c[0] for c in backend.calls) == sorted([A, B, C])
    assert all(c[2] == ["sustained", "isolated"] for c in backend.calls)  # --mode defaults to both
    text = res.output
    assert "geomean speedup" in text and "0.791x (1/2 faster)" in text and "1.369x (2/2 faster)" in text
    assert "skipped 1024x1024x1024 wmma: tuned on NVIDIA A100-SXM4-80GB" in text
    assert "baseline not measured: torch (not measured: torch is not installed" in text
    assert {f.name for f in (tmp_path / "out").iterdir()} >= {"bench.csv", "bench_geomean.csv", "bench.md",
                                                              "bench.json"}
    res = CliRunner().invoke(app, ["bench", str(path), "--mode", "server", "--out", str(tmp_path / "o2"),
                                       "--space", str(ROOT / "space.yaml")])
    assert backend.calls[-1][2] == ["isolated"]  # server: the isolated regime's older name
    assert json.loads((tmp_path / "o2" / "bench.json").read_text())["modes"] == ["isolated"]


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner.cli", "bench", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def _one_line_exit_2(res: subprocess.CompletedProcess, needle: str) -> None:
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], res.stderr


def test_bad_json_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "best.json"
    bad.write_text('{"entries": [\n  {"gpu": "NVIDIA H200",\n}')
    _one_line_exit_2(run_cli(str(bad)), f"{bad}:3: not valid JSON")
    _one_line_exit_2(run_cli(str(tmp_path / "missing.json")), "cannot read")
    bad.write_text(json.dumps({"hello": 1}))
    _one_line_exit_2(run_cli(str(bad)), "not an hgemm-tune export")
    entry = make_entry(A)
    del entry["arch"]
    data = {"schema_version": 1, "tool": "hgemm-tune", "tool_version": "0.1.0", "created": "x", "simulated": False,
            "entries": [entry]}
    bad.write_text(json.dumps(data))
    _one_line_exit_2(run_cli(str(bad)), "entries/0: 'arch' is a required property")
    bad.write_text(json.dumps(data | {"entries": []}))
    _one_line_exit_2(run_cli(str(bad)), "the export has no entries")
    _one_line_exit_2(run_cli(str(bad), "--mode", "fast"), "--mode 'fast': use sustained, isolated or both")


def test_no_gpu_is_one_line_exit_2(tmp_path):
    _gpu_reason = pytest.importorskip("tests.conftest")._gpu_reason

    if _gpu_reason() is None:
        pytest.skip("a GPU is present here")
    path = tmp_path / "best.json"
    path.write_text(json.dumps(make_export([make_entry(A)])))
    res = run_cli(str(path), "--out", str(tmp_path / "bench"))
    _one_line_exit_2(res, "GPU worker cannot start")


# ---- on a GPU: the whole command -------------------------------------------------------------

@pytest.mark.gpu
def test_bench_command_end_to_end_both_modes(tmp_path):
    """Tune a small wmma shape briefly, export it, then `hgemm-tune bench --mode both` (sustained and isolated)."""
    from tuner.build import CompilePool
    from tuner.measure import GpuBackend
    from tuner.results import write_json
    from tuner.results.export import export_studies
    from tuner.search import tune
    from tuner.space import load_space, parse_shape

    space = load_space(ROOT / "space.yaml")
    backend = GpuBackend()
    pool = CompilePool(4)
    try:
        study = tune(space, ["wmma"], parse_shape("512x384x256"), backend, trials=2,
                     storage=f"sqlite:///{tmp_path}/b.db", pool=pool)
    finally:
        pool.close()
        backend.close()
    path = write_json(export_studies([study]), tmp_path / "best.json")
    res = run_cli(str(path), "--mode", "both", "--out", str(tmp_path / "bench"), "--space", str(ROOT / "space.yaml"),
                  cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "bench" / "bench.json").read_text())
    rows = {r["mode"]: r for r in out["rows"]}
    assert set(rows) == {"sustained", "isolated"}, out["rows"]
    torch_ok = subprocess.run([sys.executable, "-c", "import torch; assert torch.cuda.is_available()"],
                              capture_output=True).returncode == 0
    for mode, r in rows.items():
        assert r["status"] == "ok" and r["verified"], r
        assert r["ours_us"] > 0 and 0 < r["ours_tflops"] < H200.peak_tflops, r
        for b in ("cublas", "cublaslt", "cublaslt_auto") + (("torch",) if torch_ok else ()):
            assert r[f"{b}_us"] > 0 and r[f"speedup_{b}"] > 0, (mode, b, r, out["notes"])
    # Cold single launches from idle are no faster than back-to-back graph replays.
    assert rows["isolated"]["ours_us"] > 0.8 * rows["sustained"]["ours_us"]
    # the sustained protocol reports whether it settled; a steady state within its round limit is expected
    assert all(r["steady"] in (True, False) for r in rows.values()), rows
    geo = {(g["mode"], g["baseline"]): g["geomean_speedup"] for g in out["geomeans"]}
    assert all(geo[(m, "cublas")] > 0 for m in ("sustained", "isolated"))
    md = (tmp_path / "bench" / "bench.md").read_text()
    assert "| 512x384x256 | sustained | wmma |" in md and "| 512x384x256 | isolated | wmma |" in md
    assert "Geomean speedup" in md and (tmp_path / "bench" / "bench.csv").is_file()


def test_report_plots_a_bench_json(result, tmp_path):
    """`hgemm-tune report bench.json` draws speedup vs FLOPs per baseline, one panel per mode."""
    bm.write_outputs(result, tmp_path, "best.json")
    res = subprocess.run([sys.executable, "-m", "tuner.cli", "report", str(tmp_path / "bench.json"),
                          "--out", str(tmp_path / "rep")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    png = tmp_path / "rep" / "bench_speedup_vs_flops.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_repeats_report_medians_and_the_ratio_range():
    """--repeats: times are medians over the runs; ratios are the median of per-run ratios,
    paired within each run; the cuBLAS cell shows the lowest and highest per-run ratio; each
    run after the first starts a fresh worker."""
    data = make_export([make_entry(A)])
    replies = iter([ok_reply({"offline": {"ours0": t, "cublas": c}})
                    for t, c in ((40.0, 38.0), (38.0, 39.9), (41.0, 41.0))])
    restarts = []
    backend = FakeBackend({A: lambda cands: next(replies)})
    backend.restart = lambda: restarts.append(1)
    res = bm.run_benchmark(data, backend, FakeBuilder(), ["offline"], repeats=3)
    (row,) = res["rows"]
    assert len(restarts) == 2 and row["runs"] == 3
    assert row["ours_us"] == 40.0 and row["cublas_us"] == 39.9  # median us, ours and cuBLAS
    assert row["speedup_cublas"] == pytest.approx(1.0)  # median of the per-run ratios, not 39.9 / 40.0
    assert (row["speedup_cublas_min"], row["speedup_cublas_max"]) == (pytest.approx(0.95), pytest.approx(1.05))
    md = bm.markdown(res)
    assert "1.000 (0.950-1.050)" in md and "3 runs, each in a fresh worker process" in md
    # one run: no range
    one = bm.run_benchmark(data, FakeBackend({A: ok_reply({"offline": {"ours0": 40.0, "cublas": 38.0}})}),
                           FakeBuilder(), ["offline"])
    assert "(0.950" not in bm.markdown(one) and "fresh worker" not in bm.markdown(one)


def test_bench_repeats_count_a_kernel_only_if_every_run_verified_it():
    """A kernel that fails verification in one of the runs is a failed row, never a median of the
    runs it passed."""
    data = make_export([make_entry(A)])
    replies = iter([ok_reply({"offline": {"ours0": 10.0, "cublas": 12.0}}),
                    ok_reply({"offline": {"cublas": 12.0}}, verify={"ours0": {"ok": False, "kind": "wrong",
                                                                              "reason": "3 outputs differ"}})])
    backend = FakeBackend({A: lambda cands: next(replies)})
    backend.restart = lambda: None
    (row,) = bm.run_benchmark(data, backend, FakeBuilder(), ["offline"], repeats=2)["rows"]
    assert row["status"] == "failed" and row["reason"] == "wrong: 3 outputs differ" and row["speedup_cublas"] is None


@pytest.mark.nvcc
def test_prebuild_fills_the_cache_without_a_gpu(tmp_path):
    """`hgemm-tune prebuild` compiles an export's kernels and a fresh study's seeds for --arch into
    HGEMM_TUNE_CACHE with no GPU present, so a CPU machine can build the cache that a GPU run then
    carries; a second run finds every build cached."""
    entry = make_entry("256x256x256", arch="sm_90a", knobs=WMMA_KNOBS)
    path = tmp_path / "best.json"
    path.write_text(json.dumps(make_export([entry])))
    env = os.environ | {"HGEMM_TUNE_CACHE": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "tuner.cli", "prebuild", str(path), "--families", "wmma", "--arch", "sm_90a"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "256x256x256 (export)" in done.stdout and "1 of 1 built" in done.stderr
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == 1
    seeds = subprocess.run(cmd + ["--shapes", "256x256x256"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
    assert seeds.returncode == 0, seeds.stderr
    assert "cached" in seeds.stdout and "seed" in seeds.stdout  # the export's build is found; seeds are built
    assert len(list((tmp_path / "cache").glob("*.cubin"))) >= 2
    bad = subprocess.run([sys.executable, "-m", "tuner.cli", "prebuild"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: prebuild needs an export file, --shapes, or both"


def test_bench_buckets_follow_the_cuda_l2_table(result):
    """Per regime and FLOP bucket: our best per shape against each baseline, and how often cuBLAS
    stays the pick (A: 2.1e9 FLOPs, B: 4.29e9, one bucket; C did not verify, E did not build)."""
    by = {(g["mode"], g["bucket"]): g for g in result["buckets"]}
    assert set(by) == {("sustained", "2.7e+08-4.3e+09"), ("isolated", "2.7e+08-4.3e+09")}
    sus, iso = by[("sustained", "2.7e+08-4.3e+09")], by[("isolated", "2.7e+08-4.3e+09")]
    assert sus["shapes"] == 2 and sus["cublas"] == pytest.approx((0.5 * 1.25) ** 0.5) and sus["vendor_keeps"] == 0.5
    assert iso["cublas"] == pytest.approx((1.5 * 1.25) ** 0.5) and iso["vendor_keeps"] == 0.0
    assert "## By FLOP bucket" in bm.markdown(result) and "| sustained | 2.7e+08-4.3e+09 | 2 |" in bm.markdown(result)


def test_a_long_bench_stops_at_its_deadline_checkpoints_and_resumes():
    data = make_export([make_entry(A), make_entry(B), make_entry(E)])
    saved = []
    first = bm.run_benchmark(data, FakeBackend(REPLIES | {E: REPLIES[A]}), FakeBuilder(), ["offline"],
                             deadline=0.0, checkpoint=saved.append)
    assert first["rows"] == [] and first["left"] == 3  # past the deadline before the first shape
    part = bm.run_benchmark(data, FakeBackend(REPLIES | {E: REPLIES[A]}), FakeBuilder(), ["offline"],
                            checkpoint=saved.append, checkpoint_s=0.0)
    assert part["left"] == 0 and saved and saved[-1]["left"] == 1  # a checkpoint before each later shape
    earlier = {"rows": [r for r in part["rows"] if r["shape"] == E], "notes": {}}
    backend = FakeBackend(REPLIES)
    rest = bm.run_benchmark(data, backend, FakeBuilder(), ["offline"], earlier=earlier)
    assert sorted(c[0] for c in backend.calls) == sorted([A, B])  # E kept, not timed again
    assert sorted({r["shape"] for r in rest["rows"]}) == sorted([A, B, E]) and rest["left"] == 0


def test_bench_resume_refuses_another_bench(tmp_path, monkeypatch):
    """--resume keeps an unfinished run's shapes of the same export, regimes and repeats; another
    bench in --out, or a damaged one, is a one-line error before the GPU starts."""
    from typer.testing import CliRunner

    from tuner.api import results as api_results
    from tuner.cli.app import app

    backend = FakeBackend(REPLIES)
    monkeypatch.setattr(api_results, "make_backend", lambda *a: backend)
    monkeypatch.setattr(bm, "Builder", lambda space, target, pool: FakeBuilder())
    monkeypatch.setattr(api_results, "nvcc_path", lambda: "/usr/bin/nvcc")
    monkeypatch.setattr(api_results, "cutlass_include", lambda: tmp_path)
    path = tmp_path / "best.json"
    path.write_text(json.dumps(make_export([make_entry(A), make_entry(B)])))
    out = tmp_path / "out"
    args = ["bench", str(path), "--out", str(out), "--mode", "sustained", "--space", str(ROOT / "space.yaml")]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    calls = len(backend.calls)
    res = CliRunner().invoke(app, [*args, "--resume"])
    assert res.exit_code == 0, res.output
    assert len(backend.calls) == calls  # both shapes were benched: nothing timed again
    assert len(json.loads((out / "bench.json").read_text())["rows"]) == 2
    res = CliRunner().invoke(app, [*args[:5], "both", *args[6:], "--resume"])
    assert isinstance(res.exception, UserError) and "holds another bench" in str(res.exception)
    (out / "bench.json").write_text("{")
    res = CliRunner().invoke(app, [*args, "--resume"])
    assert isinstance(res.exception, UserError) and "cannot be read as a bench result" in str(res.exception)


def test_autotune_sample_is_stratified_and_reaches_the_worker():
    shapes = [f"{m}x{n}x{k}" for m in (64, 512, 4096) for n in (64, 512, 4096) for k in (64, 512, 4096)]
    sample = bm.autotune_sample(shapes, 6)
    assert bm.autotune_sample(shapes, 6) == sample and 5 <= len(sample) <= 8  # the same draw every time
    buckets = {bm.flop_bucket(2.0 * math.prod(int(d) for d in s.split("x"))) for s in shapes}
    assert {bm.flop_bucket(2.0 * math.prod(int(d) for d in s.split("x"))) for s in sample} == buckets
    assert bm.autotune_sample(shapes, 100) == set(shapes)
    data = make_export([make_entry(A), make_entry(B)])
    backend = FakeBackend(REPLIES)
    bm.run_benchmark(data, backend, FakeBuilder(), ["offline"], autotune_shapes={B})
    assert backend.autotuned == [B]


def test_resume_benches_again_a_shape_whose_export_entry_changed():
    """A grid's export grows and re-picks between calls: an earlier row counts only while the
    export still holds that kernel at that shape."""
    first = bm.run_benchmark(make_export([make_entry(A), make_entry(B)]), FakeBackend(REPLIES), FakeBuilder(),
                             ["offline"])
    repicked = make_export([make_entry(A, knobs=WMMA_KNOBS | {"STAGES": 3}), make_entry(B)])
    backend = FakeBackend(REPLIES)
    again = bm.run_benchmark(repicked, backend, FakeBuilder(), ["offline"], earlier=first)
    assert [c[0] for c in backend.calls] == [A]  # B kept; A's kernel changed: timed again
    assert sorted(r["shape"] for r in again["rows"]) == sorted([A, B])

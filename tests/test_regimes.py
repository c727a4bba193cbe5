"""The two named timing regimes (CPU): the steady-state and energy rules, the sustained protocol on
a simulated GPU that runs its queue only when the host waits (as a real one runs ahead of it),
the regimes through the worker protocol, the replay backend and a search (`--objective`), and
older bench files read by their regime names."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tuner.errors import UserError
from tuner.measure import ReplayBackend, timing
from tuner.measure.backend import EvalRequest, LaunchSpec, Measurement
from tuner.measure.protocol import (
    PROTOCOL_VERSION,
    CompareReply,
    EvaluateRequest,
    decode_reply,
    decode_request,
    encode_request,
)
from tuner.measure.regimes import (
    ISOLATED,
    SUSTAINED,
    Plan,
    RegimeReport,
    canonical,
    combine_reports,
    slice_energy,
    steady_after,
)
from tuner.measure.replay import record_baseline, record_measurement
from tuner.space import parse_shape

DATA = Path(__file__).resolve().parent / "data"
REPLAY = DATA / "replay_4096x4096x8192.jsonl"
SHAPE = parse_shape("4096x4096x8192")


# ---- the rules ---------------------------------------------------------------------------------

def test_regime_names_and_their_older_aliases():
    assert canonical("sustained") == canonical("Offline") == SUSTAINED
    assert canonical(" isolated ") == canonical("server") == ISOLATED
    with pytest.raises(ValueError, match="use sustained or isolated"):
        canonical("energy")


def test_steady_after_needs_every_contender_within_tolerance_over_the_window():
    settling = [110.0, 105.0, 102.0, 100.5, 100.2, 100.0, 100.1, 100.0]
    flat = [50.0] * 8
    # the window of 3 rounds first within 1% for both: rounds 4-6 (100.5, 100.2, 100.0)
    assert steady_after({"a": settling, "b": flat}, window=3, tol=0.01) == 6
    assert steady_after({"a": settling, "b": flat}, window=3, tol=0.01, min_rounds=7) == 7
    wobble = [100.0, 104.0] * 4  # 4% apart every other round: never within 2%
    assert steady_after({"a": flat, "b": wobble}, window=3, tol=0.02) is None
    assert steady_after({"a": flat[:2]}, window=3, tol=0.02) is None  # too few rounds to say


def test_slice_energy_is_a_contenders_own_and_refused_when_the_counter_is_coarse():
    assert slice_energy([(300.0, 100), (310.0, 100)]) == (pytest.approx(3.05), None)
    mj, why = slice_energy([(600.0, 100), (0.0, 100), (620.0, 100), (0.0, 100)])
    assert mj is None and "moved in 2 of 4 slices" in why
    assert slice_energy([(None, 100)]) == (None, "no energy counter reading")


def test_combine_reports_over_runs():
    a = RegimeReport(SUSTAINED, rounds=9, steady=True, steady_after=9, energy_mj={"x": 3.0, "y": 2.0},
                     spread={"x": 0.01}).to_dict()
    b = RegimeReport(SUSTAINED, rounds=14, steady=True, steady_after=14, energy_mj={"x": 5.0, "y": None},
                     spread={"x": 0.015}).to_dict()
    c = RegimeReport(SUSTAINED, rounds=60, steady=False, energy_mj={"x": 4.0}).to_dict()
    both = combine_reports([a, b])
    assert both["steady"] is True and both["steady_after"] == 14 and both["steady_runs"] == 2
    assert both["energy_mj"] == {"x": 4.0, "y": None} and both["spread"] == {"x": 0.015}
    mixed = combine_reports([a, b, c])
    assert mixed["steady"] is False and mixed["steady_runs"] == 2 and mixed["runs"] == 3
    assert combine_reports([a, {}])["steady"] is None  # a run that said nothing: unknown, never assumed
    assert combine_reports([{}, {}])["steady"] is None


# ---- the sustained protocol on a simulated GPU ------------------------------------------------

class LazyGpu:
    """A stream whose work runs only when the host waits on it (an event or a synchronize), as a
    GPU runs ahead of the host; an energy counter (mJ) that follows each contender's power."""

    def __init__(self, power_w: dict[str, float], counter_step_mj: float = 0.0):
        self.clock_ms, self.energy, self.queue, self.capture = 0.0, 0.0, [], None
        self.power_w, self.step = power_w, counter_step_mj
        self.slices: list[str] = []  # the contender of each maximal run of launches, in GPU order
        self.ptr = 7

    def run(self, name: str, ms: float) -> None:
        def op():
            if not self.slices or self.slices[-1] != name:
                self.slices.append(name)
            self.clock_ms += ms
            self.energy += self.power_w.get(name, 0.0) * ms
        self.queue.append(op)

    def counter(self) -> float:
        """The energy counter as NVML would read it: whole steps of `counter_step_mj` when set."""
        return self.energy if not self.step else self.step * (self.energy // self.step)

    def drain(self, until=None) -> None:
        while self.queue:
            op = self.queue.pop(0)
            op()
            if op is until:
                return

    def synchronize(self):
        self.drain()

    def begin_capture(self):
        self.capture = []

    def is_capturing(self):
        return self.capture is not None

    def end_capture(self):
        ops, self.capture = self.capture, None
        return SimpleNamespace(launch=lambda stream: [op(stream) for op in ops])


class LazyEvent:
    def __init__(self):
        self.t, self.stream, self.op = None, None, None

    def record(self, stream):
        self.stream = stream

        def op():
            self.t = stream.clock_ms
        self.op = op
        stream.queue.append(op)

    def synchronize(self):
        self.stream.drain(self.op)


def _lazy_cp():
    return SimpleNamespace(cuda=SimpleNamespace(Event=LazyEvent, get_elapsed_time=lambda s, e: e.t - s.t,
                                                runtime=SimpleNamespace(CUDARuntimeError=RuntimeError)))


def _contender(name: str, ms):
    """A launch of `ms` (a number, or a function of the GPU clock in ms: a kernel whose speed drifts)."""
    def launch(buf, stream):
        t = ms(stream.clock_ms) if callable(ms) else ms
        if stream.capture is not None:
            stream.capture.append(lambda s: s.run(name, ms(s.clock_ms) if callable(ms) else ms))
        else:
            stream.run(name, t)
    return launch


class EnergySampler:
    def __init__(self, gpu: LazyGpu):
        self.gpu, self.log = gpu, []

    def start(self):
        self.log.append("start")

    def stop(self, gemms=None):
        self.log.append(("stop", gemms))

    def energy_mj(self):
        return self.gpu.counter()


SMALL = Plan(slice_ms=1.0, warmup_rounds=2, min_rounds=4, max_rounds=40, window=3, tol=0.01, max_s=60.0)


def test_sustained_interleaves_short_slices_in_a_new_order_every_round(monkeypatch):
    monkeypatch.setattr(timing, "_cp", _lazy_cp)
    queued: list[tuple[int, str]] = []
    real = timing._Slice

    def logged(r, name, *rest):
        queued.append((r, name))
        return real(r, name, *rest)

    monkeypatch.setattr(timing, "_Slice", logged)
    gpu = LazyGpu({})
    names = ["ours", "cublas", "cublaslt", "torch"]
    contenders = {n: _contender(n, 0.01 * (i + 1)) for i, n in enumerate(names)}
    times, report = timing.time_sustained(contenders, None, gpu, random.Random(3), plan=SMALL)
    assert times == pytest.approx({"ours": 10.0, "cublas": 20.0, "cublaslt": 30.0, "torch": 40.0})
    rounds: dict[int, list[str]] = {}
    for r, name in queued:
        rounds.setdefault(r, []).append(name)
    full = [order for order in rounds.values() if len(order) == len(names)]
    assert len(full) == SMALL.warmup_rounds + report.rounds  # equal warm-up, then the timed rounds
    assert all(sorted(order) == sorted(names) for order in full)  # every round: each contender once
    assert len({tuple(order) for order in full}) > 1  # ... in a new order
    # the one slice queued when the rounds stopped ran, untimed
    assert len(queued) == len(names) * len(full) + 1
    # slices back to back: the GPU ran every slice's launches without a host wait between them
    assert gpu.slices[len(names):][:3] != []
    assert report.steady and report.rounds == report.steady_after == SMALL.min_rounds
    assert report.warmup_rounds == SMALL.warmup_rounds and report.window == SMALL.window


def test_sustained_runs_until_steady_and_says_when_it_is_not(monkeypatch):
    monkeypatch.setattr(timing, "_cp", _lazy_cp)

    def cooling(t):  # 30% slow at first, settling as the (simulated) power state settles
        return 0.01 * (1.0 + 0.3 * 0.5 ** (t / 5.0))

    gpu = LazyGpu({})
    times, report = timing.time_sustained({"ours": _contender("ours", cooling), "cublas": _contender("cublas", 0.02)},
                                          None, gpu, random.Random(0), plan=SMALL)
    assert report.steady and report.steady_after > SMALL.min_rounds and report.rounds == report.steady_after
    assert report.spread["ours"] <= SMALL.tol and times["ours"] == pytest.approx(10.0, rel=0.02)

    class Wobbly:  # every replay of its graph 5% slower or faster than the one before, forever
        def __init__(self, n):
            self.n, self.replays = n, 0

        def launch(self, stream):
            self.replays += 1
            for _ in range(self.n):
                stream.run("ours", 0.0105 if self.replays % 2 else 0.0100)

    wobbling = _contender("ours", 0.01)
    wobbling.capture = lambda buf, s, n: Wobbly(n)  # its own graph (as torch's is)
    gpu = LazyGpu({})
    plan = Plan(slice_ms=1.0, warmup_rounds=1, min_rounds=3, max_rounds=12, window=3, tol=0.01, max_s=60.0)
    _, report = timing.time_sustained({"ours": wobbling, "cublas": _contender("cublas", 0.02)},
                                      None, gpu, random.Random(0), plan=plan)
    assert report.steady is False and report.steady_after is None and report.rounds == plan.max_rounds


def test_sustained_gives_each_contender_its_own_energy_per_gemm(monkeypatch):
    monkeypatch.setattr(timing, "_cp", _lazy_cp)
    # 700 W for ours, 400 W for cuBLAS: per GEMM 700 W x 10 us = 7 mJ and 400 W x 20 us = 8 mJ
    gpu = LazyGpu({"ours": 700.0, "cublas": 400.0})
    sampler = EnergySampler(gpu)
    contenders = {"ours": _contender("ours", 0.010), "cublas": _contender("cublas", 0.020)}
    _, report = timing.time_sustained(contenders, None, gpu, random.Random(5), sampler=sampler, plan=SMALL)
    assert report.energy_mj == {"ours": pytest.approx(7.0), "cublas": pytest.approx(8.0)}
    assert report.energy_note is None
    assert sampler.log[0] == "start" and sampler.log[-1][0] == "stop"
    # a counter that moves in steps coarser than a slice gives lumps: no energy, and why
    gpu = LazyGpu({"ours": 700.0, "cublas": 400.0}, counter_step_mj=10_000.0)
    _, report = timing.time_sustained(contenders, None, gpu, random.Random(5), sampler=EnergySampler(gpu), plan=SMALL)
    assert report.energy_mj == {"ours": None, "cublas": None} and "too coarse" in report.energy_note


# ---- the worker protocol -------------------------------------------------------------------------

def test_protocol_5_carries_the_regime_both_ways():
    assert PROTOCOL_VERSION == 5
    req = EvaluateRequest("/k.cubin", (64, 64, 64), LaunchSpec(), [{}], mode=ISOLATED)
    assert decode_request(encode_request(req)) == req
    rep = RegimeReport(ISOLATED, rounds=100, steady=True, steady_after=20).to_dict()
    # an older worker's keys (offline, server) are found under the regimes' names
    reply = decode_reply(CompareReply, {"status": "ok", "modes": ["offline", "server"],
                                        "times_by_mode": {"offline": {"a": 1.0}, "server": {"a": 2.0}},
                                        "regimes_by_mode": {"server": rep}})
    assert reply.times_in(SUSTAINED) == {"a": 1.0} and reply.times_in(ISOLATED) == {"a": 2.0}
    assert reply.regime_in("isolated").steady_after == 20 and reply.regime_in(SUSTAINED).steady is None


# ---- --objective: the replay backend, the search, the export -----------------------------------

@pytest.fixture
def two_regime_replay(tmp_path):
    """The H200 replay file plus the same configs in the isolated regime (synthetic: each time
    plus 2%, the cuBLAS baseline plus 3%, a steady report), written by record_measurement."""
    path = tmp_path / "two.jsonl"
    lines = [json.loads(x) for x in REPLAY.read_text().splitlines() if x.strip()]
    for rec in lines:
        if rec.get("type") == "baseline":
            record_baseline(path, SHAPE, rec["baselines_us"])
            record_baseline(path, SHAPE, {k: v * 1.03 for k, v in rec["baselines_us"].items()}, mode=ISOLATED)
            continue
        path.open("a").write(json.dumps(rec) + "\n")
        m = Measurement(**rec["measurement"])
        m.times_us = {k: v * 1.02 for k, v in m.times_us.items()}
        m.mode = ISOLATED
        m.regime = RegimeReport(ISOLATED, rounds=100, warmup_rounds=3, steady=True, steady_after=20).to_dict()
        record_measurement(path, EvalRequest(rec["family"], rec["config"], SHAPE, None, LaunchSpec(), [],
                                             mode=ISOLATED), m)
    return path


def test_an_isolated_objective_searches_its_own_study_and_exports_it(space, two_regime_replay, tmp_path):
    from tuner.results import validate
    from tuner.results.export import export_studies
    from tuner.search import StudyMeta, TrialRecord, best_trial, tune

    backend = ReplayBackend(two_regime_replay, "sm_90a")
    assert backend.baseline(SHAPE, mode="server")["cublas"] == pytest.approx(backend.baseline(SHAPE)["cublas"] * 1.03)
    storage = f"sqlite:///{tmp_path}/o.db"
    iso = tune(space, ["wmma"], SHAPE, backend, trials=6, storage=storage, seed=0, objective="isolated")
    sus = tune(space, ["wmma"], SHAPE, backend, trials=6, storage=storage, seed=0)
    assert iso.study_name == sus.study_name + "-isolated"  # two studies: one regime's times each
    assert StudyMeta.of(iso).objective == ISOLATED and StudyMeta.of(sus).objective == SUSTAINED
    bi, bs = TrialRecord.of(best_trial(iso)), TrialRecord.of(best_trial(sus))
    assert bi.objective == ISOLATED and bi.regime_report["steady_after"] == 20
    assert bs.objective == SUSTAINED and bs.regime_report == {}
    if bi.config == bs.config:
        assert bi.time_us == pytest.approx(bs.time_us * 1.02)
    data = export_studies([iso, sus])
    validate(data)
    by = {e["study"]: e for e in data["entries"]}
    assert by[iso.study_name]["objective"] == ISOLATED and by[iso.study_name]["steady_state"]["steady"] is True
    assert by[sus.study_name]["objective"] == SUSTAINED and by[sus.study_name]["steady_state"]["steady"] is None
    # a study is never resumed in another regime
    with pytest.raises(UserError, match="minimizes the isolated time"):
        tune(space, ["wmma"], SHAPE, backend, trials=7, storage=storage, name=iso.study_name)


def test_a_replay_file_without_the_regime_says_so(space, tmp_path):
    from tuner.search import tune

    backend = ReplayBackend(REPLAY, "sm_90a")
    with pytest.raises(UserError, match="no baseline for shape 4096x4096x8192 in the isolated regime"):
        backend.baseline(SHAPE, mode=ISOLATED)
    m = backend.evaluate(EvalRequest("wmma", {}, SHAPE, None, LaunchSpec(), [], mode=ISOLATED))
    assert m.status == "not_recorded" and "isolated regime" in m.reason
    with pytest.raises(UserError, match="--objective 'energy'"):
        tune(space, ["wmma"], SHAPE, backend, trials=1, storage=f"sqlite:///{tmp_path}/e.db", objective="energy")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)


def test_a_bad_objective_is_one_line_exit_2_and_the_help_teaches(tmp_path):
    res = _cli("tune", "--shape", "4096x4096x8192", "--backend", "replay", "--replay", str(REPLAY),
               "--objective", "fastest", "--storage", f"sqlite:///{tmp_path}/x.db")
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "--objective 'fastest': choose sustained" in lines[0], res.stderr
    helped = _cli("sweep", "--help")
    assert "--objective" in helped.stdout and "power-capped" in helped.stdout


def test_report_reads_an_older_bench_json_by_regime(tmp_path):
    """A bench.json written before the regimes (modes offline and server, no steady state) still
    gives the plot and the per-contender table, under the regimes' names."""
    pytest.importorskip("matplotlib")
    from tuner.results.report import write_bench_report

    row = {"shape": "1024x1024x1024", "M": 1024, "N": 1024, "K": 1024, "family": "wmma", "status": "ok",
           "verified": True, "reason": None, "ours_us": 10.0, "ours_tflops": 214.7, "roofline_pct": 21.7,
           "cublas_us": 5.0, "cublaslt_us": None, "cublaslt_auto_us": None, "torch_us": None, "speedup_cublas": 0.5,
           "speedup_cublaslt": None, "speedup_cublaslt_auto": None, "speedup_torch": None, "runs": 1,
           "regime": "unknown"}
    old = {"gpu": "NVIDIA H200", "arch": "sm_90a", "modes": ["offline", "server"], "repeats": 1,
           "rows": [row | {"mode": "offline"}, row | {"mode": "server", "ours_us": 20.0, "cublas_us": 30.0}],
           "geomeans": [{"mode": m, "baseline": b, "geomean_speedup": None, "n": 0, "wins": 0, "ok_rows": 0}
                        for m in ("offline", "server") for b in ("cublas", "cublaslt", "cublaslt_auto", "torch")],
           "skipped": [], "notes": {}, "source": "old.json"}
    files = write_bench_report(old, tmp_path)
    md = (tmp_path / "bench_report.md").read_text()
    assert [f.name for f in files] == ["bench_speedup_vs_flops.png", "bench_report.md"]
    assert "| 1024x1024x1024 | sustained | wmma | 10.00 |" in md and "| 1024x1024x1024 | isolated | wmma |" in md
    assert "| 1024x1024x1024 | isolated | cuBLAS | 30.00 | 71.6 | 1.000 | unknown | unknown | unknown | - | - " \
           "| unknown |" in md

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
    steady_text,
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
    queued = _slices(monkeypatch)
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

def test_the_protocol_carries_the_regime_both_ways():
    assert PROTOCOL_VERSION == 6  # 5: named regimes; 6: evaluate_many
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


# ---- a search trial's screen (Screen): variants ranked briefly, only the best timed in full ---------

def test_screen_keeps_the_best_the_near_ties_and_no_more_than_the_cap():
    from tuner.measure.regimes import TRIAL_SCREEN as S

    assert (S.keep, S.margin, S.cap) == (3, 0.03, 6)
    clear = {f"v{i}": 10.0 + i for i in range(16)}  # 1 us apart: far outside 3% of the 3rd best
    assert S.survivors(clear) == ["v0", "v1", "v2"]
    ties = {"a": 10.0, "b": 10.1, "c": 10.2, "d": 10.5, "e": 10.6, "f": 12.0}  # bar: 10.2 x 1.03 = 10.506
    assert S.survivors(ties) == ["a", "b", "c", "d"]
    many = {f"t{i}": 10.0 + 0.01 * i for i in range(10)} | {"slow": 20.0}  # 10 within the margin
    assert S.survivors(many) == [f"t{i}" for i in range(6)]
    assert S.survivors({"x": 2.0, "y": 1.0}) == ["y", "x"] and not S.applies(3) and S.applies(4)


class FakeSampler:
    def __init__(self, mode=""):
        self.result = {"available": False, "reason": "fake"}

    def start(self):
        return self

    def stop(self, gemms=None):
        return self.result

    def energy_mj(self):
        return None

    def quiet(self):
        import contextlib
        return contextlib.nullcontext()


def _variant(i: int) -> dict:
    return {"RASTER": i % 4, "SWIZZLE": i // 4}


def _fake_worker(monkeypatch, gpu: LazyGpu, variant_ms: list[float], cublas_ms: float = 0.2):
    """A Worker whose GPU is `gpu`, whose binary's variant i launches in `variant_ms[i]`, with
    verification passing and no NVML; its timing code is the real one."""
    from tuner.measure import worker as wk

    monkeypatch.setattr(timing, "_cp", _lazy_cp)
    monkeypatch.setattr(timing, "_idle", lambda s: None)
    monkeypatch.setattr(wk, "ClockSampler", FakeSampler)
    for check in ("full_check", "random_check"):
        monkeypatch.setattr(wk.verify, check, lambda *a, **k: {"ok": True})
    monkeypatch.setattr(wk.verify, "fill_normal", lambda buf: None)
    by_key = {json.dumps(_variant(i), sort_keys=True): ms for i, ms in enumerate(variant_ms)}

    class Binary:
        def __init__(self, ms: float | None = None):
            self.ms = ms

        def launcher(self, variant):
            key = json.dumps(variant, sort_keys=True)
            return _contender(key, self.ms if self.ms is not None else by_key[key])

    def load(binary, launch, digest):  # compare: "/k<ms>.so" names its kernel's time
        return Binary(float(binary[2:-3]) if binary.startswith("/k") and binary != "/k.so" else None)

    monkeypatch.setattr(wk, "load_candidate", load)

    def no_lt(*a):
        raise OSError("no cuBLASLt in the fake")

    monkeypatch.setattr(wk, "CublasLt", no_lt)
    w = object.__new__(wk.Worker)
    w.stream, w.rng, w._l2_flush, w._cublas16 = gpu, random.Random(11), lambda s: None, None
    w.cublas = _contender("cublas", cublas_ms)
    w.buffers_for = lambda shape: None
    return w


def _slices(monkeypatch) -> list[tuple[int, str]]:
    """Every slice the sustained rounds queue, as (round, contender), in order."""
    log: list[tuple[int, str]] = []
    real = timing._Slice

    def logged(r, name, *rest):
        log.append((r, name))
        return real(r, name, *rest)

    monkeypatch.setattr(timing, "_Slice", logged)
    return log


def _count(log) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, name in log:
        out[name] = out.get(name, 0) + 1
    return out


def _exactly_plus_one(counts: dict[str, int], names, each: int) -> None:
    """Every one of `names` got `each` slices, one of them one more (the slice already queued when
    the rounds stopped runs out, untimed), and nothing else got any."""
    assert set(counts) == set(names), counts
    assert sorted(counts.values()) == [each] * (len(names) - 1) + [each + 1], counts


def _evaluate(w, n: int, mode: str = SUSTAINED):
    from tuner.measure.protocol import LaunchSpec as Spec

    return w.evaluate(EvaluateRequest("/k.so", (64, 64, 64), Spec(), [_variant(i) for i in range(n)], mode=mode))


def test_a_trial_screens_16_variants_and_times_only_the_kept_ones_with_cublas(monkeypatch):
    from tuner.measure.regimes import SUSTAINED_TRIAL as P
    from tuner.measure.regimes import TRIAL_SCREEN as S

    # variant 0 clearly fastest; the others 10% apart and more: exactly keep = 3 survive
    ms = [0.08] + [0.10 + 0.01 * i for i in range(15)]
    log = _slices(monkeypatch)
    reply = _evaluate(_fake_worker(monkeypatch, LazyGpu({}), ms), 16)
    keys = [json.dumps(_variant(i), sort_keys=True) for i in range(16)]
    assert reply.ok and set(reply.times) == set(keys[:3]) and reply.baselines == {"cublas": pytest.approx(200.0)}
    assert min(reply.times, key=reply.times.get) == keys[0] and reply.times[keys[0]] == pytest.approx(80.0)
    rep = RegimeReport.from_dict(reply.regime)
    assert (rep.screened, rep.kept) == (16, 3) and set(rep.screen_us) == set(keys)
    assert rep.screen_us[keys[15]] == pytest.approx(1000 * ms[15])  # the dropped ones' times: screen only
    assert set(rep.launches) == set(keys[:3]) | {"cublas"} and rep.steady and rep.rounds == P.min_rounds
    # the screen: the 16 variants alone, 1 warm-up + 2 timed rounds each; then the steady stage
    # on the 3 kept and cuBLAS only, 2 warm-up + its timed rounds each
    n_screen = 16 * (S.warmup_rounds + S.rounds) + 1
    _exactly_plus_one(_count(log[:n_screen]), keys, S.warmup_rounds + S.rounds)
    _exactly_plus_one(_count(log[n_screen:]), keys[:3] + ["cublas"], P.warmup_rounds + rep.rounds)
    assert steady_text(reply.regime) == "yes (5 rounds; 3 of 16 variants after a screen)"


def test_near_ties_within_the_margin_all_go_on_up_to_the_cap(monkeypatch):
    log = _slices(monkeypatch)
    keys = [json.dumps(_variant(i), sort_keys=True) for i in range(16)]
    # 5 variants within 3% of the 3rd best (0.1000 .. 0.1030 ms), the rest 20% slower
    ms = [0.1000, 0.1005, 0.1010, 0.1020, 0.1030] + [0.125] * 11
    reply = _evaluate(_fake_worker(monkeypatch, LazyGpu({}), ms), 16)
    rep = RegimeReport.from_dict(reply.regime)
    assert (rep.screened, rep.kept) == (16, 5) and set(reply.times) == set(keys[:5])
    assert set(_count(log[16 * 3 + 1:])) == set(keys[:5]) | {"cublas"}
    # 10 within the margin: the 6 fastest of them (the cap)
    log.clear()
    ms = [0.1000 + 0.0002 * i for i in range(10)] + [0.125] * 6
    reply = _evaluate(_fake_worker(monkeypatch, LazyGpu({}), ms), 16)
    rep = RegimeReport.from_dict(reply.regime)
    assert (rep.screened, rep.kept) == (16, 6) and set(reply.times) == set(keys[:6])
    assert set(_count(log[16 * 3 + 1:])) == set(keys[:6]) | {"cublas"}


def test_keep_or_fewer_variants_are_not_screened(monkeypatch):
    from tuner.measure.regimes import SUSTAINED_TRIAL as P

    log = _slices(monkeypatch)
    reply = _evaluate(_fake_worker(monkeypatch, LazyGpu({}), [0.1, 0.2, 0.3]), 3)
    rep = RegimeReport.from_dict(reply.regime)
    keys = [json.dumps(_variant(i), sort_keys=True) for i in range(3)]
    assert set(reply.times) == set(keys) and (rep.screened, rep.kept, rep.screen_us) == (0, 0, {})
    _exactly_plus_one(_count(log), keys + ["cublas"], P.warmup_rounds + rep.rounds)  # one stage only
    assert steady_text(reply.regime) == f"yes ({rep.rounds} rounds)"


def test_an_isolated_trial_screens_with_a_short_isolated_pass(monkeypatch):
    from tuner.measure.regimes import TRIAL_SCREEN as S

    gpu = LazyGpu({})
    launches: dict[str, int] = {}
    real_run = gpu.run

    def counted(name, ms):
        launches[name] = launches.get(name, 0) + 1
        real_run(name, ms)

    gpu.run = counted
    ms = [0.08] + [0.10 + 0.01 * i for i in range(15)]
    reply = _evaluate(_fake_worker(monkeypatch, gpu, ms), 16, mode=ISOLATED)
    keys = [json.dumps(_variant(i), sort_keys=True) for i in range(16)]
    rep = RegimeReport.from_dict(reply.regime)
    assert reply.mode == ISOLATED and set(reply.times) == set(keys[:3]) and (rep.screened, rep.kept) == (16, 3)
    assert set(rep.launches) == set(keys[:3]) | {"cublas"} and rep.launches["cublas"] == rep.rounds
    # set-up (an eager launch, the graph's upload, an estimate) + warm-up + the timed launches
    screen = 3 + S.warmup_rounds + S.isolated_rounds
    full = 3 + timing.ISOLATED_PLAN.warmup_rounds + rep.rounds
    assert all(launches[k] == screen for k in keys[3:]) and all(launches[k] == screen + full for k in keys[:3])
    assert launches["cublas"] == full


def test_bench_and_confirm_time_every_contender_in_full(monkeypatch):
    """compare (bench, confirm) never screens: 16 candidates and cuBLAS, each in every round."""
    from tuner.measure.protocol import CandidateSpec as Cand
    from tuner.measure.protocol import CompareRequest
    from tuner.measure.protocol import LaunchSpec as Spec
    from tuner.measure.regimes import SUSTAINED_BENCH as B

    log = _slices(monkeypatch)
    w = _fake_worker(monkeypatch, LazyGpu({}), [])
    cands = {f"ours{i}": Cand(f"/k{0.5 + 0.05 * i:.2f}.so", Spec()) for i in range(16)}
    reply = w.compare(CompareRequest((64, 64, 64), cands, torch=False))
    assert reply.ok and set(reply.times) == set(cands) | {"cublas"}
    rep = reply.regime_in(SUSTAINED)
    assert (rep.screened, rep.kept, rep.screen_us) == (0, 0, {}) and rep.rounds == B.min_rounds
    _exactly_plus_one(_count(log), [*cands, "cublas"], B.warmup_rounds + rep.rounds)


def test_the_screen_can_be_switched_off_for_an_a_b_run(monkeypatch):
    from tuner.measure.regimes import SCREEN_ENV

    monkeypatch.setenv(SCREEN_ENV, "0")
    reply = _evaluate(_fake_worker(monkeypatch, LazyGpu({}), [0.08] + [0.10 + 0.01 * i for i in range(15)]), 16)
    assert len(reply.times) == 16 and RegimeReport.from_dict(reply.regime).screened == 0

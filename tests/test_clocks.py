"""Clock regimes (CPU): ClockSampler on a fake pynvml, the timing loops' sections, the replay
backend carrying clock records through a tune into the export and the summary table, and bench's
clock columns (markdown, CSV, the CLI table)."""

from __future__ import annotations

import csv
import json
import math
import random
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from tuner.measure import ReplayBackend, clocks, timing
from tuner.measure.backend import EvalRequest, LaunchSpec, Measurement
from tuner.measure.protocol import CompareReply, decode_reply
from tuner.measure.regimes import RegimeReport
from tuner.measure.replay import record_baseline, record_measurement
from tuner.results import bench as bm
from tuner.space import parse_shape

DATA = Path(__file__).resolve().parent / "data"
REPLAY = DATA / "replay_4096x4096x8192.jsonl"
SHAPE = parse_shape("4096x4096x8192")
CAP, IDLE, THERM = 0x4, 0x1, 0x20


def _w(rows):
    """Rows with power in mW (as NVML reads it) -> the sampler's rows (W), for `summarize`."""
    return [(sm, mem, mw / 1000.0, temp, mask) for sm, mem, mw, temp, mask in rows]


class FakeNvml:
    """pynvml as far as ClockSampler uses it. Each sample (read starting with the reasons) takes
    the next row of `script`: (SM MHz, memory MHz, power mW, temperature C, reasons bitmask)."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    class NVMLError(Exception):
        pass

    def __init__(self, script, energy_mj=None, devices=2):
        self.script, self.step, self.row = list(script), -1, None
        self.energy = list(energy_mj) if energy_mj is not None else None
        self.devices, self.opened_by = devices, None
        self.inits = 0

    def nvmlInit(self):
        self.inits += 1

    def nvmlDeviceGetCount(self):
        return self.devices

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        self.opened_by = ("pci", bus)
        return "h"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.opened_by = ("uuid", uuid)
        return "h"

    def nvmlDeviceGetHandleByIndex(self, i):
        self.opened_by = ("index", i)
        return "h"

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        self.step = min(self.step + 1, len(self.script) - 1)
        self.row = self.script[self.step]
        return self.row[4]

    def nvmlDeviceGetClockInfo(self, h, kind):
        return self.row[0] if kind == self.NVML_CLOCK_SM else self.row[1]

    def nvmlDeviceGetPowerUsage(self, h):
        return self.row[2]

    def nvmlDeviceGetTemperature(self, h, kind):
        return self.row[3]

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if self.energy is None:
            raise self.NVMLError("Not Supported")
        return self.energy.pop(0) if len(self.energy) > 1 else self.energy[0]


@pytest.fixture
def nvml(monkeypatch):
    """Install a fake pynvml (sys.modules) and a PCI bus id for CUDA device 0."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(clocks.DISABLE_ENV, raising=False)
    monkeypatch.setattr(clocks, "_cuda_pci_bus_id", lambda: "00000000:1B:00.0")
    clocks.reset_nvml()

    def install(script, energy_mj=None, devices=2):
        fake = FakeNvml(script, energy_mj, devices)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        clocks.reset_nvml()
        return fake

    yield install
    clocks.reset_nvml()


# The open() probe reads one sample, start() one, two by hand, stop() one: rows 1-4 are the section.
CAPPED = [(1980, 2619, 300_000, 40, 0),                          # the probe when NVML opens
          (1965, 2619, 520_000, 45, 0),
          (1500, 2619, 699_000, 58, CAP),
          (1365, 2619, 701_500, 61, CAP | 0x10),
          (1620, 2619, 690_000, 60, CAP)]


def _section(sampler, extra: int = 2, gemms: int | None = None) -> dict:
    sampler.start()
    for _ in range(extra):
        sampler._sample()
    return sampler.stop(gemms=gemms)


def test_sampler_aggregates_decodes_and_labels_a_power_capped_section(nvml):
    fake = nvml(CAPPED, energy_mj=[1_000_000, 1_012_500])
    s = clocks.ClockSampler("offline", interval_s=60.0)  # the thread never fires: samples by hand
    assert s.available and fake.opened_by == ("pci", "00000000:1B:00.0") and fake.inits == 1
    rec = _section(s, gemms=250)
    assert rec["available"] and rec["mode"] == "offline" and rec["samples"] == 4
    assert (rec["sm_mhz_min"], rec["sm_mhz_median"], rec["sm_mhz_max"]) == (1365, (1500 + 1620) / 2, 1965)
    assert rec["mem_mhz_median"] == 2619 and rec["temp_c_max"] == 61 and rec["power_limit_w"] == 700.0
    assert rec["power_w_median"] == pytest.approx((690.0 + 699.0) / 2) and rec["power_w_max"] == 701.5
    assert rec["reasons"] == {"sw_power_cap": 0.75, "sync_boost": 0.25}
    assert rec["busy_samples"] == 4 and rec["regime"] == "power-capped"
    assert rec["energy_j"] == pytest.approx(12.5) and rec["gemms"] == 250
    assert rec["energy_basis"] == "ends"  # the counter stepped once in the section: no slope to take
    assert rec["energy_per_gemm_mj"] == pytest.approx(50.0)
    assert "not split between contenders" in rec["energy_note"]
    assert rec["mean_power_w"] == pytest.approx(12.5 / rec["seconds"], rel=1e-3)
    assert clocks.gpu_state(rec) == {"sm_mhz": 1560.0, "power_w": rec["power_w_median"], "temp_c": 61}
    json.dumps(rec)  # crosses the worker protocol as JSON


def test_sampler_samples_in_a_background_thread(nvml):
    nvml([(1980, 2619, 500_000, 50, 0)] * 3, energy_mj=[0, 500])
    s = clocks.ClockSampler("offline", interval_s=0.002).start()
    time.sleep(0.08)
    with s.quiet():  # held off: no sample while the timing thread holds the gate
        n = len(s._samples)
        time.sleep(0.02)
        assert len(s._samples) == n
    rec = s.stop(gemms=10)
    assert rec["samples"] >= 5 and rec["regime"] == "full clocks" and rec["energy_per_gemm_mj"] == pytest.approx(50)
    assert s._thread is None


@pytest.mark.parametrize("rows, label", [
    ([(1980, 2619, 500_000, 50, 0)] * 5, "full clocks"),
    # one capped busy sample of six: under 20%, still full clocks
    ([(1980, 2619, 500_000, 50, 0)] * 5 + [(1900, 2619, 700_000, 50, CAP)], "full clocks"),
    # idle samples do not dilute the busy ones: 1 capped of 2 busy
    ([(1980, 2619, 90_000, 40, IDLE)] * 3 + [(1980, 2619, 500_000, 50, 0), (1700, 2619, 700_000, 55, CAP)],
     "power-capped"),
    ([(1400, 2619, 600_000, 90, CAP | THERM)] * 5, "thermal"),
    ([(1400, 2619, 600_000, 70, 0x80)] * 5, "hw-slowdown"),
])
def test_regime_labels(rows, label):
    rec = clocks.summarize(rows, seconds=0.1, energy_j=None, gemms=None, mode="offline")
    assert rec["regime"] == label
    assert rec["energy_per_gemm_mj"] is None and rec["energy_note"] == "no energy counter on this card"


def test_throttle_reasons_decoded_by_name():
    assert clocks.decode_reasons(0) == []
    assert clocks.decode_reasons(0x1 | 0x4 | 0x8 | 0x20 | 0x40 | 0x80 | 0x2 | 0x10) == [
        "gpu_idle", "applications_clocks", "sw_power_cap", "hw_slowdown", "sync_boost", "sw_thermal", "hw_thermal",
        "hw_power_brake"]
    assert clocks.decode_reasons(0x4 | 0x10000) == ["sw_power_cap", "0x10000"]
    rec = clocks.summarize([(1, 1, 1.0, 1, 0x1), (1, 1, 1.0, 1, 0x4), (1, 1, 1.0, 1, 0x4 | 0x40), (1, 1, 1.0, 1, 0)],
                           seconds=1.0, energy_j=None, gemms=None)
    assert rec["reasons"] == {"sw_power_cap": 0.5, "gpu_idle": 0.25, "hw_thermal": 0.25}


def test_server_section_has_energy_but_no_energy_per_gemm(nvml):
    nvml([(1980, 2619, 300_000, 40, 0)] * 4, energy_mj=[5_000, 7_000])
    rec = _section(clocks.ClockSampler("server", interval_s=60.0), gemms=None)
    assert rec["energy_j"] == pytest.approx(2.0) and rec["energy_per_gemm_mj"] is None
    assert "L2 flushes and idle gaps" in rec["energy_note"]


def test_no_energy_counter_is_said(nvml):
    nvml([(1980, 2619, 300_000, 40, 0)] * 4, energy_mj=None)
    rec = _section(clocks.ClockSampler("offline", interval_s=60.0), gemms=100)
    assert rec["available"] and rec["energy_j"] is None and rec["energy_per_gemm_mj"] is None
    assert rec["energy_note"] == "no energy counter on this card"


def test_nvml_absent_or_failing_is_available_false(nvml, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    clocks.reset_nvml()
    s = clocks.ClockSampler("offline")
    assert not s.available
    rec = _section(s, extra=0, gemms=10)
    assert rec == {"available": False, "reason": "pynvml is not installed (pip install 'hgemm-tune[gpu]': "
                                                  "nvidia-ml-py)"}
    assert clocks.gpu_state(rec) == {} and clocks.regime_of(rec) == "unknown"
    with s.quiet():
        pass

    class Broken(FakeNvml):
        def nvmlInit(self):
            raise self.NVMLError("Driver Not Loaded")

    monkeypatch.setitem(sys.modules, "pynvml", Broken([]))
    clocks.reset_nvml()
    rec = clocks.ClockSampler("offline").start().stop()
    assert rec["available"] is False and rec["reason"] == "NVML: NVMLError: Driver Not Loaded"
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(CAPPED))
    monkeypatch.setenv(clocks.DISABLE_ENV, "0")
    clocks.reset_nvml()
    assert clocks.ClockSampler().stop() == {"available": False, "reason": "clock sampling off (HGEMM_TUNE_CLOCKS=0)"}


def test_the_nvml_device_follows_cuda_not_nvml_index_0(nvml, monkeypatch):
    monkeypatch.setattr(clocks, "_cuda_pci_bus_id", lambda: None)  # no cupy here
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    nvml(CAPPED, devices=2)
    rec = clocks.ClockSampler().stop()
    assert rec["available"] is False and "cannot tell which of the 2 NVML devices" in rec["reason"]
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    fake = nvml(CAPPED, devices=2)
    assert clocks.ClockSampler().available and fake.opened_by == ("index", 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8d1c0f3a-aaaa")
    fake = nvml(CAPPED, devices=2)
    assert clocks.ClockSampler().available and fake.opened_by == ("uuid", "GPU-8d1c0f3a-aaaa")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    fake = nvml(CAPPED, devices=1)
    assert clocks.ClockSampler().available and fake.opened_by == ("index", 0)


def test_combine_runs_and_cells():
    a = clocks.summarize(_w(CAPPED[1:]), seconds=0.1, energy_j=10.0, gemms=100, mode="offline")
    b = clocks.summarize([(1950, 2619, 600_000, 50, 0)] * 3, seconds=0.1, energy_j=8.0, gemms=100, mode="offline")
    both = clocks.combine([a, a, b])
    assert both["regime"] == "mixed (power-capped 2/3, full clocks 1/3)"
    assert both["sm_mhz_min"] == 1365 and both["sm_mhz_median"] == a["sm_mhz_median"]
    assert both["energy_per_gemm_mj"] == pytest.approx(100.0)
    assert clocks.combine([a, {}])["regime"] == "mixed (power-capped 1/2, unknown 1/2)"
    assert clocks.combine([a]) == a
    assert clocks.combine([{}, None])["available"] is False
    assert clocks.clock_cells(None)["regime"] == "unknown"
    assert clocks.regime_text(a) == "power-capped, 1560 MHz" and clocks.regime_text({}) == "unknown"


# ---- the timing loops wrap their timed section in the sampler ---------------------------------

class FakeSampler:
    def __init__(self):
        self.log, self.result = [], {"available": True, "regime": "full clocks"}

    def start(self):
        self.log.append("start")
        return self

    def stop(self, gemms=None):
        self.log.append(("stop", gemms))
        return self.result

    def energy_mj(self):
        return None  # a card without an energy counter

    def quiet(self):
        sampler = self

        class Gate:
            def __enter__(self):
                sampler.log.append("quiet")

            def __exit__(self, *exc):
                sampler.log.append("loud")

        return Gate()


def test_timing_sections_are_sampled(monkeypatch):
    from test_benchmark import _contender, _fake_cp, _Stream

    monkeypatch.setattr(timing, "_cp", _fake_cp)
    monkeypatch.setattr(timing, "_idle", lambda s: None)
    stream, sampler = _Stream(), FakeSampler()
    contenders = {"ours": _contender("ours", 0.010), "cublas": _contender("cublas", 0.020)}
    times, report = timing.time_sustained(contenders, None, stream, random.Random(1), sampler=sampler)
    assert times == pytest.approx({"ours": 10.0, "cublas": 20.0})
    # graphs of 300 and 150 launches (3 ms each), slices of 7 replays (about 20 ms): the section is the
    # timed rounds (8: steady at the minimum) and the one slice already queued when they stopped
    assert sampler.log[0] == "start" and len(sampler.log) == 2 and sampler.log[1][0] == "stop"
    launches = report.launches
    assert report.rounds == 8 and launches["ours"] == 8 * 7 * 300 and launches["cublas"] in (8 * 7 * 149, 8 * 7 * 150)
    assert sampler.log[1][1] - sum(launches.values()) in (launches["ours"] // 8, launches["cublas"] // 8)
    # without an energy counter no contender has an energy, and the report says why
    assert report.energy_mj == {"ours": None, "cublas": None} and "no energy counter" in report.energy_note
    # the section is the timed launches only: the sampler starts after the set-up and the warm-up rounds
    server = FakeSampler()
    timing.time_isolated(contenders, None, _Stream(), random.Random(0), launches=20, flush=lambda s: None,
                         sampler=server)
    assert server.log[0] == "start" and server.log[-1] == ("stop", None)
    assert server.log.count("quiet") == server.log.count("loud") == 40


# ---- replay: clock records through a tune, into the export and the summary table --------------

def _render(table) -> str:
    console = Console(width=400, record=True)
    console.print(table)
    return console.export_text()


def _clock_record(i: int) -> dict:
    capped = i % 2 == 0
    rows = ([(1980, 2619, 520_000, 45, 0)] + [(1500 + i, 2619, 699_000, 60, CAP)] * 3 if capped
            else [(1950 + i % 30, 2619, 610_000, 50, 0)] * 4)
    return clocks.summarize(_w(rows), seconds=0.12, energy_j=80.0, gemms=800, mode="offline")


@pytest.fixture
def clocked_replay(tmp_path):
    """The H200 replay file rewritten through record_measurement with a clock record and a
    sustained-regime report on each (synthetic, for the tables: steady after 5 + i % 4 rounds)."""
    path = tmp_path / "clocked.jsonl"
    lines = [json.loads(x) for x in REPLAY.read_text().splitlines() if x.strip()]
    for i, rec in enumerate(lines):
        if rec.get("type") == "baseline":
            record_baseline(path, SHAPE, rec["baselines_us"])
            continue
        m = Measurement(**rec["measurement"])
        m.clocks = _clock_record(i)
        m.regime = RegimeReport("sustained", rounds=5 + i % 4, warmup_rounds=2, steady=True, steady_after=5 + i % 4,
                                window=4, tol=0.03).to_dict()
        record_measurement(path, EvalRequest(rec["family"], rec["config"], SHAPE, None, LaunchSpec(), []), m)
    return path


def test_replay_carries_clock_records_through_a_tune(space, clocked_replay, tmp_path):
    from tuner.cli.views import summary_table
    from tuner.results.export import export_studies
    from tuner.search import TrialRecord, best_trial, tune

    backend = ReplayBackend(clocked_replay, "sm_90a")
    assert all(r["measurement"]["clocks"]["available"] for r in backend.records.values())
    study = tune(space, ["cute_sm80", "wmma"], SHAPE, backend, trials=15, storage=f"sqlite:///{tmp_path}/c.db",
                 seed=0)
    best = best_trial(study)
    rec = TrialRecord.of(best)
    assert rec.clocks["available"] and rec.clocks["regime"] in ("power-capped", "full clocks")
    (entry,) = export_studies([study])["entries"]
    assert entry["clocks"] == rec.clocks
    text = _render(summary_table(study))
    rows = [ln for ln in text.splitlines() if "cute_sm80" in ln or "wmma" in ln]
    assert "clock regime" in text and rows and clocks.regime_text(rec.clocks) in text
    assert all("MHz" in ln and "unknown" not in ln for ln in rows), rows  # every row has its regime
    # ... and its timing's steady state, as recorded, into the record and the export
    assert rec.objective == "sustained" and rec.regime_report["steady"] is True
    assert all("yes (" in ln and " rounds)" in ln for ln in rows), rows
    assert entry["objective"] == "sustained" and entry["steady_state"]["steady"] is True
    assert entry["steady_state"]["steady_after"] == rec.regime_report["steady_after"]


def test_older_replay_files_load_and_say_unknown(space, tmp_path):
    from tuner.cli.views import summary_table
    from tuner.results import validate
    from tuner.results.export import export_studies
    from tuner.search import TrialRecord, best_trial, tune

    backend = ReplayBackend(REPLAY, "sm_90a")
    assert not any("clocks" in r["measurement"] for r in backend.records.values())
    study = tune(space, ["cute_sm80", "wmma"], SHAPE, backend, trials=8, storage=f"sqlite:///{tmp_path}/o.db",
                 seed=0)
    assert TrialRecord.of(best_trial(study)).clocks == {}
    data = export_studies([study])
    validate(data)
    (entry,) = data["entries"]
    assert entry["clocks"]["available"] is False and "no clock record" in entry["clocks"]["reason"]
    text = _render(summary_table(study))
    rows = [ln for ln in text.splitlines() if "cute_sm80" in ln or "wmma" in ln]
    assert "clock regime" in text and rows and all("unknown" in ln and "MHz" not in ln for ln in rows), rows


def test_a_replay_record_with_bad_clocks_is_refused(tmp_path):
    from tuner.errors import UserError

    line = json.loads(REPLAY.read_text().splitlines()[1])
    line["measurement"]["clocks"] = [1, 2]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(UserError, match="clocks is not a mapping"):
        ReplayBackend(path)


# ---- bench: the clock columns are there, and "unknown" where there is no record ---------------

CAPPED_REC = clocks.summarize(_w(CAPPED[1:]), seconds=0.1, energy_j=69.45, gemms=2778, mode="sustained")
SERVER_REC = clocks.summarize(_w([(1965, 2619, 410_000, 50, 0)] * 4), seconds=0.4, energy_j=164.0, gemms=None,
                              mode="isolated")
# Synthetic regime reports (what a worker of protocol 5 sends): sustained settled after 11 rounds
# with each contender's own energy; isolated did not settle in its 100 rounds.
SUSTAINED_REP = RegimeReport("sustained", rounds=11, warmup_rounds=3, steady=True, steady_after=11, window=5, tol=0.02,
                             spread={"ours0": 0.004, "cublas": 0.012}, launches={"ours0": 1100, "cublas": 2200},
                             energy_mj={"ours0": 31.5, "cublas": 18.5}).to_dict()
ISOLATED_REP = RegimeReport("isolated", rounds=100, warmup_rounds=3, steady=False, window=4, tol=0.05,
                            spread={"ours0": 0.08, "cublas": 0.02}, launches={"ours0": 100, "cublas": 100},
                            energy_note="single launches after idle gaps: no energy per GEMM").to_dict()


def _clock_replies():
    from test_benchmark import A, B, ok_reply

    a = ok_reply({"sustained": {"ours0": 10.0, "cublas": 5.0}, "isolated": {"ours0": 20.0, "cublas": 30.0}})
    a.clocks, a.clocks_by_mode = CAPPED_REC, {"sustained": CAPPED_REC, "isolated": SERVER_REC}
    a.regimes_by_mode = {"sustained": SUSTAINED_REP, "isolated": ISOLATED_REP}
    # an older worker's reply (protocol 4): offline and server, no clock record, no regime report
    b = {"status": "ok", "modes": ["offline", "server"], "times": {"ours0": 8.0, "cublas": 10.0},
         "times_by_mode": {"offline": {"ours0": 8.0, "cublas": 10.0}, "server": {"ours0": 16.0, "cublas": 20.0}},
         "verify": {"ours0": {"ok": True}}, "notes": {}}
    return {A: a, B: b}


@pytest.fixture
def clock_result():
    from test_benchmark import A, B, FakeBackend, FakeBuilder, make_entry, make_export

    data = make_export([make_entry(A), make_entry(B)])
    return bm.run_benchmark(data, FakeBackend(_clock_replies()), FakeBuilder(), ["sustained", "isolated"])


def test_bench_rows_markdown_and_csv_carry_the_clock_regime(clock_result, tmp_path):
    from test_benchmark import A, B

    rows = {(r["shape"], r["mode"]): r for r in clock_result["rows"]}
    a = rows[(A, "sustained")]
    assert (a["sm_mhz_median"], a["sm_mhz_min"], a["regime"]) == (1560.0, 1365, "power-capped")
    assert a["power_w"] == pytest.approx(694.5) and a["energy_per_gemm_mj"] == pytest.approx(25.0)
    assert a["clocks"] == CAPPED_REC
    assert (a["steady"], a["steady_after"], a["steady_runs"], a["ours_mj_per_gemm"]) == (True, 11, "1/1", 31.5)
    s = rows[(A, "isolated")]
    assert s["regime"] == "full clocks" and s["energy_per_gemm_mj"] is None
    assert s["steady"] is False and s["ours_mj_per_gemm"] is None
    for mode in ("sustained", "isolated"):  # the older worker's offline and server rows, by their regimes
        assert rows[(B, mode)]["regime"] == "unknown" and rows[(B, mode)]["sm_mhz_median"] is None
        assert rows[(B, mode)]["steady"] is None

    bm.write_outputs(clock_result, tmp_path, "best.json")
    md = (tmp_path / "bench.md").read_text()
    header = next(ln for ln in md.splitlines() if ln.startswith("| shape | regime | family |"))
    for col in ("regime", "SM MHz med (min)", "power W", "clock regime", "mJ/GEMM (section)", "steady"):
        assert f"| {col} |" in header + " |", header
    assert "| yes | 1560 (1365) | 694 | power-capped | 25 | yes (11 rounds) |" in md
    assert "| yes | 1965 (1965) | 410 | full clocks | - | NO (100 rounds) |" in md
    assert f"| {B} | sustained | wmma | 8.00 |" in md
    assert "| yes | unknown | unknown | unknown | unknown | unknown |" in md
    # per contender and regime: time, TFLOP/s, ratio, SM clock, power, own energy, steady state
    head = next(ln for ln in md.splitlines() if ln.startswith("| shape | regime | contender |"))
    for col in ("us", "TFLOP/s", "vs cuBLAS", "SM MHz med (min)", "power W", "clock regime", "mJ/GEMM (own)",
                "steady"):
        assert f"| {col} |" in head + " |", head
    assert (f"| {A} | sustained | ours (wmma) | 10.00 | 214.7 | 0.500 | 1560 (1365) | 694 | power-capped | 31.5 "
            "| 0.40 | yes (11 rounds) |") in md
    assert (f"| {A} | sustained | cuBLAS | 5.00 | 429.5 | 1.000 | 1560 (1365) | 694 | power-capped | 18.5 "
            "| 1.20 | yes (11 rounds) |") in md
    assert f"| {A} | isolated | cuBLAS | 30.00 | 71.6 | 1.000 | 1965 (1965) | 410 | full clocks | - | 2.00 | NO " in md
    assert f"| {B} | isolated | ours (wmma) | 16.00 |" in md
    assert "| unknown | unknown | unknown | - | - | unknown |" in md
    with open(tmp_path / "bench.csv") as fh:
        csv_rows = list(csv.DictReader(fh))
    for field in ("sm_mhz_median", "sm_mhz_min", "power_w", "regime", "energy_per_gemm_mj", "steady",
                  "steady_after", "ours_mj_per_gemm"):
        assert field in csv_rows[0], field
    got = {(r["shape"], r["mode"]): r for r in csv_rows}
    assert got[(A, "sustained")]["regime"] == "power-capped" and got[(A, "sustained")]["sm_mhz_min"] == "1365"
    assert got[(A, "sustained")]["steady"] == "True" and got[(A, "sustained")]["steady_after"] == "11"
    assert got[(B, "isolated")]["regime"] == "unknown" and got[(B, "isolated")]["sm_mhz_median"] == ""
    with open(tmp_path / "bench_contenders.csv") as fh:
        contenders = list(csv.DictReader(fh))
    assert list(contenders[0]) == bm.CONTENDER_FIELDS
    lt = {(c["shape"], c["mode"], c["contender"]): c for c in contenders}
    assert lt[(A, "sustained", "cuBLAS")]["mj_per_gemm"] == "18.5" and lt[(A, "sustained", "cuBLAS")]["power_w"]
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["rows"][0]["clocks"]["available"] in (True, False)
    assert data["rows"][0]["regime_report"]["regime"] in ("sustained", "isolated") and data["contenders"]


def test_bench_repeats_with_mixed_regimes():
    from test_benchmark import A, FakeBackend, FakeBuilder, make_entry, make_export, ok_reply

    full = clocks.summarize([(1950, 2619, 600_000, 50, 0)] * 3, seconds=0.1, energy_j=8.0, gemms=400, mode="offline")
    replies = []
    for rec in (CAPPED_REC, full, CAPPED_REC):
        r = ok_reply({"offline": {"ours0": 10.0, "cublas": 5.0}})
        r.clocks_by_mode = {"offline": rec}
        replies.append(r)
    it = iter(replies)
    backend = FakeBackend({A: lambda cands: next(it)})
    backend.restart = lambda: None
    (row,) = bm.run_benchmark(make_export([make_entry(A)]), backend, FakeBuilder(), ["offline"], repeats=3)["rows"]
    assert row["regime"] == "mixed (power-capped 2/3, full clocks 1/3)" and row["sm_mhz_min"] == 1365


def test_older_compare_reply_decodes_without_clocks():
    reply = decode_reply(CompareReply, {"status": "ok", "times": {"ours0": 1.0}})
    assert reply.clocks_in("offline") == {} and reply.clocks_in("server") == {}
    reply = decode_reply(CompareReply, {"status": "ok", "modes": ["offline"], "times": {"ours0": 1.0},
                                        "times_by_mode": {"offline": {"ours0": 1.0}},
                                        "clocks_by_mode": {"offline": CAPPED_REC}})
    assert reply.clocks_in("offline")["regime"] == "power-capped"


def test_bench_cli_table_prints_the_clock_columns(tmp_path, monkeypatch):
    from test_benchmark import ROOT, A, B, FakeBackend, FakeBuilder, make_entry, make_export
    from typer.testing import CliRunner

    from tuner.api import results as api_results
    from tuner.cli.app import app

    backend = FakeBackend(_clock_replies())
    monkeypatch.setattr(api_results, "make_backend", lambda *a: backend)
    monkeypatch.setattr(bm, "Builder", lambda space, target, pool: FakeBuilder())
    monkeypatch.setattr(api_results, "nvcc_path", lambda: "/usr/bin/nvcc")
    monkeypatch.setattr(api_results, "cutlass_include", lambda: tmp_path)
    path = tmp_path / "best.json"
    path.write_text(json.dumps(make_export([make_entry(A), make_entry(B)])))
    res = CliRunner().invoke(app, ["bench", str(path), "--out", str(tmp_path / "out"),
                                   "--space", str(ROOT / "space.yaml")])
    assert res.exit_code == 0, res.output
    text = res.output
    for col in ("SM MHz med (min)", "power W", "clock regime", "mJ/GEMM (section)"):
        assert col in text, text
    line_a = next(ln for ln in text.splitlines() if A in ln and "sustained" in ln and "wmma" in ln
                  and "ours" not in ln)
    assert "1560 (1365)" in line_a and "694" in line_a and "power-capped" in line_a and "25" in line_a
    assert "yes (11 rounds)" in line_a, line_a
    line_b = next(ln for ln in text.splitlines() if B in ln and "sustained" in ln and "wmma" in ln
                  and "ours" not in ln)
    assert line_b.count("unknown") == 5, line_b  # four clock columns and steady
    # the table per contender and regime, with its clock, power, energy and steady columns
    assert "per contender and regime" in text
    for col in ("contender", "vs cuBLAS", "mJ/GEMM (own)", "steady"):
        assert col in text, text
    cublas = next(ln for ln in text.splitlines() if A in ln and "sustained" in ln and "cuBLAS" in ln)
    assert "1.000" in cublas and "1560 (1365)" in cublas and "power-capped" in cublas and "18.5" in cublas, cublas


def test_the_pci_bus_id_comes_from_cupy(monkeypatch):
    from types import SimpleNamespace

    def no_bus_id(device):
        raise AttributeError("deviceGetPCIBusId")

    props = {"pciDomainID": 0, "pciBusID": 0x1B, "pciDeviceID": 0}
    runtime = SimpleNamespace(deviceGetPCIBusId=lambda d: f"0000:{0x1B + d:02X}:00.0",
                              getDeviceProperties=lambda d: props)
    fake = SimpleNamespace(cuda=SimpleNamespace(runtime=runtime, Device=lambda: SimpleNamespace(id=1)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert clocks._cuda_pci_bus_id() == "0000:1C:00.0"  # the current device's, not device 0's by NVML's count
    runtime.deviceGetPCIBusId = no_bus_id
    assert clocks._cuda_pci_bus_id() == "0000:1b:00.0"


def test_section_energy_takes_the_counter_steps_slope_not_the_ends_phase():
    """NVML's energy counter moves in steps (here 70 J every 100 ms: 700 W). Over a 0.95 s section the
    two ends' difference is off by up to one step (700 J / 0.95 s = 737 W, over the card's cap); the
    slope between the first and last step seen, sampled every 15 ms, gives the true 700 W."""
    def counter_mj(t):
        return 70_000.0 * math.floor((t + 0.099) / 0.1)
    seconds = 0.95
    times = [i * 0.015 for i in range(int(seconds / 0.015) + 1)] + [seconds]
    trace = [(t, counter_mj(t)) for t in times]
    ends = (trace[-1][1] - trace[0][1]) / 1000.0
    assert ends / seconds > 730  # what the ends alone say
    energy, basis = clocks.section_energy(trace, seconds)
    assert basis == "counter steps" and energy / seconds == pytest.approx(700.0, rel=0.03)
    # a counter that stepped once (or never) in the section: the ends, said so
    short = [(0.0, 0.0), (0.015, 0.0), (0.03, 70_000.0), (0.045, 70_000.0)]
    assert clocks.section_energy(short, 0.045) == (pytest.approx(70.0), "ends")
    assert clocks.section_energy([(0.0, 5.0)], 0.1) == (None, None)

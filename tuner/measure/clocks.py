"""The GPU's clock regime while a timing section ran: SM clock, power, throttle reasons, energy.
(Over 400 lines on purpose: NVML's device lookup, sampling and the summary are one concern.)

Worker side: `ClockSampler` reads NVML (the `pynvml` module of the `nvidia-ml-py` package,
imported on first use) in a background thread every `interval_s` while a section of timing
runs, and sums it up as one plain record (`ClockSampler.stop()`):

    {"available": true, "mode": "sustained", "samples": 41, "interval_ms": 15.0, "seconds": 0.62,
     "sm_mhz_min": 1365, "sm_mhz_median": 1620, "sm_mhz_max": 1980, "mem_mhz_median": 2619,
     "power_w_median": 688.1, "power_w_max": 701.3, "power_limit_w": 700.0, "temp_c_max": 61,
     "reasons": {"sw_power_cap": 0.83, "gpu_idle": 0.02}, "busy_samples": 40,
     "energy_j": 431.2, "mean_power_w": 695.5, "gemms": 1270, "energy_per_gemm_mj": 339.5,
     "energy_note": "...", "regime": "power-capped"}

or, where NVML is missing or fails, `{"available": false, "reason": "..."}` and nothing else
breaks. `reasons` maps each throttle (clock event) reason seen to the share of samples it was
active in; `regime` is "thermal", "hw-slowdown", "power-capped" (the software power cap active
in at least REGIME_SHARE of the busy samples, i.e. those without gpu_idle) or "full clocks".

Energy (nvmlDeviceGetTotalEnergyConsumption, Volta and newer) is read with every sample. The
counter moves in steps tens of ms apart, so its difference between the section's two ends carries
up to one step of phase error (sustained bench sections of about a second on an H100 read 722-805 W
against its 700 W cap, 2026-12-07; such an error is the likely cause). Where the counter stepped
at least twice, over at least half the section, the section's mean power is the slope between
its first and last step (each seen within one sample interval of when it happened) and its
energy that power times the section's length (`energy_basis`: "counter steps"); otherwise the
two ends' difference ("ends").
It is NOT split between the contenders of a section. A split by each contender's
share of the section's GPU time is energy x share = (mean power of the section) x (contender's
time): it ranks the contenders exactly as their times do and cannot show a kernel that draws
less power than another, while looking like a measurement of it; NVML's counter and power
readings are too coarse (tens of ms) to resolve the ~3 ms graph replays of one contender. So
the record gives the energy of the whole section and, in the sustained regime (back-to-back
GEMMs only), the section's energy per GEMM over every contender's launches
(`energy_per_gemm_mj`); in the isolated regime the section also spends energy on the L2 flushes
and idle gaps, so there is no energy per GEMM (None, with `energy_note` saying why). Each
contender's own energy comes from the sustained regime's slices instead, where the counter
is read at every slice boundary (`ClockSampler.energy_mj`, tuner.measure.timing): a slice
holds one contender only, so its energy is that contender's, not a share by time.

Parent side: `combine` sums up several runs' records (bench --repeats, confirmation runs),
`regime_of` / `clock_cells` give what tables print; a missing record says "unknown".
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from typing import Any

INTERVAL_S = 0.015   # one NVML sample every 15 ms
REGIME_SHARE = 0.20  # a throttle reason active in at least this share of busy samples names the regime
UNKNOWN = "unknown"
DISABLE_ENV = "HGEMM_TUNE_CLOCKS"  # "0": no sampling (e.g. to A/B the sampler's own cost on timing)

# nvmlClocksEventReasons / nvmlClocksThrottleReasons bits (nvml.h).
REASON_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}
THERMAL = ("sw_thermal", "hw_thermal")
HW_SLOWDOWN = ("hw_slowdown", "hw_power_brake")

# NVML enum values, used where the pynvml module lacks the name.
_NVML_CLOCK_SM, _NVML_CLOCK_MEM, _NVML_TEMPERATURE_GPU = 1, 2, 0


def decode_reasons(mask: int) -> list[str]:
    """A throttle-reason bitmask -> the names of its bits (unknown bits as hex)."""
    names = [name for bit, name in REASON_BITS.items() if mask & bit]
    rest = mask & ~sum(REASON_BITS)
    if rest:
        names.append(f"0x{rest:x}")
    return names


def unavailable(reason: str) -> dict[str, Any]:
    return {"available": False, "reason": reason}


class ClockUnavailable(Exception):
    """NVML cannot say anything about this worker's GPU (the message says why)."""


class NvmlDevice:
    """pynvml and the handle of the GPU this process's CUDA device 0 is, opened once."""

    def __init__(self, nvml, handle):
        self.nvml, self.handle = nvml, handle
        self.has_energy = True
        self.power_limit_w: float | None = None
        with contextlib.suppress(Exception):
            self.power_limit_w = nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0
        self._reasons = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                         or getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
        self._sm = getattr(nvml, "NVML_CLOCK_SM", _NVML_CLOCK_SM)
        self._mem = getattr(nvml, "NVML_CLOCK_MEM", _NVML_CLOCK_MEM)
        self._temp = getattr(nvml, "NVML_TEMPERATURE_GPU", _NVML_TEMPERATURE_GPU)

    def sample(self) -> tuple[float, float, float, float, int]:
        """(SM MHz, memory MHz, power W, temperature C, reasons bitmask) now."""
        n, h = self.nvml, self.handle
        reasons = int(self._reasons(h)) if self._reasons is not None else 0
        return (float(n.nvmlDeviceGetClockInfo(h, self._sm)), float(n.nvmlDeviceGetClockInfo(h, self._mem)),
                n.nvmlDeviceGetPowerUsage(h) / 1000.0, float(n.nvmlDeviceGetTemperature(h, self._temp)), reasons)

    def energy_mj(self) -> float | None:
        """The energy counter (mJ since the driver loaded), or None where the card has none."""
        if not self.has_energy:
            return None
        try:
            return float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except Exception:  # noqa: BLE001 - NVMLError_NotSupported (pre-Volta, some vGPUs): no energy
            self.has_energy = False
            return None


def _cuda_pci_bus_id() -> str | None:
    """The PCI bus id of this process's current CUDA device, as cupy reports it (None without
    cupy or CUDA). CUDA numbers devices after CUDA_VISIBLE_DEVICES (fastest first by default),
    NVML by PCI order: the bus id is what both agree on."""
    try:
        import cupy

        device = cupy.cuda.Device().id
    except Exception:  # noqa: BLE001 - no cupy, no device: the caller tries the other ways
        return None
    try:
        return str(cupy.cuda.runtime.deviceGetPCIBusId(device))
    except Exception:  # noqa: BLE001 - a cupy without it: the same id from the device properties
        pass
    try:
        props = cupy.cuda.runtime.getDeviceProperties(device)
        return f"{int(props['pciDomainID']):04x}:{int(props['pciBusID']):02x}:{int(props['pciDeviceID']):02x}.0"
    except Exception:  # noqa: BLE001
        return None


def _handle(nvml, bus_id: str | None):
    """The NVML handle of the worker's GPU: by PCI bus id; else by the UUID CUDA_VISIBLE_DEVICES
    names; else by its index where CUDA_DEVICE_ORDER=PCI_BUS_ID; else the only GPU there is."""
    if bus_id:
        try:
            return nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        except TypeError:  # older pynvml takes bytes
            return nvml.nvmlDeviceGetHandleByPciBusId(bus_id.encode())
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if first.startswith(("GPU-", "MIG-")):
        return nvml.nvmlDeviceGetHandleByUUID(first)
    if first.isdigit() and os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
        return nvml.nvmlDeviceGetHandleByIndex(int(first))
    count = nvml.nvmlDeviceGetCount()
    if count == 1 and not first:
        return nvml.nvmlDeviceGetHandleByIndex(0)
    raise ClockUnavailable(f"cannot tell which of the {count} NVML devices is CUDA device 0 "
                           f"(no PCI bus id from cupy; CUDA_VISIBLE_DEVICES={first or 'unset'})")


_DEVICE: NvmlDevice | ClockUnavailable | None = None
_DEVICE_LOCK = threading.Lock()


def nvml_device() -> NvmlDevice:
    """The process's NvmlDevice, opened on first use; raises ClockUnavailable (every time, with
    the first failure's reason) where pynvml is missing or NVML fails."""
    global _DEVICE
    with _DEVICE_LOCK:
        if _DEVICE is None:
            _DEVICE = _open()
        if isinstance(_DEVICE, ClockUnavailable):
            raise _DEVICE
        return _DEVICE


def _open() -> NvmlDevice | ClockUnavailable:
    if os.environ.get(DISABLE_ENV, "1").strip() == "0":
        return ClockUnavailable(f"clock sampling off ({DISABLE_ENV}=0)")
    try:
        import pynvml
    except ImportError:
        return ClockUnavailable("pynvml is not installed (pip install 'hgemm-tune[gpu]': nvidia-ml-py)")
    try:
        pynvml.nvmlInit()
        dev = NvmlDevice(pynvml, _handle(pynvml, _cuda_pci_bus_id()))
        dev.sample()  # fails here, once, rather than in every section
        return dev
    except ClockUnavailable as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - NVMLError_*, a broken install: no clocks, nothing else breaks
        return ClockUnavailable(f"NVML: {type(exc).__name__}: {exc}")


def reset_nvml() -> None:
    """Forget the opened device (tests; a worker opens it once)."""
    global _DEVICE
    with _DEVICE_LOCK:
        _DEVICE = None


class ClockSampler:
    """Samples the worker's GPU in a background thread between `start()` and `stop()`.

    Use one sampler per timing section. `quiet()` holds the sampler off for a few
    microseconds (the isolated regime wraps each timed launch in it, so that the sampler's Python never
    runs between the events of a timed launch); the sustained regime needs nothing of the kind (its
    launches are all enqueued ahead of the GPU). Nothing here raises: a sampler without NVML
    returns `{"available": false, "reason": ...}`.
    """

    def __init__(self, mode: str = "", interval_s: float = INTERVAL_S, device: NvmlDevice | None = None):
        self.mode, self.interval_s = mode, interval_s
        self._device, self._why = device, None
        if device is None:
            try:
                self._device = nvml_device()
            except ClockUnavailable as exc:
                self._why = str(exc)
        self._samples: list[tuple[float, float, float, float, int]] = []
        self._errors: list[str] = []
        self._stop = threading.Event()
        self._gate = threading.Lock()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._e0: float | None = None
        self._energy: list[tuple[float, float]] = []  # (perf_counter s, counter mJ) at every sample
        self.result: dict[str, Any] = unavailable(self._why or "not started")

    @property
    def available(self) -> bool:
        return self._device is not None

    def _sample(self) -> None:
        assert self._device is not None
        with self._gate:
            try:
                self._samples.append(self._device.sample())
            except Exception as exc:  # noqa: BLE001 - one failed read costs a sample, not the section
                self._errors.append(f"{type(exc).__name__}: {exc}")
            energy = self._device.energy_mj()
            if energy is not None:
                self._energy.append((time.perf_counter(), energy))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> ClockSampler:
        if self._device is None:
            return self
        self._samples, self._errors, self._energy = [], [], []
        self._stop.clear()
        self._e0 = self._device.energy_mj()
        self._t0 = time.perf_counter()
        if self._e0 is not None:
            self._energy.append((self._t0, self._e0))
        self._sample()
        self._thread = threading.Thread(target=self._run, name="clock-sampler", daemon=True)
        self._thread.start()
        return self

    def energy_mj(self) -> float | None:
        """The energy counter now (mJ), or None without one: the sustained regime reads it at
        every slice boundary to give each contender its own energy (tuner.measure.timing)."""
        if self._device is None:
            return None
        try:
            return self._device.energy_mj()
        except Exception:  # noqa: BLE001 - a failed read is a missing reading, never a failed section
            return None

    def quiet(self):
        """A context in which no sample is taken (entered and left by the timing thread)."""
        return self._gate if self._thread is not None else contextlib.nullcontext()

    def stop(self, gemms: int | None = None) -> dict[str, Any]:
        """Stop sampling; the section's record (also kept as `result`). `gemms`: the GEMMs
        launched in the section, where energy per GEMM means something (the sustained regime)."""
        if self._device is None:
            return self.result
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self._sample()
        seconds = time.perf_counter() - self._t0
        e1 = self._device.energy_mj()
        if e1 is not None:
            self._energy.append((self._t0 + seconds, e1))
        energy_j, basis = section_energy(self._energy, seconds) if self._e0 is not None else (None, None)
        self.result = summarize(self._samples, seconds=seconds, energy_j=energy_j, gemms=gemms, mode=self.mode,
                                interval_s=self.interval_s, power_limit_w=self._device.power_limit_w,
                                errors=self._errors, energy_basis=basis)
        return self.result

    def __enter__(self) -> ClockSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def section_energy(trace: list[tuple[float, float]], seconds: float) -> tuple[float | None, str | None]:
    """A section's energy (J) from its (time s, counter mJ) readings, and how it was found: the slope
    between the counter's first and last step seen, times the section's length, where it stepped at
    least twice over at least half the section ("counter steps"); else the difference between the
    section's two ends ("ends"), which may be off by one step of the counter."""
    if len(trace) < 2:
        return None, None
    steps = [trace[i] for i in range(1, len(trace)) if trace[i][1] != trace[i - 1][1]]
    if len(steps) >= 2 and steps[-1][0] - steps[0][0] >= 0.5 * seconds > 0:
        watts = (steps[-1][1] - steps[0][1]) / 1000.0 / (steps[-1][0] - steps[0][0])
        return watts * seconds, "counter steps"
    return (trace[-1][1] - trace[0][1]) / 1000.0, "ends"


def summarize(samples: list[tuple[float, float, float, float, int]], *, seconds: float, energy_j: float | None,
              gemms: int | None, mode: str = "", interval_s: float = INTERVAL_S,
              power_limit_w: float | None = None, errors: list[str] | None = None,
              energy_basis: str | None = None) -> dict[str, Any]:
    """Samples (SM MHz, memory MHz, power W, temperature C, reasons bitmask) of one section ->
    its clock record (see the module docstring)."""
    if not samples:
        why = f"no NVML sample could be read ({errors[0]})" if errors else "no NVML sample"
        return unavailable(why)
    sm = [s[0] for s in samples]
    power = [s[2] for s in samples]
    masks = [s[4] for s in samples]
    counts: dict[str, int] = {}
    for mask in masks:
        for name in decode_reasons(mask):
            counts[name] = counts.get(name, 0) + 1
    busy = [m for m in masks if not m & 0x1]
    rec: dict[str, Any] = {
        "available": True, "mode": mode, "samples": len(samples), "interval_ms": round(interval_s * 1000.0, 3),
        "seconds": round(seconds, 9),
        "sm_mhz_min": min(sm), "sm_mhz_median": statistics.median(sm), "sm_mhz_max": max(sm),
        "mem_mhz_median": statistics.median(s[1] for s in samples),
        "power_w_median": round(statistics.median(power), 3), "power_w_max": round(max(power), 3),
        "power_limit_w": power_limit_w, "temp_c_max": max(s[3] for s in samples),
        "reasons": {name: round(n / len(samples), 4) for name, n in sorted(counts.items(), key=lambda kv: -kv[1])},
        "busy_samples": len(busy),
        "energy_j": round(energy_j, 6) if energy_j is not None else None,
        "mean_power_w": round(energy_j / seconds, 3) if energy_j is not None and seconds > 0 else None,
        "energy_basis": energy_basis if energy_j is not None else None,
        "gemms": gemms, "energy_per_gemm_mj": None, "energy_note": None,
        "regime": regime(busy or masks),
    }
    if energy_j is None:
        rec["energy_note"] = "no energy counter on this card"
    elif gemms:
        rec["energy_per_gemm_mj"] = round(energy_j * 1000.0 / gemms, 6)
        rec["energy_note"] = ("the section's energy over all its GEMMs (every contender's launches), "
                              "not split between contenders")
    else:
        rec["energy_note"] = ("no energy per GEMM: the section's energy includes L2 flushes and idle gaps"
                              if mode in ("isolated", "server") else "no GEMM count for the section")
    if errors:
        rec["sample_errors"] = len(errors)
    return rec


def regime(masks: list[int], share: float = REGIME_SHARE) -> str:
    """The regime of a section from its samples' reason bitmasks (the busy ones where any)."""
    if not masks:
        return UNKNOWN

    def active(names: tuple[str, ...]) -> float:
        bits = sum(bit for bit, name in REASON_BITS.items() if name in names)
        return sum(1 for m in masks if m & bits) / len(masks)

    if active(THERMAL) >= share:
        return "thermal"
    if active(HW_SLOWDOWN) >= share:
        return "hw-slowdown"
    if active(("sw_power_cap",)) >= share:
        return "power-capped"
    return "full clocks"


def gpu_state(record: dict[str, Any] | None) -> dict[str, Any]:
    """The older after-timing snapshot (SM clock, power, temperature), from a section's record."""
    if not record or not record.get("available"):
        return {}
    return {"sm_mhz": record["sm_mhz_median"], "power_w": record["power_w_median"], "temp_c": record["temp_c_max"]}


# ---- parent side: what tables print --------------------------------------------------------

def regime_of(record: dict[str, Any] | None) -> str:
    """The regime label of a record, "unknown" where there is none (older data, no NVML)."""
    if not record or not record.get("available"):
        return UNKNOWN
    return str(record.get("regime") or UNKNOWN)


def combine(records: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Several sections' records (one per run) -> one: medians of the medians, the lowest
    minimum, the highest maximum, summed samples, and the regime when every run agrees, else
    "mixed (power-capped 2/3, full clocks 1/3)". Runs without a record count as "unknown"."""
    recs = [r for r in records if r]
    ok = [r for r in recs if r.get("available")]
    if not ok:
        why = next((r.get("reason") for r in recs if r.get("reason")), None)
        return unavailable(why or "no clock record")
    if len(ok) == 1 and len(records) == 1:
        return dict(ok[0])

    def vals(key: str) -> list:
        return [r[key] for r in ok if r.get(key) is not None]

    def med(key: str) -> float | None:
        return statistics.median(vals(key)) if vals(key) else None

    def low(key: str) -> float | None:
        return min(vals(key)) if vals(key) else None

    def high(key: str) -> float | None:
        return max(vals(key)) if vals(key) else None

    labels = [regime_of(r) for r in records]
    counts: dict[str, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    label = labels[0] if len(counts) == 1 else "mixed (" + ", ".join(
        f"{k} {n}/{len(labels)}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])) + ")"
    reasons: dict[str, float] = {}
    for r in ok:
        for name, share in (r.get("reasons") or {}).items():
            reasons[name] = max(reasons.get(name, 0.0), share)
    return {
        "available": True, "mode": ok[0].get("mode", ""), "runs": len(records), "runs_with_clocks": len(ok),
        "samples": sum(r.get("samples", 0) for r in ok),
        "sm_mhz_min": low("sm_mhz_min"), "sm_mhz_median": med("sm_mhz_median"),
        "sm_mhz_max": high("sm_mhz_max"), "mem_mhz_median": med("mem_mhz_median"),
        "power_w_median": med("power_w_median"), "power_w_max": high("power_w_max"),
        "power_limit_w": med("power_limit_w"), "temp_c_max": high("temp_c_max"),
        "reasons": reasons,  # the highest share each reason had in any run
        "energy_j": med("energy_j"), "mean_power_w": med("mean_power_w"),
        "energy_per_gemm_mj": med("energy_per_gemm_mj"),
        "energy_note": next((r.get("energy_note") for r in ok if r.get("energy_note")), None),
        "regime": label,
    }


def clock_cells(record: dict[str, Any] | None) -> dict[str, Any]:
    """The columns a table prints for one measurement: SM MHz median and minimum, power median
    (W), regime, energy per GEMM (mJ); None where the record lacks a value. Without a record the
    regime is "unknown" (never left blank)."""
    if not record or not record.get("available"):
        return {"sm_mhz_median": None, "sm_mhz_min": None, "power_w": None, "regime": UNKNOWN,
                "energy_per_gemm_mj": None}
    # The energy counter's mean over the section, where there is one: NVML's power reading averages
    # over about a second, so in a section of a few hundred ms it lags (an H100 offline section read
    # a 133 W median while its energy counter gave 414 W, 2026-12-07).
    power = record.get("mean_power_w") if record.get("mean_power_w") is not None else record.get("power_w_median")
    return {"sm_mhz_median": record.get("sm_mhz_median"), "sm_mhz_min": record.get("sm_mhz_min"),
            "power_w": power, "regime": regime_of(record), "energy_per_gemm_mj": record.get("energy_per_gemm_mj")}


def regime_text(record: dict[str, Any] | None) -> str:
    """One cell: "power-capped, 1620 MHz" / "full clocks, 1950 MHz" / "unknown"."""
    label = regime_of(record)
    if label == UNKNOWN or record is None or record.get("sm_mhz_median") is None:
        return label
    return f"{label}, {record['sm_mhz_median']:.0f} MHz"

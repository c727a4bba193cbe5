"""Timing, the same for every contender: offline (CUDA-graph replays of back-to-back launches,
interleaved in random order) and server (single launches after an L2 flush and an idle gap)."""

from __future__ import annotations

import contextlib
import random
import time
from typing import Any

import numpy as np

from tuner.measure.buffers import Buffers
from tuner.measure.clocks import ClockSampler
from tuner.measure.device import KernelFault, abandon_capture, sync_or_fault
from tuner.measure.device import cp as _cp

REPLAYS = 7           # timed graph replays per contender (median taken)
GRAPH_TARGET_MS = 3.0  # each graph replay runs about this long
SERVER_LAUNCHES = 100  # server mode: single launches per contender (median taken) ...
SERVER_MIN_LAUNCHES = 15  # ... at least this many, however slow the kernel ...
SERVER_BUDGET_MS = 2000.0  # ... and no more than this much kernel time per contender
SERVER_GAP_US = (20.0, 500.0)  # server mode: idle gap before each launch, uniform in this range


def capture_launches(launch, buf: Buffers, stream, n: int):
    """`n` back-to-back launches of one contender as a replayable graph (`.launch(stream)`).

    A contender that cannot be captured into a cupy graph carries its own `capture`
    attribute (a torch CUDA graph, or eager replays); everything else is one cupy graph."""
    custom = getattr(launch, "capture", None)
    if custom is not None:
        return custom(buf, stream, n)
    stream.begin_capture()
    try:
        for _ in range(n):
            launch(buf, stream)
    except BaseException:
        abandon_capture(stream)
        raise
    return stream.end_capture()


def _dropped(name: str, mode: str, exc: Exception, stream, notes: dict[str, str] | None) -> None:
    """A contender whose set-up failed in one timing mode: with `notes`, drop it and say why
    (after surfacing any CUDA error as a fault); without, raise as before."""
    if notes is None or isinstance(exc, KernelFault):
        raise exc
    sync_or_fault(stream)
    notes[name] = f"not measured ({mode}): {type(exc).__name__}: {exc}"


def time_graphs(contenders: dict[str, Any], buf: Buffers, stream, rng: random.Random,
                notes: dict[str, str] | None = None, sampler: ClockSampler | None = None) -> dict[str, float]:
    """Offline mode: per contender a CUDA graph of back-to-back launches; replays of all
    contenders interleaved in random order; median replay time / launches, in us.

    With `notes`, a contender that cannot be set up is left out and `notes[name]` says why.
    With `sampler` (tuner.measure.clocks), the timed replays are its section: it samples the SM
    clock, power and throttle reasons while they run and is stopped with the section's GEMM
    count (every contender's launches: the energy is not split between contenders; see
    tuner.measure.clocks); its record is `sampler.result`."""
    cp = _cp()
    graphs = {}
    for name, launch in contenders.items():
        try:
            # Estimate one launch to size the graph (warms the kernel up as well).
            start, end = cp.cuda.Event(), cp.cuda.Event()
            launch(buf, stream)
            start.record(stream)
            for _ in range(3):
                launch(buf, stream)
            end.record(stream)
            sync_or_fault(end)
            est_ms = max(cp.cuda.get_elapsed_time(start, end) / 3, 1e-3)
            n = int(min(max(GRAPH_TARGET_MS / est_ms, 2), 2000))
            graph = capture_launches(launch, buf, stream, n)
            graph.launch(stream)  # warm-up replay
        except Exception as exc:  # noqa: BLE001 - see _dropped: noted or re-raised
            _dropped(name, "offline", exc, stream, notes)
            continue
        graphs[name] = (graph, n)
    sync_or_fault(stream)
    samples: dict[str, list[float]] = {name: [] for name in graphs}
    order = list(graphs)
    events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(REPLAYS * len(order))]
    pending = []
    if sampler is not None:
        sampler.start()
    try:
        for r in range(REPLAYS):
            rng.shuffle(order)
            for i, name in enumerate(order):
                graph, n = graphs[name]
                start, end = events[r * len(order) + i]
                start.record(stream)
                graph.launch(stream)
                end.record(stream)
                pending.append((name, n, start, end))
        sync_or_fault(stream)
    finally:
        if sampler is not None:
            sampler.stop(gemms=sum(n for _, n, _, _ in pending))
    for name, n, start, end in pending:
        samples[name].append(cp.cuda.get_elapsed_time(start, end) * 1000.0 / n)
    return {name: float(np.median(v)) for name, v in samples.items()}


class L2Flush:
    """A buffer of at least twice the L2 size, allocated once; overwriting all of it before a
    launch evicts A, B and C from L2, so the launch reads its inputs from DRAM."""

    def __init__(self, l2_bytes: int | None = None):
        cp = _cp()
        if l2_bytes is None:
            l2_bytes = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["l2CacheSize"])
        mib = 1 << 20
        self.nbytes = -(-max(2 * int(l2_bytes), 8 * mib) // mib) * mib  # >= 2x L2, in whole MiB
        self.buf = cp.empty(self.nbytes, dtype=cp.uint8)
        self.value = 0

    def __call__(self, stream) -> None:
        self.value = (self.value + 1) & 0xFF  # a new byte every time: every line is really rewritten
        _cp().cuda.runtime.memsetAsync(self.buf.data.ptr, self.value, self.nbytes, stream.ptr)


def _idle(seconds: float) -> None:
    """Leave the GPU idle this long. A host spin, not time.sleep: sleep overshoots short gaps
    by tens of microseconds (timer slack)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def time_server(contenders: dict[str, Any], buf: Buffers, stream, rng: random.Random,
                launches: int = SERVER_LAUNCHES, flush=None, gap_us: tuple[float, float] = SERVER_GAP_US,
                budget_ms: float = SERVER_BUDGET_MS, notes: dict[str, str] | None = None,
                sampler: ClockSampler | None = None) -> dict[str, float]:
    """Server mode: many single launches, each cold and from an idle GPU; median in us.

    Before every launch: overwrite the L2 flush buffer (`flush(stream)`: >= 2x the L2 size),
    synchronize, then leave the GPU idle for a random gap (uniform in `gap_us`), then time one
    launch with CUDA events. Contenders are interleaved in a new random order every round.
    Each launch is a one-launch CUDA graph, so the host-side cost of issuing it is one
    cudaGraphLaunch for every contender alike (cuBLAS's and torch's host overhead and
    Python's call overhead are not timed, as in offline mode). `launches` rounds at most,
    fewer when the slowest contender would exceed `budget_ms` of kernel time (never fewer
    than SERVER_MIN_LAUNCHES).

    With `sampler` (tuner.measure.clocks), the timed rounds are its section (flushes and idle
    gaps included, so it gives the section's energy but no energy per GEMM); it takes no
    sample between the events of a timed launch (`sampler.quiet()`)."""
    cp = _cp()
    flush = flush if flush is not None else L2Flush()
    singles, est = {}, {}
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for name, launch in contenders.items():
        try:
            launch(buf, stream)  # warm-up: module load, library heuristics, workspaces
            graph = capture_launches(launch, buf, stream, 1)
            graph.launch(stream)  # the first replay uploads the graph
            flush(stream)
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            sync_or_fault(end)
            est[name] = max(cp.cuda.get_elapsed_time(start, end), 1e-3)
        except Exception as exc:  # noqa: BLE001 - see _dropped: noted or re-raised
            _dropped(name, "server", exc, stream, notes)
            continue
        singles[name] = graph
    sync_or_fault(stream)
    if not singles:
        return {}
    rounds = min(launches, max(SERVER_MIN_LAUNCHES, int(budget_ms / max(est.values()))))
    samples: dict[str, list[float]] = {name: [] for name in singles}
    order = list(singles)
    if sampler is not None:
        sampler.start()
    quiet = sampler.quiet if sampler is not None else contextlib.nullcontext
    try:
        for _ in range(rounds):
            rng.shuffle(order)
            for name in order:
                flush(stream)
                sync_or_fault(stream)
                _idle(rng.uniform(*gap_us) * 1e-6)
                with quiet():
                    start.record(stream)
                    singles[name].launch(stream)
                    end.record(stream)
                sync_or_fault(end)
                samples[name].append(cp.cuda.get_elapsed_time(start, end) * 1000.0)
    finally:
        if sampler is not None:
            sampler.stop()
    return {name: float(np.median(v)) for name, v in samples.items() if v}


class TorchGraph:
    """n back-to-back torch calls captured by torch itself (its allocator and capture mode),
    replayed on our stream: the fallback when torch does not capture into a cupy graph."""

    def __init__(self, torch, ext, launch, buf: Buffers, stream, n: int):
        self.torch, self.ext = torch, ext
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=ext):
            for _ in range(n):
                launch(buf, stream)

    def launch(self, stream) -> None:
        with self.torch.cuda.stream(self.ext):
            self.graph.replay()


class EagerReplay:
    """n back-to-back eager calls: the last resort when no graph captures the contender."""

    def __init__(self, launch, buf: Buffers, n: int):
        self.call, self.buf, self.n = launch, buf, n

    def launch(self, stream) -> None:
        for _ in range(self.n):
            self.call(self.buf, stream)

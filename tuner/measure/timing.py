"""Timing, the same for every contender, in the two regimes of tuner.measure.regimes:
sustained (CUDA-graph replays of back-to-back launches in short slices, round-robin in a new
random order every round, until steady) and isolated (single launches after an L2 flush and an
idle gap, interleaved per launch)."""

from __future__ import annotations

import contextlib
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from tuner.measure.buffers import Buffers
from tuner.measure.clocks import ClockSampler
from tuner.measure.device import KernelFault, abandon_capture, sync_or_fault
from tuner.measure.device import cp as _cp
from tuner.measure.regimes import (
    ISOLATED,
    ISOLATED_PLAN,
    SUSTAINED,
    SUSTAINED_BENCH,
    Plan,
    RegimeReport,
    Screen,
    block_medians,
    slice_energy,
    spread,
    steady_after,
)

GRAPH_TARGET_MS = 3.0  # sustained: each graph replay runs about this long (a slice is whole replays)
SERVER_LAUNCHES = 100  # isolated: single launches per contender (median taken) ...
SERVER_MIN_LAUNCHES = 15  # ... at least this many, however slow the kernel ...
SERVER_BUDGET_MS = 2000.0  # ... and no more than this much kernel time per contender
SERVER_GAP_US = (20.0, 500.0)  # isolated: idle gap before each launch, uniform in this range


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
    """A contender whose set-up failed in one regime: with `notes`, drop it and say why
    (after surfacing any CUDA error as a fault); without, raise as before."""
    if notes is None or isinstance(exc, KernelFault):
        raise exc
    sync_or_fault(stream)
    notes[name] = f"not measured ({mode}): {type(exc).__name__}: {exc}"


@dataclass
class _Slice:
    round: int
    name: str
    start: Any
    end: Any
    gemms: int


def _graph_for(launch, buf: Buffers, stream, target_ms: float = GRAPH_TARGET_MS) -> tuple[Any, int, float]:
    """One contender's graph of back-to-back launches sized to about `target_ms`: (graph,
    launches in it, estimated ms of one replay). Estimating runs the kernel 4 times and
    replaying once uploads the graph: the same for every contender, before any warm-up."""
    cp = _cp()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    launch(buf, stream)
    start.record(stream)
    for _ in range(3):
        launch(buf, stream)
    end.record(stream)
    sync_or_fault(end)
    est_ms = max(cp.cuda.get_elapsed_time(start, end) / 3, 1e-3)
    n = int(min(max(target_ms / est_ms, 2), 2000))
    graph = capture_launches(launch, buf, stream, n)
    graph.launch(stream)  # the first replay uploads the graph
    return graph, n, est_ms * n


def time_sustained(contenders: dict[str, Any], buf: Buffers, stream, rng: random.Random,
                   notes: dict[str, str] | None = None, sampler: ClockSampler | None = None,
                   plan: Plan = SUSTAINED_BENCH, clock=time.perf_counter) -> tuple[dict[str, float], RegimeReport]:
    """The sustained regime: per contender a CUDA graph of back-to-back launches, replayed in
    slices of about `plan.slice_ms` (a whole number of replays: every contender the same GPU
    time per slice), round-robin over the contenders in a new random order every round, with
    no gap between slices (the GPU never idles, so every contender runs in the same power
    state). `plan.warmup_rounds` untimed rounds first; then timed rounds until the last
    `plan.window` rounds agree within `plan.tol` for every contender (the steady state), at
    least `plan.min_rounds`, at most `plan.max_rounds` or `plan.max_s`. A contender's time is
    the median of its per-GEMM slice times over that last window, in us.

    The host runs one slice behind the GPU (one queued, one running): when a slice ends it
    reads the energy counter (`sampler.energy_mj()`), so each slice's energy is the difference
    between the readings at its two boundaries, and a contender's energy per GEMM is its
    window's slices' energy over their GEMMs, where the counter resolves the slices
    (`regimes.slice_energy`). With `notes`, a contender that cannot be set up is left out and
    `notes[name]` says why. With `sampler`, the timed rounds are its section."""
    return _rounds(_graphs(contenders, buf, stream, notes), stream, rng, sampler, plan, clock)


_Graphs = dict[str, tuple[Any, int, float]]  # name -> (graph, launches per replay, ms of one replay)


def _graphs(contenders: dict[str, Any], buf: Buffers, stream, notes: dict[str, str] | None,
            target_ms: float = GRAPH_TARGET_MS) -> _Graphs:
    """Every contender's graph (`_graph_for`), built once before any timed round; a contender
    that cannot be set up is left out (with `notes`) or raises."""
    graphs: _Graphs = {}
    for name, launch in contenders.items():
        try:
            graphs[name] = _graph_for(launch, buf, stream, target_ms)
        except Exception as exc:  # noqa: BLE001 - see _dropped: noted or re-raised
            _dropped(name, SUSTAINED, exc, stream, notes)
    sync_or_fault(stream)
    return graphs


def _rounds(built: _Graphs, stream, rng: random.Random, sampler: ClockSampler | None, plan: Plan,
            clock=time.perf_counter) -> tuple[dict[str, float], RegimeReport]:
    """time_sustained's rounds over graphs already built: slices of whole replays, round-robin
    in a new random order every round, until steady (see time_sustained)."""
    cp = _cp()
    # name -> (graph, launches per replay, replays per slice)
    graphs = {name: (g, n, max(1, round(plan.slice_ms / ms))) for name, (g, n, ms) in built.items()}
    report = RegimeReport(SUSTAINED, warmup_rounds=plan.warmup_rounds, window=plan.window, tol=plan.tol)
    if not graphs:
        return {}, report
    names = list(graphs)
    read = sampler.energy_mj if sampler is not None else (lambda: None)

    def schedule():
        r = 0
        while True:
            order = names[:]
            rng.shuffle(order)  # a new order every round: no contender always follows another
            for name in order:
                yield r, name
            r += 1

    slots = schedule()
    pending: deque[_Slice] = deque()
    section_gemms = 0
    started: float | None = None

    def enqueue() -> None:
        nonlocal section_gemms, started
        r, name = next(slots)
        if r == plan.warmup_rounds and started is None:  # the first timed slice: the section starts
            started = clock()
            if sampler is not None:
                sampler.start()
        graph, n, reps = graphs[name]
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(reps):
            graph.launch(stream)
        end.record(stream)
        pending.append(_Slice(r, name, start, end, n * reps))
        if started is not None:
            section_gemms += n * reps

    per_round: dict[str, list[float]] = {name: [] for name in names}
    energy: dict[str, list[tuple[float | None, int]]] = {name: [] for name in names}
    this_round: dict[str, tuple[float, tuple[float | None, int]]] = {}
    done = 0  # timed rounds complete
    e_prev = read()
    try:
        enqueue()
        enqueue()
        while pending:
            s = pending.popleft()
            sync_or_fault(s.end)
            e_now = read()
            delta = e_now - e_prev if e_now is not None and e_prev is not None else None
            e_prev = e_now
            stop = False
            if s.round >= plan.warmup_rounds:
                us = cp.cuda.get_elapsed_time(s.start, s.end) * 1000.0 / s.gemms
                this_round[s.name] = (us, (delta, s.gemms))
                if len(this_round) == len(names):  # a round complete: every contender once
                    for name, (t, e) in this_round.items():
                        per_round[name].append(t)
                        energy[name].append(e)
                    this_round = {}
                    done += 1
                    steady = steady_after(per_round, plan.window, plan.tol, plan.min_rounds)
                    out_of_time = started is not None and clock() - started > plan.max_s
                    stop = steady is not None or done >= plan.max_rounds or out_of_time
            if not stop:
                enqueue()
            else:
                while pending:  # the slice already queued runs out; it counts in the section only
                    sync_or_fault(pending.popleft().end)
    finally:
        if sampler is not None and started is not None:
            sampler.stop(gemms=section_gemms)
    steady = steady_after(per_round, plan.window, plan.tol, plan.min_rounds)
    w = min(plan.window, done) or 1
    report.rounds, report.steady, report.steady_after = done, steady is not None, steady
    times = {}
    notes_e = set()
    for name in names:
        window = per_round[name][-w:]
        if not window:
            continue
        times[name] = float(np.median(window))
        report.spread[name] = round(spread(window), 6)
        report.launches[name] = sum(g for _, g in energy[name])
        mj, why = slice_energy(energy[name][-w:])
        report.energy_mj[name] = round(mj, 6) if mj is not None else None
        if why:
            notes_e.add(why)
    report.energy_note = "; ".join(sorted(notes_e)) or None
    return times, report


def time_trial(variants: dict[str, Any], others: dict[str, Any], buf: Buffers, stream, rng: random.Random,
               screen: Screen, mode: str = SUSTAINED, plan: Plan = SUSTAINED_BENCH,
               sampler: ClockSampler | None = None, flush=None,
               clock=time.perf_counter) -> tuple[dict[str, float], RegimeReport]:
    """A search trial: one binary's run-time `variants` against `others` (cuBLAS) in `mode`.

    With more variants than `screen.keep`, a screen first ranks the variants alone in a short
    pass of the same regime (sustained: `screen.plan()`, slices of `screen.slice_ms`; isolated:
    `screen.isolated_rounds` single launches), and only `screen.survivors` go on, with
    `others`, to the full protocol (`plan`; the isolated regime's own). Times come from that
    full protocol only; the report says how many variants were screened and kept and gives
    every screened variant's screen time (`screen_us`). `sampler`'s section is the full
    protocol's timed rounds. Every variant's sustained graph is built once, sized to the
    screen's slice whether or not a screen runs (every trial of a study the same graphs)."""
    screening = screen.applies(len(variants))
    screen_us: dict[str, float] = {}
    kept: list[str] = list(variants)
    if mode == ISOLATED:
        # Single launches need no graph to reuse: the screen is a short isolated run of its own.
        if screening:
            screen_us, _ = time_isolated(variants, buf, stream, rng, launches=screen.isolated_rounds, flush=flush,
                                         plan=Plan(warmup_rounds=screen.warmup_rounds, window=1, tol=float("inf")))
            kept = screen.survivors(screen_us)
        times, report = time_isolated({n: variants[n] for n in kept} | others, buf, stream, rng, flush=flush,
                                      sampler=sampler)
    else:
        built = _graphs(variants | others, buf, stream, None, target_ms=screen.slice_ms)
        if screening:
            screen_us, _ = _rounds({n: built[n] for n in variants}, stream, rng, None, screen.plan(), clock)
            kept = screen.survivors(screen_us)
            built = {n: g for n, g in built.items() if n in others or n in kept}
        times, report = _rounds(built, stream, rng, sampler, plan, clock)
    if screening:
        report.screened, report.kept = len(screen_us), len(kept)
        report.screen_us = {n: round(t, 6) for n, t in screen_us.items()}
    return times, report


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


def time_isolated(contenders: dict[str, Any], buf: Buffers, stream, rng: random.Random,
                  launches: int = SERVER_LAUNCHES, flush=None, gap_us: tuple[float, float] = SERVER_GAP_US,
                  budget_ms: float = SERVER_BUDGET_MS, notes: dict[str, str] | None = None,
                  sampler: ClockSampler | None = None,
                  plan: Plan = ISOLATED_PLAN) -> tuple[dict[str, float], RegimeReport]:
    """The isolated regime: many single launches, each cold and from an idle GPU; median in us.

    Before every launch: overwrite the L2 flush buffer (`flush(stream)`: >= 2x the L2 size),
    synchronize, then leave the GPU idle for a random gap (uniform in `gap_us`), then time one
    launch with CUDA events. Contenders are interleaved per launch, in a new random order every
    round. Each launch is a one-launch CUDA graph, so the host-side cost of issuing it is one
    cudaGraphLaunch for every contender alike (cuBLAS's and torch's host overhead and
    Python's call overhead are not timed, as in the sustained regime). `plan.warmup_rounds`
    untimed rounds of the same kind first (equal warm-up); then `launches` rounds at most,
    fewer when the slowest contender would exceed `budget_ms` of kernel time (never fewer
    than SERVER_MIN_LAUNCHES). Steady: the medians of blocks of `plan.block` rounds, over the
    last `plan.window` blocks, agree within `plan.tol`.

    With `sampler` (tuner.measure.clocks), the timed rounds are its section (flushes and idle
    gaps included, so it gives the section's energy but no energy per GEMM); it takes no
    sample between the events of a timed launch (`sampler.quiet()`)."""
    cp = _cp()
    flush = flush if flush is not None else L2Flush()
    singles, est = {}, {}
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for name, launch in contenders.items():
        try:
            launch(buf, stream)  # module load, library heuristics, workspaces
            graph = capture_launches(launch, buf, stream, 1)
            graph.launch(stream)  # the first replay uploads the graph
            flush(stream)
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            sync_or_fault(end)
            est[name] = max(cp.cuda.get_elapsed_time(start, end), 1e-3)
        except Exception as exc:  # noqa: BLE001 - see _dropped: noted or re-raised
            _dropped(name, ISOLATED, exc, stream, notes)
            continue
        singles[name] = graph
    sync_or_fault(stream)
    report = RegimeReport(ISOLATED, warmup_rounds=plan.warmup_rounds, window=plan.window, tol=plan.tol,
                          energy_note="single launches after idle gaps: the section's energy is mostly "
                                      "flushes and idle time, no energy per GEMM")
    if not singles:
        return {}, report
    rounds = min(launches, max(SERVER_MIN_LAUNCHES, int(budget_ms / max(est.values()))))
    samples: dict[str, list[float]] = {name: [] for name in singles}
    order = list(singles)
    quiet = sampler.quiet if sampler is not None else contextlib.nullcontext

    def one_round(timed: bool) -> None:
        rng.shuffle(order)
        for name in order:
            flush(stream)
            sync_or_fault(stream)
            _idle(rng.uniform(*gap_us) * 1e-6)
            if not timed:  # warm-up: the same flush, gap and launch, untimed
                singles[name].launch(stream)
                continue
            with quiet():
                start.record(stream)
                singles[name].launch(stream)
                end.record(stream)
            sync_or_fault(end)
            samples[name].append(cp.cuda.get_elapsed_time(start, end) * 1000.0)

    for _ in range(plan.warmup_rounds):
        one_round(False)
    if sampler is not None:
        sampler.start()
    try:
        for _ in range(rounds):
            one_round(True)
    finally:
        if sampler is not None:
            sampler.stop()
    blocks = {name: block_medians(v, plan.block) for name, v in samples.items()}
    at = steady_after(blocks, plan.window, plan.tol)
    report.rounds, report.steady = rounds, at is not None
    report.steady_after = at * plan.block if at is not None else None
    for name, v in samples.items():
        if len(blocks[name]) >= plan.window:
            report.spread[name] = round(spread(blocks[name][-plan.window:]), 6)
        report.launches[name] = len(v)
    return {name: float(np.median(v)) for name, v in samples.items() if v}, report


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

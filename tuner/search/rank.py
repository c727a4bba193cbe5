"""Ranking a kernel catalogue for one shape: which compiled configs a fresh study times first.

A catalogue's kernels cost no nvcc ([0034](../../docs/decisions/0034-kernel-catalogue.md)), so
the cheapest useful trials of a fresh study are its best few catalogue kernels, each timed at
every run-time variant. With a small trial budget the order matters: catalogue order would
time whatever configs happen to be first. `rank_catalogue` orders them by two signals
([0037](../../docs/decisions/0037-catalogue-ranking.md)):

* an analytic cost model (`predict_us`): output tiles, waves over the SMs with cluster
  rounding, per-tile k-steps at the lower of the compute and L2-feed rates, split-K/stream-K,
  a fixed launch cost and the DRAM floor. It is meant to order configs, not to be accurate;
* nearby tuned shapes (`NearPick`, from the same storage): a config that won, or was near the
  best, at the nearest tuned shapes has its predicted time discounted, since a measurement at
  a near shape is better evidence than the model.

With `ranker="nvidia"` (`--rank-by nvidia`, the optional `heuristics` extra) NVIDIA's
nvMatmulHeuristics estimates each variant it can express in place of the cost model
(tuner.search.nvidia_heuristics); the neighbour credit applies the same way.

`rank_quality` checks the ranking against what a study then measured (`hgemm-tune rank-check`);
`rerank_quality` recomputes another ranker's order on the same study, to compare the two.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import optuna

from tuner.errors import UserError
from tuner.measure import config_key
from tuner.search.records import StudyMeta, TrialRecord
from tuner.search.sampler import NearPick, full_config
from tuner.search.studies import current_ok, study_gpu
from tuner.space import Family, Shape, Space, Target

# ---- the cost model's constants (round figures for H100/H200; they only need to order configs)

LAUNCH_US = 3.1          # launch and a plain grid's prologue: every kernel
# A persistent kernel's own set-up on top (the tile scheduler's parameters and first tile, the
# persistent loop around the mainloop): with LAUNCH_US, the 3-5 us measured for one on an H100. Fitted on the H100's
# 68-shape sweep (2026-12-07): `basic` 64x64 beat pingpong 64x64 by 0.55-0.73 us at every
# one-wave shape where both were timed (pingpong's halved tile overhead included, below).
PERSISTENT_SETUP_US = 0.9
L2_TBS = 10.0            # aggregate L2-to-SM bandwidth, TB/s: feeds each tile's operands
TILE_OVERHEAD_US = 0.6   # per output tile: pipeline fill and epilogue store
# The share of the dense tensor-core peak each family's MMA path reaches at best: wgmma (Hopper),
# mma.sync (Ampere-style, ~2/3 of wgmma's rate on Hopper), wmma (no swizzled pipeline). A
# family the model does not know (a proposer's) gets the middle.
FAMILY_PEAK = {"cute_sm90": 0.85, "cute_sm80": 0.55, "wmma": 0.35}
OTHER_PEAK = 0.5
SM_SMEM = 233472         # shared memory per SM (228 KB on Hopper): how many small CTAs fit at once
SM_THREADS = 2048

# ---- the neighbour signal: a measured time at a near shape beats the model, so a config that
# won a nearby shape ranks as if 20% faster than predicted, one that was near its best (2nd or
# 3rd) as if 10% faster. Multiplicative: a winner still ranks below a config the model predicts
# much faster (a 64-row winner at M = 64 does not lead at M = 8192).
WINNER_CREDIT = 0.8
NEAR_BEST_CREDIT = 0.9
NEAR_BEST_PLACES = 3


@dataclass(frozen=True)
class Tile:
    """How one config cuts the problem: what the cost model reads of a config."""

    m: int
    n: int
    k: int
    cluster_m: int = 1
    cluster_n: int = 1
    splits: int = 1            # split-K parts per output tile
    stream_k: bool = False     # k-iterations spread evenly over the SMs
    deterministic: bool = True  # partials added in k order (each split waits for the one before)
    parallel_reduction: bool = False  # each split adds up 1/splits of its tile at once (basic's split-K)
    pingpong: bool = False     # one warpgroup's epilogue under the other's MMAs
    ctas_per_sm: int = 1
    persistent: bool = False   # a persistent kernel (cooperative, pingpong): PERSISTENT_SETUP_US more


@dataclass(frozen=True)
class Candidate:
    """One catalogue config, ranked for a shape."""

    family: str
    config: dict[str, Any]       # compile-time knobs
    variant: dict[str, Any]      # the run-time knob values predicted fastest (every one is timed)
    predicted_us: float          # the ranker's time at that variant
    score_us: float              # predicted_us after the neighbour credit: what orders candidates
    evidence: str                # why the credit ("won 4096x4096x8192"), "" when none
    rank: int                    # 1: tried first
    # What predicted_us came from: "model" (predict_us), "nvidia" (nvMatmulHeuristics' estimate)
    # or "model-scaled" (our model on its scale, for a config it cannot express).
    predicted_by: str = "model"

    @property
    def key(self) -> str:
        return config_key(self.family, self.config)


@dataclass
class Ranking:
    candidates: list[Candidate]
    dropped: list[tuple[str, dict[str, Any], str]] = field(default_factory=list)  # (family, config, why)


def tile_of(fam: Family, full: dict[str, Any], shape: Shape, target: Target) -> Tile | None:
    """The tiling of a full config (compile and run-time knobs); None for a family without tile knobs."""
    if {"TILE_M", "TILE_N", "TILE_K"} <= set(full):  # cute_sm90: one persistent CTA per SM
        decomp = str(full.get("DECOMP", "data_parallel"))
        splits = int(decomp.split("_")[1]) if decomp.startswith("split_") else 1
        ctas = 1
        if full.get("SCHEDULE") == "basic":  # a grid of tiles: as many CTAs per SM as shared memory allows
            smem = int(fam.env(full, shape, target).get("smem_bytes", 0) or 0)
            ctas = max(min(SM_SMEM // smem if smem else 1, SM_THREADS // 256), 1)
        return Tile(full["TILE_M"], full["TILE_N"], full["TILE_K"], int(full.get("CLUSTER_M", 1)),
                    int(full.get("CLUSTER_N", 1)), splits, decomp == "stream_k",
                    full.get("REDUCTION", "deterministic") == "deterministic", full.get("SCHEDULE") == "basic",
                    full.get("SCHEDULE") == "pingpong", ctas, full.get("SCHEDULE") in ("cooperative", "pingpong"))
    if {"BM", "BN", "BK"} <= set(full):  # cubin families: as many CTAs per SM as smem and threads allow
        env = fam.env(full, shape, target)
        smem, threads = int(env.get("smem_bytes", 0) or 0), int(env.get("threads", 128) or 128)
        fit = min(SM_SMEM // smem if smem else 8, SM_THREADS // max(threads, 1), 8)
        return Tile(full["BM"], full["BN"], full["BK"], ctas_per_sm=max(fit, 1))
    return None


def predict_us(tile: Tile | None, family: str, shape: Shape, target: Target) -> float:
    """Predicted time of one kernel: launch + max(mainloop over waves, DRAM floor)."""
    M, N, K = shape.M, shape.N, shape.K
    bandwidth = target.bandwidth_gbs * 1e3  # bytes per us
    dram_us = 2 * (M * K + N * K + M * N) / bandwidth  # each operand read once, C written once
    peak = FAMILY_PEAK.get(family, OTHER_PEAK) * target.peak_tflops * 1e6  # flop per us, whole GPU
    if tile is None:  # nothing to model: the roofline at the family's rate
        return LAUNCH_US + max(2 * M * N * K / peak, dram_us)
    sms = target.sm_count
    # Output tiles, the grid rounded up to whole clusters; a tail tile computes its full size
    # (padding waste) but TMA/cp.async read only the rows that exist.
    tiles_m = math.ceil(math.ceil(M / tile.m) / tile.cluster_m) * tile.cluster_m
    tiles_n = math.ceil(math.ceil(N / tile.n) / tile.cluster_n) * tile.cluster_n
    tiles = tiles_m * tiles_n
    k_iters = math.ceil(K / tile.k)
    # CTAs resident at once: clusters take whole groups of SMs.
    group = tile.cluster_m * tile.cluster_n
    sm_slots = max((sms // group) * group, 1)
    slots = sm_slots * tile.ctas_per_sm
    # One k-step of one CTA: its MMAs at the SM's share of the peak, or the operand tiles at its
    # share of L2 bandwidth, whichever is slower. A cluster multicasts A along N and B along M.
    # Narrow tiles issue narrow MMAs (wgmma n64 runs below n256): TN / (TN + 16).
    sm_rate = peak / sms * tile.n / (tile.n + 16)
    rows, cols = min(tile.m, M), min(tile.n, N)
    feed = 2 * tile.k * (rows / tile.cluster_n + cols / tile.cluster_m)
    alone_us = max(2 * tile.m * tile.n * tile.k / sm_rate, feed / (L2_TBS * 1e6 / sms))  # one CTA on its SM
    step_us = alone_us * tile.ctas_per_sm
    overhead = TILE_OVERHEAD_US / (2 if tile.pingpong else 1)
    # A split's partial tile goes to the workspace and is read back (fp32): in k order the splits
    # also wait on each other, about half of them in turn. basic's parallel reduction: each CTA
    # writes its partial tile and reads 1/splits of every split's, one tile in all, at once.
    fixup = 2 * 4 * tile.m * tile.n / (L2_TBS * 1e6 / sms)
    if tile.stream_k:
        # Every tile's k-iterations spread evenly over the slots: no wave tail, one partial
        # tile to fix up per CTA where tiles do not divide evenly.
        per_cta = math.ceil(tiles * k_iters / slots)
        mainloop = per_cta * step_us + (math.ceil(tiles / slots) + 1) * overhead + (fixup if tiles % slots else 0)
    else:
        units = tiles * tile.splits
        # CTAs sharing an SM: as many as fit where the grid fills every SM, one each where it does not
        # (a one-wave split-K grid of basic's small CTAs runs each on its own SM).
        share = min(tile.ctas_per_sm, math.ceil(units / sm_slots))
        waves = math.ceil(units / (sm_slots * share))  # the last wave may leave SMs idle: quantization
        unit = math.ceil(k_iters / tile.splits) * alone_us * share + overhead
        if tile.splits > 1:
            in_turn = tile.deterministic and not tile.parallel_reduction
            unit += fixup * (tile.splits / 2 if in_turn else 1)
        mainloop = waves * unit
    return LAUNCH_US + (PERSISTENT_SETUP_US if tile.persistent else 0.0) + max(mainloop, dram_us)


def _credit(picks: list[NearPick], family: str, config: dict[str, Any]) -> tuple[float, str]:
    best = (1.0, "")
    for p in picks:
        if p.family != family or p.config != config:
            continue
        if p.place == 1:
            return WINNER_CREDIT, f"won {p.shape}"
        if p.place <= NEAR_BEST_PLACES and best[0] > NEAR_BEST_CREDIT:
            best = (NEAR_BEST_CREDIT, f"#{p.place} at {p.shape}")
    return best


def _default_distance(fam: Family, variant: dict[str, Any]) -> int:
    return sum(1 for k, v in variant.items() if fam.knobs[k].default != v)


RANKERS = ("model", "nvidia")


def check_ranker(name: str) -> str:
    """`name` if it is a ranker, else one line saying which there are."""
    if name not in RANKERS:
        raise UserError(f"--rank-by {name!r}: choose one of {', '.join(RANKERS)}")
    return name


def _nvidia_estimator(target: Target, accumulate: str) -> Callable[[dict[str, Any], Shape], float | None]:
    """nvMatmulHeuristics' estimate of a full config at a shape (None: it cannot express the
    config); a UserError when the wheel is missing. A target it has no GPU for estimates nothing."""
    from tuner.search import nvidia_heuristics as nvh

    nvh.load()
    gpu = nvh.gpu_for(target)
    if gpu is None:
        return lambda full, shape: None
    h = nvh.heuristic(gpu)
    memo: dict[tuple[Any, str], float | None] = {}

    def estimate(full: dict[str, Any], shape: Shape) -> float | None:
        cfg = nvh.nv_config(full)
        if cfg is None:
            return None
        if (cfg, str(shape)) not in memo:
            memo[cfg, str(shape)] = h.estimate_us(cfg, shape, accumulate)
        return memo[cfg, str(shape)]

    return estimate


def rank_catalogue(space: Space, configs: list[tuple[str, dict[str, Any]]], shape: Shape, target: Target,
                   neighbours: list[NearPick] | None = None, *, ranker: str = "model",
                   accumulate: str = "fp32") -> Ranking:
    """The configs (family, compile config), ranked for this shape: configs whose constraints
    reject the shape are dropped, each other one is predicted at its fastest valid run-time
    variant, discounted by the neighbour evidence, and sorted. Deterministic: ties keep
    catalogue order.

    ranker "model": our cost model (`predict_us`). "nvidia": NVIDIA's nvMatmulHeuristics
    (tuner.search.nvidia_heuristics, the `heuristics` extra) estimates every variant it can
    express; the others (stream-K, families other than cute_sm90) take our model's time scaled
    onto its scale, and ties (it ignores stages, raster and swizzle) are broken by our model."""
    check_ranker(ranker)
    estimate = _nvidia_estimator(target, accumulate) if ranker == "nvidia" else None
    picks = neighbours or []
    # Per config: (catalogue index, family, compile config, [(variant index, variant, model us, nvidia us)])
    rows: list[tuple[int, str, dict[str, Any], list[tuple[int, dict[str, Any], float, float | None]]]] = []
    dropped: list[tuple[str, dict[str, Any], str]] = []
    seen: set[str] = set()
    for i, (name, config) in enumerate(configs):
        fam = space.family(name)
        key = config_key(name, config)
        if key in seen:
            continue
        seen.add(key)
        full = full_config(fam, config)
        why = fam.violations(full, shape, target)  # as the search rejects it (compile_queue.prepare)
        if why:
            dropped.append((name, dict(config), "; ".join(why)))
            continue
        variants: list[tuple[int, dict[str, Any], float, float | None]] = []
        memo: dict[Tile | None, float] = {}
        for j, v in enumerate(fam.runtime_variants() or [{}]):
            if v and fam.violations(full | v, shape, target):
                continue
            tile = tile_of(fam, full | v, shape, target)
            if tile not in memo:
                memo[tile] = predict_us(tile, name, shape, target)
            variants.append((j, v, memo[tile], estimate(full | v, shape) if estimate else None))
        if not variants:
            dropped.append((name, dict(config), "no run-time variant passes the constraints"))
            continue
        rows.append((i, name, fam.compile_config(full), variants))
    # The two scales: the heuristic's absolute times are not ours (about twice the datasheet
    # rate's with fp32 accumulation), so a variant it cannot express takes our model's time times
    # the median ratio of its estimate to our model's over the variants both estimated at this
    # shape (1 when it estimated none): the fallbacks land where our model puts them relative
    # to the heuristic's own order, on its scale.
    both = [nv / model for *_, variants in rows for _, _, model, nv in variants if nv is not None]
    scale = statistics.median(both) if both else 1.0
    scored: list[tuple[float, float, int, Candidate]] = []
    for i, name, config, variants in rows:
        fam = space.family(name)
        best: tuple[float, float, int, int, dict[str, Any], str] | None = None
        for j, v, model, nv in variants:
            # Run-time variants neither model tells apart (raster, swizzle) predict the same time;
            # among those the one nearest the defaults is named.
            if ranker == "model":
                us, by = model, "model"
            else:
                us, by = (nv, "nvidia") if nv is not None else (model * scale, "model-scaled")
            cand = (us, model, _default_distance(fam, v), j, v, by)
            if best is None or cand[:4] < best[:4]:
                best = cand
        assert best is not None
        credit, evidence = _credit(picks, name, config)
        score = best[0] * credit
        scored.append((score, best[1], i, Candidate(name, config, best[4], round(best[0], 3), round(score, 3),
                                                    evidence, 0, best[5])))
    scored.sort(key=lambda s: s[:3])
    ranked = [replace(c, rank=r) for r, (*_, c) in enumerate(scored, 1)]
    return Ranking(ranked, dropped)


# ---- how good the ranking was ----------------------------------------------------------------

@dataclass
class RankQuality:
    """A study's ranked catalogue candidates against what it measured."""

    study: str
    shape: str
    simulated: bool
    measured: int                 # ranked candidates verified and timed
    ranked: int                   # ranked candidates with any trial (measured or not)
    first_place: int | None       # measured place (1: fastest) of the predicted #1; None: not measured
    spearman: float | None        # rank correlation of predicted order and measured times (>= 3 measured)
    best_rank: int | None         # predicted rank of the measured fastest candidate
    top: int

    @property
    def best_in_top(self) -> bool | None:
        return None if self.best_rank is None else self.best_rank <= self.top


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (ties take their average rank); None below 3 points or when
    one side is constant."""
    if len(xs) != len(ys) or len(xs) < 3:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return cov / math.sqrt(vx * vy) if vx and vy else None


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def rank_quality(study: optuna.Study, top: int = 5) -> RankQuality | None:
    """How the ranking recorded in a study's trials (`TrialRecord.catalogue_rank`) compares with
    the times it measured; None for a study with no ranked catalogue trial. Spearman is taken
    between the predicted order (rank, i.e. the credited predicted time) and the measured times,
    over the candidates that verified; only current trials count (`current_ok`)."""
    trials = study.get_trials(deepcopy=False)
    ranked = {r.catalogue_rank for t in trials if t.state.is_finished()
              for r in [TrialRecord.of(t)] if r.catalogue_rank is not None}
    if not ranked:
        return None
    times: dict[int, float] = {}
    for t in current_ok(trials, study_gpu(study), screened=True):
        rec = TrialRecord.of(t)
        measured = order_time(rec)
        if rec.catalogue_rank is not None and measured is not None:
            times[rec.catalogue_rank] = min(measured, times.get(rec.catalogue_rank, math.inf))
    return _quality(study, len(ranked), times, top)


def order_time(rec: TrialRecord) -> float | None:
    """The time a trial ranks by when the ranking is checked: a batched trial's (several binaries
    screened together, regime `batch` > 1) best screen time, which every binary of its batch has
    from the same short pass, the kept and the screened-out alike; any other trial's own time."""
    report = rec.regime_report or {}
    if (report.get("batch") or 0) > 1 and report.get("screen_us"):
        return min(report["screen_us"].values())
    return rec.time_us


def rerank_quality(study: optuna.Study, space: Space, ranker: str, top: int = 5) -> RankQuality | None:
    """`rank_quality` of another ranker on the same study: the study's ranked catalogue candidates
    (their recorded configs, in recorded order, which only breaks exact ties) ranked again by
    `ranker` from the config, the study's shape, target and accumulation, with no neighbour
    credit (the storage now holds this study's own result and later ones), against the times the
    study measured. Candidates whose family or knobs the space no longer has are left out. The
    same computation for "model" and "nvidia" puts the two rankers side by side (rank-check)."""
    trials = study.get_trials(deepcopy=False)
    recorded: dict[str, tuple[int, str, dict[str, Any]]] = {}
    for t in trials:
        rec = TrialRecord.of(t)
        if t.state.is_finished() and rec.catalogue_rank is not None:
            recorded.setdefault(config_key(rec.family, rec.config), (rec.catalogue_rank, rec.family, rec.config))
    if not recorded:
        return None
    configs = [(f, c) for _, f, c in sorted(recorded.values(), key=lambda r: r[0]) if in_space(space, f, c)]
    meta = StudyMeta.of(study)
    ranking = rank_catalogue(space, configs, meta.shape_record, meta.target_record, ranker=ranker,
                             accumulate=meta.accumulate)
    rank_of = {c.key: c.rank for c in ranking.candidates}
    times: dict[int, float] = {}
    for t in current_ok(trials, study_gpu(study), screened=True):
        rec = TrialRecord.of(t)
        r, measured = rank_of.get(config_key(rec.family, rec.config)), order_time(rec)
        if r is not None and measured is not None:
            times[r] = min(measured, times.get(r, math.inf))
    return _quality(study, len(ranking.candidates), times, top)


def in_space(space: Space, family: str, config: dict[str, Any]) -> bool:
    """A config the space still has (its families and knob lists may have changed since)."""
    try:
        space.family(family).complete(config)
    except UserError:
        return False
    return True


def _quality(study: optuna.Study, ranked: int, times: dict[int, float], top: int) -> RankQuality:
    """The quality figures of one ranking (rank -> best measured time of that candidate)."""
    meta = StudyMeta.of(study)
    order = sorted(times, key=lambda r: (times[r], r))  # measured fastest first
    return RankQuality(
        study=study.study_name, shape=meta.shape, simulated=meta.simulated, measured=len(times), ranked=ranked,
        first_place=order.index(1) + 1 if 1 in times else None,
        spearman=spearman([float(r) for r in times], list(times.values())),
        best_rank=order[0] if order else None, top=top)

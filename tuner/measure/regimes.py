"""The two named timing regimes, and the rules that make a comparison in them fair.

Every contender of a comparison (our kernels and the vendor baselines) is measured in the same
thermal and power state: interleaved at fine grain, the order shuffled every round, after the
same warm-up, and only once the per-round times have settled (docs/decisions/0036).

- `sustained`: back-to-back launches. Per contender a CUDA graph of back-to-back launches,
  replayed in short slices (about `Plan.slice_ms` each) round-robin over the contenders until
  the last `window` rounds agree within `tol`: the power-capped steady state a GEMM-bound
  service runs in. Its energy counter is read at every slice boundary, which gives each
  contender its own energy per GEMM where the counter resolves the slices.
- `isolated`: single launches, each after an L2 flush and a random idle gap, interleaved per
  launch between the contenders: the cold, full-clock latency of one GEMM.

`offline` (= sustained) and `server` (= isolated) are the older names: accepted wherever a
regime is read (the CLI, requests, older bench.json and replay files), never written.

Parent side and worker side both import this module: it imports nothing of the GPU.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import asdict, dataclass, field, fields
from typing import Any

SUSTAINED, ISOLATED = "sustained", "isolated"
REGIMES = (SUSTAINED, ISOLATED)
ALIASES = {"offline": SUSTAINED, "server": ISOLATED}
OBJECTIVES = REGIMES  # what a search may minimize: the time in one regime
# A contender's energy per GEMM counts only when the counter moved in at least this share of its
# slices: a counter coarser than the slices gives lumps, not a measurement (then None, said why).
ENERGY_RESOLVED_SHARE = 0.9


def canonical(name: str) -> str:
    """A regime name or an older alias -> the regime; ValueError for anything else."""
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key not in REGIMES:
        raise ValueError(f"unknown timing regime {name!r}: use sustained or isolated "
                         "(offline and server are accepted as their older names)")
    return key


def canonical_or_none(name: str) -> str | None:
    try:
        return canonical(name)
    except ValueError:
        return None


@dataclass(frozen=True)
class Plan:
    """How long a regime's measurement runs and when it counts as steady.

    sustained: `warmup_rounds` untimed rounds, then timed rounds of one slice per contender
    (each about `slice_ms` of back-to-back launches), until `window` consecutive rounds agree
    within `tol` (max-min over median, every contender), at least `min_rounds`, at most
    `max_rounds` or `max_s` seconds. isolated: `warmup_rounds` untimed rounds of single launches,
    then the timed rounds (their number set by the time budget); steadiness is checked on the
    medians of blocks of `block` rounds."""

    slice_ms: float = 20.0
    warmup_rounds: int = 3
    min_rounds: int = 8
    max_rounds: int = 60
    window: int = 5
    tol: float = 0.02
    max_s: float = 10.0
    block: int = 1


# bench and confirm: long enough slices for the energy counter, a tight window.
SUSTAINED_BENCH = Plan()
# A search trial: the same protocol, shorter (every trial pays it).
SUSTAINED_TRIAL = Plan(slice_ms=6.0, warmup_rounds=2, min_rounds=5, max_rounds=25, window=4, tol=0.03, max_s=3.0)
ISOLATED_PLAN = Plan(slice_ms=0.0, warmup_rounds=3, min_rounds=0, max_rounds=0, window=4, tol=0.05, block=5)


@dataclass(frozen=True)
class Screen:
    """A search trial's first stage, when its binary has more than `keep` run-time variants: a
    short interleaved pass over the variants alone (`warmup_rounds` untimed rounds, then
    `rounds` timed ones; in the isolated regime `isolated_rounds` single launches each), ranked
    by median; only the survivors (`survivors`) and cuBLAS then run the full protocol. bench
    and confirm never screen: they time their few contenders in full.

    Why these numbers: the screen runs while the power-capped clock may still be falling (tens
    of ms, against a cap controller that settles over a few hundred ms), so a variant's screen
    time is off by a few percent depending on where in the rounds it ran. `margin` (3%) keeps
    every variant the screen cannot tell from the `keep`-th best, so the true best is dropped
    only if the screen put it more than 3% behind `keep` slower variants; `cap` (6) bounds the
    steady stage at 7 contenders with cuBLAS (against 17 for 16 variants) when many tie."""

    keep: int = 3
    margin: float = 0.03
    cap: int = 6
    slice_ms: float = 1.5      # sustained: one slice per variant per round (and a trial's graph size)
    warmup_rounds: int = 1
    rounds: int = 2            # sustained: timed rounds (the median of 2 is their mean)
    isolated_rounds: int = 10  # isolated: timed single launches per variant (single launches are noisier)
    max_s: float = 1.0

    def applies(self, variants: int) -> bool:
        return variants > self.keep

    def plan(self) -> Plan:
        """The screen's sustained plan: exactly `rounds` timed rounds (no steady check: tol inf)."""
        return Plan(slice_ms=self.slice_ms, warmup_rounds=self.warmup_rounds, min_rounds=self.rounds,
                    max_rounds=self.rounds, window=self.rounds, tol=float("inf"), max_s=self.max_s)

    def survivors(self, times: dict[str, float]) -> list[str]:
        """The variants the steady stage times, fastest first: the best `keep`, and any other
        within `margin` of the `keep`-th best, `cap` at most."""
        ranked = sorted(times, key=times.__getitem__)
        if len(ranked) <= self.keep:
            return ranked
        bar = times[ranked[self.keep - 1]] * (1.0 + self.margin)
        return [n for i, n in enumerate(ranked) if i < self.keep or times[n] <= bar][:max(self.cap, self.keep)]


# Every search trial (evaluate) screens with this; bench, confirm and baseline never do.
TRIAL_SCREEN = Screen()
# "0" in the worker's environment: no screen (to A/B the screen against timing every variant).
SCREEN_ENV = "HGEMM_TUNE_SCREEN"
NO_SCREEN = Screen(keep=1 << 30)


def trial_screen(env: dict[str, str]) -> Screen:
    return NO_SCREEN if env.get(SCREEN_ENV, "").strip() == "0" else TRIAL_SCREEN


def spread(values: list[float]) -> float:
    """(max - min) / median: how far apart a window's per-round times are."""
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med > 0 else float("inf")


def steady_after(series: dict[str, list[float]], window: int, tol: float, min_rounds: int = 0) -> int | None:
    """The first round count n (n >= window and n >= min_rounds) at which every contender's
    values in rounds n-window+1..n spread by at most `tol`; None if that never held."""
    if not series or window < 1:
        return None
    rounds = min(len(v) for v in series.values())
    for n in range(max(window, min_rounds), rounds + 1):
        if all(spread(v[n - window:n]) <= tol for v in series.values()):
            return n
    return None


def block_medians(values: list[float], block: int) -> list[float]:
    """Medians of consecutive blocks of `block` values (a last partial block is dropped)."""
    block = max(1, block)
    return [statistics.median(values[i:i + block]) for i in range(0, len(values) - block + 1, block)]


def slice_energy(slices: list[tuple[float | None, int]],
                 resolved_share: float = ENERGY_RESOLVED_SHARE) -> tuple[float | None, str | None]:
    """One contender's slices (energy counter delta in mJ or None, GEMMs) -> (mJ per GEMM, why
    none). None where a slice has no reading (no counter) or the counter stood still in more
    than 1 - `resolved_share` of them (it updates more slowly than the slices last)."""
    if not slices:
        return None, "no timed slice"
    if any(e is None for e, _ in slices):
        return None, "no energy counter reading"
    moved = sum(1 for e, _ in slices if e and e > 0)
    if moved < resolved_share * len(slices):
        return None, (f"the energy counter moved in {moved} of {len(slices)} slices: too coarse for "
                      "slices this short")
    gemms = sum(g for _, g in slices)
    return (sum(e for e, _ in slices if e) / gemms if gemms else None), None


@dataclass
class RegimeReport:
    """How one regime's timing went: the protocol it followed and whether it settled. Travels
    as a plain dict (`to_dict`) in worker replies, trial records, replay files and bench rows."""

    regime: str
    rounds: int = 0                 # timed rounds run (each: every contender once)
    warmup_rounds: int = 0          # untimed rounds before them, the same for every contender
    steady: bool | None = None      # None: not checked (an older worker or replay record)
    steady_after: int | None = None  # timed rounds run when the steady check first held
    window: int = 0
    tol: float = 0.0
    spread: dict[str, float] = field(default_factory=dict)    # contender -> spread of the reported window
    launches: dict[str, int] = field(default_factory=dict)    # contender -> timed GEMMs
    # contender -> its own energy per GEMM (mJ) from its slices; None where unresolved (energy_note)
    energy_mj: dict[str, float | None] = field(default_factory=dict)
    energy_note: str | None = None
    # A search trial's screen (Screen): how many variants it ranked (0: no screen ran), how many
    # went on to the rounds above, and every screened variant's screen time (us). Those times
    # are the screen's, never the steady protocol's: a variant missing from the trial's times
    # was dropped by the screen.
    screened: int = 0
    kept: int = 0
    screen_us: dict[str, float] = field(default_factory=dict)
    # A batch (evaluate_many): how many binaries were screened together in this section (0: this
    # trial's binary alone); `screened` and `kept` then count the variants of all of them.
    batch: int = 0

    def for_item(self, prefix: str) -> RegimeReport:
        """One binary's view of a batch section: its own contenders' entries (named
        "<prefix><variant>" in the section, here "<variant>") and the others' (cuBLAS)."""
        def own(d: dict[str, Any]) -> dict[str, Any]:
            return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in d.items()
                    if k.startswith(prefix) or "|" not in k}
        return dataclasses.replace(self, spread=own(self.spread), launches=own(self.launches),
                                   energy_mj=own(self.energy_mj),
                                   screen_us={k[len(prefix):]: v for k, v in self.screen_us.items()
                                              if k.startswith(prefix)})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None, regime: str = SUSTAINED) -> RegimeReport:
        """A stored report; keys it does not know are dropped, missing ones take their defaults
        ({} or None: an older record, steady unknown)."""
        raw = dict(raw or {})
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in raw.items() if k in names}
        known["regime"] = canonical_or_none(known.get("regime", regime)) or regime
        return cls(**known)


def steady_text(report: dict[str, Any] | RegimeReport | None) -> str:
    """One cell: "yes (9 rounds)", "NO (60 rounds)", "unknown"."""
    if report is None:
        return "unknown"
    rep = report if isinstance(report, RegimeReport) else RegimeReport.from_dict(report)
    if rep.steady is None:
        return "unknown"
    screen = f"; {rep.kept} of {rep.screened} variants after a screen" if rep.screened else ""
    if rep.batch > 1:
        screen += f" of {rep.batch} binaries"
    if rep.steady:
        return f"yes ({rep.steady_after} rounds{screen})"
    return f"NO ({rep.rounds} rounds{screen})"


def combine_reports(reports: list[dict[str, Any] | None], regime: str = SUSTAINED) -> dict[str, Any]:
    """Several runs' reports of one regime -> one: steady only if every run was (None if no run
    said), the most rounds any run needed, each contender's median energy and largest spread,
    and how many runs were steady (`steady_runs`, `runs`)."""
    reps = [RegimeReport.from_dict(r, regime) for r in reports if r]
    out = RegimeReport(regime).to_dict() | {"runs": len(reports), "steady_runs": 0}
    if not reps:
        return out
    said = [r.steady for r in reps if r.steady is not None]
    # steady: every run said so; not steady: any run did not settle; else unknown
    out["steady"] = False if not all(said) else (True if len(said) == len(reports) else None)
    out["steady_runs"] = sum(1 for s in said if s)
    afters = [r.steady_after for r in reps if r.steady_after is not None]
    out["steady_after"] = max(afters) if afters else None
    out["rounds"] = max(r.rounds for r in reps)
    out["warmup_rounds"], out["window"], out["tol"] = reps[0].warmup_rounds, reps[0].window, reps[0].tol
    for key in ("spread", "launches", "energy_mj"):
        names = {n for r in reps for n in getattr(r, key)}
        merged: dict[str, Any] = {}
        for n in names:
            vals = [getattr(r, key).get(n) for r in reps]
            known = [v for v in vals if v is not None]
            if key == "energy_mj":  # a contender's energy only where every run resolved it
                merged[n] = statistics.median(known) if known and len(known) == len(reps) else None
            elif known:
                merged[n] = max(known) if key == "spread" else sum(known)
        out[key] = merged
    out["energy_note"] = next((r.energy_note for r in reps if r.energy_note), None)
    return out

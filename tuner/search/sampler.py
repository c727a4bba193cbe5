"""The ask side of the search: which configs to try. The Optuna sampler proposes (family first,
then its compile-time knobs), seeds and nearby shapes' winners are enqueued first, and
`Claims` keeps any config from being compiled or timed twice in a study."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Any

import optuna

from tuner.errors import UserError
from tuner.measure import config_key
from tuner.measure.regimes import OBJECTIVES, SUSTAINED, canonical
from tuner.search.records import UNMEASURED_FAILS, Status, StudyMeta, TrialRecord
from tuner.search.studies import best_per_family, ranked_per_family
from tuner.space import Family, Shape, Space, parse_shape

SAMPLERS = ("tpe", "random", "gp", "cmaes", "grid")
STALE_PROPOSALS = 200  # this many proposals in a row without a new valid config: the space is spent
EXPLORE_AFTER = 20     # after this many stale proposals in a row, enqueue a random valid unmeasured config


class _AskTellGridSampler(optuna.samplers.GridSampler):
    """GridSampler calls study.stop() once the grid is done, which only works inside
    study.optimize; our ask/tell loop stops on its own trial count instead."""

    def after_trial(self, study, trial, state, values) -> None:  # noqa: D102
        return None


def make_sampler(name: str, seed: int | None, families: list[Family]) -> optuna.samplers.BaseSampler:
    if name == "tpe":
        # multivariate+group: knobs of one family are modelled jointly, families apart.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=12)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    if name == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    if name == "grid":
        if len(families) > 1:
            # Optuna's grid is the cross product of every parameter: across families that is
            # the product of all their knobs (10^8 points for two), nearly all of them unused.
            raise UserError("--sampler grid searches one family at a time: pick it with --families")
        grid: dict[str, list] = {"family": [f.name for f in families]}
        for fam in families:
            for knob in fam.compile_knobs:
                grid[f"{fam.name}.{knob.name}"] = list(knob.values)
        return _AskTellGridSampler(grid, seed=seed)
    raise UserError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")


def study_name(shape: Shape, families: list[Family], arch: str, layout: str = "TN", accumulate: str = "fp32",
               objective: str = SUSTAINED) -> str:
    """The default study name; a study of another objective than sustained is another study
    (its times are of another regime), named with the objective at the end."""
    acc = {"fp32": "f32", "fp16": "f16"}[accumulate]
    name = f"{shape}-{layout}-{acc}acc-{arch}-{'+'.join(f.name for f in families)}"
    return name if objective == SUSTAINED else f"{name}-{objective}"


def suggest(trial: optuna.Trial, families: list[Family]) -> tuple[Family, dict[str, Any]]:
    """Family first, then that family's compile-time knobs (namespaced by family)."""
    fam_by_name = {f.name: f for f in families}
    name = trial.suggest_categorical("family", list(fam_by_name))
    fam = fam_by_name[name]
    config = {k.name: trial.suggest_categorical(f"{name}.{k.name}", list(k.values)) for k in fam.compile_knobs}
    return fam, config


def trial_params(fam: Family, config: dict[str, Any]) -> dict[str, Any]:
    return {"family": fam.name} | {f"{fam.name}.{k}": v for k, v in config.items()}


def full_config(fam: Family, config: dict[str, Any]) -> dict[str, Any]:
    """A compile config completed with the defaults of every knob, run-time ones included: what
    the constraints check and the template renders."""
    return fam.complete(config | {k.name: k.default for k in fam.runtime_knobs})


def random_valid_config(families: list[Family], shape: Shape, target, taken: set[str], rng,
                        tries: int = 4000) -> tuple[Family, dict[str, Any]] | None:
    """A config drawn uniformly from the knob lists that passes the constraints and no trial
    holds yet; None when `tries` draws find none (the space is all but spent)."""
    for _ in range(tries):
        fam = rng.choice(families)
        config = {k.name: rng.choice(k.values) for k in fam.compile_knobs}
        full = full_config(fam, config)
        if config_key(fam.name, config) not in taken and not fam.violations(full, shape, target):
            return fam, config
    return None


def seed_configs(fam: Family, shape: Shape) -> list[dict[str, Any]]:
    """Configs worth trying first: the family default, the family's `seeds` from space.yaml
    whose `when` holds for the shape (invalid ones for this shape are rejected before nvcc
    like any other), then tile sizes matched to the shape."""
    seeds = [fam.compile_config(fam.defaults())]
    seeds += [fam.compile_config(fam.defaults() | s) for s in fam.seeds_for(shape)]
    knobs = {k.name: k for k in fam.compile_knobs}
    if {"BM", "BN"} <= set(knobs):
        for bm, bn in ((128, 256), (256, 128), (128, 128), (64, 128), (128, 64), (64, 64)):
            if bm in knobs["BM"].values and bn in knobs["BN"].values:
                seeds.append(fam.compile_config(fam.defaults() | {"BM": bm, "BN": bn}))
    out, seen = [], set()
    for s in seeds:
        key = json.dumps(s, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _key_of(trial: optuna.trial.FrozenTrial) -> str | None:
    """The (family, compile config) a trial measures, from its params (set even while RUNNING)."""
    fam = trial.params.get("family")
    if fam is None:
        return None
    prefix = f"{fam}."
    return config_key(fam, {k[len(prefix):]: v for k, v in trial.params.items() if k.startswith(prefix)})


def _claimed(study: optuna.Study, exclude: int) -> dict[str, optuna.trial.FrozenTrial]:
    """Configs that a trial of this study (any worker) measured, rejected or is measuring now."""
    out: dict[str, optuna.trial.FrozenTrial] = {}
    for t in study.get_trials(deepcopy=False):
        status = TrialRecord.of(t).status
        if t.number == exclude or status == Status.DUPLICATE:
            continue
        if t.state == optuna.trial.TrialState.FAIL and status in UNMEASURED_FAILS:
            continue  # never measured (killed or interrupted): free to measure again
        key = _key_of(t)
        if key is not None and (key not in out or t.state == optuna.trial.TrialState.COMPLETE):
            out[key] = t
    return out


class Claims:
    """`_claimed`, read from the storage only when a config is not already known to be
    settled here: reading every trial costs ~0.1 s once a study holds a thousand, and most
    proposals repeat configs we know. A miss, or a hit still in flight, re-reads, so
    configs that other workers hold are still seen."""

    def __init__(self, study: optuna.Study):
        self.study = study
        self.known: dict[str, optuna.trial.FrozenTrial] = {}

    def get(self, key: str, exclude: int) -> optuna.trial.FrozenTrial | None:
        hit = self.known.get(key)
        if hit is None or hit.number == exclude or not hit.state.is_finished():
            self.known = _claimed(self.study, exclude)
            hit = self.known.get(key)
        return hit if hit is not None and hit.number != exclude else None

    def keys(self) -> set[str]:
        self.known = _claimed(self.study, -1)
        return set(self.known)


def check_objective(objective: str) -> str:
    """--objective: the regime whose time a search minimizes; one clear line for anything else."""
    try:
        key = canonical(objective)
    except ValueError:
        key = None
    if key not in OBJECTIVES:
        raise UserError(f"--objective {objective!r}: choose sustained (back-to-back launches, power-capped "
                        "steady state) or isolated (single launches after an idle gap, full clocks)")
    return key


def check_accumulate(space: Space, family_names: list[str], accumulate: str) -> None:
    """Every family must build the problem's accumulator type."""
    cannot = [n for n in family_names if accumulate not in space.family(n).accumulate]
    if cannot:
        able = [f.name for f in space.families.values() if accumulate in f.accumulate]
        raise UserError(f"{accumulate} accumulation: family {', '.join(cannot)} does not build it "
                        f"(families that do: {', '.join(able) or 'none'})")


@dataclass(frozen=True)
class NearPick:
    """A verified config of a nearby tuned shape: what a fresh shape tries first, and evidence
    for ranking a catalogue (tuner.search.rank)."""

    family: str
    config: dict[str, Any]   # compile-time knobs
    shape: str               # the tuned shape it was measured at
    distance: float          # sum of |log2| ratios of M, N, K to the shape asked about
    place: int               # 1: that study's best of its family, 2: the next distinct config, ...
    time_us: float


def nearest_picks(studies: list[optuna.Study], shape: Shape, families: list[str], k: int = 2,
                  top: int = 1) -> list[NearPick]:
    """The `top` best distinct configs per family of the k nearest tuned shapes (distance: sum
    of |log2| ratios), nearest shape first, best first."""
    scored = []
    for st in studies:
        try:
            meta = StudyMeta.of(st)
        except UserError:  # not a study of ours
            continue
        if meta.shape == str(shape):
            continue
        scored.append((parse_shape(meta.shape).distance(shape), st))
    picks: list[NearPick] = []
    for dist, st in sorted(scored, key=lambda x: x[0])[:k]:
        meta_shape = StudyMeta.of(st).shape
        # top 1 keeps best_per_family's order: what a sweep enqueued before the ranking existed
        best = ({fam: [t] for fam, t in best_per_family(st).items()} if top == 1
                else ranked_per_family(st, top))
        for fam, trials in best.items():
            if fam in families:
                for place, t in enumerate(trials, 1):
                    picks.append(NearPick(fam, TrialRecord.of(t).config, meta_shape, dist, place, float(t.value)))
    return picks


def nearest_winners(studies: list[optuna.Study], shape: Shape, families: list[str],
                    k: int = 2) -> list[tuple[str, dict]]:
    """Best config per family of the k nearest tuned shapes (distance: sum of |log2| ratios):
    what a sweep tries first on a fresh shape."""
    return [(p.family, p.config) for p in nearest_picks(studies, shape, families, k)]

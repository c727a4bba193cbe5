"""Optuna search over the compile-time knobs of one or more families, for one shape.

The loop asks trials ahead and keeps the nvcc pool busy while the GPU measures the
oldest compiled candidate; each trial's record (params, source hash, compile time,
time, TFLOP/s, verification, failure reason) lives in the Optuna storage as user
attributes, so an interrupted study keeps every finished trial and resumes.
Run-time knobs are not sampled: every cubin is timed at all of their values.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import optuna

from tuner.bench import EvalRequest, Measurement, config_key
from tuner.compile import CompilePool, CompileResult
from tuner.errors import UserError
from tuner.render import RenderError, render, source_hash, template_hash
from tuner.shapes import Shape
from tuner.space import Family, Space

SAMPLERS = ("tpe", "random", "gp", "cmaes", "grid")
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


def study_name(shape: Shape, families: list[Family], arch: str, layout: str = "TN", accumulate: str = "fp32") -> str:
    acc = {"fp32": "f32", "fp16": "f16"}[accumulate]
    return f"{shape}-{layout}-{acc}acc-{arch}-{'+'.join(f.name for f in families)}"


def suggest(trial: optuna.Trial, families: list[Family]) -> tuple[Family, dict[str, Any]]:
    """Family first, then that family's compile-time knobs (namespaced by family)."""
    fam_by_name = {f.name: f for f in families}
    name = trial.suggest_categorical("family", list(fam_by_name))
    fam = fam_by_name[name]
    config = {k.name: trial.suggest_categorical(f"{name}.{k.name}", list(k.values)) for k in fam.compile_knobs}
    return fam, config


def trial_params(fam: Family, config: dict[str, Any]) -> dict[str, Any]:
    return {"family": fam.name} | {f"{fam.name}.{k}": v for k, v in config.items()}


@dataclass
class TrialRecord:
    """What one trial did, as stored in the trial's user attributes."""

    family: str
    config: dict[str, Any]
    status: str                       # ok | invalid | render_error | compile_error | failed | fault | timeout | ...
    source_hash: str = ""
    cache_key: str = ""
    compile_s: float = 0.0
    cached: bool = False
    registers: int | None = None
    spill_bytes: int | None = None
    time_us: float | None = None
    tflops: float | None = None
    variant: dict[str, Any] = field(default_factory=dict)
    variant_times_us: dict[str, float] = field(default_factory=dict)
    cublas_us: float | None = None
    speedup_cublas: float | None = None
    verify: dict[str, Any] = field(default_factory=dict)
    kind: str | None = None
    reason: str | None = None
    simulated: bool = False
    gpu: str = ""
    duplicate_of: int | None = None
    gpu_state: dict[str, Any] = field(default_factory=dict)

    def attrs(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def record_from_measurement(rec: TrialRecord, shape: Shape, m: Measurement, peak_tflops: float) -> TrialRecord:
    rec.simulated, rec.gpu, rec.gpu_state = m.simulated, m.gpu, m.gpu_state
    rec.verify = m.verify
    rec.variant_times_us = m.times_us
    rec.cublas_us = m.baselines_us.get("cublas")
    if not m.ok:
        rec.status, rec.kind, rec.reason = m.status if m.status != "ok" else "failed", m.kind, m.reason
        return rec
    variant, t = m.best()
    tflops = shape.tflops(t)
    if tflops > peak_tflops * 1.02:
        # Faster than the hardware can go: a measurement bug, never a result.
        rec.status, rec.kind = "failed", "impossible"
        rec.reason = f"{tflops:.0f} TFLOP/s is above the {peak_tflops:.0f} TFLOP/s peak: measurement bug"
        return rec
    rec.status, rec.time_us, rec.tflops, rec.variant = "ok", t, tflops, variant
    if rec.cublas_us:
        rec.speedup_cublas = rec.cublas_us / t
    return rec


@dataclass
class Pending:
    trial: optuna.Trial | None
    family: Family
    config: dict[str, Any]
    record: TrialRecord
    future: Any = None                # Future[CompileResult] or None (replay / cached)
    request: EvalRequest | None = None


def launch_spec(fam: Family, config: dict[str, Any], shape: Shape, target) -> dict[str, Any]:
    """How the GPU worker launches this family's binary: a cubin's 1-D geometry, or, for a
    library, only the SM count its persistent scheduler sizes the grid by."""
    launch = fam.launch_geometry(config, shape, target)
    if launch is None:
        return {"artifact": "library", "sm_count": target.sm_count}
    return {"artifact": "cubin", "grid": launch.grid, "block": launch.block, "smem": launch.smem}


def compare_candidate(fam: Family, config: dict[str, Any], shape: Shape, target, binary: str,
                      pdl: bool = False) -> dict[str, Any]:
    """One candidate of `GpuBackend.compare`: the built binary of a full config, how to launch
    it on `shape`, and the run-time knobs it runs with."""
    return {"cubin": binary, "launch": launch_spec(fam, config, shape, target) | {"pdl": pdl},
            "variant": fam.runtime_config(config)}


def full_config(fam: Family, config: dict[str, Any]) -> dict[str, Any]:
    """A compile config completed with the defaults of every knob, run-time ones included: what
    the constraints check and the template renders."""
    return fam.complete(config | {k.name: k.default for k in fam.runtime_knobs})


def prepare(fam: Family, config: dict[str, Any], shape: Shape, backend, pool: CompilePool | None,
            accumulate: str = "fp32") -> Pending:
    """Validate, render and (if the backend runs real code) start compiling one config."""
    full = full_config(fam, config)
    rec = TrialRecord(family=fam.name, config=fam.compile_config(full), status="pending")
    why = fam.violations(full, shape, backend.target)
    if why:
        rec.status, rec.kind, rec.reason = "invalid", "invalid", "; ".join(why)
        return Pending(None, fam, rec.config, rec)
    # Every run-time variant must satisfy the constraints too.
    variants = [v for v in fam.runtime_variants() if not fam.violations(full | v, shape, backend.target)]
    try:
        source = render(fam, full, backend.target.arch, accumulate=accumulate)
    except RenderError as exc:
        # This config's failure, like a compile error (a proposed template may fail at some knob
        # combinations only): the trial records why, the study goes on.
        rec.status, rec.kind, rec.reason = "render_error", "render", str(exc)
        return Pending(None, fam, rec.config, rec)
    rec.source_hash = source_hash(source)
    req = EvalRequest(fam.name, rec.config, shape, None, launch_spec(fam, full, shape, backend.target), variants,
                      accumulate)
    pending = Pending(None, fam, rec.config, rec, request=req)
    if backend.needs_cubin:
        if pool is None:
            raise UserError("a compile pool is needed for a real GPU backend")
        pending.future = pool.submit(source, backend.target.arch, fam.artifact)
    return pending


def finish(p: Pending, shape: Shape, backend, timeout_s: float,
           recorder: Callable[[EvalRequest, Measurement], None] | None = None) -> TrialRecord:
    """Wait for the compile, then measure on the backend."""
    rec = p.record
    if rec.status in ("invalid", "render_error"):
        return rec
    assert p.request is not None
    if p.future is not None:
        cres: CompileResult = p.future.result()
        rec.cache_key, rec.compile_s, rec.cached = cres.key, cres.seconds, cres.cached
        rec.registers, rec.spill_bytes = cres.registers, cres.spill_bytes
        if not cres.ok:
            rec.status, rec.kind, rec.reason = "compile_error", "compile", cres.error
            return rec
        p.request.cubin = cres.cubin
    m = backend.evaluate(p.request, timeout_s=timeout_s)
    if recorder is not None and not m.simulated:
        recorder(p.request, m)
    return record_from_measurement(rec, shape, m, backend.target.peak_tflops)


@dataclass
class Progress:
    done: int = 0
    invalid: int = 0
    failed: int = 0
    best_us: float | None = None
    best_tflops: float | None = None


def _tell(study: optuna.Study, trial: optuna.Trial, rec: TrialRecord) -> bool:
    """Store the record and the value; False if another worker finished this trial first
    (SQLite cannot lock rows, so two processes may pop the same enqueued trial)."""
    told = False
    try:
        for key, value in rec.attrs().items():
            trial.set_user_attr(key, value)
        if rec.status == "ok" and rec.time_us is not None:
            study.tell(trial, rec.time_us)
        elif rec.status == "invalid":
            # PRUNED, not FAIL: TPE ignores failed trials but ranks pruned ones among the
            # bad, so it learns the shape of the constraints instead of re-proposing them.
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        told = True
    except optuna.exceptions.UpdateFinishedTrialError:
        told = True
        return False
    finally:
        if not told:  # interrupted (or a storage error) between the attributes and the tell
            with contextlib.suppress(Exception):  # the original error is the one to see
                _fail_held(study, trial, "interrupted", "interrupted while its result was stored")
    return True


def _fail_held(study: optuna.Study, trial: optuna.Trial, status: str, reason: str | None = None) -> None:
    """Tell a trial this process holds as FAIL, unmeasured (`status`: interrupted, surplus). One that
    is finished already (told before the interrupt, or by another worker) is left as it is."""
    with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
        trial.set_user_attr("status", status)
        if reason:
            trial.set_user_attr("reason", reason)
    with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
        study.tell(trial, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)


class _Interrupts:
    """SIGINT and SIGTERM (how `tune --workers` stops its workers) as one KeyboardInterrupt, raised
    outside the `deferred()` sections that ask and tell trials; further signals are ignored while
    the process tells the trials it holds as FAIL ("interrupted") and exits."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending = self.stopping = False

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stopping:
            return
        self.stopping = True
        if self.depth:
            self.pending = True  # raised when the section ends
        else:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.pending and not self.depth:
                self.pending = False
                raise KeyboardInterrupt

    @contextlib.contextmanager
    def handled(self) -> Iterator[None]:
        """Handle SIGINT and SIGTERM this way inside the block (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        self.pending = self.stopping = False
        for sig in old:
            signal.signal(sig, self._on_signal)
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)


INTERRUPTS = _Interrupts()


def hang_timeout_s(cublas_us: float) -> float:
    """Seconds before an evaluation counts as a hang: verification plus timing of all
    variants take a few hundred kernel-lengths; allow 200,000 cuBLAS times, at least 20 s."""
    return max(20.0, cublas_us * 1e-6 * 200_000)


# Never count toward --trials: not evaluated (rejected before nvcc, repeats, handed back).
NOT_EVALUATED = (None, "invalid", "duplicate", "surplus", "interrupted")
# Nor measured: a config a replay file has no measurement for ("not_recorded", told as FAIL)
# spends a trial, as on the GPU it would have been measured, but is never reported as measured.
NOT_MEASURED = (*NOT_EVALUATED, "not_recorded")
STALE_PROPOSALS = 200  # this many proposals in a row without a new valid config: the space is spent
EXPLORE_AFTER = 20     # after this many stale proposals in a row, enqueue a random valid unmeasured config


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


def stored_config(t: optuna.trial.FrozenTrial) -> dict[str, Any]:
    """A trial's kernel as stored: compile-time config and run-time variant."""
    return t.user_attrs["config"] | t.user_attrs.get("variant", {})


def gpu_model(backend_name: str | None) -> str | None:
    """The GPU model a measurement ran on, from a backend name ('gpu:NVIDIA H200#1' -> 'NVIDIA H200');
    None for replayed or unknown measurements."""
    if not backend_name or not backend_name.startswith("gpu:"):
        return None
    return backend_name[len("gpu:"):].split("#")[0]


def current_ok(trials: Iterable[optuna.trial.FrozenTrial], gpu: str | None = None) -> list[optuna.trial.FrozenTrial]:
    """The verified trials whose time still describes their kernel's code. A resumed study measures
    a config again when the template now renders other code for it (`tune`); the older trial of
    that config keeps its old time, so it must not rank: where the same kernel (family and stored
    config) has trials with different source hashes, only those with the latest one count.
    With `gpu` (a model, `gpu_model`): only the trials measured on that model, where there are any.
    Picks do not carry between cards (sessions 18-19: an H100 study's best ran 5% behind on an H200, and
    an H200 study's 8% behind on an H100), so times from two models must not be ranked together."""
    finished = [(t, config_key(t.user_attrs.get("family", ""), stored_config(t))) for t in trials
                if t.state.is_finished() and "config" in t.user_attrs]
    latest: dict[str, tuple[Any, str]] = {}  # kernel -> (when, source hash) of its latest trial
    for t, key in finished:
        h, when = t.user_attrs.get("source_hash"), t.datetime_complete or t.datetime_start
        if h and when and (key not in latest or when > latest[key][0]):
            latest[key] = (when, h)
    ok = [t for t, key in finished if t.state == optuna.trial.TrialState.COMPLETE
          and t.user_attrs.get("status") == "ok"
          and (not t.user_attrs.get("source_hash") or key not in latest
               or latest[key][1] == t.user_attrs["source_hash"])]
    here = [t for t in ok if gpu and gpu_model(t.user_attrs.get("gpu")) == gpu]
    return here or ok


def _current_best(study: optuna.Study, gpu: str | None) -> tuple[float | None, float | None]:
    """(time in us, TFLOP/s) of the study's best trial that still describes its code on this GPU
    model (`current_ok`)."""
    ok = current_ok(study.get_trials(deepcopy=False), gpu)
    if not ok:
        return None, None
    best = min(ok, key=lambda t: t.value)
    return best.value, best.user_attrs.get("tflops")


def evaluated_trials(study: optuna.Study) -> int:
    """Trials that count toward --trials: everything evaluated, not configs rejected before nvcc."""
    return sum(1 for t in study.get_trials(deepcopy=False)
               if t.state.is_finished() and t.user_attrs.get("status") not in NOT_EVALUATED)


def measured_trials(study: optuna.Study) -> int:
    """Evaluated trials with a measurement (not a replay file's not-recorded configs): what reports count."""
    return sum(1 for t in study.get_trials(deepcopy=False)
               if t.state.is_finished() and t.user_attrs.get("status") not in NOT_MEASURED)


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
        if t.number == exclude or t.user_attrs.get("status") == "duplicate":
            continue
        if t.state == optuna.trial.TrialState.FAIL and t.user_attrs.get("status") in (None, "interrupted", "surplus"):
            continue  # never measured (killed or interrupted): free to measure again
        key = _key_of(t)
        if key is not None and (key not in out or t.state == optuna.trial.TrialState.COMPLETE):
            out[key] = t
    return out


class _Claims:
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


def open_study(name: str, storage, sampler: optuna.samplers.BaseSampler | None = None) -> optuna.Study:
    from tuner.storage import open_storage

    if isinstance(storage, str):
        storage = open_storage(storage)
    try:
        return optuna.create_study(study_name=name, storage=storage, direction="minimize",
                                   sampler=sampler, load_if_exists=True)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - storage errors are input errors here
        raise UserError(f"cannot open study {name!r} in {storage!r}: {type(exc).__name__}: {exc}") from None


def existing_study(name: str, storage: optuna.storages.BaseStorage) -> optuna.Study | None:
    """The study if the storage holds it, else None; never creates one."""
    if name not in optuna.get_all_study_names(storage):
        return None
    return optuna.load_study(study_name=name, storage=storage)


def check_accumulate(space: Space, family_names: list[str], accumulate: str) -> None:
    """Every family must build the problem's accumulator type."""
    cannot = [n for n in family_names if accumulate not in space.family(n).accumulate]
    if cannot:
        able = [f.name for f in space.families.values() if accumulate in f.accumulate]
        raise UserError(f"{accumulate} accumulation: family {', '.join(cannot)} does not build it "
                        f"(families that do: {', '.join(able) or 'none'})")


def tune(space: Space, family_names: list[str], shape: Shape, backend, *, trials: int, sampler: str = "tpe",
         storage: str, name: str | None = None, seed: int | None = None, timeout_s: float | None = None,
         pool: CompilePool | None = None, lookahead: int | None = None, eval_timeout_s: float = 60.0,
         on_progress: Callable[[Progress, TrialRecord | None], None] | None = None,
         recorder: Callable[[EvalRequest, Measurement], None] | None = None,
         warm_start: list[tuple[str, dict[str, Any]]] | None = None,
         patience: int | None = None, accumulate: str = "fp32") -> optuna.Study:
    """Run (or join, or resume) the study until it holds `trials` measured trials.

    accumulate: fp32 (the default problem) or fp16 accumulation, a different problem with
    its own study, verification and cuBLAS baseline (fp16 compute).

    warm_start: (family, config) pairs tried first in a fresh study (e.g. the winners of
    nearby shapes). patience: stop once the best has not improved for this many trials.

    Several processes may run this on one study at once (`hgemm-tune worker`): the count,
    the duplicates and the best are always read back from the shared storage."""
    from tuner.storage import Heartbeat, open_storage

    families = [space.family(n) for n in family_names]
    check_accumulate(space, family_names, accumulate)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = name or study_name(shape, families, backend.target.arch, accumulate=accumulate)
    backing = open_storage(storage)
    study = open_study(name, backing, make_sampler(sampler, seed, families))
    fresh = not study.get_trials(deepcopy=False)
    for key, value in (("shape", str(shape)), ("families", [f.name for f in families]),
                       ("target", backend.target.to_dict()), ("backend", backend.name),
                       ("simulated", backend.simulated), ("trials_target", trials), ("accumulate", accumulate),
                       ("template_hashes", {f.name: template_hash(f) for f in families})):
        study.set_user_attr(key, value)
    def fail_stale() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # experimental-API and "heartbeat without optimize" notes
            optuna.storages.fail_stale_trials(study)  # trials of workers that died: failed, re-queued

    fail_stale()
    last_stale_check = time.perf_counter()
    if fresh:
        by_name = {f.name: f for f in families}
        for fam_name, cfg in warm_start or []:
            if fam_name in by_name:
                study.enqueue_trial(trial_params(by_name[fam_name], cfg), skip_if_exists=True)
        for fam in families:
            for cfg in seed_configs(fam, shape):
                study.enqueue_trial(trial_params(fam, cfg), skip_if_exists=True)

    here = gpu_model(getattr(backend, "name", None))  # None for replayed measurements
    progress = Progress(done=evaluated_trials(study))
    progress.best_us, progress.best_tflops = _current_best(study, here)
    # Ask ahead enough to keep every nvcc job busy while the GPU measures.
    lookahead = lookahead or (2 * pool.jobs if pool else 8)
    deadline = time.perf_counter() + timeout_s if timeout_s else None
    max_asks = trials * 30 + 100  # the sampler may keep proposing invalid configs: bound it
    asks = stale = 0
    rng = random.Random(seed)
    claims = _Claims(study)
    since_best = 0  # measured trials since the best improved (for patience)
    queue: deque[Pending] = deque()

    current_hashes: dict[str, str | None] = {}

    def measured_elsewhere(prev: optuna.trial.FrozenTrial, fam: Family, config: dict[str, Any]) -> bool:
        """True if `prev` ran code that the template no longer renders for this config (a resumed
        study after a template fix: session 17's wide tiles), or ran on another GPU model (a study
        resumed on another card), so its time says nothing of this code on this GPU."""
        if not prev.state.is_finished():
            return False
        there = gpu_model(prev.user_attrs.get("gpu"))
        if here and there and there != here:
            return True
        stored = prev.user_attrs.get("source_hash")
        if not stored:
            return False
        key = config_key(fam.name, config)
        if key not in current_hashes:
            full = full_config(fam, config)
            try:
                current_hashes[key] = source_hash(render(fam, full, backend.target.arch, accumulate=accumulate))
            except (RenderError, UserError):
                current_hashes[key] = None  # prepare() reports it if it is measured
        return current_hashes[key] not in (None, stored)

    def want_more() -> bool:
        return (progress.done + len(queue) < trials and asks < max_asks and stale < STALE_PROPOSALS
                and (patience is None or since_best < patience)
                and (deadline is None or time.perf_counter() < deadline))

    def held() -> list[int]:
        return [p.trial._trial_id for p in list(queue) if p.trial is not None]

    try:
        with Heartbeat(backing, held):
            while True:
                # Every storage call runs inside INTERRUPTS.deferred(): a KeyboardInterrupt raised
                # mid-transaction leaves the SQLite connection holding its lock (SQLAlchemy rolls
                # back on its own errors only), and then the FAIL "interrupted" writes below wait
                # on that lock until the parent kills us (seen in CI: 16 trials left RUNNING).
                if time.perf_counter() - last_stale_check > 30:
                    with INTERRUPTS.deferred():
                        fail_stale()  # a worker that died mid-study: its trials go back to the queue
                    last_stale_check = time.perf_counter()
                # Keep the compile pool fed: ask ahead while the GPU works on the oldest.
                while want_more() and len(queue) < lookahead:
                    # Asked, then queued or told within one section: a signal never leaves a
                    # trial RUNNING between ask and tell (it is raised once the section ends).
                    with INTERRUPTS.deferred():
                        with warnings.catch_warnings():
                            # We beat the heartbeat ourselves (Heartbeat), so Optuna's ask-side note is moot.
                            warnings.simplefilter("ignore", UserWarning)
                            trial = study.ask()
                        asks += 1
                        stale += 1
                        try:
                            fam, config = suggest(trial, families)
                            key = config_key(fam.name, config)
                            if stale and stale % EXPLORE_AFTER == 0:
                                # The sampler keeps circling configs we have: steer it with a fresh valid one.
                                pick = random_valid_config(families, shape, backend.target, claims.keys(), rng)
                                if pick is None:
                                    stale = STALE_PROPOSALS  # nothing valid is left to try
                                else:
                                    study.enqueue_trial(trial_params(*pick))
                            prev = claims.get(key, exclude=trial.number)
                            if prev is not None and measured_elsewhere(prev, fam, config):
                                prev = None  # measured on other code or another GPU: measure this one
                            if prev is not None:
                                # Measured, rejected or being measured already: never compile or time it twice.
                                trial.set_user_attr("status", "duplicate")
                                trial.set_user_attr("duplicate_of", prev.number)
                                if prev.state == optuna.trial.TrialState.COMPLETE:
                                    study.tell(trial, prev.value)
                                elif prev.state == optuna.trial.TrialState.PRUNED:  # a repeat of an invalid one
                                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                                else:
                                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                                continue
                            p = prepare(fam, config, shape, backend, pool, accumulate)
                            p.trial = trial
                            if p.record.status == "invalid":
                                _tell(study, trial, p.record)
                                progress.invalid += 1
                                continue
                            stale = 0
                            queue.append(p)
                        except optuna.exceptions.UpdateFinishedTrialError:
                            # Another worker popped the same enqueued trial (SQLite cannot lock rows)
                            # and finished it first: it is theirs; ask again.
                            continue
                if not queue:
                    break
                with INTERRUPTS.deferred():
                    filled = evaluated_trials(study) >= trials
                    if filled:
                        # Other workers filled the study meanwhile: hand back what we hold, unmeasured.
                        for q in queue:
                            assert q.trial is not None
                            _fail_held(study, q.trial, "surplus")
                        queue.clear()
                if filled:
                    break
                p = queue[0]
                rec = finish(p, shape, backend, eval_timeout_s, recorder)  # a signal may stop it here
                assert p.trial is not None
                with INTERRUPTS.deferred():
                    _tell(study, p.trial, rec)
                    queue.popleft()
                    # Other workers add trials too: the count that stops us is the study's.
                    progress.done = evaluated_trials(study)
                since_best += 1
                if rec.status == "ok" and rec.time_us is not None:
                    # The study's best, not a running min: a measurement of a config again after a
                    # template change retires its older time (and other workers add trials too).
                    before = progress.best_us
                    progress.best_us, progress.best_tflops = _current_best(study, here)
                    if progress.best_us is not None and (before is None or progress.best_us < before):
                        since_best = 0
                else:
                    progress.failed += 1
                if on_progress:
                    on_progress(progress, rec)
    except KeyboardInterrupt:
        with INTERRUPTS.deferred():  # a second signal must not cut this short
            for p in queue:
                if p.trial is not None:
                    _fail_held(study, p.trial, "interrupted", "interrupted before it was measured")
        raise
    return study

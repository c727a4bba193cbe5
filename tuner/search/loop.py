"""The search loop: Optuna ask/tell over the compile-time knobs of one or more families, for one shape.

`Search` is one process's part of a study, split along Optuna's own seam: `ask_batch` asks
trials ahead (the sampler side, `tuner.search.sampler`) and hands them to the nvcc pool (the
compile queue, `tuner.search.compile_queue`); `measure_next` measures the oldest on the
backend while the pool builds the rest; `tell` stores its record (`tuner.search.tell`).
Each trial's record lives in the Optuna storage, so an interrupted study keeps every
finished trial and resumes. Run-time knobs are not sampled: every binary is timed at all
of their values. Several processes may run one study (`hgemm-tune worker`): the count, the
duplicates and the best are always read back from the shared storage.
"""

from __future__ import annotations

import random
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna

from tuner.build import CompilePool, RenderError, render, source_hash, template_hash
from tuner.errors import UserError
from tuner.measure import Backend, EvalRequest, Measurement, config_key
from tuner.measure.regimes import SUSTAINED
from tuner.search.compile_queue import Pending, finish, finish_many, prepare, ready
from tuner.search.interrupts import INTERRUPTS
from tuner.search.owners import this_process
from tuner.search.rank import Candidate
from tuner.search.records import Status, StudyMeta, TrialRecord, mark_owner, mark_telling
from tuner.search.sampler import (
    EXPLORE_AFTER,
    STALE_PROPOSALS,
    Claims,
    check_accumulate,
    check_objective,
    full_config,
    make_sampler,
    random_valid_config,
    seed_configs,
    study_name,
    suggest,
    trial_params,
)
from tuner.search.storage import Heartbeat, open_storage
from tuner.search.studies import current_best, evaluated_trials, gpu_model, open_study, slot_claims
from tuner.search.tell import fail_held, fail_orphans, tell, tell_duplicate
from tuner.space import Family, Shape, Space

STALE_CHECK_S = 30.0  # how often a running search fails the trials of workers that died
# Claiming a slot to tell a trial in (Search.claim_slot): tries, and the random pause between them.
CLAIM_TRIES = 40
CLAIM_PAUSE_S = (0.01, 0.1)


@dataclass
class Progress:
    done: int = 0
    invalid: int = 0
    failed: int = 0
    screened: int = 0  # verified, left behind by a batch's shared screen (Status.SCREENED)
    best_us: float | None = None
    best_tflops: float | None = None


ProgressCallback = Callable[[Progress, TrialRecord | None], None]
Recorder = Callable[[EvalRequest, Measurement], None]


class Search:
    """Run (or join, or resume) a study until it holds `trials` evaluated trials."""

    def __init__(self, space: Space, family_names: list[str], shape: Shape, backend: Backend, *, trials: int,
                 storage: str, sampler: str = "tpe", name: str | None = None, seed: int | None = None,
                 pool: CompilePool | None = None, lookahead: int | None = None, eval_timeout_s: float = 60.0,
                 recorder: Recorder | None = None, warm_start: list[tuple[str, dict[str, Any]]] | None = None,
                 patience: int | None = None, accumulate: str = "fp32", catalogue: dict[str, str] | None = None,
                 objective: str = SUSTAINED, ranking: dict[str, Candidate] | None = None, batch: int = 1):
        self.families: list[Family] = [space.family(n) for n in family_names]
        check_accumulate(space, family_names, accumulate)
        objective = check_objective(objective)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.shape, self.backend, self.pool, self.trials = shape, backend, pool, trials
        self.eval_timeout_s, self.recorder = eval_timeout_s, recorder
        self.patience, self.accumulate, self.objective = patience, accumulate, objective
        # Up to `batch` ready binaries (catalogue kernels, finished builds) are measured in one request:
        # one shared screen of all their variants, one steady stage (measure.evaluate_many).
        self.batch = max(1, batch)
        self.catalogue = catalogue or {}  # source hash -> digest of the kernel catalogue holding it
        self.ranking = ranking or {}  # config key -> its place in the catalogue ranking for this shape
        self.backing = open_storage(storage)
        self.owner = this_process()
        name = name or study_name(shape, self.families, backend.target.arch, accumulate=accumulate,
                                  objective=objective)
        self.study = open_study(name, self.backing, make_sampler(sampler, seed, self.families))
        fresh = not self.study.get_trials(deepcopy=False)
        if not fresh and "shape" in self.study.user_attrs and StudyMeta.of(self.study).objective != objective:
            # Its values are times of another regime: one study never ranks two regimes' times.
            raise UserError(f"study {name!r} minimizes the {StudyMeta.of(self.study).objective} time, not the "
                            f"{objective} time: run it with --objective {StudyMeta.of(self.study).objective}, or "
                            "name another study")
        StudyMeta(shape=str(shape), families=[f.name for f in self.families], target=backend.target.to_dict(),
                  backend=backend.name, simulated=backend.simulated, trials_target=trials, accumulate=accumulate,
                  template_hashes={f.name: template_hash(f) for f in self.families},
                  objective=objective).write(self.study)
        self.recovered: list[int] = []  # re-queued trials of dead workers: asked first
        self._fail_stale()
        if fresh:
            self._enqueue_seeds(warm_start or [])
        self.here = gpu_model(getattr(backend, "name", None))  # None for replayed measurements
        self.progress = Progress(done=evaluated_trials(self.study))
        self.progress.best_us, self.progress.best_tflops = current_best(self.study, self.here)
        # Ask ahead enough to keep every nvcc job busy while the GPU measures.
        self.lookahead = max(lookahead or (2 * pool.jobs if pool else 8), self.batch)
        self.max_asks = trials * 30 + 100  # the sampler may keep proposing invalid configs: bound it
        self.asks = self.stale = self.since_best = 0
        self.rng = random.Random(seed)
        self.claims = Claims(self.study)
        self.queue: deque[Pending] = deque()
        self.deadline: float | None = None
        self._current_hashes: dict[str, str | None] = {}

    # ---- set-up --------------------------------------------------------------------------

    def _fail_stale(self) -> None:
        """Trials of workers that died: failed, and their configs re-queued (measured next). The
        owner check finds a worker killed on this host at once, on every storage; the heartbeat
        (RDB storages) one on another host, after its grace period."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # experimental-API and "heartbeat without optimize" notes
            self.recovered += fail_orphans(self.study)
            optuna.storages.fail_stale_trials(self.study)
        self._last_stale_check = time.perf_counter()

    def _enqueue_seeds(self, warm_start: list[tuple[str, dict[str, Any]]]) -> None:
        """A fresh study tries first the warm-start configs (nearby shapes' winners), then each
        family's seeds."""
        by_name = {f.name: f for f in self.families}
        for fam_name, cfg in warm_start:
            if fam_name in by_name:
                self.study.enqueue_trial(trial_params(by_name[fam_name], cfg), skip_if_exists=True)
        for fam in self.families:
            for cfg in seed_configs(fam, self.shape):
                self.study.enqueue_trial(trial_params(fam, cfg), skip_if_exists=True)

    # ---- ask -----------------------------------------------------------------------------

    def measured_elsewhere(self, prev: optuna.trial.FrozenTrial, fam: Family, config: dict[str, Any]) -> bool:
        """True if `prev` ran code that the template no longer renders for this config (a resumed
        study after a template fix), or ran on another GPU model (a study resumed on another
        card), so its time says nothing of this code on this GPU."""
        if not prev.state.is_finished():
            return False
        rec = TrialRecord.of(prev)
        there = gpu_model(rec.gpu)
        if self.here and there and there != self.here:
            return True
        if not rec.source_hash:
            return False
        key = config_key(fam.name, config)
        if key not in self._current_hashes:
            try:
                source = render(fam, full_config(fam, config), self.backend.target.arch, accumulate=self.accumulate)
                self._current_hashes[key] = source_hash(source)
            except (RenderError, UserError):
                self._current_hashes[key] = None  # prepare() reports it if it is measured
        return self._current_hashes[key] not in (None, rec.source_hash)

    def want_more(self) -> bool:
        return (self.progress.done + len(self.queue) < self.trials and self.asks < self.max_asks
                and self.stale < STALE_PROPOSALS
                and (self.patience is None or self.since_best < self.patience)
                and (self.deadline is None or time.perf_counter() < self.deadline))

    def _recovered_trial(self) -> optuna.Trial | None:
        """A dead worker's config, re-queued by this process (`fail_orphans`), before anything
        else queued: Optuna pops WAITING trials oldest first, and a fresh study's seeds wait
        ahead of it, so a resumed study could fill up without measuring it."""
        while self.recovered:
            trial_id = self.recovered.pop(0)
            try:
                if self.study._storage.set_trial_state_values(trial_id, state=optuna.trial.TrialState.RUNNING):
                    return optuna.Trial(self.study, trial_id)
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another process took and finished it
        return None

    def ask(self) -> None:
        """Ask one trial; queue it for compiling, or tell it at once (a duplicate, an invalid config)."""
        # Asked, then queued or told within one section: a signal never leaves a trial RUNNING
        # between ask and tell (it is raised once the section ends).
        with INTERRUPTS.deferred():
            with warnings.catch_warnings():
                # We beat the heartbeat ourselves (Heartbeat), so Optuna's ask-side note is moot.
                warnings.simplefilter("ignore", UserWarning)
                trial = self._recovered_trial() or self.study.ask()
            self.asks += 1
            self.stale += 1
            try:
                # A kill -9 leaves the trial RUNNING; its owner says it is dead (tell.fail_orphans).
                mark_owner(trial, self.owner)
                fam, config = suggest(trial, self.families)
                if self.stale % EXPLORE_AFTER == 0:
                    self._explore()
                prev = self.claims.get(config_key(fam.name, config), exclude=trial.number)
                if prev is not None and self.measured_elsewhere(prev, fam, config):
                    prev = None  # measured on other code or another GPU: measure this one
                if prev is not None:
                    tell_duplicate(self.study, trial, prev)  # never compile or time a config twice
                    return
                p = prepare(fam, config, self.shape, self.backend, self.pool, self.accumulate, self.objective)
                p.trial = trial
                p.record.catalogue = self.catalogue.get(p.record.source_hash, "")
                ranked = self.ranking.get(config_key(fam.name, p.record.config))
                if ranked is not None:  # kept with the trial: the model is checked against its time
                    p.record.catalogue_rank, p.record.predicted_us = ranked.rank, ranked.predicted_us
                    p.record.predicted_variant = dict(ranked.variant)
                    p.record.predicted_by = ranked.predicted_by
                if p.record.status == Status.INVALID:
                    tell(self.study, trial, p.record)
                    self.progress.invalid += 1
                    return
                self.stale = 0
                self.queue.append(p)
            except optuna.exceptions.UpdateFinishedTrialError:
                # Another worker popped the same enqueued trial (SQLite cannot lock rows) and
                # finished it first: it is theirs; ask again.
                return

    def _explore(self) -> None:
        """The sampler keeps circling configs we have: steer it with a fresh valid one."""
        pick = random_valid_config(self.families, self.shape, self.backend.target, self.claims.keys(), self.rng)
        if pick is None:
            self.stale = STALE_PROPOSALS  # nothing valid is left to try
        else:
            self.study.enqueue_trial(trial_params(*pick))

    def ask_batch(self) -> None:
        """Keep the compile pool fed: ask ahead while the GPU works on the oldest."""
        while self.want_more() and len(self.queue) < self.lookahead:
            self.ask()

    # ---- measure and tell ----------------------------------------------------------------

    def _hand_back_if_filled(self) -> bool:
        """Other workers filled the study meanwhile: hand back what we hold, unmeasured."""
        with INTERRUPTS.deferred():
            if evaluated_trials(self.study) < self.trials:
                return False
            for q in self.queue:
                assert q.trial is not None
                fail_held(self.study, q.trial, Status.SURPLUS)
            self.queue.clear()
            return True

    def claim_slot(self, trial: optuna.Trial) -> bool:
        """May this measured trial be told? Other workers measure at the same time, and the count
        read before measuring may be stale by the time we tell. Each worker marks its trial
        "telling", then counts the evaluated trials and the other workers' marks: it tells only
        if all of them fit in the study. Whichever of two workers reads last sees both marks,
        so two never take one last slot; when marks collide both step back for a random pause
        and try again. False: the study is full (or stayed contended): hand the trial back."""
        for _ in range(CLAIM_TRIES):
            mark_telling(trial, True)
            evaluated, others = slot_claims(self.study, trial.number)
            if evaluated >= self.trials:
                return False
            if evaluated + others < self.trials:
                return True
            mark_telling(trial, False)
            time.sleep(self.rng.uniform(*CLAIM_PAUSE_S))
        return False

    def measure_next(self) -> TrialRecord | None:
        """Measure the oldest queued trial and tell it; None if it was handed back unmeasured (the
        study filled while it was measured) or another worker told it first."""
        p = self.queue[0]
        rec = finish(p, self.shape, self.backend, self.eval_timeout_s, self.recorder)  # a signal may stop it here
        return self._tell_oldest(p, rec)

    def batchable(self) -> list[Pending]:
        """The oldest queued trials that are ready to measure now (catalogue kernels, finished
        builds), `batch` at most; [] unless two or more are and the backend measures batches."""
        if self.batch < 2 or getattr(self.backend, "evaluate_many", None) is None:
            return []
        out: list[Pending] = []
        for p in self.queue:
            if len(out) >= self.batch or not ready(p):
                break
            out.append(p)
        return out if len(out) > 1 else []

    def measure_many(self, ps: list[Pending]) -> list[TrialRecord | None]:
        """Measure the oldest queued trials `ps` together (one shared screen and section) and tell
        each, oldest first (measure_next's rules for each)."""
        recs = finish_many(ps, self.shape, self.backend, self.eval_timeout_s, self.recorder)
        return [self._tell_oldest(p, rec) for p, rec in zip(ps, recs, strict=True)]

    def _tell_oldest(self, p: Pending, rec: TrialRecord) -> TrialRecord | None:
        """Tell the measured trial at the head of the queue and drop it from the queue."""
        assert p.trial is not None and self.queue[0] is p
        with INTERRUPTS.deferred():
            try:
                claimed = self.claim_slot(p.trial)
            except optuna.exceptions.UpdateFinishedTrialError:
                self.queue.popleft()  # another worker popped the same enqueued trial and told it
                return None
            if not claimed:
                fail_held(self.study, p.trial, Status.SURPLUS, "the study filled while it was measured")
                self.queue.popleft()
                self.progress.done = evaluated_trials(self.study)
                return None
            tell(self.study, p.trial, rec)
            self.queue.popleft()
            # Other workers add trials too: the count that stops us is the study's.
            self.progress.done = evaluated_trials(self.study)
        self.since_best += 1
        if rec.status == Status.OK and rec.time_us is not None:
            # The study's best, not a running min: a measurement of a config again after a
            # template change retires its older time (and other workers add trials too).
            before = self.progress.best_us
            self.progress.best_us, self.progress.best_tflops = current_best(self.study, self.here)
            if self.progress.best_us is not None and (before is None or self.progress.best_us < before):
                self.since_best = 0
        elif rec.status == Status.SCREENED:
            self.progress.screened += 1
        else:
            self.progress.failed += 1
        return rec

    def held(self) -> list[int]:
        """Storage ids of the trials this process holds (the heartbeat keeps them alive)."""
        return [p.trial._trial_id for p in list(self.queue) if p.trial is not None]

    def run(self, timeout_s: float | None = None, on_progress: ProgressCallback | None = None) -> optuna.Study:
        self.deadline = time.perf_counter() + timeout_s if timeout_s else None
        try:
            with Heartbeat(self.backing, self.held):
                while True:
                    # Every storage call runs inside INTERRUPTS.deferred(): a KeyboardInterrupt raised
                    # mid-transaction leaves the SQLite connection holding its lock (SQLAlchemy rolls
                    # back on its own errors only), and then the FAIL "interrupted" writes would wait
                    # on that lock until the parent kills us (seen in CI: 16 trials left RUNNING).
                    if time.perf_counter() - self._last_stale_check > STALE_CHECK_S:
                        with INTERRUPTS.deferred():
                            self._fail_stale()  # a worker that died mid-study: its trials go back to the queue
                    self.ask_batch()
                    if not self.queue or self._hand_back_if_filled():
                        break
                    batch = self.batchable()
                    for rec in (self.measure_many(batch) if batch else [self.measure_next()]):
                        if on_progress and rec is not None:
                            on_progress(self.progress, rec)
        except BaseException as exc:  # an interrupt, or an error (a worker that cannot restart, the storage)
            why = ("interrupted before it was told" if isinstance(exc, KeyboardInterrupt)
                   else f"the search stopped on {type(exc).__name__} before it was told")
            with INTERRUPTS.deferred():  # a second signal must not cut this short
                for p in self.queue:
                    if p.trial is not None:
                        fail_held(self.study, p.trial, Status.INTERRUPTED, why)
            raise
        return self.study


def tune(space: Space, family_names: list[str], shape: Shape, backend: Backend, *, trials: int,
         sampler: str = "tpe", storage: str, name: str | None = None, seed: int | None = None,
         timeout_s: float | None = None, pool: CompilePool | None = None, lookahead: int | None = None,
         eval_timeout_s: float = 60.0, on_progress: ProgressCallback | None = None, recorder: Recorder | None = None,
         warm_start: list[tuple[str, dict[str, Any]]] | None = None, patience: int | None = None,
         accumulate: str = "fp32", objective: str = SUSTAINED, batch: int = 1) -> optuna.Study:
    """Run (or join, or resume) the study until it holds `trials` measured trials.

    accumulate: fp32 (the default problem) or fp16 accumulation, a different problem with
    its own study, verification and cuBLAS baseline (fp16 compute). objective: the timing
    regime whose time the search minimizes (sustained or isolated, tuner.measure.regimes).
    warm_start: (family, config) pairs tried first in a fresh study (e.g. the winners of
    nearby shapes). patience: stop once the best has not improved for this many trials. batch:
    ready binaries measured together in one shared screen (Search.batchable)."""
    search = Search(space, family_names, shape, backend, trials=trials, storage=storage, sampler=sampler, name=name,
                    seed=seed, pool=pool, lookahead=lookahead, eval_timeout_s=eval_timeout_s, recorder=recorder,
                    warm_start=warm_start, patience=patience, accumulate=accumulate, objective=objective,
                    batch=batch)
    return search.run(timeout_s, on_progress)

"""What a trial and a study hold: the typed records behind Optuna's user attributes.

This module is the only code that reads or writes `user_attrs`: every other stage takes a
`TrialRecord` (`TrialRecord.of(trial)`) or a `StudyMeta` (`StudyMeta.of(study)`). Studies
written by older versions of the tool miss some keys; the records fill their defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import optuna

from tuner.measure import Measurement
from tuner.measure.regimes import SUSTAINED
from tuner.space import Shape, Target


class Status(str, Enum):
    """What became of a trial. A str, so stored attributes and comparisons stay plain strings."""

    PENDING = "pending"              # asked, not yet measured (never stored as final)
    OK = "ok"                        # verified and timed
    # verified, and a batch's shared screen kept none of its variants (told PRUNED, its best
    # screen time reported as the intermediate value): slower than the kept ones, not timed in full
    SCREENED = "screened"
    INVALID = "invalid"              # rejected by the constraints before nvcc (told PRUNED)
    RENDER_ERROR = "render_error"
    COMPILE_ERROR = "compile_error"
    FAILED = "failed"                # ran and was wrong, or refused, or impossibly fast
    FAULT = "fault"                  # a CUDA error: the worker was restarted
    TIMEOUT = "timeout"              # a hang: the worker was killed
    NOT_RECORDED = "not_recorded"    # the replay file has no measurement for this config
    DUPLICATE = "duplicate"          # a config another trial measured, rejected or is measuring
    SURPLUS = "surplus"              # handed back unmeasured: other workers filled the study
    INTERRUPTED = "interrupted"      # handed back unmeasured: Ctrl-C / SIGTERM

    def __str__(self) -> str:
        return self.value


# Never count toward --trials: not evaluated (rejected before nvcc, repeats, handed back).
NOT_EVALUATED = (None, Status.INVALID, Status.DUPLICATE, Status.SURPLUS, Status.INTERRUPTED)
# Nor measured: a config a replay file has no measurement for ("not_recorded", told as FAIL)
# spends a trial, as on the GPU it would have been measured, but is never reported as measured.
NOT_MEASURED = (*NOT_EVALUATED, Status.NOT_RECORDED)
# Held by no one and never measured: free to measure again.
UNMEASURED_FAILS = (None, Status.INTERRUPTED, Status.SURPLUS)


@dataclass
class TrialRecord:
    """What one trial did, as stored in the trial's user attributes."""

    family: str
    config: dict[str, Any]           # compile-time knobs
    status: str                      # a Status value
    source_hash: str = ""
    cache_key: str = ""
    compile_s: float = 0.0
    cached: bool = False
    registers: int | None = None
    spill_bytes: int | None = None
    time_us: float | None = None
    tflops: float | None = None
    variant: dict[str, Any] = field(default_factory=dict)  # the run-time knobs of the best time
    # The full (steady) protocol's time of every variant it timed. A search trial with more
    # variants than its screen keeps (regimes.Screen) times only the survivors in full: the
    # others' screen times, and how many were screened and kept, are in regime_report
    # (screen_us, screened, kept), never here.
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
    # The clock regime of its measurement (tuner.measure.clocks record; {} in older studies).
    clocks: dict[str, Any] = field(default_factory=dict)
    # The timing regime its time was taken in: the study's objective (tuner.measure.regimes);
    # older studies were timed back-to-back (offline), the sustained regime's predecessor.
    objective: str = SUSTAINED
    # How that timing went (RegimeReport.to_dict(): rounds, steady state, energy, the screen);
    # {} when unknown.
    regime_report: dict[str, Any] = field(default_factory=dict)
    # The digest of the kernel catalogue that holds this trial's kernel ("" when none does): with
    # `cached`, its binary came from the catalogue and cost no nvcc time.
    catalogue: str = ""
    # Where the catalogue ranking (tuner.search.rank) put this config for this shape: its place
    # (1 = predicted fastest), the predicted time and the run-time variant predicted best. None
    # and {} when the config was not a ranked catalogue candidate. Kept so that the model can be
    # checked against the measured times (`hgemm-tune rank-check`).
    catalogue_rank: int | None = None
    predicted_us: float | None = None
    predicted_variant: dict[str, Any] = field(default_factory=dict)
    # Which ranker's time predicted_us is (Candidate.predicted_by: model, nvidia, model-scaled).
    predicted_by: str | None = None
    # Read back only: the trial's number and value (its time in us when COMPLETE).
    number: int | None = field(default=None, compare=False)
    value: float | None = field(default=None, compare=False)

    _STORED = ()  # filled below: the field names written as attributes

    def validate(self) -> None:
        """The record's own rules: ok has a time and TFLOP/s; a failure says why."""
        if self.status == Status.OK and (self.time_us is None or self.tflops is None):
            raise ValueError(f"trial record {self.family} {self.config}: ok without a time")
        if self.status not in (Status.OK, Status.PENDING, Status.DUPLICATE) and not (self.reason or self.kind):
            raise ValueError(f"trial record {self.family} {self.config}: {self.status} without a reason")

    def to_attrs(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Status) else v) for k, v in dataclasses.asdict(self).items()
                if k in TrialRecord._STORED}

    def write(self, trial: optuna.Trial) -> None:
        for key, value in self.to_attrs().items():
            trial.set_user_attr(key, value)

    @classmethod
    def of(cls, t: optuna.trial.FrozenTrial) -> TrialRecord:
        """The record a finished (or running) trial holds; missing keys take their defaults."""
        a = t.user_attrs
        known = {k: a[k] for k in cls._STORED if k in a}
        known.setdefault("family", t.params.get("family", ""))
        known.setdefault("config", {})
        known.setdefault("status", None)
        return cls(**known, number=t.number, value=t.value)

    @property
    def kernel(self) -> dict[str, Any]:
        """The kernel as stored: compile-time config and run-time variant."""
        return self.config | self.variant

    def apply(self, m: Measurement, shape: Shape, peak_tflops: float) -> TrialRecord:
        """Fill the record from a measurement; a time faster than the hardware is a failure."""
        self.simulated, self.gpu, self.gpu_state, self.clocks = m.simulated, m.gpu, m.gpu_state, m.clocks
        self.regime_report = m.regime  # `objective` was set when the trial was asked (compile_queue.prepare)
        self.verify = m.verify
        self.variant_times_us = m.times_us
        self.cublas_us = m.baselines_us.get("cublas")
        if not m.ok:
            self.status = m.status if m.status != Status.OK else Status.FAILED
            self.kind, self.reason = m.kind, m.reason
            return self
        variant, t = m.best()
        tflops = shape.tflops(t)
        if tflops > peak_tflops * 1.02:
            # Faster than the hardware can go: a measurement bug, never a result.
            self.status, self.kind = Status.FAILED, "impossible"
            self.reason = f"{tflops:.0f} TFLOP/s is above the {peak_tflops:.0f} TFLOP/s peak: measurement bug"
            return self
        self.status, self.time_us, self.tflops, self.variant = Status.OK, t, tflops, variant
        if self.cublas_us:
            self.speedup_cublas = self.cublas_us / t
        return self


TrialRecord._STORED = tuple(f.name for f in dataclasses.fields(TrialRecord) if f.name not in ("number", "value"))


def mark_trial(trial: optuna.Trial, status: Status, reason: str | None = None,
               duplicate_of: int | None = None) -> None:
    """Label a trial that is not measured (duplicate, interrupted, surplus) without a full record."""
    trial.set_user_attr("status", str(status))
    if reason:
        trial.set_user_attr("reason", reason)
    if duplicate_of is not None:
        trial.set_user_attr("duplicate_of", duplicate_of)


def mark_owner(trial: optuna.Trial, owner: dict[str, Any]) -> None:
    """Record the process that holds a trial (tuner.search.owners), so that a search can fail the
    trials of a worker that was killed without telling them, on storages without heartbeats too."""
    trial.set_user_attr("owner", owner)


def trial_owner(t: optuna.trial.FrozenTrial) -> dict[str, Any] | None:
    return t.user_attrs.get("owner")


def mark_telling(trial: optuna.Trial, telling: bool) -> None:
    """A measured trial about to be told claims one of the study's last slots (Search.claim_slot):
    every worker counts the claims of the others, so the study never ends above its count."""
    trial.set_user_attr("telling", telling)


def is_telling(t: optuna.trial.FrozenTrial) -> bool:
    return t.state == optuna.trial.TrialState.RUNNING and bool(t.user_attrs.get("telling"))


@dataclass
class StudyMeta:
    """What a study is about, stored as its user attributes when the search starts."""

    shape: str
    families: list[str] = field(default_factory=list)
    target: dict[str, Any] = field(default_factory=dict)  # Target.to_dict() of the GPU it ran on
    backend: str = ""
    simulated: bool = False
    trials_target: int = 100
    accumulate: str = "fp32"
    template_hashes: dict[str, str] = field(default_factory=dict)
    # The regime whose time the search minimizes (tuner.measure.regimes); older studies: sustained.
    objective: str = SUSTAINED

    def write(self, study: optuna.Study) -> None:
        for key, value in dataclasses.asdict(self).items():
            study.set_user_attr(key, value)

    @classmethod
    def of(cls, study: optuna.Study) -> StudyMeta:
        a = study.user_attrs
        if "shape" not in a:
            from tuner.errors import UserError

            raise UserError(f"study {study.study_name!r} was not created by hgemm-tune (no shape)")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in a.items() if k in names})

    @property
    def target_record(self) -> Target:
        return Target(**self.target)

    @property
    def shape_record(self) -> Shape:
        from tuner.space import parse_shape

        return parse_shape(self.shape)


def confirm_record(study: optuna.Study) -> dict[str, Any] | None:
    """The study's stored confirmation (tuner.search.confirm), if any."""
    return study.user_attrs.get("confirm")


def store_confirm_record(study: optuna.Study, record: dict[str, Any]) -> None:
    study.set_user_attr("confirm", record)


def sweep_done_trials(study: optuna.Study) -> int:
    """The trial budget a sweep last finished this study at (0: never finished by a sweep)."""
    return int(study.user_attrs.get("sweep_done_trials", 0))


def mark_sweep_done(study: optuna.Study, trials: int) -> None:
    study.set_user_attr("sweep_done_trials", trials)


def holds_kernel(t: optuna.trial.FrozenTrial) -> bool:
    """Whether the trial stored a kernel (a family's config); duplicates and handed-back trials do not."""
    return "config" in t.user_attrs


def study_shape(study: optuna.Study) -> str | None:
    """The shape a study tunes, or None for a study hgemm-tune did not create."""
    return study.user_attrs.get("shape")


def study_backend(study: optuna.Study) -> str | None:
    """The backend the study last ran on (`gpu:NAME`, `replay:FILE`), if it recorded one."""
    return study.user_attrs.get("backend")

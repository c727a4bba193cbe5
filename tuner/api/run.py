"""The run's configuration and plumbing: `Options`, the `Listener` that reports progress, the
result records, and the backend and compile pool a run measures with."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from tuner.build import CompilePool, cutlass_include, nvcc_path
from tuner.errors import UserError
from tuner.measure import Backend, CompareReply, GpuBackend, ReplayBackend
from tuner.measure.regimes import SUSTAINED
from tuner.search import (
    INTERRUPTS,
    SAMPLERS,
    Progress,
    TrialRecord,
    check_accumulate,
    check_objective,
    nvidia_heuristics,
)
from tuner.search.rank import check_ranker
from tuner.space import ACCUMULATE, Shape, Space, Target

DEFAULT_STORAGE = "sqlite:///runs/hgemm.db"
BACKENDS = ("gpu", "replay")


# Binaries per shared screen with a catalogue, and the most a request may hold (each binary's
# variants get CUDA graphs in the worker: 16 variants x 32 binaries is ~500 graphs already).
BATCH_WITH_CATALOGUE = 8
MAX_BATCH = 32


@dataclass
class Options:
    """Everything a tune, sweep, worker, confirm or bench run takes besides what it tunes."""

    trials: int = 100                   # measured trials a study should hold (a re-run resumes up to this)
    storage: str = DEFAULT_STORAGE      # Optuna storage URL: sqlite:///F, postgresql://..., journal:F
    space_file: Path | None = None      # default: the packaged space.yaml
    families: list[str] | str | None = None  # names or a comma list; default: all that build the problem here
    sampler: str = "tpe"
    seed: int | None = None
    timeout_s: float | None = None      # stop asking for new trials after this long
    backend: str = "gpu"                # gpu | replay
    replay: Path | None = None          # recorded measurements for the replay backend
    arch: str = "sm_90a"                # the replay backend's target (a GPU backend reads the device)
    gpu: int | None = None              # GPU index (CUDA_VISIBLE_DEVICES for the worker)
    jobs: int | None = None             # nvcc jobs (default: one per core)
    record: Path | None = None          # append every real measurement to this replay file
    accumulate: str = "fp32"            # fp32, or fp16 (its own problem, against cuBLAS in fp16 compute)
    confirm_top: int = 3                # re-time this many best kernels in fresh runs before export (0: no)
    confirm_runs: int = 3
    runs_dir: Path = Path("runs")       # exports, worker logs
    catalogue: Path | None = None       # a kernel catalogue: checked, loaded into the compile cache, tried first
    # After the run: the catalogue (or none) plus every exported kernel it lacks, written here (the
    # winners join it; may be the --catalogue file itself, replaced whole).
    catalogue_out: Path | None = None
    # How many of the catalogue's configs, ranked for the shape (tuner.search.rank), a fresh study
    # times before the sampler's own proposals; None: all of them, in ranked order.
    catalogue_top: int | None = None
    # What ranks the catalogue (tuner.search.rank.RANKERS): our cost model, or NVIDIA's
    # nvMatmulHeuristics (the optional `heuristics` extra) where it can express the config.
    rank_by: str = "model"
    # The timing regime whose time the search minimizes (sustained, isolated); None: a joined study's own.
    objective: str | None = SUSTAINED
    # Ready binaries measured together: verified one by one, then all their run-time variants in one
    # shared screen and one steady stage with cuBLAS (measure.evaluate_many). None: BATCH_WITH_CATALOGUE
    # with a catalogue (its kernels are ready at once), else 1 (a binary at a time as its build lands).
    batch: int | None = None

    @property
    def batch_size(self) -> int:
        if self.batch is not None:
            return self.batch
        return BATCH_WITH_CATALOGUE if self.catalogue is not None else 1

    def check(self) -> None:
        """Every input checked before any work: one clear error, never a traceback minutes in."""
        if self.accumulate not in ACCUMULATE:
            raise UserError(f"--accumulate {self.accumulate!r}: choose one of {', '.join(ACCUMULATE)}")
        if self.sampler not in SAMPLERS:
            raise UserError(f"unknown sampler {self.sampler!r}; choose one of {', '.join(SAMPLERS)}")
        if self.backend not in BACKENDS:
            raise UserError(f"unknown backend {self.backend!r}: use gpu or replay")
        if self.backend == "replay" and self.replay is None:
            raise UserError("--backend replay needs --replay FILE (a file of recorded GPU measurements)")
        if self.objective is not None:  # an older name (offline, server) becomes the regime's
            self.objective = check_objective(self.objective)
        if self.batch is not None and not 1 <= self.batch <= MAX_BATCH:
            raise UserError(f"--batch {self.batch}: must be 1 to {MAX_BATCH} (binaries measured together)")
        if self.catalogue_out is not None and self.catalogue_out.suffix != ".zip":
            raise UserError(f"--catalogue-out {self.catalogue_out}: a catalogue is a .zip file")
        if self.catalogue_top is not None and self.catalogue is None:
            raise UserError("--catalogue-top needs --catalogue FILE (the catalogue whose ranked configs are tried)")
        if self.catalogue_top is not None and self.catalogue_top < 0:
            raise UserError(f"--catalogue-top {self.catalogue_top}: must be >= 0 (0: enqueue no catalogue config)")
        check_ranker(self.rank_by)
        if self.rank_by != "model" and self.catalogue is None:
            raise UserError("--rank-by needs --catalogue FILE (it orders the catalogue's configs)")
        if self.rank_by == "nvidia":
            nvidia_heuristics.load()  # not installed: one line saying how, before any work
        if self.trials < 0 or self.confirm_top < 0 or self.confirm_runs < 1:
            raise UserError("--trials and --confirm must be >= 0 and --confirm-runs >= 1")


class Listener:
    """What a run reports as it goes; every method does nothing here. The CLI overrides them."""

    def started(self, shape: Shape, baselines: dict[str, float], backend: str, families: list[str],
                accumulate: str) -> None: ...

    def search(self, label: str, trials: int) -> None:
        """A search of `trials` trials starts (a progress bar)."""

    def trial(self, progress: Progress, rec: TrialRecord | None) -> None: ...

    def confirming(self, top: int, runs: int) -> None: ...

    def confirm_run(self, i: int, reply: CompareReply) -> None: ...

    def confirmed(self, record: dict[str, Any], earlier: bool) -> None: ...

    def sweep_shape(self, i: int, total: int, shape: Shape | None) -> None:
        """Shape i of a sweep starts (None: the sweep is over)."""

    def message(self, text: str) -> None: ...


@dataclass
class TuneResult:
    study: optuna.Study
    export: dict[str, Any]        # the export of this study (tuner.results.export)
    files: list[Path]
    seconds: float
    measured_before: int          # measured trials the study held when this run started
    measured: int                 # ... and holds now
    evaluated: int                # trials counted toward --trials (with a replay file's unrecorded ones)
    grown: Any = None             # --catalogue-out: the tuner.build.catalogue.BuildSummary

    @property
    def trials_per_min(self) -> float | None:
        new = self.measured - self.measured_before
        return 60 * new / self.seconds if new > 0 and self.seconds > 0 else None


@dataclass
class SweepResult:
    studies: list[optuna.Study]
    export: dict[str, Any]
    files: list[Path]
    shapes: int                   # shapes the lists named
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (shape, why)
    seconds: float = 0.0          # wall time of this run, confirmation included
    searched: int = 0             # shapes this run searched (not finished in an earlier one)
    new_trials: int = 0           # trials this run measured
    grown: Any = None             # --catalogue-out: the tuner.build.catalogue.BuildSummary

    def rates(self) -> tuple[float, float]:
        """(shapes/min, trials/min) of this run's own work."""
        minutes = self.seconds / 60 if self.seconds > 0 else float("nan")
        return self.searched / minutes, self.new_trials / minutes


# ---- set-up ----------------------------------------------------------------------------

def split_list(text: str) -> list[str]:
    """A comma list from the command line: names, blanks dropped."""
    return [n.strip() for n in text.split(",") if n.strip()]


def make_backend(opts: Options, log: Path | None = None) -> Backend:
    opts.check()
    if opts.backend == "replay":
        assert opts.replay is not None
        return ReplayBackend(opts.replay, opts.arch)
    return GpuBackend(gpu=opts.gpu, log_path=log)


def check_family_names(space: Space, names: list[str] | str | None, accumulate: str = "fp32") -> list[str] | None:
    """The named families (a list, or a comma list), checked without a GPU: each is a family of
    the space and builds this accumulation. None: none named (all that build it here)."""
    if names is None:
        return None
    text, names = (names, split_list(names)) if isinstance(names, str) else (",".join(names), names)
    if not names:
        raise UserError(f"--families {text!r} names no family; families: {', '.join(space.families)}")
    check_accumulate(space, names, accumulate)  # also: every name is a family
    return names


def families_for(space: Space, names: list[str] | str | None, target: Target, backend: Backend | None = None,
                 accumulate: str = "fp32") -> list[str]:
    """The families a run searches: those named (a list, or a comma list; checked), else all that
    build this problem here."""
    names = check_family_names(space, names, accumulate)
    if names is not None:
        too_new = [n for n in names if target.cc < space.family(n).min_arch]
        if too_new:
            raise UserError(f"family {', '.join(too_new)} needs a newer GPU than {target.arch}")
        return names
    fams = [f.name for f in space.families.values() if target.cc >= f.min_arch and accumulate in f.accumulate]
    recorded = getattr(backend, "families", None)
    if recorded is not None:  # a replay file can only answer for the families it recorded
        fams = [f for f in fams if f in recorded]
    if not fams:
        raise UserError(f"no family of the space builds {accumulate} accumulation on {target.arch}"
                        + (" with measurements in the replay file" if recorded is not None else ""))
    return fams


@contextlib.contextmanager
def measuring(backend: Backend, jobs: int | None) -> Iterator[CompilePool | None]:
    """The compile pool a backend needs (toolchain checked before any trial); closes both.
    SIGINT and SIGTERM (a parent stopping its workers) end the search at a safe point: the
    trials held are told FAIL ("interrupted"), never left RUNNING."""
    pool = None
    with INTERRUPTS.handled():
        try:
            if backend.needs_cubin:
                nvcc_path(), cutlass_include()  # missing toolchain: one clear error before any trial
                pool = CompilePool(jobs)
            yield pool
        finally:
            backend.close()
            if pool:
                pool.close()

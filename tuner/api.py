"""The library API: what every `hgemm-tune` command calls, usable from Python as it is.

    from tuner.api import Options, tune_shape, sweep
    result = tune_shape("4096x4096x8192", Options(trials=200))
    print(result.export["entries"][0]["speedup"])

One `Options` object carries everything a run takes besides what it tunes. Progress goes out
through a `Listener` (the CLI draws bars and tables from it); nothing here prints. Errors in
the input are `tuner.errors.UserError`, raised before any GPU work starts.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import optuna

from tuner.build import CompilePool, CompileResult, cutlass_include, nvcc_path, render
from tuner.errors import UserError
from tuner.measure import Backend, CompareReply, GpuBackend, ReplayBackend, record_baseline, record_measurement
from tuner.results import bench as bench_stage
from tuner.results import read_json, write_json
from tuner.results.export import export_studies
from tuner.search import (
    INTERRUPTS,
    SAMPLERS,
    Progress,
    Search,
    TrialRecord,
    check_accumulate,
    confirmable,
    confirmation,
    evaluated_trials,
    existing_study,
    load_studies,
    measured_trials,
    nearest_winners,
    open_storage,
    study_name,
)
from tuner.search import confirm as confirm_study
from tuner.search.compile_queue import hang_timeout_s
from tuner.search.records import StudyMeta, mark_sweep_done, sweep_done_trials
from tuner.search.studies import best_trial
from tuner.space import ACCUMULATE, Shape, Space, Target, load_space, parse_shape, target_for_arch

DEFAULT_STORAGE = "sqlite:///runs/hgemm.db"
BACKENDS = ("gpu", "replay")


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


def families_for(space: Space, names: list[str] | str | None, target: Target, backend: Backend | None = None,
                 accumulate: str = "fp32") -> list[str]:
    """The families a run searches: those named (a list, or a comma list; checked), else all that
    build this problem here."""
    if names is not None:
        text, names = (names, split_list(names)) if isinstance(names, str) else (",".join(names), names)
        if not names:
            raise UserError(f"--families {text!r} names no family; families: {', '.join(space.families)}")
        check_accumulate(space, names, accumulate)  # also: every name is a family
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


def _search(space: Space, fams: list[str], shape: Shape, be: Backend, pool: CompilePool | None, opts: Options,
            listener: Listener, *, name: str, trials: int, record: Path | None, label: str = "tuning",
            warm_start: list | None = None, patience: int | None = None,
            timeout_s: float | None = None) -> optuna.Study:
    """One study's search in this process, with its cuBLAS baseline measured first."""
    baselines = be.baseline(shape, opts.accumulate)
    if record and not be.simulated:  # a replayed baseline is not a measurement
        record_baseline(record, shape, baselines, opts.accumulate)
    listener.started(shape, baselines, be.name, fams, opts.accumulate)
    listener.search(label, trials)
    recorder = (lambda req, m: record_measurement(record, req, m)) if record else None
    search = Search(space, fams, shape, be, trials=trials, storage=opts.storage, sampler=opts.sampler, name=name,
                    seed=opts.seed, pool=pool, eval_timeout_s=hang_timeout_s(baselines["cublas"]),
                    recorder=recorder, warm_start=warm_start, patience=patience, accumulate=opts.accumulate)
    return search.run(timeout_s, listener.trial)


def confirm_best(space: Space, study: optuna.Study, be: Backend, pool: CompilePool | None, opts: Options,
             listener: Listener) -> None:
    """Confirm the study's best kernels unless a confirmation as large still holds."""
    top, runs = opts.confirm_top, opts.confirm_runs
    if not top or not confirmable(study, be):
        return
    held = confirmation(study, best_trial(study))
    if held and held["top"] >= top and held["runs"] >= runs:
        listener.confirmed(held, earlier=True)
        return
    listener.confirming(top, runs)
    record = confirm_study(space, study, be, pool, top=top, runs=runs, on_run=listener.confirm_run)
    if record is not None:
        listener.confirmed(record, earlier=False)


# ---- the entry points ------------------------------------------------------------------

def tune_shape(shape: Shape | str, opts: Options | None = None, listener: Listener | None = None, *,
               study: str | None = None, output: Path | None = None, workers: int = 1) -> TuneResult:
    """Tune one shape: sample configs, compile, verify, time against cuBLAS; confirm the best
    few in fresh runs; export the winner (runs/<study>.json, and `output`).

    workers > 1: the study is created here and filled by that many `hgemm-tune worker`
    processes (one per GPU, round robin)."""
    from tuner.search.workers import run_workers

    opts = opts or Options()
    listener = listener or Listener()
    shp = parse_shape(shape) if isinstance(shape, str) else shape
    opts.check()
    space = load_space(opts.space_file)
    opts.runs_dir.mkdir(parents=True, exist_ok=True)
    open_storage(opts.storage)  # a bad storage URL fails here, before the GPU starts
    be = make_backend(opts, opts.runs_dir / "worker.log")
    try:
        fams = families_for(space, opts.families, be.target, be, opts.accumulate)
    except UserError:
        be.close()
        raise
    name = study or study_name(shp, [space.family(f) for f in fams], be.target.arch, accumulate=opts.accumulate)
    before = measured_so_far(name, opts.storage)
    started = time.perf_counter()
    with measuring(be, opts.jobs) as pool:
        if workers == 1:
            st = _search(space, fams, shp, be, pool, opts, listener, name=name, trials=opts.trials,
                         record=opts.record, timeout_s=opts.timeout_s)
        else:
            # Create the study (attributes, seeds) here, then let the workers fill it.
            st = _search(space, fams, shp, be, pool, opts, listener, name=name, trials=0, record=None)
            codes = run_workers(workers, name, opts.storage, opts.trials, worker_args(opts), opts.jobs, opts.backend,
                                opts.runs_dir, on_tick=lambda done, best: listener.trial(
                                    Progress(done=done, best_us=best), None))
            for i, code in enumerate(codes):
                if code not in (0, None):
                    listener.message(f"worker {i} exited with {code} ({opts.runs_dir}/worker-{i}.log)")
    seconds = time.perf_counter() - started
    if opts.confirm_top and confirmable(st, be):  # each confirmation run starts a fresh worker
        be = make_backend(opts, opts.runs_dir / "worker.log")
        with measuring(be, opts.jobs) as pool:
            confirm_best(space, st, be, pool, opts, listener)
    data = export_studies([st])
    files = [write_json(data, opts.runs_dir / f"{name}.json")]
    if output:
        files.append(write_json(data, output))
    return TuneResult(st, data, files, seconds, before, measured_trials(st), evaluated_trials(st))


def worker_args(opts: Options) -> list[str]:
    """The command-line options a `hgemm-tune worker` needs to search as this run does."""
    args = ["--backend", opts.backend, "--sampler", opts.sampler, "--arch", opts.arch]
    args += ["--space", str(opts.space_file)] if opts.space_file else []
    args += ["--replay", str(opts.replay)] if opts.replay else []
    args += ["--record", str(opts.record)] if opts.record else []
    args += ["--timeout", str(opts.timeout_s)] if opts.timeout_s else []
    return args


def measured_so_far(name: str, storage: str) -> int:
    """Measured trials a study already holds (0 when it does not exist yet): a resumed run's
    trials per minute count only what this run measured."""
    st = existing_study(name, open_storage(storage))
    return measured_trials(st) if st else 0


def join_study(study: str, opts: Options, listener: Listener | None = None) -> optuna.Study:
    """Join an existing study as one more worker: ask, compile, measure, tell, until it is full
    (`opts.trials`, default the target it was created with)."""
    listener = listener or Listener()
    opts.check()
    (st,) = load_studies(opts.storage, [study])  # joins an existing study: a typo must not create one
    meta = StudyMeta.of(st)
    space = load_space(opts.space_file)
    opts.runs_dir.mkdir(parents=True, exist_ok=True)
    log = opts.runs_dir / f"gpu-worker-{opts.gpu if opts.gpu is not None else 'main'}.log"
    be = make_backend(replace(opts, accumulate=meta.accumulate), log)
    with measuring(be, opts.jobs) as pool:
        return _search(space, meta.families, meta.shape_record, be, pool, replace(opts, accumulate=meta.accumulate),
                       listener, name=study, trials=opts.trials or meta.trials_target, record=opts.record,
                       label=f"worker {be.name}", timeout_s=opts.timeout_s)


def sweep(opts: Options, shape_lists: list[str] | str, *, time_per_shape: float | None = None,
          budget_s: float | None = None, patience: int | None = 15, output: Path | None = None,
          listener: Listener | None = None) -> SweepResult:
    """Tune every shape of the space file's named shape lists, cheapest first, one study per
    shape, resumable; each shape starts from its nearest tuned shapes' winners, stops after
    `patience` trials without a new best, and has its best few confirmed in fresh runs."""
    listener = listener or Listener()
    opts.check()
    space = load_space(opts.space_file)
    text, shape_lists = ((shape_lists, split_list(shape_lists)) if isinstance(shape_lists, str)
                         else (",".join(shape_lists), shape_lists))
    if not shape_lists:
        raise UserError(f"--shapes {text!r} names no shape list; lists: {', '.join(space.shapes) or 'none'}")
    missing = [n for n in shape_lists if n not in space.shapes]
    if missing:
        raise UserError(f"{space.path}: no shape list {missing[0]!r}; lists: {', '.join(space.shapes) or 'none'}")
    todo = sorted(dict.fromkeys(s for n in shape_lists for s in space.shapes[n]), key=lambda s: (s.flops, str(s)))
    opts.runs_dir.mkdir(parents=True, exist_ok=True)
    backing = open_storage(opts.storage)
    be = make_backend(opts, opts.runs_dir / "worker.log")
    try:
        fams = families_for(space, opts.families, be.target, be, opts.accumulate)
    except UserError:
        be.close()
        raise
    deadline = time.perf_counter() + budget_s if budget_s else None
    done, skipped = [], []
    with measuring(be, opts.jobs) as pool:
        for i, shp in enumerate(todo):
            if deadline and time.perf_counter() > deadline:
                break
            listener.sweep_shape(i, len(todo), shp)
            name = study_name(shp, [space.family(f) for f in fams], be.target.arch, accumulate=opts.accumulate)
            st = existing_study(name, backing)  # created by the search only: a skipped shape leaves no study
            if st is not None and max(evaluated_trials(st), sweep_done_trials(st)) >= opts.trials:
                confirm_best(space, st, be, pool, opts, listener)  # unless it holds
                done.append(st)  # finished in an earlier run
                continue
            left = deadline - time.perf_counter() if deadline else None
            limit = min(x for x in (time_per_shape, left) if x) if (time_per_shape or left) else None
            try:
                st = _search(space, fams, shp, be, pool, opts, listener, name=name, trials=opts.trials,
                             record=opts.record, warm_start=nearest_tuned(opts.storage, shp, fams),
                             patience=patience or None, timeout_s=limit)
            except UserError as exc:  # this shape cannot be measured (no baseline): the rest can
                skipped.append((str(shp), str(exc)))
                continue
            if evaluated_trials(st) and not (deadline and time.perf_counter() >= deadline):
                # Stopped by its count, patience or its own time box: done at this trial budget.
                mark_sweep_done(st, opts.trials)
                confirm_best(space, st, be, pool, opts, listener)
            done.append(st)
        listener.sweep_shape(len(todo), len(todo), None)
    data = export_studies(done)
    files = [write_json(data, opts.runs_dir / "sweep.json")]
    if output:
        files.append(write_json(data, output))
    return SweepResult(done, data, files, len(todo), skipped)


def nearest_tuned(storage: str, shape: Shape, families: list[str]) -> list[tuple[str, dict]]:
    """The winners of the nearest tuned shapes in the storage (none when it holds nothing yet)."""
    try:
        studies = load_studies(storage)
    except UserError:
        return []
    return nearest_winners(studies, shape, families)


def confirm(storage: str, study: str, opts: Options, listener: Listener | None = None) -> dict[str, Any] | None:
    """Re-time one study's `opts.confirm_top` best kernels in `opts.confirm_runs` fresh worker runs."""
    listener = listener or Listener()
    (st,) = load_studies(storage, [study])
    space = load_space(opts.space_file)
    be = make_backend(opts, opts.runs_dir / "worker.log")
    with measuring(be, opts.jobs) as pool:
        confirm_best(space, st, be, pool, opts, listener)
    return st.user_attrs.get("confirm")


def bench(export_file: Path, modes: list[str], opts: Options, *, out: Path, torch: bool = True, repeats: int = 1,
          on_start=None, on_shape=None) -> tuple[dict[str, Any], list[Path]]:
    """Re-verify and time every exported kernel for this GPU against the vendor libraries,
    `repeats` runs each in a fresh worker; writes bench.csv, bench_geomean.csv, bench.md and
    bench.json under `out`."""
    if repeats < 1:
        raise UserError("--repeats must be >= 1")
    data = read_json(export_file)
    if not data["entries"]:
        raise UserError(f"{export_file}: the export has no entries (no study had a verified kernel)")
    space = load_space(opts.space_file)
    out.mkdir(parents=True, exist_ok=True)
    be = make_backend(replace(opts, backend="gpu"), out / "worker.log")
    pool = None
    try:
        chosen, _ = bench_stage.select_entries(data, be.target)
        if not chosen:
            gpus = sorted({e["gpu"] for e in data["entries"]})
            raise UserError(f"{export_file}: no entry for this GPU ({be.target.name}, {be.target.arch}); "
                            f"the export holds {', '.join(gpus)}")
        nvcc_path(), cutlass_include()  # missing toolchain: one clear error before any build
        pool = CompilePool(opts.jobs)
        if on_start:
            on_start(be.name, len({e["shape"] for e in chosen}))
        builder = bench_stage.Builder(space, be.target, pool)
        result = bench_stage.run_benchmark(data, be, builder, modes, torch=torch, repeats=repeats, on_shape=on_shape)
    finally:
        be.close()
        if pool:
            pool.close()
    return result, bench_stage.write_outputs(result, out, str(export_file))


@dataclass
class Build:
    label: str                    # what was built: an export entry's shape, or a seed of a shape
    family: str
    result: CompileResult


def prebuild(export_file: Path | None, shapes: list[str], arch: str, opts: Options,
             on_done=None) -> list[Build]:
    """Compile, without a GPU, the kernels a later GPU run will need, into the compile cache:
    every entry of an export, and the seeds a fresh study of each shape tries first."""
    from tuner.results.entries import entry_build
    from tuner.search.sampler import full_config, seed_configs

    space = load_space(opts.space_file)
    target = target_for_arch(arch)
    nvcc_path(), cutlass_include()
    jobs: list[tuple[str, str, str, str]] = []  # (label, family, source, artifact)
    if export_file is not None:
        for e in read_json(export_file)["entries"]:
            if e["arch"] != arch:
                continue
            build = entry_build(space, e, target)
            jobs.append((f"{e['shape']} (export)", build.family, build.source, build.artifact))
    for text in shapes:
        shape = parse_shape(text)
        for fam in (space.family(f) for f in families_for(space, opts.families, target, None, opts.accumulate)):
            for cfg in seed_configs(fam, shape):
                full = full_config(fam, cfg)
                if fam.violations(full, shape, target):
                    continue  # the search rejects it before nvcc too
                jobs.append((f"{shape} seed {json.dumps(cfg, separators=(',', ':'))}", fam.name,
                             render(fam, full, arch, accumulate=opts.accumulate), fam.artifact))
    pool = CompilePool(opts.jobs)
    try:
        futures = [(label, fam, pool.submit(source, arch, artifact)) for label, fam, source, artifact in jobs]
        builds = []
        for label, fam, future in futures:
            builds.append(Build(label, fam, future.result()))
            if on_done:
                on_done(len(builds), len(futures))
    finally:
        pool.close()
    return builds

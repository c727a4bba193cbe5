"""Tuning: one shape (`tune_shape`), a study joined as one more worker (`join_study`), every
shape of a space file's lists (`sweep`), and re-timing a study's best (`confirm`)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage

from tuner.api.run import (
    Listener,
    Options,
    SweepResult,
    TuneResult,
    check_family_names,
    families_for,
    make_backend,
    measuring,
    split_list,
)
from tuner.build import CompilePool
from tuner.build.catalogue import Catalogue, open_catalogue
from tuner.errors import UserError
from tuner.measure import Backend, record_baseline, record_measurement
from tuner.measure.regimes import SUSTAINED
from tuner.results import check_output, write_export
from tuner.results.export import export_studies
from tuner.search import (
    Progress,
    Search,
    confirmable,
    confirmation,
    evaluated_trials,
    existing_study,
    load_studies,
    measured_trials,
    open_storage,
    study_name,
)
from tuner.search import confirm as confirm_study
from tuner.search.compile_queue import hang_timeout_s
from tuner.search.rank import (
    NEAR_BEST_PLACES,
    RANKERS,
    Candidate,
    RankQuality,
    check_ranker,
    in_space,
    rank_catalogue,
    rank_quality,
    rerank_quality,
)
from tuner.search.records import StudyMeta, confirm_record, mark_sweep_done, sweep_done_trials
from tuner.search.sampler import NearPick, nearest_picks
from tuner.search.studies import best_trial, nearest_studies
from tuner.space import Shape, Space, Target, load_space, parse_shape

DEFAULT_STORAGE = "sqlite:///runs/hgemm.db"
NEAR_SHAPES = 2  # tuned shapes whose winners a fresh shape tries first and the catalogue ranking credits
BACKENDS = ("gpu", "replay")


def _search(space: Space, fams: list[str], shape: Shape, be: Backend, pool: CompilePool | None, opts: Options,
            listener: Listener, *, name: str, trials: int, record: Path | None, label: str = "tuning",
            warm_start: list | None = None, patience: int | None = None,
            timeout_s: float | None = None, catalogue: Catalogue | None = None) -> optuna.Study:
    """One study's search in this process, with its cuBLAS baseline measured first. A fresh
    study tries the catalogue's configs of its families first (their builds cost no nvcc)."""
    objective = opts.objective or SUSTAINED
    baselines = be.baseline(shape, opts.accumulate, objective)
    if record and not be.simulated:  # a replayed baseline is not a measurement
        record_baseline(record, shape, baselines, opts.accumulate, objective)
    listener.started(shape, baselines, be.name, fams, opts.accumulate)
    listener.search(label, trials)
    recorder = (lambda req, m: record_measurement(record, req, m)) if record else None
    held: dict[str, str] = {}
    ranking: dict[str, Candidate] = {}
    if catalogue is not None:
        ranked = rank_for(space, catalogue, fams, shape, be.target, opts)
        ranking = {c.key: c for c in ranked}
        top = ranked if opts.catalogue_top is None else ranked[:opts.catalogue_top]
        warm_start = [(c.family, c.config) for c in top] + (warm_start or [])
        held = {k.source_hash: catalogue.digest[:16] for k in catalogue.kernels}
    search = Search(space, fams, shape, be, trials=trials, storage=opts.storage, sampler=opts.sampler, name=name,
                    seed=opts.seed, pool=pool, eval_timeout_s=hang_timeout_s(baselines["cublas"]),
                    recorder=recorder, warm_start=warm_start, patience=patience, accumulate=opts.accumulate,
                    catalogue=held, objective=objective, ranking=ranking, batch=opts.batch_size)
    return search.run(timeout_s, listener.trial)


def rank_for(space: Space, catalogue: Catalogue, fams: list[str], shape: Shape, target: Target,
             opts: Options) -> list[Candidate]:
    """The catalogue's configs of these families, ranked for the shape (tuner.search.rank): the
    cost model (or NVIDIA's heuristic, `opts.rank_by`), and the winners and near-best configs of
    the nearest tuned shapes in the storage. Configs the space no longer has, or whose
    constraints reject the shape, are left out."""
    configs = [(f, c) for f, c in catalogue.configs(fams, opts.accumulate) if in_space(space, f, c)]
    return rank_catalogue(space, configs, shape, target,
                          tuned_neighbours(opts.storage, shape, fams, top=NEAR_BEST_PLACES),
                          ranker=opts.rank_by, accumulate=opts.accumulate).candidates


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
    _, be, fams, cat = _start(space, opts, output)
    name = study or study_name(shp, [space.family(f) for f in fams], be.target.arch, accumulate=opts.accumulate,
                               objective=opts.objective or SUSTAINED)
    before = measured_so_far(name, opts.storage)
    started = time.perf_counter()
    with measuring(be, opts.jobs) as pool:
        if workers == 1:
            st = _search(space, fams, shp, be, pool, opts, listener, name=name, trials=opts.trials,
                         record=opts.record, timeout_s=opts.timeout_s, catalogue=cat)
        else:
            # Create the study (attributes, seeds) here, then let the workers fill it.
            st = _search(space, fams, shp, be, pool, opts, listener, name=name, trials=0, record=None,
                         catalogue=cat)
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
    files = _write_exports(data, [opts.runs_dir / f"{name}.json", *([output] if output else [])], listener)
    grown = _grow(opts, data, be.target.arch, f"tune {shp}")
    return TuneResult(st, data, files, seconds, before, measured_trials(st), evaluated_trials(st), grown)


def _grow(opts: Options, data: dict[str, Any], arch: str, label: str) -> Any:
    """--catalogue-out: the winners join the catalogue (tuner.api.results.grow_catalogue)."""
    if opts.catalogue_out is None:
        return None
    from tuner.api.results import grow_catalogue

    return grow_catalogue(opts, data, arch, label)


def _write_exports(data: dict[str, Any], paths: list[Path], listener: Listener) -> list[Path]:
    """Write the export to each path, never clobbering a better one (`write_export`); say what was kept."""
    files = []
    for path in paths:
        written, note = write_export(data, path)
        if note:
            listener.message(note)
        if written:
            files.append(written)
    return files


def worker_args(opts: Options) -> list[str]:
    """The command-line options a `hgemm-tune worker` needs to search as this run does."""
    args = ["--backend", opts.backend, "--sampler", opts.sampler, "--arch", opts.arch]
    args += ["--space", str(opts.space_file)] if opts.space_file else []
    args += ["--replay", str(opts.replay)] if opts.replay else []
    args += ["--record", str(opts.record)] if opts.record else []
    args += ["--timeout", str(opts.timeout_s)] if opts.timeout_s else []
    args += ["--objective", opts.objective or SUSTAINED]
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
    # A worker measures as the study does: its accumulation, and its objective unless --objective
    # names another (which the search refuses: one study never ranks two regimes' times).
    opts = replace(opts, accumulate=meta.accumulate, objective=opts.objective or meta.objective)
    be = make_backend(opts, log)
    with measuring(be, opts.jobs) as pool:
        return _search(space, meta.families, meta.shape_record, be, pool, opts,
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
    backing, be, fams, cat = _start(space, opts, output)
    started = time.perf_counter()
    deadline = started + budget_s if budget_s else None
    done, skipped = [], []
    searched, new_trials = 0, 0   # this run's own work, for its rates (a resumed shape adds none)
    with measuring(be, opts.jobs) as pool:
        for i, shp in enumerate(todo):
            if deadline and time.perf_counter() > deadline:
                break
            listener.sweep_shape(i, len(todo), shp)
            name = study_name(shp, [space.family(f) for f in fams], be.target.arch, accumulate=opts.accumulate,
                              objective=opts.objective or SUSTAINED)
            st = existing_study(name, backing)  # created by the search only: a skipped shape leaves no study
            if st is not None and max(evaluated_trials(st), sweep_done_trials(st)) >= opts.trials:
                confirm_best(space, st, be, pool, opts, listener)  # unless it holds
                done.append(st)  # finished in an earlier run
                continue
            left = deadline - time.perf_counter() if deadline else None
            limit = min(x for x in (time_per_shape, left) if x) if (time_per_shape or left) else None
            before = evaluated_trials(st) if st is not None else 0
            try:
                st = _search(space, fams, shp, be, pool, opts, listener, name=name, trials=opts.trials,
                             record=opts.record, warm_start=nearest_tuned(opts.storage, shp, fams),
                             patience=patience or None, timeout_s=limit, catalogue=cat)
            except UserError as exc:  # this shape cannot be measured (no baseline): the rest can
                skipped.append((str(shp), str(exc)))
                continue
            searched += 1
            new_trials += evaluated_trials(st) - before
            if evaluated_trials(st) and not (deadline and time.perf_counter() >= deadline):
                # Stopped by its count, patience or its own time box: done at this trial budget.
                mark_sweep_done(st, opts.trials)
                confirm_best(space, st, be, pool, opts, listener)
            done.append(st)
        listener.sweep_shape(len(todo), len(todo), None)
    data = export_studies(done)
    files = _write_exports(data, [opts.runs_dir / "sweep.json", *([output] if output else [])], listener)
    grown = _grow(opts, data, be.target.arch, f"sweep {text}")
    return SweepResult(done, data, files, len(todo), skipped, seconds=time.perf_counter() - started,
                       searched=searched, new_trials=new_trials, grown=grown)


def _start(space: Space, opts: Options,
           output: Path | None) -> tuple[BaseStorage, Backend, list[str], Catalogue | None]:
    """Check every input before the GPU starts (families, the output file, the storage), then
    start the backend and pick the families it can build; the catalogue, if any, is loaded.
    Returns the opened storage too (opening a SQLite file checks it: done once)."""
    check_family_names(space, opts.families, opts.accumulate)
    if output:
        check_output(output)
    if opts.catalogue_out is not None:  # said now, not after the run: where it goes, and the nvcc it may need
        from tuner.build import cutlass_include, nvcc_path
        from tuner.results.schema import check_writable_folder

        out = opts.catalogue_out
        if out.is_dir():
            raise UserError(f"--catalogue-out {out}: is a folder, not a catalogue file")
        if out.exists() and (opts.catalogue is None or out.resolve() != opts.catalogue.resolve()):
            if opts.catalogue is not None:  # its kernels would be replaced by --catalogue's, silently
                raise UserError(f"--catalogue-out {out}: exists and is not the --catalogue {opts.catalogue}; "
                                "name a new file, or the --catalogue itself to extend it")
            from tuner.build.catalogue import check_catalogue, read_catalogue

            check_catalogue(read_catalogue(out), space, opts.arch)  # the base the winners join: checked now
        check_writable_folder(out.parent, f"--catalogue-out {out}")
        nvcc_path(), cutlass_include()
    backing = open_storage(opts.storage)  # a bad storage URL, a corrupt file: here, before the GPU starts
    opts.runs_dir.mkdir(parents=True, exist_ok=True)
    be = make_backend(opts, opts.runs_dir / "worker.log")
    try:
        return backing, be, families_for(space, opts.families, be.target, be, opts.accumulate), \
            load_catalogue(opts, space, be.target.arch)
    except UserError:
        be.close()
        raise


def load_catalogue(opts: Options, space: Space, arch: str, cache_dir: Path | None = None) -> Catalogue | None:
    """The run's kernel catalogue (`opts.catalogue`), verified (manifest, every binary's sha256),
    checked against this nvcc, CUTLASS, arch and templates, and loaded into the compile cache,
    before any trial; None when the run has none."""
    if opts.catalogue is None:
        return None
    from tuner.build.compile import DEFAULT_CACHE

    return open_catalogue(opts.catalogue, space, arch, cache_dir or DEFAULT_CACHE)


def nearest_tuned(storage: str, shape: Shape, families: list[str]) -> list[tuple[str, dict]]:
    """The winners of the nearest tuned shapes in the storage (none when it holds nothing yet)."""
    return [(p.family, p.config) for p in tuned_neighbours(storage, shape, families)]


def tuned_neighbours(storage: str, shape: Shape, families: list[str], top: int = 1) -> list[NearPick]:
    """The `top` best configs per family of the nearest tuned shapes in the storage, with their
    shape, distance and place (none when it holds nothing yet)."""
    try:
        studies = nearest_studies(storage, shape, NEAR_SHAPES)
    except UserError:
        return []
    return nearest_picks(studies, shape, families, k=NEAR_SHAPES, top=top)


def confirm(storage: str, study: str, opts: Options, listener: Listener | None = None) -> dict[str, Any] | None:
    """Re-time one study's `opts.confirm_top` best kernels in `opts.confirm_runs` fresh worker runs."""
    listener = listener or Listener()
    (st,) = load_studies(storage, [study])
    space = load_space(opts.space_file)
    be = make_backend(opts, opts.runs_dir / "worker.log")
    with measuring(be, opts.jobs) as pool:
        confirm_best(space, st, be, pool, opts, listener)
    return confirm_record(st)


def rank_check(storage: str, top: int = 5, studies: list[str] | None = None) -> list[RankQuality]:
    """How well the catalogue ranking predicted each study's measured order (tuner.search.rank):
    one row per study that timed ranked catalogue candidates, read-only."""
    if top < 1:
        raise UserError(f"--top {top}: must be >= 1")
    found = load_studies(storage, studies, read_only=True)
    return [q for st in found for q in [rank_quality(st, top)] if q is not None]


def rank_compare(storage: str, top: int = 5, studies: list[str] | None = None, space_file: Path | None = None,
                 rankers: tuple[str, ...] | None = None) -> list[tuple[RankQuality, dict[str, RankQuality | None]]]:
    """`rank_check` with each ranker's order recomputed on the same measured studies: per study
    the recorded ranking's quality and, per ranker, that of its order recomputed from the
    candidates' configs, the shape and the target (tuner.search.rank.rerank_quality, no
    neighbour credit). Default rankers: the model, and nvidia where its wheel is installed."""
    from tuner.search import nvidia_heuristics

    if rankers is None:
        rankers = RANKERS if nvidia_heuristics.available() else ("model",)
    for r in rankers:
        check_ranker(r)
    rows = rank_check(storage, top, studies)
    if not rows:
        return []
    space = load_space(space_file)
    by_name = {st.study_name: st for st in load_studies(storage, [q.study for q in rows], read_only=True)}
    return [(q, {r: rerank_quality(by_name[q.study], space, r, top) for r in rankers}) for q in rows]

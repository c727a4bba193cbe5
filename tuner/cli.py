"""hgemm-tune command line.

    hgemm-tune --shape 4096x4096x8192 --trials 500     # tune one shape (same as `tune`)
    hgemm-tune render --family cute_sm80 --shape 4096x4096x8192 --set BM=256
    hgemm-tune show --shape 4096x4096x8192             # source of the best trial
    hgemm-tune doctor                                  # GPU, arch, nvcc, headers, cupy
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tuner.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="rich",
                  pretty_exceptions_enable=False,
                  help="Find, verify and export the fastest fp16 GEMM kernel per shape on your NVIDIA GPU.")
console = Console(stderr=True)
# Tables go to stdout; when that is a file or pipe, do not squeeze them to 80 columns.
out_console = Console(width=None if sys.stdout.isatty() else 220)

DEFAULT_STORAGE = "sqlite:///runs/hgemm.db"
SpaceOpt = typer.Option(Path("space.yaml"), "--space", help="Search-space file (families, knobs, constraints).")
AccumulateOpt = typer.Option("fp32", "--accumulate",
                             help="fp32 (default) or fp16 accumulation. fp16 is a different problem: its own study, "
                                  "only families that build it, verified and timed against cuBLAS in fp16 compute.")


def _accumulate(value: str) -> str:
    from tuner.space import ACCUMULATE

    if value not in ACCUMULATE:
        raise UserError(f"--accumulate {value!r}: choose one of {', '.join(ACCUMULATE)}")
    return value


def _parse_sets(sets: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for item in sets:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected KNOB=VALUE")
        key, value = item.split("=", 1)
        try:
            config[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            config[key.strip()] = value.strip()
    return config


def _make_backend(backend: str, replay: Path | None, arch: str, gpu: int | None, log: Path | None):
    from tuner.bench import GpuBackend, ReplayBackend

    if backend == "replay":
        if replay is None:
            raise UserError("--backend replay needs --replay FILE (a file of recorded GPU measurements)")
        return ReplayBackend(replay, arch)
    if backend == "gpu":
        return GpuBackend(gpu=gpu, log_path=log)
    raise UserError(f"unknown backend {backend!r}: use gpu or replay")


def _families_for(space, names: str | None, target, backend=None, accumulate: str = "fp32") -> list[str]:
    from tuner.search import check_accumulate

    if names is not None:
        chosen = [n.strip() for n in names.split(",") if n.strip()]
        if not chosen:
            raise UserError(f"--families {names!r} names no family; families: {', '.join(space.families)}")
        check_accumulate(space, chosen, accumulate)  # also: every name is a family
        too_new = [n for n in chosen if target.cc < space.family(n).min_arch]
        if too_new:
            raise UserError(f"family {', '.join(too_new)} needs a newer GPU than {target.arch}")
        return chosen
    fams = [f.name for f in space.families.values() if target.cc >= f.min_arch and accumulate in f.accumulate]
    recorded = getattr(backend, "families", None)
    if recorded is not None:  # a replay file can only answer for the families it recorded
        fams = [f for f in fams if f in recorded]
    if not fams:
        raise UserError(f"no family of the space builds {accumulate} accumulation on {target.arch}"
                        + (" with measurements in the replay file" if recorded is not None else ""))
    return fams


def _fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def _summary(study, shape) -> Table:
    from tuner.export import best_per_family, study_stats
    from tuner.target import Target

    target = Target(**study.user_attrs["target"])
    simulated = bool(study.user_attrs.get("simulated"))
    roof = target.roofline_us(shape.flops, shape.min_bytes)
    title = f"{shape} on {target.name} ({target.arch})" + ("  [SIMULATED: replayed measurements]" if simulated else "")
    table = Table(title=title)
    for col in ("family", "trial", "time us", "TFLOP/s", "% roofline", "cuBLAS us", "vs cuBLAS", "config"):
        table.add_column(col, justify="right" if col not in ("family", "config") else "left")
    best = sorted(best_per_family(study).values(), key=lambda t: t.value)
    for t in best:
        a = t.user_attrs
        table.add_row(a["family"], str(t.number), _fmt(t.value, ".2f"), _fmt(a.get("tflops"), ".1f"),
                      _fmt(100 * roof / t.value, ".1f"), _fmt(a.get("cublas_us"), ".2f"),
                      _fmt(a.get("speedup_cublas"), ".3f") + "x",
                      json.dumps(a["config"] | a.get("variant", {}), separators=(",", ":")))
    stats = study_stats(study)
    table.caption = (f"{stats['trials']} trials measured, {stats['ok']} verified, "
                     f"{stats['invalid_rejected']} rejected before nvcc, {stats['duplicates']} duplicates; "
                     f"failures: {stats['failures'] or 'none'}; median cold compile "
                     f"{_fmt(stats['compile_s_cold_median'], '.1f')} s"
                     + (f"; {stats['not_recorded']} not recorded in the replay file (not measured)"
                        if stats["not_recorded"] else "")
                     + (f"; {stats['other_gpu']} verified trials measured on another GPU model are not ranked"
                        if stats["other_gpu"] else ""))
    return table


ConfirmOpt = typer.Option(
    3, "--confirm", min=0,
    help="After the search, re-verify and re-time the K best distinct kernels with cuBLAS and cuBLASLt in "
         "--confirm-runs fresh worker runs and export the fastest by median time (a trial's time is one "
         "measurement; near-equal kernels swap places by a few percent from run to run). 0: export the "
         "in-study best.")
ConfirmRunsOpt = typer.Option(3, "--confirm-runs", min=1, help="Fresh worker runs of the confirmation.")


def _confirm(space, study, be, pool, top: int, runs: int, bar: tuple | None = None) -> None:
    """Confirm the study's best kernels (tuner.confirm) unless a confirmation as large still
    holds, and print what it measured; with `bar` (a progress bar and task already shown, as
    in a sweep) only report progress there. Export then takes the confirmed winner."""
    from rich.markup import escape

    from tuner.confirm import confirm, confirmable, confirmation
    from tuner.export import best_trial

    if not top or not confirmable(study, be):
        return
    held = confirmation(study, best_trial(study))
    if held and held["top"] >= top and held["runs"] >= runs:
        if bar is None:
            console.print(f"confirmed earlier ({held['top']} kernels, {held['runs']} runs): trial #{held['trial']}")
        return
    if bar is not None:  # a sweep: its own bar, and its summary table shows what was exported
        progress, task = bar
        progress.reset(task, total=runs, status=f"confirming the top {top}")
        confirm(space, study, be, pool, top=top, runs=runs, on_run=lambda i, _: progress.update(task, completed=i + 1))
        return
    with _progress() as progress:
        task = progress.add_task(f"confirming the top {top}", total=runs, status="")
        record = confirm(space, study, be, pool, top=top, runs=runs,
                         on_run=lambda i, reply: progress.update(task, completed=i + 1,
                                                                 status=reply.get("status", "")))
    if record is None:
        return
    table = Table(title=f"confirmation: {record['top']} kernels x {record['runs']} fresh runs, medians")
    for col in ("trial", "family", "in-study us", "median us", "runs us", "vs cuBLAS", "verified"):
        table.add_column(col, justify="left" if col in ("family", "verified") else "right")
    for k in sorted(record["kernels"], key=lambda k: (k["median_us"] is None, k["median_us"] or 0)):
        mark = " *" if k["trial"] == record["winner"] else ""
        table.add_row(f"#{k['trial']}{mark}", k["family"], _fmt(k["in_study_us"], ".2f"), _fmt(k["median_us"], ".2f"),
                      " ".join(_fmt(t, ".2f") for t in k["times_us"]), _fmt(k["speedup_cublas"], ".3f"),
                      "yes" if k["verified"] else f"[red]no[/]: {escape(str(k['reason']))}")
    table.caption = "* exported" if record["winner"] is not None else "[red]no kernel passed every run[/]"
    out_console.print(table)


def _progress() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=console)


@contextlib.contextmanager
def _measuring(be, jobs: int | None, resume_hint: str):
    """The compile pool a backend needs (toolchain checked before any trial); closes both,
    and turns Ctrl-C into a note that finished trials are kept."""
    from tuner.compile import CompilePool, cutlass_include, nvcc_path
    from tuner.search import INTERRUPTS

    pool = None
    # SIGINT and SIGTERM (`tune --workers` stopping its workers) end the search at a safe point:
    # the trials held are told FAIL ("interrupted"), never left RUNNING.
    with INTERRUPTS.handled():
        try:
            if be.needs_cubin:
                nvcc_path(), cutlass_include()  # missing toolchain: one clear error before any trial
                pool = CompilePool(jobs)
            yield pool
        except KeyboardInterrupt:
            console.print(f"[yellow]interrupted[/]: every finished trial is saved; {resume_hint}")
            raise typer.Exit(130) from None
        finally:
            be.close()
            if pool:
                pool.close()


def _search(space, fams, shp, be, *, trials, sampler, storage, name, seed, timeout, jobs, record, label="tuning",
            accumulate="fp32"):
    """Run the search in this process with a progress bar; returns the study."""
    from tuner.bench import record_baseline, record_measurement
    from tuner.search import hang_timeout_s
    from tuner.search import tune as run_tune

    with _measuring(be, jobs, "run the same command to resume.") as pool:
        baselines = be.baseline(shp, accumulate)
        if record and not be.simulated:  # a replayed baseline is not a measurement
            record_baseline(record, shp, baselines, accumulate)
        acc = "" if accumulate == "fp32" else f" ({accumulate} compute)"
        console.print(f"{shp}: {shp.flops / 1e9:.1f} GFLOP; cuBLAS{acc} {baselines['cublas']:.2f} us "
                      f"({shp.tflops(baselines['cublas']):.1f} TFLOP/s) on {be.name}; families {', '.join(fams)}")
        with _progress() as bar:
            task = bar.add_task(label, total=trials, status="")

            def on_progress(p, rec) -> None:
                best = f"best {p.best_us:.2f} us {p.best_tflops:.1f} TFLOP/s" if p.best_us else "no verified kernel yet"
                bar.update(task, completed=min(p.done, trials),
                           status=f"{best} | failed {p.failed} | rejected {p.invalid}")

            recorder = (lambda req, m: record_measurement(record, req, m)) if record else None
            return run_tune(space, fams, shp, be, trials=trials, sampler=sampler, storage=storage, name=name,
                            seed=seed, timeout_s=timeout, pool=pool, on_progress=on_progress, recorder=recorder,
                            eval_timeout_s=hang_timeout_s(baselines["cublas"]), accumulate=accumulate)


def _measured_so_far(name: str, storage: str) -> int:
    """Measured trials a study already holds (0 when it does not exist yet): a resumed run's
    trials per minute count only what this run measured."""
    from tuner.search import existing_study, measured_trials
    from tuner.storage import open_storage

    st = existing_study(name, open_storage(storage))
    return measured_trials(st) if st else 0


def _gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
        return max(1, sum(1 for line in out.splitlines() if line.startswith("GPU ")))
    except (OSError, subprocess.TimeoutExpired):
        return 1


WORKER_STOP_S = 20.0  # how long an interrupted `tune --workers` waits for its workers to tell their trials


def _spawn_workers(n: int, name: str, storage: str, trials: int, args: list[str], jobs: int | None,
                   backend: str) -> None:
    """N `hgemm-tune worker` processes on one study, one per GPU (round robin), sharing the
    compile cache on disk; this process only shows their joint progress."""
    from tuner.export import best_trial
    from tuner.search import INTERRUPTS, evaluated_trials, open_study

    gpus = _gpu_count() if backend == "gpu" else 1
    per_jobs = jobs or max(1, (os.cpu_count() or 1) // n)
    procs = []
    for i in range(n):
        cmd = [sys.executable, "-m", "tuner.cli", "worker", "--study", name, "--storage", storage,
               "--trials", str(trials), "--jobs", str(per_jobs), *args]
        if backend == "gpu":
            cmd += ["--gpu", str(i % gpus)]
        log = open(Path("runs") / f"worker-{i}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    study = open_study(name, storage)
    with _progress() as bar, INTERRUPTS.handled():
        task = bar.add_task(f"{n} workers", total=trials, status="")
        try:
            while any(p.poll() is None for p, _ in procs):
                time.sleep(1.0)
                # Ctrl-C inside a storage read can leave this process holding SQLite's read lock
                # (the traceback keeps the cursor alive), and then no worker can write its FAIL
                # "interrupted" before we kill it (CI: 16 trials left RUNNING). Deferred, the
                # interrupt lands between reads.
                with INTERRUPTS.deferred():
                    b = best_trial(study)
                    done = evaluated_trials(study)
                bar.update(task, completed=min(done, trials),
                           status=f"best {b.value:.2f} us" if b else "no verified kernel yet")
        except KeyboardInterrupt:
            # Each worker tells the trials it holds as FAIL ("interrupted") on SIGTERM, then exits:
            # give them that time before killing any, so no trial stays RUNNING.
            for p, _ in procs:
                p.terminate()
            deadline = time.monotonic() + WORKER_STOP_S
            for p, log in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                    console.print(f"[yellow]a worker did not stop within {WORKER_STOP_S:.0f} s and was killed[/]: "
                                  "the trials it held stay RUNNING until the next run fails them as stale")
                log.close()
            console.print("[yellow]interrupted[/]: every finished trial is saved; run the same command to resume.")
            raise typer.Exit(130) from None
    for i, (p, log) in enumerate(procs):
        log.close()
        if p.returncode not in (0, None):
            console.print(f"[yellow]worker {i} exited with {p.returncode}[/] (runs/worker-{i}.log)")


@app.command()
def tune(
    shape: str = typer.Option(..., "--shape", "-s", help="MxNxK, e.g. 4096x4096x8192 (A: MxK, B: NxK, C: MxN)."),
    trials: int = typer.Option(100, "--trials", "-n", min=0,
                               help="Measured trials the study should hold; a re-run resumes up to this."),
    families: str | None = typer.Option(None, "--families", "-f", help="Comma list (default: all for this GPU)."),
    sampler: str = typer.Option("tpe", help="tpe | random | gp | cmaes | grid."),
    timeout: float | None = typer.Option(None, help="Stop asking for new trials after this many seconds."),
    storage: str = typer.Option(DEFAULT_STORAGE, help="Optuna storage: sqlite:///F, postgresql://..., journal:F."),
    study: str | None = typer.Option(None, help="Study name (default: derived from shape, families, arch)."),
    backend: str = typer.Option("gpu", help="gpu: measure on this machine's GPU; replay: recorded measurements."),
    replay: Path | None = typer.Option(None, help="Recorded-measurements file for --backend replay."),
    arch: str = typer.Option("sm_90a", help="Target arch for --backend replay (a GPU backend reads the device)."),
    gpu: int | None = typer.Option(None, help="GPU index (sets CUDA_VISIBLE_DEVICES for the worker)."),
    workers: int = typer.Option(1, min=1, help="Worker processes on this study (one per GPU, round robin)."),
    jobs: int | None = typer.Option(None, help="Parallel nvcc jobs (default: one per core, split among workers)."),
    seed: int | None = typer.Option(None, help="Sampler seed, for reproducible searches."),
    record: Path | None = typer.Option(None, help="Append every measurement to this replay file."),
    space_file: Path = SpaceOpt,
    output: Path | None = typer.Option(None, "-o", "--output", help="Also write the best config JSON here."),
    accumulate: str = AccumulateOpt,
    confirm: int = ConfirmOpt,
    confirm_runs: int = ConfirmRunsOpt,
) -> None:
    """Tune one shape: sample configs, compile, verify, time against cuBLAS; confirm the best few
    in fresh runs; export the winner as JSON."""
    from tuner.confirm import confirmable
    from tuner.export import export_studies, write_json
    from tuner.search import evaluated_trials, measured_trials, study_name
    from tuner.shapes import parse_shape
    from tuner.space import load_space

    shp = parse_shape(shape)
    space = load_space(space_file)
    Path("runs").mkdir(exist_ok=True)
    be = _make_backend(backend, replay, arch, gpu, Path("runs") / "worker.log")
    fams = _families_for(space, families, be.target, be, _accumulate(accumulate))
    name = study or study_name(shp, [space.family(f) for f in fams], be.target.arch, accumulate=accumulate)
    if be.simulated:
        console.print("[yellow]SIMULATED[/]: replaying recorded measurements, no GPU runs.")
    before = _measured_so_far(name, storage)
    started = time.perf_counter()
    common = dict(sampler=sampler, storage=storage, name=name, seed=seed, timeout=timeout, jobs=jobs,
                  accumulate=accumulate)
    if workers == 1:
        st = _search(space, fams, shp, be, trials=trials, record=record, **common)
    else:
        # Create the study (attributes, seeds) here, then let the workers fill it.
        st = _search(space, fams, shp, be, trials=0, record=None, **common)
        args = ["--backend", backend, "--space", str(space_file), "--sampler", sampler]
        args += ["--replay", str(replay)] if replay else []
        args += ["--arch", arch] + (["--record", str(record)] if record else [])
        args += ["--timeout", str(timeout)] if timeout else []
        _spawn_workers(workers, name, storage, trials, args, jobs, backend)
    elapsed = time.perf_counter() - started
    out_console.print(_summary(st, shp))
    if confirm and confirmable(st, be):  # each confirmation run starts a fresh worker
        with _measuring(be, jobs, "the search's trials are saved; run the same command to confirm.") as pool:
            _confirm(space, st, be, pool, confirm, confirm_runs)
    data = export_studies([st])
    path = write_json(data, Path("runs") / f"{name}.json")
    if output:
        write_json(data, output)
    n = measured_trials(st)
    new = n - before
    rate = f" ({new} this run, {60 * new / elapsed:.1f} trials/min)" if new > 0 and elapsed > 0 else ""
    console.print(f"{elapsed:.0f} s this run; study holds {n} measured trials{rate}; "
                  f"best config JSON: {path}" + (f" and {output}" if output else ""))
    spent = evaluated_trials(st)  # with a replay file's not-recorded configs, which count toward --trials
    if spent < trials and not timeout:
        console.print(f"[yellow]stopped at {spent} of {trials} trials[/]: the sampler proposed no new valid config "
                      "in many tries; the space (or what the sampler explores of it) is spent.")
    if not data["entries"]:
        console.print("[red]no candidate passed verification[/]")
        raise typer.Exit(1)


@app.command()
def worker(
    study: str = typer.Option(..., help="Study to join (created by `hgemm-tune tune`)."),
    storage: str = typer.Option(DEFAULT_STORAGE,
                                help="Storage URL shared by all workers (postgresql://... across machines)."),
    trials: int | None = typer.Option(None, help="Stop when the study holds this many measured trials "
                                                 "(default: the target it was created with)."),
    backend: str = typer.Option("gpu", help="gpu or replay."),
    replay: Path | None = typer.Option(None, help="Recorded-measurements file for --backend replay."),
    arch: str = typer.Option("sm_90a", help="Target arch for --backend replay."),
    gpu: int | None = typer.Option(None, help="GPU index for this worker (CUDA_VISIBLE_DEVICES)."),
    jobs: int | None = typer.Option(None, help="Parallel nvcc jobs."),
    sampler: str = typer.Option("tpe", help="Sampler of this worker."),
    timeout: float | None = typer.Option(None, help="Stop asking for new trials after this many seconds."),
    record: Path | None = typer.Option(None, help="Append every measurement to this replay file."),
    space_file: Path = SpaceOpt,
) -> None:
    """Join a study as one more worker: ask, compile, measure, tell, until the study is full."""
    from tuner.export import load_studies
    from tuner.search import measured_trials
    from tuner.shapes import parse_shape
    from tuner.space import load_space

    (st,) = load_studies(storage, [study])  # joins an existing study: a typo must not create one
    attrs = st.user_attrs
    if "shape" not in attrs:
        raise UserError(f"study {study!r} in {storage} was not created by hgemm-tune tune (no shape)")
    shp = parse_shape(attrs["shape"])
    space = load_space(space_file)
    Path("runs").mkdir(exist_ok=True)
    log = Path("runs") / f"gpu-worker-{gpu if gpu is not None else os.getpid()}.log"
    be = _make_backend(backend, replay, arch, gpu, log)
    target = trials if trials is not None else int(attrs.get("trials_target", 100))
    st = _search(space, attrs["families"], shp, be, trials=target, sampler=sampler, storage=storage, name=study,
                 seed=None, timeout=timeout, jobs=jobs, record=record, label=f"worker {be.name}",
                 accumulate=attrs.get("accumulate", "fp32"))
    console.print(f"worker {be.name} done: study holds {measured_trials(st)} measured trials")


def _nearest_winners(storage: str, shape, families: list[str], k: int = 2) -> list[tuple[str, dict]]:
    """Best config per family of the k nearest tuned shapes (distance: sum of |log2| ratios)."""
    import math

    from tuner.export import best_per_family, load_studies
    from tuner.shapes import parse_shape

    try:
        studies = load_studies(storage)
    except UserError:
        return []
    scored = []
    for st in studies:
        other = st.user_attrs.get("shape")
        if not other or other == str(shape):
            continue
        o = parse_shape(other)
        dist = sum(abs(math.log2(a / b)) for a, b in ((o.M, shape.M), (o.N, shape.N), (o.K, shape.K)))
        scored.append((dist, st))
    seeds: list[tuple[str, dict]] = []
    for _, st in sorted(scored, key=lambda x: x[0])[:k]:
        for fam, t in best_per_family(st).items():
            if fam in families:
                seeds.append((fam, t.user_attrs["config"]))
    return seeds


@app.command()
def sweep(
    space_file: Path = typer.Argument(Path("space.yaml"), help="Space file whose `shapes:` lists are tuned."),
    shapes: str = typer.Option("default", help="Comma list of shape-list names in the file (e.g. subgrid27)."),
    trials_per_shape: int = typer.Option(30, help="Measured trials per shape (resumes up to this)."),
    time_per_shape: float | None = typer.Option(None, help="Seconds of search per shape at most."),
    budget: float | None = typer.Option(None, help="Seconds for the whole sweep; unfinished shapes resume later."),
    patience: int = typer.Option(15, min=0, help="Stop a shape after this many trials without a new best "
                                                 "(0: never, run every shape to --trials-per-shape)."),
    families: str | None = typer.Option(None, "--families", "-f", help="Comma list (default: all for this GPU)."),
    sampler: str = typer.Option("tpe", help="tpe | random | gp | cmaes | grid."),
    storage: str = typer.Option(DEFAULT_STORAGE, help="Optuna storage holding one study per shape."),
    backend: str = typer.Option("gpu", help="gpu or replay."),
    replay: Path | None = typer.Option(None, help="Recorded-measurements file for --backend replay."),
    arch: str = typer.Option("sm_90a", help="Target arch for --backend replay."),
    gpu: int | None = typer.Option(None, help="GPU index."),
    jobs: int | None = typer.Option(None, help="Parallel nvcc jobs."),
    seed: int | None = typer.Option(None, help="Sampler seed."),
    output: Path | None = typer.Option(None, "-o", "--output", help="Also write the best configs JSON here."),
    accumulate: str = AccumulateOpt,
    confirm: int = ConfirmOpt,
    confirm_runs: int = ConfirmRunsOpt,
) -> None:
    """Tune every shape of the file's shape lists, cheapest first, one study per shape, resumable;
    confirm each shape's best few in fresh runs."""
    import optuna

    from tuner.export import export_studies, write_json
    from tuner.search import evaluated_trials, existing_study, hang_timeout_s, measured_trials, study_name
    from tuner.search import tune as run_tune
    from tuner.space import load_space
    from tuner.storage import open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = load_space(space_file)
    names = [n.strip() for n in shapes.split(",") if n.strip()]
    if not names:
        raise UserError(f"--shapes {shapes!r} names no shape list; lists: {', '.join(space.shapes) or 'none'}")
    missing = [n for n in names if n not in space.shapes]
    if missing:
        raise UserError(f"{space_file}: no shape list {missing[0]!r}; lists: {', '.join(space.shapes) or 'none'}")
    todo = sorted(dict.fromkeys(s for n in names for s in space.shapes[n]), key=lambda s: (s.flops, str(s)))
    Path("runs").mkdir(exist_ok=True)
    be = _make_backend(backend, replay, arch, gpu, Path("runs") / "worker.log")
    fams = _families_for(space, families, be.target, be, _accumulate(accumulate))
    if be.simulated:
        console.print("[yellow]SIMULATED[/]: replaying recorded measurements, no GPU runs.")
    backing = open_storage(storage)
    deadline = time.perf_counter() + budget if budget else None
    done_studies, skipped = [], []
    with _measuring(be, jobs, "run the same sweep to continue.") as pool, _progress() as bar:
        over = bar.add_task("shapes", total=len(todo), status="")
        inner = bar.add_task("trials", total=trials_per_shape, status="")
        for shp in todo:
            if deadline and time.perf_counter() > deadline:
                break
            name = study_name(shp, [space.family(f) for f in fams], be.target.arch, accumulate=accumulate)
            st = existing_study(name, backing)  # created by run_tune only: a skipped shape leaves no study
            if st is not None and (evaluated_trials(st) >= trials_per_shape
                                   or st.user_attrs.get("sweep_done_trials", 0) >= trials_per_shape):
                _confirm(space, st, be, pool, confirm, confirm_runs, bar=(bar, inner))  # unless it holds
                done_studies.append(st)  # finished in an earlier run
                bar.advance(over)
                continue
            try:
                baselines = be.baseline(shp, accumulate)
            except UserError as exc:
                skipped.append((str(shp), str(exc)))
                bar.advance(over)
                continue
            bar.update(over, status=str(shp))
            bar.reset(inner, total=trials_per_shape)
            left = deadline - time.perf_counter() if deadline else None
            limit = min(x for x in (time_per_shape, left) if x) if (time_per_shape or left) else None

            def on_progress(p, rec) -> None:
                best = f"best {p.best_us:.2f} us" if p.best_us else "no verified kernel yet"
                bar.update(inner, completed=min(p.done, trials_per_shape), status=f"{best} | failed {p.failed}")

            st = run_tune(space, fams, shp, be, trials=trials_per_shape, sampler=sampler, storage=storage,
                          name=name, seed=seed, timeout_s=limit, pool=pool, on_progress=on_progress,
                          warm_start=_nearest_winners(storage, shp, fams), patience=patience or None,
                          eval_timeout_s=hang_timeout_s(baselines["cublas"]), accumulate=accumulate)
            if evaluated_trials(st) and not (deadline and time.perf_counter() >= deadline):
                # Stopped by its count, patience or its own time box: done at this trial budget.
                st.set_user_attr("sweep_done_trials", trials_per_shape)
                _confirm(space, st, be, pool, confirm, confirm_runs, bar=(bar, inner))
            done_studies.append(st)
            bar.advance(over)
    data = export_studies(done_studies)
    # The export's pick: our kernel only where it beat the vendor library, else cuBLAS.
    picks = {e.get("shape"): e.get("pick") for e in data.get("entries", [])}
    exported = {e["study"]: e for e in data["entries"]}
    table = Table("shape", "best family", "us", "TFLOP/s", "cuBLAS us", "vs cuBLAS", "pick", "trials", "confirmed",
                  title="sweep" + ("  [SIMULATED]" if be.simulated else ""))
    for st in done_studies:
        e = exported.get(st.study_name, {})
        shp_s = st.user_attrs.get("shape", "?")
        conf = e.get("confirm")
        table.add_row(shp_s, e.get("family", "-"), _fmt(e.get("time_us"), ".2f"), _fmt(e.get("tflops"), ".1f"),
                      _fmt(e.get("baselines_us", {}).get("cublas"), ".2f"),
                      _fmt(e.get("speedup", {}).get("cublas"), ".3f"),
                      str(picks.get(shp_s, "-")), str(measured_trials(st)),
                      "-" if not conf else (f"{conf['runs']} runs" if conf["verified"] else "[red]failed[/]"))
    out_console.print(table)
    for shp_s, why in skipped:
        console.print(f"[yellow]skipped {shp_s}[/]: {why}")
    ours = sum(1 for p in picks.values() if p not in (None, "cublas"))
    if picks:
        console.print(f"our kernel is the pick for {ours} of {len(picks)} shapes; cuBLAS for the rest")
    path = write_json(data, Path("runs") / "sweep.json")
    if output:
        write_json(data, output)
    left = len(todo) - len(done_studies) - len(skipped)
    console.print(f"{len(done_studies)} shapes tuned, {len(skipped)} skipped, {left} left for a later run; "
                  f"JSON: {path}" + (f" and {output}" if output else ""))


@app.command()
def record(
    storage: str = typer.Argument(DEFAULT_STORAGE, help="Storage whose real (GPU) trials to write out."),
    output: Path = typer.Option(..., "-o", "--output", help="Replay file (JSON lines) to write."),
) -> None:
    """Write a storage's real GPU measurements as a replay file for --backend replay."""
    from tuner.bench import records_from_study
    from tuner.export import load_studies

    lines = [json.dumps(r) for st in load_studies(storage) for r in records_from_study(st)]
    output.write_text("".join(line + "\n" for line in lines))
    console.print(f"{len(lines)} records -> {output}")


@app.command()
def render(
    family: str = typer.Option(..., "--family", "-f", help="Kernel family (see space.yaml)."),
    shape: str = typer.Option("4096x4096x8192", "--shape", "-s", help="Shape the config is checked against."),
    sets: list[str] = typer.Option([], "--set", help="KNOB=VALUE; unset knobs take the family default."),
    arch: str = typer.Option("sm_90a", help="Target arch."),
    space_file: Path = SpaceOpt,
) -> None:
    """Print the CUDA source of one config, as the tuner would build it."""
    from tuner.render import render as render_source
    from tuner.shapes import parse_shape
    from tuner.space import load_space
    from tuner.target import target_for_arch

    space = load_space(space_file)
    fam = space.family(family)
    config = fam.complete(_parse_sets(sets))
    target = target_for_arch(arch)
    why = fam.violations(config, parse_shape(shape), target)
    if why:
        raise UserError(f"config rejected for {shape} on {arch}: {'; '.join(why)}")
    launch = fam.launch_geometry(config, parse_shape(shape), target)
    where = (f"grid={launch.grid} block={launch.block} smem={launch.smem}" if launch
             else "set by the library's host code (artifact: library)")
    console.print(f"// launch: {where} "
                  f"runtime knobs: {{{', '.join(f'{k.name}={config[k.name]}' for k in fam.runtime_knobs)}}}")
    sys.stdout.write(render_source(fam, config, arch))


@app.command()
def show(
    shape: str | None = typer.Option(None, "--shape", "-s", help="Show the best trial of this shape's study."),
    study: str | None = typer.Option(None, help="Study name (see `hgemm-tune studies`)."),
    trial: int | None = typer.Option(None, help="Trial number (default: the exported one)."),
    storage: str = typer.Option(DEFAULT_STORAGE, help="Optuna storage URL."),
    space_file: Path = SpaceOpt,
) -> None:
    """Print the CUDA source of a finished trial (by default the one export takes: the confirmed
    winner, else the in-study best)."""
    from tuner.export import exported_trial, load_studies
    from tuner.render import render as render_source
    from tuner.render import source_hash
    from tuner.space import load_space

    studies = load_studies(storage, [study] if study else None)
    if shape and not study:
        from tuner.shapes import parse_shape

        want = str(parse_shape(shape))
        studies = [s for s in studies if s.user_attrs.get("shape") == want]
    if len(studies) != 1:
        names = ", ".join(s.study_name for s in studies) or "none"
        raise UserError(f"pick one study with --study (matching: {names})")
    st = studies[0]
    if trial is not None and not 0 <= trial < len(st.trials):
        raise UserError(f"study {st.study_name} has no trial {trial} (it has 0..{len(st.trials) - 1})")
    t = st.trials[trial] if trial is not None else exported_trial(st)[0]
    if t is None or "family" not in t.user_attrs or "config" not in t.user_attrs:
        raise UserError(f"study {st.study_name}: no kernel to show for "
                        + (f"trial {trial} (a duplicate or interrupted trial)" if trial is not None else "its best"))
    a = t.user_attrs
    fam = load_space(space_file).family(a["family"])
    source = render_source(fam, fam.complete_stored(a["config"]), st.user_attrs["target"]["arch"],
                           accumulate=st.user_attrs.get("accumulate", "fp32"))
    if a.get("source_hash") and source_hash(source) != a["source_hash"]:
        console.print("[yellow]warning[/]: the template changed since this trial ran; this is today's rendering")
    console.print(f"// trial {t.number}: {a.get('status')} {a.get('time_us')} us, variant {a.get('variant')}")
    sys.stdout.write(source)


@app.command()
def studies(storage: str = typer.Option(DEFAULT_STORAGE, help="Optuna storage URL.")) -> None:
    """List the studies in a storage with their best time (in-study) and what export takes."""
    from tuner.export import best_trial, exported_trial, load_studies

    table = Table("study", "trials", "best us", "TFLOP/s", "vs cuBLAS", "exported")
    for st in load_studies(storage):
        b = best_trial(st)
        t, confirmed = exported_trial(st)
        if confirmed is not None:
            what = (f"#{t.number}: {confirmed['median_us']:.2f} us, median of {confirmed['runs']} confirm runs"
                    if confirmed["median_us"] is not None else f"cuBLAS (#{t.number} failed confirmation)")
        else:
            what = f"#{t.number} (unconfirmed)" if t else "-"
        table.add_row(st.study_name, str(len(st.trials)), _fmt(b.value if b else None, ".2f"),
                      _fmt(b.user_attrs.get("tflops") if b else None, ".1f"),
                      _fmt(b.user_attrs.get("speedup_cublas") if b else None, ".3f"), what)
    out_console.print(table)


@app.command()
def export(
    storage: str = typer.Argument(DEFAULT_STORAGE, help="Optuna storage URL holding the studies."),
    output: Path = typer.Option(Path("best.json"), "-o", "--output", help="JSON file to write."),
    study: list[str] = typer.Option([], help="Only these studies (default: all)."),
) -> None:
    """Write the best verified config of every study as JSON (the confirmed winner where the
    study's confirmation holds, else its in-study best)."""
    from tuner.export import export_studies, load_studies, write_json

    data = export_studies(load_studies(storage, study or None))
    write_json(data, output)
    console.print(f"{len(data['entries'])} entries -> {output}" + ("  [SIMULATED]" if data["simulated"] else ""))


@app.command()
def report(
    source: str = typer.Argument("runs/sweep.json", help="An export JSON file, a storage URL (sqlite:///...), "
                                                         "or the bench.json that `hgemm-tune bench` wrote."),
    out: Path = typer.Option(Path("runs/report"), "--out", help="Folder for the PNG plots and report.md."),
) -> None:
    """Plots (speedup vs FLOPs, heatmap over M x N, roofline, winners' knobs) and a table.

    Given a bench.json: speedup over every baseline (cuBLAS, cuBLASLt, cuBLASLt autotuned,
    torch) against FLOPs, offline and server mode side by side."""
    from tuner.export import export_studies, load_studies, read_json
    from tuner.report import write_bench_report, write_report

    is_url = "://" in source or source.startswith("journal:")
    bench = None if is_url else _bench_json(source)
    if bench is not None:
        files = write_bench_report(bench, out)
    else:
        data = export_studies(load_studies(source)) if is_url else read_json(source)
        files = write_report(data, out)
    if not files:
        raise UserError(f"{source}: no verified entries to report on")
    for f in files:
        console.print(f"wrote {f}")


def _bench_json(path: str) -> dict | None:
    """The file's data if it is `hgemm-tune bench` output (rows per mode), else None (an
    export, or a file read_json will report on)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "rows" in data and "modes" in data else None


_BENCH_HELP = (
    "Re-verify and time every exported kernel against cuBLAS, cuBLASLt and torch.matmul.\n\n"
    "For each shape of the export that was tuned on this GPU: rebuild the kernel from its template and "
    "knobs, verify it again (exact 0/1 inputs, random inputs against cuBLAS's own error, fp32 accumulation, "
    "NaN-poisoned output, guard bands), then time it with cuBLAS (cublasGemmEx), cuBLASLt (heuristic pick, "
    "and autotuned over its top 16) and torch.matmul (when torch is installed), interleaved in random order "
    "in one worker process, in each --mode.\n\n"
    "Writes, per shape and mode: our us, TFLOP/s, % of roofline, every baseline's us, the speedup over each "
    "(baseline us / ours us) and whether it verified; then the geomean speedup per baseline and mode "
    "(bench.csv, bench_geomean.csv, bench.md, bench.json under --out). A kernel that fails verification is "
    "a row saying why, never a win; a baseline that cannot be measured is named in the notes; entries tuned "
    "on another GPU are skipped and listed.\n\n"
    "Example: [bold]hgemm-tune bench runs/sweep.json --mode both --out runs/bench[/]\n\n"
    "Exit code 0 when every kernel verified and was timed, 1 when some did not, 2 for bad input (missing "
    "or invalid JSON, no entry for this GPU, no GPU, no nvcc)."
)


@app.command(help=_BENCH_HELP)
def bench(
    export_file: Path = typer.Argument(..., metavar="EXPORT_JSON",
                                       help="Export to re-measure: the JSON of `hgemm-tune export`, `sweep -o` "
                                            "or `tune -o` (validated against tuner/export_schema.json)."),
    mode: str = typer.Option("both", "--mode", "-m",
                             help="offline: CUDA graph of back-to-back launches (throughput, host overhead "
                                  "excluded); server: single launches, each after an L2 flush and a random "
                                  "20-500 us idle gap (cold, from idle); both."),
    out: Path = typer.Option(Path("runs/bench"), "--out", help="Folder for bench.csv, bench_geomean.csv, "
                                                                "bench.md and bench.json."),
    space_file: Path = SpaceOpt,
    gpu: int | None = typer.Option(None, help="GPU index (sets CUDA_VISIBLE_DEVICES for the worker)."),
    jobs: int | None = typer.Option(None, help="Parallel nvcc jobs (default: one per core)."),
    torch: bool = typer.Option(True, "--torch/--no-torch", help="Also time torch.matmul (when torch is installed)."),
) -> None:
    """Re-verify and time every exported kernel against cuBLAS, cuBLASLt and torch.matmul."""
    from rich.markup import escape

    from tuner import benchmark as bm
    from tuner.compile import CompilePool, cutlass_include, nvcc_path
    from tuner.export import read_json
    from tuner.space import load_space

    modes = bm.parse_modes(mode)
    data = read_json(export_file)
    if not data["entries"]:
        raise UserError(f"{export_file}: the export has no entries (no study had a verified kernel)")
    space = load_space(space_file)
    out.mkdir(parents=True, exist_ok=True)
    be = _make_backend("gpu", None, "sm_90a", gpu, out / "worker.log")
    pool = None
    try:
        chosen, skipped = bm.select_entries(data, be.target)
        if not chosen:
            gpus = sorted({e["gpu"] for e in data["entries"]})
            raise UserError(f"{export_file}: no entry for this GPU ({be.target.name}, {be.target.arch}); "
                            f"the export holds {', '.join(gpus)}")
        nvcc_path(), cutlass_include()  # missing toolchain: one clear error before any build
        pool = CompilePool(jobs)
        shapes = len({e["shape"] for e in chosen})
        console.print(f"{len(chosen)} kernel(s) over {shapes} shape(s) on {be.name}, modes {', '.join(modes)}"
                      + (f"; {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} skipped" if skipped else ""))
        with _progress() as bar:
            task = bar.add_task("bench", total=shapes, status="")

            def on_shape(i: int, n: int, shape: str, rows: list[dict]) -> None:
                ok = [r for r in rows if r["status"] == "ok" and r["speedup_cublas"]]
                status = (", ".join(f"{r['mode']} {r['speedup_cublas']:.3f}x vs cuBLAS" for r in ok)
                          if ok else "not verified/timed")
                bar.update(task, completed=i + 1, status=f"{shape}: {status}")

            builder = bm.Builder(space, be.target, pool)
            result = bm.run_benchmark(data, be, builder, modes, torch=torch, on_shape=on_shape)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: nothing written")
        raise typer.Exit(130) from None
    finally:
        be.close()
        if pool:
            pool.close()
    files = bm.write_outputs(result, out, str(export_file))
    table = Table(title=f"bench on {result['gpu']} ({result['arch']}): vs X = X us / ours us")
    for col in ("shape", "mode", "family", "ours us", "TFLOP/s", "cuBLAS us",
                *(f"vs {bm.LABELS[b]}" for b in bm.BASELINES), "verified"):
        table.add_column(col, justify="left" if col in ("shape", "mode", "family", "verified") else "right")
    for r in result["rows"]:
        verified = "yes" if r["status"] == "ok" else f"[red]{r['status']}[/]: {escape(str(r['reason']))}"
        table.add_row(r["shape"], r["mode"], r["family"], _fmt(r["ours_us"], ".2f"), _fmt(r["ours_tflops"], ".1f"),
                      _fmt(r["cublas_us"], ".2f"), *(_fmt(r[f"speedup_{b}"], ".3f") for b in bm.BASELINES), verified)
    out_console.print(table)
    geo = Table("baseline", *modes, title="geomean speedup (baseline us / ours us)")
    by = {(g["mode"], g["baseline"]): g for g in result["geomeans"]}
    for b in bm.BASELINES:
        geo.add_row(bm.LABELS[b], *(bm.geomean_text(by[(m, b)]) for m in modes))
    out_console.print(geo)
    for s in result["skipped"]:
        console.print(f"[yellow]skipped[/] {s['shape']} {s['family']}: {escape(s['reason'])}")
    unmeasured = sorted({f"{bm.LABELS[b]} ({v})" for n in result["notes"].values() for b, v in n.items()
                         if b in bm.BASELINES})
    for u in unmeasured:
        console.print(f"[yellow]baseline not measured[/]: {escape(u)}")
    console.print("wrote " + ", ".join(str(f) for f in files))
    if any(r["status"] != "ok" for r in result["rows"]):
        console.print("[red]some kernels did not verify or were not timed[/] (see the verified column)")
        raise typer.Exit(1)


@app.command()
def propose(
    family: str = typer.Option(..., "--family", "-f", help="Family whose template the LLM rewrites."),
    shape: list[str] = typer.Option(..., "--shape", "-s", help="Target shape(s) the child must win on."),
    rounds: int = typer.Option(1, min=1, help="Rounds; each round's failures are fed back to the next."),
    candidates: int = typer.Option(1, min=1, help="Proposals asked per round."),
    base_url: str | None = typer.Option(None, help="OpenAI-compatible endpoint (or OPENAI_BASE_URL)."),
    model: str | None = typer.Option(None, help="Model name (or OPENAI_MODEL)."),
    timeout: float = typer.Option(120.0, help="Seconds per LLM request: a deadline for the whole answer."),
    backend: str = typer.Option("auto", help="auto: the GPU if present, else compile-only; gpu; none."),
    trials: int = typer.Option(12, help="Trials of the short tune of parent and child per shape."),
    arch: str = typer.Option("sm_90a", help="Build target when no GPU is present."),
    storage: str = typer.Option(DEFAULT_STORAGE, help="Studies whose results and errors the prompt reports "
                                                      "(read only)."),
    space_file: Path = SpaceOpt,
    out: Path = typer.Option(Path("runs/proposals"), help="Where prompts, replies and outcomes are kept."),
    versions_dir: Path | None = typer.Option(None, help="Where an accepted child is written as a family version "
                                                        "(default: the family's templates folder)."),
) -> None:
    """Ask an LLM for a template improvement, validate it, and keep it only if it wins."""
    from rich.markup import escape

    from proposer.client import ChatClient
    from proposer.evidence import gather
    from proposer.loop import run_rounds
    from proposer.validate import terminal_safe
    from tuner.shapes import parse_shape
    from tuner.space import load_space

    space = load_space(space_file)
    if space.family(family).artifact != "cubin":
        # The static checks allow device code only (no host code, no launches): a library
        # family's host half could never pass them.
        raise UserError(f"propose rewrites device-code (cubin) families; {family} is a host+device library")
    shapes = [parse_shape(s) for s in shape]
    client = ChatClient(base_url, model, timeout_s=timeout)
    evidence = gather(storage, family, shapes)
    be = None
    if backend in ("auto", "gpu"):
        try:
            be = _make_backend("gpu", None, arch, None, Path("runs") / "worker.log")
        except UserError as exc:
            if backend == "gpu":
                raise
            console.print(f"[yellow]no GPU[/] ({escape(str(exc))}): proposals are validated up to nvcc only")
    target_arch = be.target.arch if be else arch
    try:
        outcomes = run_rounds(space, family, shapes, client, rounds=rounds, candidates=candidates, out_dir=out,
                              backend=be, arch=target_arch, trials=trials, evidence=evidence,
                              versions_dir=versions_dir,
                              log=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True))
    finally:
        if be:
            be.close()
    table = Table("proposal", "status", "reason", title=f"proposals for {family}")
    for o in outcomes:
        table.add_row(escape(terminal_safe(o.id)), o.status, escape(terminal_safe(o.reason, one_line=True)[:160]))
    out_console.print(table)
    if outcomes and all(o.status == "endpoint_error" for o in outcomes):
        # One plain line: the endpoint never gave a usable answer (unreachable, or no chat completion).
        print(f"error: the LLM endpoint never answered usefully: "
              f"{terminal_safe(outcomes[-1].reason, one_line=True)[:300]}", file=sys.stderr)
        raise typer.Exit(1)


@app.command()
def proposals(out: Path = typer.Option(Path("runs/proposals"), help="Folder of recorded proposals.")) -> None:
    """List recorded proposals, their outcomes and the family versions they became."""
    from rich.markup import escape

    from proposer.loop import list_proposals
    from proposer.validate import terminal_safe

    def cell(value, width: int = 80) -> str:  # outcome.json is a file: anything may be in it
        return escape(terminal_safe(str(value), one_line=True)[:width])

    table = Table("proposal", "round", "status", "version", "reason")
    for o in list_proposals(out):
        metrics = o.get("metrics") if isinstance(o.get("metrics"), dict) else {}
        table.add_row(cell(o["id"]), cell(o["round"]), cell(o["status"]), cell(metrics.get("version", "-")),
                      cell(o["reason"], 120))
    out_console.print(table)


@app.command()
def doctor() -> None:
    """Check the GPU, its arch, nvcc, the CUTLASS headers and cupy."""
    from tuner.compile import cutlass_include, cutlass_version, nvcc_path, nvcc_version

    table = Table("check", "status", "detail")
    ok = True

    def row(name: str, good: bool, detail: str, required: bool = True) -> None:
        nonlocal ok
        ok &= good or not required
        status = "[green]ok[/]" if good else ("[red]missing[/]" if required else "[yellow]optional[/]")
        table.add_row(name, status, detail)

    try:
        row("nvcc", True, f"{nvcc_path()} (CUDA {nvcc_version()})")
    except UserError as exc:
        row("nvcc", False, str(exc))
    try:
        row("CUTLASS/CuTe headers", True, f"{cutlass_include()} (nvidia-cutlass {cutlass_version()})")
    except UserError as exc:
        row("CUTLASS/CuTe headers", False, str(exc))
    try:
        import cupy

        row("cupy", True, cupy.__version__)
        try:
            from tuner.target import target_from_device

            props = cupy.cuda.runtime.getDeviceProperties(0)
            name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
            t = target_from_device(props, name)
            row("GPU", True, f"{name}: cc {t.cc}, build {t.arch}, {t.sm_count} SMs, "
                f"{t.max_smem // 1024} KiB smem/block, driver {cupy.cuda.runtime.driverGetVersion()}")
        except Exception as exc:  # noqa: BLE001 - any CUDA failure means: no usable GPU
            row("GPU", False, f"no usable CUDA device: {exc}")
    except ImportError:
        row("cupy", False, "pip install 'hgemm-tune\\[gpu]' (cupy-cuda13x) to measure on a GPU")
    for mod, why in (("optuna", "search"), ("nvmath", "cuBLASLt baselines"), ("openai", "LLM proposer")):
        try:
            m = __import__(mod)
            row(mod, True, getattr(m, "__version__", "installed"))
        except ImportError:
            row(mod, False, f"not installed ({why})", required=mod == "optuna")
    row("cpu cores", True, f"{os.cpu_count()} (one nvcc job each)")
    row("disk", True, f"{shutil.disk_usage('.').free // 2**30} GiB free here")
    out_console.print(table)
    if not ok:
        raise typer.Exit(1)


def main() -> None:
    # `hgemm-tune --shape ...` is `hgemm-tune tune --shape ...`.
    argv = sys.argv[1:]
    if argv and argv[0].startswith("-") and argv[0] not in ("--help", "-h"):
        sys.argv.insert(1, "tune")
    try:
        app(standalone_mode=True)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)  # one plain line: no wrapping, no markup
        sys.exit(2)


if __name__ == "__main__":
    main()

"""Commands that tune: `tune` (one shape), `worker` (join a study), `sweep` (shape lists)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from tuner import api
from tuner.cli import options as o
from tuner.cli.views import CliListener, console, fmt, out_console, summary_table
from tuner.measure.clocks import regime_text
from tuner.measure.regimes import steady_text


def _interrupted(hint: str) -> typer.Exit:
    console.print(f"[yellow]interrupted[/]: every finished trial is saved; {hint}")
    return typer.Exit(130)


def tune(
    shape: o.Shape,
    trials: Annotated[int, typer.Option("--trials", "-n", min=0,
                                        help="Measured trials the study should hold; a re-run resumes up to this.")
                      ] = 100,
    families: o.Families = None,
    sampler: o.Sampler = "tpe",
    timeout: o.Timeout = None,
    storage: o.Storage = o.DEFAULT_STORAGE,
    study: Annotated[str | None, typer.Option(help="Study name (default: derived from shape, families, arch).")
                     ] = None,
    backend: o.Backend = "gpu",
    replay: o.Replay = None,
    arch: o.Arch = "sm_90a",
    gpu: o.Gpu = None,
    workers: Annotated[int, typer.Option(min=1, help="Worker processes on this study (one per GPU, round robin).")
                       ] = 1,
    jobs: o.Jobs = None,
    seed: o.Seed = None,
    record: o.Record = None,
    space_file: o.SpaceFile = None,
    output: o.Output = None,
    accumulate: o.Accumulate = "fp32",
    confirm: o.Confirm = 3,
    confirm_runs: o.ConfirmRuns = 3,
    catalogue: o.Catalogue = None,
    catalogue_top: o.CatalogueTop = None,
    catalogue_out: o.CatalogueGrow = None,
    rank_by: o.RankBy = "model",
    objective: o.Objective = "sustained",
    batch: o.Batch = None,
) -> None:
    """Tune one shape: sample configs, compile, verify, time against cuBLAS; confirm the best few
    in fresh runs; export the winner as JSON."""
    opts = api.Options(trials=trials, storage=storage, space_file=space_file, families=families,
                       sampler=sampler, seed=seed, timeout_s=timeout, backend=backend, replay=replay, arch=arch,
                       gpu=gpu, jobs=jobs, record=record, accumulate=accumulate, confirm_top=confirm,
                       confirm_runs=confirm_runs, catalogue=catalogue, catalogue_top=catalogue_top,
                       catalogue_out=catalogue_out, rank_by=rank_by, objective=objective, batch=batch)
    try:
        with CliListener() as listener:
            res = api.tune_shape(shape, opts, listener, study=study, output=output, workers=workers)
    except KeyboardInterrupt:
        raise _interrupted("run the same command to resume.") from None
    out_console.print(summary_table(res.study))
    rate = (f" ({res.measured - res.measured_before} this run, {res.trials_per_min:.1f} trials/min)"
            if res.trials_per_min else "")
    console.print(f"{res.seconds:.0f} s this run; study holds {res.measured} measured trials{rate}; "
                  + (f"best config JSON: {' and '.join(str(f) for f in res.files)}" if res.files
                     else "no export written"))
    _say_grown(res.grown, catalogue_out)
    if res.evaluated < trials and not timeout:
        console.print(f"[yellow]stopped at {res.evaluated} of {trials} trials[/]: the sampler proposed no new valid "
                      "config in many tries; the space (or what the sampler explores of it) is spent.")
    if not res.export["entries"]:
        console.print("[red]no candidate passed verification[/]")
        raise typer.Exit(1)


def worker(
    study: Annotated[str, typer.Option(help="Study to join (created by `hgemm-tune tune`).")],
    storage: o.Storage = o.DEFAULT_STORAGE,
    trials: Annotated[int | None, typer.Option(help="Stop when the study holds this many measured trials "
                                                    "(default: the target it was created with).")] = None,
    backend: o.Backend = "gpu",
    replay: o.Replay = None,
    arch: o.Arch = "sm_90a",
    gpu: o.Gpu = None,
    jobs: o.Jobs = None,
    sampler: o.Sampler = "tpe",
    timeout: o.Timeout = None,
    record: o.Record = None,
    space_file: o.SpaceFile = None,
    objective: o.JoinObjective = None,
) -> None:
    """Join a study as one more worker: ask, compile, measure, tell, until the study is full."""
    from tuner.search import measured_trials

    opts = api.Options(trials=trials or 0, storage=storage, space_file=space_file, sampler=sampler,
                       timeout_s=timeout, backend=backend, replay=replay, arch=arch, gpu=gpu, jobs=jobs,
                       record=record, objective=objective)
    try:
        with CliListener() as listener:
            st = api.join_study(study, opts, listener)
    except KeyboardInterrupt:
        raise _interrupted("run the same command to resume.") from None
    console.print(f"worker done: study holds {measured_trials(st)} measured trials")


def sweep(
    space_file: Annotated[Path | None, typer.Argument(
        help="Space file whose `shapes:` lists are tuned (default: the packaged space.yaml).")] = None,
    shapes: Annotated[str, typer.Option(help="Comma list of shape-list names in the file (e.g. subgrid27).")
                      ] = "default",
    trials_per_shape: Annotated[int, typer.Option(help="Measured trials per shape (resumes up to this).")] = 30,
    time_per_shape: Annotated[float | None, typer.Option(help="Seconds of search per shape at most.")] = None,
    budget: Annotated[float | None, typer.Option(
        help="Seconds for the whole sweep; unfinished shapes resume later.")] = None,
    patience: Annotated[int, typer.Option(min=0, help="Stop a shape after this many trials without a new best "
                                                      "(0: never, run every shape to --trials-per-shape).")] = 15,
    families: o.Families = None,
    sampler: o.Sampler = "tpe",
    storage: o.Storage = o.DEFAULT_STORAGE,
    backend: o.Backend = "gpu",
    replay: o.Replay = None,
    arch: o.Arch = "sm_90a",
    gpu: o.Gpu = None,
    jobs: o.Jobs = None,
    seed: o.Seed = None,
    output: o.Output = None,
    accumulate: o.Accumulate = "fp32",
    confirm: o.Confirm = 3,
    confirm_runs: o.ConfirmRuns = 3,
    catalogue: o.Catalogue = None,
    catalogue_top: o.CatalogueTop = None,
    catalogue_out: o.CatalogueGrow = None,
    rank_by: o.RankBy = "model",
    objective: o.Objective = "sustained",
    batch: o.Batch = None,
) -> None:
    """Tune every shape of the file's shape lists, cheapest first, one study per shape, resumable;
    confirm each shape's best few in fresh runs."""
    from tuner.search import measured_trials
    from tuner.search.records import study_shape

    opts = api.Options(trials=trials_per_shape, storage=storage, space_file=space_file, families=families,
                       sampler=sampler, seed=seed, backend=backend, replay=replay, arch=arch, gpu=gpu, jobs=jobs,
                       accumulate=accumulate, confirm_top=confirm, confirm_runs=confirm_runs, catalogue=catalogue,
                       catalogue_top=catalogue_top, catalogue_out=catalogue_out, rank_by=rank_by, objective=objective,
                       batch=batch)
    try:
        with CliListener(sweep=True) as listener:
            res = api.sweep(opts, shapes, time_per_shape=time_per_shape,
                            budget_s=budget, patience=patience, output=output, listener=listener)
    except KeyboardInterrupt:
        raise _interrupted("run the same sweep to continue.") from None
    # The export's pick: our kernel only where it beat the vendor library, else cuBLAS.
    picks = {e.get("shape"): e.get("pick") for e in res.export["entries"]}
    exported = {e["study"]: e for e in res.export["entries"]}
    table = Table("shape", "best family", "us", "TFLOP/s", "cuBLAS us", "vs cuBLAS", "clock regime", "steady", "pick",
                  "trials", "confirmed", title=f"sweep, {opts.objective} time" + ("  [SIMULATED]" if backend == "replay"
                                                                                  else ""))
    for st in res.studies:
        e = exported.get(st.study_name, {})
        shp = study_shape(st) or "?"
        conf = e.get("confirm")
        table.add_row(shp, e.get("family", "-"), fmt(e.get("time_us"), ".2f"), fmt(e.get("tflops"), ".1f"),
                      fmt(e.get("baselines_us", {}).get("cublas"), ".2f"),
                      fmt(e.get("speedup", {}).get("cublas"), ".3f"),
                      escape(regime_text(e.get("clocks"))) if e else "-",
                      steady_text(e.get("steady_state")) if e else "-", str(picks.get(shp, "-")),
                      str(measured_trials(st)),
                      "-" if not conf else (f"{conf['runs']} runs" if conf["verified"] else "[red]failed[/]"))
    out_console.print(table)
    for shp, why in res.skipped:
        console.print(f"[yellow]skipped {shp}[/]: {escape(why)}")
    ours = sum(1 for p in picks.values() if p not in (None, "cublas"))
    if picks:
        console.print(f"our kernel is the pick for {ours} of {len(picks)} shapes; cuBLAS for the rest")
    left = res.shapes - len(res.studies) - len(res.skipped)
    if res.searched:
        shapes_min, trials_min = res.rates()
        console.print(f"this run: {res.searched} shapes searched, {res.new_trials} trials measured in "
                      f"{res.seconds:.0f} s ({shapes_min:.1f} shapes/min, {trials_min:.0f} trials/min, "
                      "confirmation included)")
    console.print(f"{len(res.studies)} shapes tuned, {len(res.skipped)} skipped, {left} left for a later run; "
                  + (f"JSON: {' and '.join(str(f) for f in res.files)}" if res.files else "no export written"))
    _say_grown(res.grown, catalogue_out)


def _say_grown(grown, path: Path | None) -> None:
    """One line for --catalogue-out: what joined the catalogue, or why nothing was written."""
    if path is None:
        return
    if grown is None:
        console.print(f"--catalogue-out {path}: not written (the export holds no verified kernel of ours)")
        return
    cat, joined = grown.catalogue, grown.compiled + grown.from_cache
    console.print(f"catalogue {cat.path}: {len(cat.kernels)} kernels (digest {cat.digest[:16]}); "
                  f"{joined} winner{'s' * (joined != 1)} joined ({grown.from_cache} from the compile cache, "
                  f"{grown.compiled} compiled), {grown.reused} already held"
                  + (f"; [red]{len(grown.failed)} failed to build[/], first {grown.failed[0][0].family} "
                     f"{escape(json.dumps(grown.failed[0][0].config, separators=(',', ':')))}: "
                     f"{escape(grown.failed[0][1][:200])}" if grown.failed else ""))

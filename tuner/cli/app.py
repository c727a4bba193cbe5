"""hgemm-tune's commands: each parses its options, calls tuner.api (or a stage's public
function) and prints. No tuning logic lives here.

    hgemm-tune --shape 4096x4096x8192 --trials 500     # tune one shape (same as `tune`)
    hgemm-tune sweep --shapes subgrid27                # every shape of a list in the space file
    hgemm-tune bench runs/sweep.json --repeats 3       # re-verify and time an export vs the vendors
    hgemm-tune doctor                                  # GPU, arch, nvcc, headers, space, templates
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from tuner import api
from tuner.cli import options as o
from tuner.cli.views import CliListener, console, fmt, out_console, progress_bar, summary_table
from tuner.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="rich",
                  pretty_exceptions_enable=False,
                  help="Find, verify and export the fastest fp16 GEMM kernel per shape on your NVIDIA GPU.")


def _parse_sets(sets: list[str]) -> dict:
    config: dict = {}
    for item in sets:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected KNOB=VALUE")
        key, value = item.split("=", 1)
        try:
            config[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            config[key.strip()] = value.strip()
    return config


def _interrupted(hint: str) -> typer.Exit:
    console.print(f"[yellow]interrupted[/]: every finished trial is saved; {hint}")
    return typer.Exit(130)


@app.command()
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
) -> None:
    """Tune one shape: sample configs, compile, verify, time against cuBLAS; confirm the best few
    in fresh runs; export the winner as JSON."""
    opts = api.Options(trials=trials, storage=storage, space_file=space_file, families=families,
                       sampler=sampler, seed=seed, timeout_s=timeout, backend=backend, replay=replay, arch=arch,
                       gpu=gpu, jobs=jobs, record=record, accumulate=accumulate, confirm_top=confirm,
                       confirm_runs=confirm_runs)
    try:
        with CliListener() as listener:
            res = api.tune_shape(shape, opts, listener, study=study, output=output, workers=workers)
    except KeyboardInterrupt:
        raise _interrupted("run the same command to resume.") from None
    out_console.print(summary_table(res.study))
    rate = (f" ({res.measured - res.measured_before} this run, {res.trials_per_min:.1f} trials/min)"
            if res.trials_per_min else "")
    console.print(f"{res.seconds:.0f} s this run; study holds {res.measured} measured trials{rate}; "
                  f"best config JSON: {' and '.join(str(f) for f in res.files)}")
    if res.evaluated < trials and not timeout:
        console.print(f"[yellow]stopped at {res.evaluated} of {trials} trials[/]: the sampler proposed no new valid "
                      "config in many tries; the space (or what the sampler explores of it) is spent.")
    if not res.export["entries"]:
        console.print("[red]no candidate passed verification[/]")
        raise typer.Exit(1)


@app.command()
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
) -> None:
    """Join a study as one more worker: ask, compile, measure, tell, until the study is full."""
    from tuner.search import measured_trials

    opts = api.Options(trials=trials or 0, storage=storage, space_file=space_file, sampler=sampler,
                       timeout_s=timeout, backend=backend, replay=replay, arch=arch, gpu=gpu, jobs=jobs,
                       record=record)
    try:
        with CliListener() as listener:
            st = api.join_study(study, opts, listener)
    except KeyboardInterrupt:
        raise _interrupted("run the same command to resume.") from None
    console.print(f"worker done: study holds {measured_trials(st)} measured trials")


@app.command()
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
) -> None:
    """Tune every shape of the file's shape lists, cheapest first, one study per shape, resumable;
    confirm each shape's best few in fresh runs."""
    from tuner.search import measured_trials

    opts = api.Options(trials=trials_per_shape, storage=storage, space_file=space_file, families=families,
                       sampler=sampler, seed=seed, backend=backend, replay=replay, arch=arch, gpu=gpu, jobs=jobs,
                       accumulate=accumulate, confirm_top=confirm, confirm_runs=confirm_runs)
    try:
        with CliListener(sweep=True) as listener:
            res = api.sweep(opts, shapes, time_per_shape=time_per_shape,
                            budget_s=budget, patience=patience, output=output, listener=listener)
    except KeyboardInterrupt:
        raise _interrupted("run the same sweep to continue.") from None
    # The export's pick: our kernel only where it beat the vendor library, else cuBLAS.
    picks = {e.get("shape"): e.get("pick") for e in res.export["entries"]}
    exported = {e["study"]: e for e in res.export["entries"]}
    table = Table("shape", "best family", "us", "TFLOP/s", "cuBLAS us", "vs cuBLAS", "pick", "trials", "confirmed",
                  title="sweep" + ("  [SIMULATED]" if backend == "replay" else ""))
    for st in res.studies:
        e = exported.get(st.study_name, {})
        shp = st.user_attrs.get("shape", "?")
        conf = e.get("confirm")
        table.add_row(shp, e.get("family", "-"), fmt(e.get("time_us"), ".2f"), fmt(e.get("tflops"), ".1f"),
                      fmt(e.get("baselines_us", {}).get("cublas"), ".2f"),
                      fmt(e.get("speedup", {}).get("cublas"), ".3f"),
                      str(picks.get(shp, "-")), str(measured_trials(st)),
                      "-" if not conf else (f"{conf['runs']} runs" if conf["verified"] else "[red]failed[/]"))
    out_console.print(table)
    for shp, why in res.skipped:
        console.print(f"[yellow]skipped {shp}[/]: {escape(why)}")
    ours = sum(1 for p in picks.values() if p not in (None, "cublas"))
    if picks:
        console.print(f"our kernel is the pick for {ours} of {len(picks)} shapes; cuBLAS for the rest")
    left = res.shapes - len(res.studies) - len(res.skipped)
    console.print(f"{len(res.studies)} shapes tuned, {len(res.skipped)} skipped, {left} left for a later run; "
                  f"JSON: {' and '.join(str(f) for f in res.files)}")


@app.command()
def record(
    output: Annotated[Path, typer.Option("-o", "--output", help="Replay file (JSON lines) to write.")],
    storage: Annotated[str, typer.Argument(help="Storage whose real (GPU) trials to write out.")] = o.DEFAULT_STORAGE,
) -> None:
    """Write a storage's real GPU measurements as a replay file for --backend replay."""
    from tuner.search import load_studies
    from tuner.search.studies import replay_records

    lines = [json.dumps(r) for st in load_studies(storage) for r in replay_records(st)]
    output.write_text("".join(line + "\n" for line in lines))
    console.print(f"{len(lines)} records -> {output}")


@app.command()
def render(
    family: Annotated[str, typer.Option("--family", "-f", help="Kernel family (see space.yaml).")],
    shape: Annotated[str, typer.Option("--shape", "-s", help="Shape the config is checked against.")
                     ] = "4096x4096x8192",
    sets: Annotated[list[str] | None, typer.Option(
        "--set", help="KNOB=VALUE; unset knobs take the family default.")] = None,
    arch: o.Arch = "sm_90a",
    space_file: o.SpaceFile = None,
) -> None:
    """Print the CUDA source of one config, as the tuner would build it."""
    from tuner.build import render as render_source
    from tuner.space import load_space, parse_shape, target_for_arch

    fam = load_space(space_file).family(family)
    config = fam.complete(_parse_sets(sets or []))
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
    shape: Annotated[str | None, typer.Option("--shape", "-s", help="Show the best trial of this shape's study.")
                     ] = None,
    study: o.Study = None,
    trial: Annotated[int | None, typer.Option(help="Trial number (default: the exported one).")] = None,
    storage: o.Storage = o.DEFAULT_STORAGE,
    space_file: o.SpaceFile = None,
) -> None:
    """Print the CUDA source of a finished trial (by default the one export takes: the confirmed
    winner, else the in-study best)."""
    from tuner.build import render as render_source
    from tuner.build import source_hash
    from tuner.results.export import exported_trial
    from tuner.search import StudyMeta, TrialRecord, load_studies
    from tuner.space import load_space, parse_shape

    studies = load_studies(storage, [study] if study else None)
    if shape and not study:
        want = str(parse_shape(shape))
        studies = [s for s in studies if s.user_attrs.get("shape") == want]
    if len(studies) != 1:
        names = ", ".join(s.study_name for s in studies) or "none"
        raise UserError(f"pick one study with --study (matching: {names})")
    st = studies[0]
    if trial is not None and not 0 <= trial < len(st.trials):
        raise UserError(f"study {st.study_name} has no trial {trial} (it has 0..{len(st.trials) - 1})")
    t = st.trials[trial] if trial is not None else exported_trial(st)[0]
    rec = TrialRecord.of(t) if t is not None else None
    if rec is None or not rec.family or "config" not in t.user_attrs:
        raise UserError(f"study {st.study_name}: no kernel to show for "
                        + (f"trial {trial} (a duplicate or interrupted trial)" if trial is not None else "its best"))
    meta = StudyMeta.of(st)
    fam = load_space(space_file).family(rec.family)
    source = render_source(fam, fam.complete_stored(rec.config), meta.target_record.arch, accumulate=meta.accumulate)
    if rec.source_hash and source_hash(source) != rec.source_hash:
        console.print("[yellow]warning[/]: the template changed since this trial ran; this is today's rendering")
    console.print(f"// trial {t.number}: {rec.status} {rec.time_us} us, variant {rec.variant or None}")
    sys.stdout.write(source)


@app.command()
def studies(storage: o.Storage = o.DEFAULT_STORAGE) -> None:
    """List the studies in a storage with their best time (in-study) and what export takes."""
    from tuner.results.export import exported_trial
    from tuner.search import TrialRecord, best_trial, load_studies

    table = Table("study", "trials", "best us", "TFLOP/s", "vs cuBLAS", "exported")
    for st in load_studies(storage):
        b = best_trial(st)
        rb = TrialRecord.of(b) if b else None
        t, confirmed = exported_trial(st)
        if confirmed is not None:
            what = (f"#{t.number}: {confirmed['median_us']:.2f} us, median of {confirmed['runs']} confirm runs"
                    if confirmed["median_us"] is not None else f"cuBLAS (#{t.number} failed confirmation)")
        else:
            what = f"#{t.number} (unconfirmed)" if t else "-"
        table.add_row(st.study_name, str(len(st.trials)), fmt(b.value if b else None, ".2f"),
                      fmt(rb.tflops if rb else None, ".1f"), fmt(rb.speedup_cublas if rb else None, ".3f"), what)
    out_console.print(table)


@app.command()
def export(
    storage: Annotated[str, typer.Argument(help="Optuna storage URL holding the studies.")] = o.DEFAULT_STORAGE,
    output: Annotated[Path, typer.Option("-o", "--output", help="JSON file to write.")] = Path("best.json"),
    study: Annotated[list[str] | None, typer.Option(help="Only these studies (default: all).")] = None,
) -> None:
    """Write the best verified config of every study as JSON (the confirmed winner where the
    study's confirmation holds, else its in-study best)."""
    from tuner.results import write_json
    from tuner.results.export import export_studies
    from tuner.search import load_studies

    data = export_studies(load_studies(storage, study or None))
    write_json(data, output)
    console.print(f"{len(data['entries'])} entries -> {output}" + ("  [SIMULATED]" if data["simulated"] else ""))


@app.command()
def report(
    source: Annotated[str, typer.Argument(help="An export JSON file, a storage URL (sqlite:///...), or the "
                                               "bench.json that `hgemm-tune bench` wrote.")] = "runs/sweep.json",
    out: Annotated[Path, typer.Option("--out", help="Folder for the PNG plots and report.md.")] = Path("runs/report"),
) -> None:
    """Plots (speedup vs FLOPs, heatmap over M x N, roofline, winners' knobs) and a table.

    Given a bench.json: speedup over every baseline (cuBLAS, cuBLASLt, cuBLASLt autotuned,
    torch) against FLOPs, offline and server mode side by side."""
    from tuner.results import read_json
    from tuner.results.export import export_studies
    from tuner.results.report import write_bench_report, write_report
    from tuner.search import load_studies

    is_url = "://" in source or source.startswith("journal:")
    bench_data = None if is_url else _bench_json(source)
    if bench_data is not None:
        files = write_bench_report(bench_data, out)
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
    "in one worker process, in each --mode. With --repeats R, R such runs per shape, each in a fresh worker "
    "process: median times, the median of the per-run ratios and their range.\n\n"
    "Writes, per shape and mode: our us, TFLOP/s, % of roofline, every baseline's us, the speedup over each "
    "(baseline us / ours us) and whether it verified; then the geomean speedup per baseline and mode "
    "(bench.csv, bench_geomean.csv, bench.md, bench.json under --out). A kernel that fails verification is "
    "a row saying why, never a win; a baseline that cannot be measured is named in the notes; entries tuned "
    "on another GPU are skipped and listed.\n\n"
    "Example: [bold]hgemm-tune bench runs/sweep.json --mode both --repeats 3 --out runs/bench[/]\n\n"
    "Exit code 0 when every kernel verified and was timed, 1 when some did not, 2 for bad input (missing "
    "or invalid JSON, no entry for this GPU, no GPU, no nvcc)."
)


@app.command(help=_BENCH_HELP)
def bench(
    export_file: Annotated[Path, typer.Argument(
        metavar="EXPORT_JSON", help="Export to re-measure: the JSON of `hgemm-tune export`, `sweep -o` or "
                                    "`tune -o` (validated against tuner/results/export_schema.json).")],
    mode: Annotated[str, typer.Option("--mode", "-m", help="offline: CUDA graph of back-to-back launches "
                                      "(throughput, host overhead excluded); server: single launches, each after an "
                                      "L2 flush and a random 20-500 us idle gap (cold, from idle); both.")] = "both",
    repeats: Annotated[int, typer.Option("--repeats", "-r", min=1, help="Runs per shape, each in a fresh worker "
                                                                        "process (median and range).")] = 1,
    out: Annotated[Path, typer.Option("--out", help="Folder for bench.csv, bench_geomean.csv, bench.md and "
                                                    "bench.json.")] = Path("runs/bench"),
    space_file: o.SpaceFile = None,
    gpu: o.Gpu = None,
    jobs: o.Jobs = None,
    torch: Annotated[bool, typer.Option("--torch/--no-torch", help="Also time torch.matmul (when installed).")
                     ] = True,
) -> None:
    from tuner.results import bench as bm

    modes = bm.parse_modes(mode)
    opts = api.Options(space_file=space_file, gpu=gpu, jobs=jobs)
    bar = progress_bar()
    task = bar.add_task("bench", total=None, status="", start=False)

    def on_start(backend: str, shapes: int) -> None:  # inputs checked, the GPU is up: the work starts
        console.print(f"{shapes} shape(s) on {backend}, modes {', '.join(modes)}"
                      + (f", {repeats} runs each" if repeats > 1 else ""))
        bar.start()
        bar.start_task(task)
        bar.update(task, total=shapes)

    def on_shape(i: int, n: int, shape: str, rows: list[dict]) -> None:
        ok = [r for r in rows if r["status"] == "ok" and r["speedup_cublas"]]
        status = (", ".join(f"{r['mode']} {r['speedup_cublas']:.3f}x vs cuBLAS" for r in ok)
                  if ok else "not verified/timed")
        bar.update(task, completed=i + 1, status=f"{shape}: {status}")

    try:
        result, files = api.bench(export_file, modes, opts, out=out, torch=torch, repeats=repeats,
                                  on_start=on_start, on_shape=on_shape)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: nothing written")
        raise typer.Exit(130) from None
    finally:
        bar.stop()
    runs = f", {repeats} runs each" if repeats > 1 else ""
    table = Table(title=f"bench on {result['gpu']} ({result['arch']}){runs}: vs X = X us / ours us")
    for col in ("shape", "mode", "family", "ours us", "TFLOP/s", "cuBLAS us",
                *(f"vs {bm.LABELS[b]}" for b in bm.BASELINES), "verified"):
        table.add_column(col, justify="left" if col in ("shape", "mode", "family", "verified") else "right")
    for r in result["rows"]:
        verified = "yes" if r["status"] == "ok" else f"[red]{r['status']}[/]: {escape(str(r['reason']))}"
        table.add_row(r["shape"], r["mode"], r["family"], fmt(r["ours_us"], ".2f"), fmt(r["ours_tflops"], ".1f"),
                      fmt(r["cublas_us"], ".2f"), *(bm._speedup_cell(r, b) for b in bm.BASELINES), verified)
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
def prebuild(
    export_file: Annotated[Path | None, typer.Argument(
        metavar="[EXPORT_JSON]", help="Build the kernels of this export (for --arch).")] = None,
    shapes: Annotated[str | None, typer.Option(
        help="Comma list of MxNxK: build the configs a fresh study of each shape tries first (its seeds).")] = None,
    families: o.Families = None,
    arch: o.Arch = "sm_90a",
    space_file: o.SpaceFile = None,
    jobs: o.Jobs = None,
) -> None:
    """Compile kernels into the compile cache on a machine without a GPU.

    Build on a CPU machine, carry the cache (HGEMM_TUNE_CACHE) to the GPU machine, and its runs
    spend no GPU time waiting for nvcc on those builds. Prints each build's registers and spills.

    Example: [bold]hgemm-tune prebuild runs/sweep.json --shapes 4096x4096x8192 --arch sm_90a[/]"""
    from tuner.build.compile import DEFAULT_CACHE

    if export_file is None and not shapes:
        raise UserError("prebuild needs an export file, --shapes, or both")
    with progress_bar() as bar:
        task = bar.add_task("nvcc", total=None, status="")
        builds = api.prebuild(export_file, [s for s in (shapes or "").split(",") if s.strip()], arch,
                              api.Options(space_file=space_file, families=families, jobs=jobs),
                              on_done=lambda done, total: bar.update(task, total=total, completed=done))
    table = Table("kernel", "family", "registers", "spill bytes", "compile s", "status", title=f"prebuild for {arch}")
    for b in builds:
        table.add_row(b.label, b.family, fmt(b.result.registers, "d"), fmt(b.result.spill_bytes, "d"),
                      "cached" if b.result.cached else f"{b.result.seconds:.1f}",
                      "ok" if b.result.ok else f"[red]failed[/]: {escape((b.result.error or '')[:120])}")
    out_console.print(table)
    failed = sum(1 for b in builds if not b.result.ok)
    console.print(f"{len(builds) - failed} of {len(builds)} built into {DEFAULT_CACHE}")
    if failed:
        raise typer.Exit(1)


@app.command()
def propose(
    family: Annotated[str, typer.Option("--family", "-f", help="Family whose template the LLM rewrites.")],
    shape: Annotated[list[str], typer.Option("--shape", "-s", help="Target shape(s) the child must win on.")],
    rounds: Annotated[int, typer.Option(min=1, help="Rounds; each round's failures are fed back to the next.")] = 1,
    candidates: Annotated[int, typer.Option(min=1, help="Proposals asked per round.")] = 1,
    base_url: Annotated[str | None, typer.Option(help="OpenAI-compatible endpoint (or OPENAI_BASE_URL).")] = None,
    model: Annotated[str | None, typer.Option(help="Model name (or OPENAI_MODEL).")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds per LLM request.")] = 120.0,
    backend: Annotated[str, typer.Option(help="auto: the GPU if present, else compile-only; gpu; none.")] = "auto",
    trials: Annotated[int, typer.Option(help="Trials of the short tune of parent and child per shape.")] = 12,
    arch: o.Arch = "sm_90a",
    storage: Annotated[str, typer.Option(help="Studies whose results and errors the prompt reports (read only).")
                       ] = o.DEFAULT_STORAGE,
    space_file: o.SpaceFile = None,
    out: Annotated[Path, typer.Option(help="Where prompts, replies and outcomes are kept.")] = Path("runs/proposals"),
    versions_dir: Annotated[Path | None, typer.Option(
        help="Where an accepted child is written as a family version (default: the family's templates folder).")
    ] = None,
) -> None:
    """Ask an LLM for a template improvement, validate it, and keep it only if it wins."""
    from proposer.client import ChatClient
    from proposer.evidence import gather
    from proposer.loop import run_rounds
    from tuner.measure import GpuBackend
    from tuner.space import load_space, parse_shape

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
            be = GpuBackend(log_path=Path("runs") / "worker.log")
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
    for oc in outcomes:
        table.add_row(oc.id, oc.status, escape(oc.reason[:160]))
    out_console.print(table)


@app.command()
def proposals(out: Annotated[Path, typer.Option(help="Folder of recorded proposals.")] = Path("runs/proposals")
              ) -> None:
    """List recorded proposals, their outcomes and the family versions they became."""
    from proposer.loop import list_proposals

    table = Table("proposal", "round", "status", "version", "reason")
    for oc in list_proposals(out):
        table.add_row(oc["id"], str(oc["round"]), oc["status"], oc.get("metrics", {}).get("version", "-"),
                      escape(oc["reason"][:120]))
    out_console.print(table)


@app.command()
def doctor() -> None:
    """Check the GPU, its arch, nvcc, the CUTLASS headers, cupy, and the packaged space and templates."""
    from tuner.build import cutlass_include, cutlass_version, nvcc_path, nvcc_version
    from tuner.space import default_space_path, load_space

    table = Table("check", "status", "detail")
    ok = True

    def row(name: str, good: bool, detail: str, required: bool = True) -> None:
        nonlocal ok
        ok &= good or not required
        status = "[green]ok[/]" if good else ("[red]missing[/]" if required else "[yellow]optional[/]")
        table.add_row(name, status, escape(detail))

    try:
        space = load_space()
        row("space and templates", True, f"{default_space_path()}: {len(space.families)} families "
            f"({', '.join(space.families)}), their templates found")
    except UserError as exc:
        row("space and templates", False, str(exc))
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
            from tuner.space import target_from_device

            props = cupy.cuda.runtime.getDeviceProperties(0)
            name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
            t = target_from_device(props, name)
            row("GPU", True, f"{name}: cc {t.cc}, build {t.arch}, {t.sm_count} SMs, "
                f"{t.max_smem // 1024} KiB smem/block, driver {cupy.cuda.runtime.driverGetVersion()}")
        except Exception as exc:  # noqa: BLE001 - any CUDA failure means: no usable GPU
            row("GPU", False, f"no usable CUDA device: {exc}")
    except ImportError:
        row("cupy", False, "pip install 'hgemm-tune[gpu]' (cupy-cuda13x) to measure on a GPU")
    for mod, why in (("optuna", "search"), ("nvmath", "cuBLASLt baselines"), ("openai", "LLM proposer"),
                     ("matplotlib", "report plots: pip install 'hgemm-tune[report]'")):
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

"""Commands on results: `report`, `bench` (re-measure an export against the vendors), `prebuild`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from tuner import api
from tuner.cli import options as o
from tuner.cli.views import console, fmt, out_console, progress_bar
from tuner.errors import UserError


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
    from tuner.results.report import check_report_out, require_matplotlib, write_bench_report, write_report
    from tuner.search import load_studies

    require_matplotlib()  # the [report] extra: said before anything is read or written
    check_report_out(out)
    is_url = "://" in source or source.startswith("journal:")
    bench_data = None if is_url else _bench_json(source)
    if bench_data is not None:
        files = write_bench_report(bench_data, out)
    else:
        data = export_studies(load_studies(source, read_only=True)) if is_url else read_json(source)
        files = write_report(data, out)
    if not files:
        raise UserError(f"{source}: no verified entries to report on")
    for f in files:
        console.print(f"wrote {f}")


def _bench_json(path: str) -> dict | None:
    """The file's data if it is `hgemm-tune bench` output (rows per mode), else None (an
    export, or a file read_json will report on)."""
    try:
        data = json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "rows" in data and "modes" in data else None


BENCH_HELP = (
    "Re-verify and time every exported kernel against cuBLAS, cuBLASLt and torch.matmul.\n\n"
    "For each shape of the export that was tuned on this GPU: rebuild the kernel from its template and "
    "knobs, verify it again (exact 0/1 inputs, random inputs against cuBLAS's own error, fp32 accumulation, "
    "NaN-poisoned output, guard bands), then time it with cuBLAS (cublasGemmEx), cuBLASLt (heuristic pick, "
    "and autotuned over its top 16) and torch.matmul (when torch is installed), all interleaved in one worker "
    "process in the same thermal and power state, in each --mode (timing regime: sustained, isolated or both). "
    "With --repeats R, R such runs per shape, each in a fresh worker process: median times, the median of the "
    "per-run ratios and their range.\n\n"
    "Writes, per shape and regime: our us, TFLOP/s, % of roofline, every baseline's us, the speedup over each "
    "(baseline us / ours us), the clock regime it was timed in (SM MHz median and minimum, power, regime: "
    "power-capped, thermal, full clocks or unknown, and the section's energy per GEMM), whether the timing "
    "reached its steady state (after how many rounds) and whether it verified; per contender and regime: "
    "time, TFLOP/s, ratio to cuBLAS, SM clock, power, its own energy per GEMM (sustained, where the energy "
    "counter resolves it) and steady state; then the geomean speedup per baseline and regime, and the CUDA-L2 "
    "paper's table: per regime and FLOP bucket, the geomean over each baseline and the share of shapes where "
    "cuBLAS stays the pick (bench.csv, bench_contenders.csv, bench_geomean.csv, bench.md, bench.json under "
    "--out, rewritten every half minute: a grid-sized bench stops at --budget seconds and continues with "
    "--resume). A kernel that "
    "fails verification is a row saying why, never a win; a baseline that cannot be measured is named in the "
    "notes; entries tuned on another GPU are skipped and listed.\n\n"
    "Example: [bold]hgemm-tune bench runs/sweep.json --mode both --repeats 3 --out runs/bench[/]\n\n"
    "Exit code 0 when every kernel verified and was timed, 1 when some did not, 2 for bad input (missing "
    "or invalid JSON, no entry for this GPU, no GPU, no nvcc)."
)


def bench(
    export_file: Annotated[Path, typer.Argument(
        metavar="EXPORT_JSON", help="Export to re-measure: the JSON of `hgemm-tune export`, `sweep -o` or "
                                    "`tune -o` (validated against tuner/results/export_schema.json).")],
    mode: o.Modes = "both",
    repeats: Annotated[int, typer.Option("--repeats", "-r", min=1, help="Runs per shape, each in a fresh worker "
                                                                        "process (median and range).")] = 1,
    out: Annotated[Path, typer.Option("--out", help="Folder for bench.csv, bench_geomean.csv, bench.md and "
                                                    "bench.json.")] = Path("runs/bench"),
    space_file: o.SpaceFile = None,
    gpu: o.Gpu = None,
    jobs: o.Jobs = None,
    torch: Annotated[bool, typer.Option("--torch/--no-torch", help="Also time torch.matmul (when installed).")
                     ] = True,
    resume: Annotated[bool, typer.Option("--resume", help="Keep the shapes an unfinished run of the same export, "
                                                          "--mode and --repeats wrote to --out, bench the rest.")
                      ] = False,
    budget: Annotated[float | None, typer.Option(help="Seconds: start no shape after this; what is left is "
                                                      "benched by a later --resume.")] = None,
    autotune_sample: Annotated[int | None, typer.Option(
        "--autotune-sample", min=1, help="Autotune cuBLASLt (cuBLASLt-auto, its top 16 timed) on a stratified "
                                         "sample of N shapes only, drawn per FLOP bucket (a grid's costliest "
                                         "baseline); default: every shape.")] = None,
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
                                  on_start=on_start, on_shape=on_shape, resume=resume, budget_s=budget,
                                  autotune_sample=autotune_sample)
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted[/]: the shapes benched up to the last half-minute checkpoint are in "
                      f"{out}; `--resume` continues")
        raise typer.Exit(130) from None
    finally:
        if bar.live.is_started:
            bar.stop()
    runs = f", {repeats} runs each" if repeats > 1 else ""
    table = Table(title=f"bench on {result['gpu']} ({result['arch']}){runs}: vs X = X us / ours us")
    for col in ("shape", "regime", "family", "ours us", "TFLOP/s", "cuBLAS us",
                *(f"vs {bm.LABELS[b]}" for b in bm.BASELINES), *bm.CLOCK_HEAD, "steady", "verified"):
        table.add_column(col, justify="left" if col in ("shape", "regime", "family", "verified", "clock regime",
                                                        "steady") else "right")
    shapes = len({r["shape"] for r in result["rows"]})
    for r in result["rows"] if shapes <= PRINT_SHAPES else []:
        verified = "yes" if r["status"] == "ok" else f"[red]{r['status']}[/]: {escape(str(r['reason']))}"
        table.add_row(r["shape"], r["mode"], r["family"], fmt(r["ours_us"], ".2f"), fmt(r["ours_tflops"], ".1f"),
                      fmt(r["cublas_us"], ".2f"), *(bm._speedup_cell(r, b) for b in bm.BASELINES),
                      *(escape(c) for c in bm.clock_texts(r)), escape(bm.steady_cell(r)), verified)
    if shapes <= PRINT_SHAPES:
        out_console.print(table)
        out_console.print(contender_table(result["contenders"], runs))
    else:
        console.print(f"{shapes} shapes: the tables per shape and per contender are in {out / 'bench.md'}")
    geo = Table("baseline", *modes, title="geomean speedup (baseline us / ours us)")
    by = {(g["mode"], g["baseline"]): g for g in result["geomeans"]}
    for b in bm.BASELINES:
        geo.add_row(bm.LABELS[b], *(bm.geomean_text(by[(m, b)]) for m in modes))
    out_console.print(geo)
    out_console.print(bucket_table(result.get("buckets") or [], modes))
    if result.get("left"):
        console.print(f"[yellow]{result['left']} shape(s) left[/] (--budget): run the same command with --resume")
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


PRINT_SHAPES = 40  # more shapes than this (a grid): the per-shape tables go to bench.md only


def bucket_table(buckets: list[dict], modes: list[str]) -> Table:
    """The CUDA-L2 paper's table: per regime and FLOP bucket, geomean speedup of our best kernel per
    shape over each baseline, and the share of shapes where cuBLAS stays the pick."""
    from tuner.results import bench as bm

    table = Table("regime", "FLOPs", "shapes", *(f"vs {bm.LABELS[b]}" for b in bm.BASELINES), "cuBLAS stays the pick",
                  title="by FLOP bucket (our best kernel per shape; vendor fallback not counted)")
    for g in buckets:
        table.add_row(g["mode"], g["bucket"], str(g["shapes"]), *(fmt(g[b], ".3f") for b in bm.BASELINES),
                      f"{100 * g['vendor_keeps']:.0f}%")
    return table


def contender_table(contenders: list[dict], runs: str = "") -> Table:
    """Per shape, regime and contender: time, TFLOP/s, ratio to cuBLAS, the section's SM clock and
    power (one section per shape and regime: the same for every contender), its own energy per
    GEMM, the spread of its rounds and whether the timing settled."""
    from tuner.results import bench as bm

    table = Table(title=f"per contender and regime{runs}: vs cuBLAS = cuBLAS us / its us")
    for col in bm.CONTENDER_HEAD:
        table.add_column(col, justify="left" if col in ("shape", "regime", "contender", "clock regime", "steady")
                         else "right")
    for c in contenders:
        table.add_row(*(escape(x) for x in bm.contender_texts(c)))
    return table


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


def package(
    export_file: Annotated[Path, typer.Argument(metavar="EXPORT_JSON", help="The export whose picks to package.")],
    out: o.OutDir,
    arch: o.Arch = "sm_90a",
    space_file: o.SpaceFile = None,
    jobs: o.Jobs = None,
) -> None:
    """Compile an export's tuned kernels for --arch into ONE shared library with a C API.

    Writes DIR/libhgemm_tuned.so, DIR/hgemm_tuned.h (`hgemm_tuned_run`, status codes, a dispatch
    table for any M >= 1 of a tuned (N, K)) and DIR/package.json; the program needs only the CUDA
    driver. Picks that share a compile-time config share one kernel. Running it again on the same
    export keeps a DIR that already holds this build. PyTorch: `tuner.runtime.torch_op.load(DIR)`.

    Example: [bold]hgemm-tune package runs/best.json -o dist/ --arch sm_90a[/]"""
    bar = progress_bar(transient=True)
    task = bar.add_task("nvcc", total=None, status="")

    def on_done(done: int, total: int) -> None:  # the bar starts with the first build, after the checks
        if console.is_terminal:
            bar.start()
        bar.update(task, total=total, completed=done)

    try:
        result = api.package(export_file, out, arch, api.Options(space_file=space_file, jobs=jobs), on_done=on_done)
    finally:
        if bar.live.is_started:
            bar.stop()
    table = Table("N", "K", "M buckets (pick: kernel, run-time knobs)", title=f"dispatch table for {arch}")
    picks = {p.index: p for p in result.picks}

    def name(pick: int | None) -> str:
        if pick is None:
            return "vendor"
        p = picks[pick]
        knobs = ",".join(f"{v}" for v in p.variant.values())
        return f"k{p.kernel}" + escape(f"[{knobs}]" if knobs else "")

    for layer in result.layers:
        table.add_row(str(layer["N"]), str(layer["K"]),
                      ", ".join(f"{b['M']} ({name(b['pick'])})" for b in layer["buckets"]))
    out_console.print(table)
    for note in result.skipped:
        console.print(f"left out: {escape(note)}")
    how = "kept (already this build)" if result.reused else f"built in {result.seconds:.1f} s"
    console.print(f"{len(result.picks)} picks, {len(result.kernels)} kernels in {result.library} "
                  f"({result.size_bytes / 1e6:.1f} MB, {how}); header {result.header}")


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UserError(f"{what} {text!r}: expected a comma list of integers") from None
    if not values or min(values) < 1:
        raise UserError(f"{what} {text!r}: expected positive integers")
    return values


def check_package(
    package_dir: Annotated[Path, typer.Argument(metavar="DIR", help="A folder made by `hgemm-tune package`.")],
    layers: Annotated[str | None, typer.Option(
        "--layers", help="Comma list of NxK to check (default: every layer of the package).")] = None,
    m_max: Annotated[int, typer.Option("--m-max", min=1, max=65536, help="Check every M from 1 to this.")] = 4096,
    out: Annotated[Path | None, typer.Option("-o", "--out", help="Also write the report as JSON here.")] = None,
) -> None:
    """Check a package on this GPU as a program uses it: every M of its layers through the C
    entry (ctypes) and through torch.ops.hgemm.linear against cuBLAS, a CUDA-graph capture, a
    torch.compile of the operator (one graph, dynamic M), and the operator's host time per call
    next to F.linear's. Needs torch with CUDA, not nvcc. Exit code 1 when any check fails.

    Example: [bold]hgemm-tune check-package dist/ --layers 4096x4096,14336x4096[/]"""
    import dataclasses
    import json

    nk = None
    if layers:
        try:
            nk = [tuple(int(v) for v in item.lower().split("x")) for item in layers.split(",") if item.strip()]
        except ValueError:
            raise UserError(f"--layers {layers!r}: expected NxK items, e.g. 4096x4096,14336x4096") from None
        if any(len(t) != 2 for t in nk):
            raise UserError(f"--layers {layers!r}: expected NxK items, e.g. 4096x4096,14336x4096")
    report = api.check_package(package_dir, nk, m_max, on_layer=lambda lc: console.print(
        f"{lc.N}x{lc.K}: {lc.ours} M on our kernels, {lc.vendor} on the vendor, "
        f"{len(lc.failed_c) + len(lc.failed_op)} failed"))
    from tuner.runtime.check import summary_rows

    rows = summary_rows(report)
    table = Table(*rows[0].keys(), title=f"check-package on {report.gpu} (torch {report.torch})")
    for r in rows:
        table.add_row(*(str(v) for v in r.values()))
    out_console.print(table)
    console.print(f"host time per call at {report.host_shape}: "
                  + ", ".join(f"{k} {v:.2f} us" for k, v in report.host_us.items())
                  + f"; nvcc on PATH: {'yes' if report.nvcc_reachable else 'no'}, CUTLASS importable: "
                  + f"{'yes' if report.cutlass_importable else 'no'}; {report.seconds:.0f} s")
    if out:
        out.write_text(json.dumps(dataclasses.asdict(report) | {"ok": report.ok}, indent=1, default=str))
    if not report.ok:
        for lc in report.layers:
            if lc.failed_c or lc.failed_op:
                console.print(f"[red]FAILED[/] {lc.N}x{lc.K}: C entry at M {lc.failed_c[:10]}, "
                              f"operator at M {lc.failed_op[:10]}")
        raise typer.Exit(1)


def bench_model(
    package_dir: Annotated[Path, typer.Argument(metavar="DIR", help="A folder made by `hgemm-tune package`.")],
    layers: Annotated[int, typer.Option("--layers", min=1, max=32, help="Decoder layers of the model.")] = 2,
    prefill: Annotated[str, typer.Option("--prefill", help="Comma list of prefill lengths (tokens).")
                       ] = "512,1024,2048,4096",
    decode: Annotated[str, typer.Option("--decode", help="Comma list of decode batch sizes.")] = "1,8,32,64",
    repeats: Annotated[int, typer.Option("--repeats", min=3, help="Timed forwards per contender and case.")] = 20,
    graphs: Annotated[bool, typer.Option("--graphs/--no-graphs", help="Also time CUDA-graph replays.")] = True,
    out: Annotated[Path | None, typer.Option("-o", "--out", help="Also write the rows as JSON here.")] = None,
) -> None:
    """Time a Llama-3-8B-shaped transformers model (random weights, nothing downloaded) stock
    and with its Linear layers on the package, interleaved, eager and CUDA-graph replayed; the
    logits' max error against an fp32 copy for both.

    Example: [bold]hgemm-tune bench-model dist/ --layers 2 --prefill 512,4096 --decode 1,64[/]"""
    import json

    pre, dec = _int_list(prefill, "--prefill"), _int_list(decode, "--decode")
    report = api.bench_model(package_dir, layers, pre, dec, repeats, graphs,
                             on_row=lambda r: console.print(f"{r.phase} B={r.batch} T={r.tokens} {r.mode}: "
                                                            f"{fmt(r.stock_ms, '.3f')} -> {fmt(r.ours_ms, '.3f')} ms"))
    table = Table("phase", "batch", "tokens", "M", "mode", "stock ms", "ours ms", "speedup", "Linear on ours",
                  "logits err stock", "logits err ours", "note",
                  title=f"Llama-3-8B-shaped, {report.layers} layers, on {report.gpu} (torch {report.torch}, "
                        f"transformers {report.transformers})")
    for r in report.rows:
        table.add_row(r.phase, str(r.batch), str(r.tokens), str(r.M), r.mode, fmt(r.stock_ms, ".3f"),
                      fmt(r.ours_ms, ".3f"), fmt(r.speedup, ".3f"), f"{r.linear_calls_ours}/{r.linear_calls}",
                      fmt(r.stock_err, ".3g"), fmt(r.ours_err, ".3g"), escape(r.note))
    out_console.print(table)
    if out:
        out.write_text(json.dumps(report.to_dict(), indent=1))


catalogue_app = typer.Typer(no_args_is_help=True, help="Build or inspect a kernel catalogue: compiled kernels of "
                            "chosen configs in one verified file, carried to the GPU machine (`tune --catalogue`).")


@catalogue_app.command("build")
def catalogue_build(
    export_file: Annotated[Path | None, typer.Option(
        "--from", metavar="EXPORT_JSON", help="Build the kernels of this export (its entries for --arch).")] = None,
    seeds_for: Annotated[str | None, typer.Option(
        "--seeds-for", help="Comma list of MxNxK: the configs a fresh study of each shape tries first (its seeds).")
                         ] = None,
    kernels: Annotated[Path | None, typer.Option(
        "--kernels", metavar="KERNELS_JSON", help="Build the kernels of this kernel list (`catalogue curve` writes "
                                                  "one: the distilled set).")] = None,
    families: o.Families = None,
    arch: o.Arch = "sm_90a",
    output: o.CatalogueOut = Path("runs/catalogue-sm_90a.zip"),
    update: o.Update = None,
    space_file: o.SpaceFile = None,
    accumulate: o.Accumulate = "fp32",
    jobs: o.Jobs = None,
) -> None:
    """Compile kernels into one catalogue file on a machine without a GPU.

    Which configs: an export's kernels (--from), a kernel list's (--kernels), the seeds of shapes
    (--seeds-for), or, with none of them, each family's default config and its space.yaml seeds
    for any shape (--families picks the families). Incremental: kernels already in --update (or in --output when it
    exists) are kept and not built again. The manifest records each kernel's family, knobs,
    template and source hashes, binary sha256, registers and spills, why it is there, and the
    toolchain (nvcc, CUTLASS, arch); its digest names the content.

    Example: [bold]hgemm-tune catalogue build --seeds-for 4096x4096x8192,512x512x512 -o runs/cat.zip[/]"""
    shapes = [s for s in (seeds_for or "").split(",") if s.strip()]
    opts = api.Options(space_file=space_file, families=families, jobs=jobs, accumulate=accumulate)
    with progress_bar() as bar:
        task = bar.add_task("nvcc", total=None, status="")
        res = api.catalogue_build(output, export_file, shapes, arch, opts, update=update, kernels_file=kernels,
                                  on_done=lambda done, total: bar.update(task, total=total, completed=done))
    _catalogue_table(res.catalogue)
    for job, error in res.failed:
        console.print(f"[red]failed[/] {job.family} {json.dumps(job.config, separators=(',', ':'))}: "
                      f"{escape(error[:200])}")
    mean = f" ({sum(res.compile_s) / len(res.compile_s):.1f} s each)" if res.compile_s else ""
    console.print(f"catalogue {res.catalogue.path}: {len(res.catalogue.kernels)} kernels, digest "
                  f"{res.catalogue.digest[:16]}, {res.catalogue.path.stat().st_size / 1e6:.2f} MB; compiled "
                  f"{res.compiled}{mean}, from the compile cache {res.from_cache}, reused from the catalogue "
                  f"{res.reused}, failed {len(res.failed)}")
    if res.failed:
        raise typer.Exit(1)


@catalogue_app.command("curve")
def catalogue_curve(
    storage: Annotated[str, typer.Argument(metavar="STORAGE", help="Optuna storage URL of the studies (e.g. a sweep's "
                                                                   "sqlite:///runs/grid.db).")],
    study: Annotated[list[str] | None, typer.Option("--study", help="Only these studies (repeat the option); "
                                                                    "default: all, of one GPU model.")] = None,
    tolerance: Annotated[float, typer.Option(help="A shape counts as kept when the set reaches its best within "
                                                  "this fraction.")] = 0.01,
    size: Annotated[int | None, typer.Option(help="Write the first N kernels of the curve as the kernel list "
                                                  "(default: the smallest set that keeps every shape).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Folder for curve.json, curve.csv, kernels.json "
                                                           "and curve.png.")] = None,
    space_file: o.SpaceFile = None,
) -> None:
    """How many kernels a catalogue needs: from the studies' fully timed kernels, add them greedily
    by the geomean they lift, and show at each size what an export reaches against cuBLAS (our best
    of the set, or cuBLAS where faster) and how many shapes stay within --tolerance of their best.
    A kernel a batch's screen left behind counts as not timed at that shape, so each size's figure
    is a lower bound. The smallest set that keeps every shape goes to kernels.json, for
    `catalogue build --kernels`.

    Example: [bold]hgemm-tune catalogue curve sqlite:///runs/grid.db --out runs/curve[/]"""
    from tuner.space import load_space

    space = load_space(space_file)
    m, curve, files = api.catalogue_curve(storage, study, tolerance, out, size)
    table = Table("kernels", "geomean vs cuBLAS", "of best", f"shapes within {tolerance:.0%}", "added",
                  title=f"catalogue curve: {curve.shapes} shapes, {curve.kernels} kernels timed in full"
                        + (f" on {curve.gpu}" if curve.gpu else "  [SIMULATED]"))
    for p in curve.points:
        fam, config = (m.kernels[p.added][0], m.kernels[p.added][1]) if p.added else ("", {})
        label = "(cuBLAS alone)" if not p.added else f"{fam} " + _changed_knobs(space, fam, config)
        table.add_row(str(p.size), f"{p.geomean_vs_cublas:.4f}x", f"{p.geomean_of_best:.4f}",
                      f"{p.within}/{curve.shapes}", escape(label))
    out_console.print(table)
    keep = (f"{curve.keep} kernels keep every shape within {tolerance:.0%} of its best" if curve.keep is not None
            else f"no set keeps every shape within {tolerance:.0%}")
    console.print(f"{keep}; all {len(curve.points) - 1} useful kernels: {curve.full_geomean_vs_cublas:.4f}x cuBLAS"
                  + (f"; wrote {', '.join(str(f) for f in files)}" if files else ""))


def _changed_knobs(space, family: str, config: dict) -> str:
    """The knobs of a config that differ from its family's defaults (the whole config if the family is gone)."""
    try:
        defaults = space.family(family).defaults()
    except UserError:
        defaults = {}
    return ",".join(f"{k}={v}" for k, v in config.items() if defaults.get(k) != v) or "defaults"


@catalogue_app.command("show")
def catalogue_show(
    catalogue: Annotated[Path, typer.Argument(metavar="CATALOGUE", help="A catalogue file.")],
    space_file: o.SpaceFile = None,
    arch: Annotated[str | None, typer.Option("--arch", help="Also check it was built for this arch.")] = None,
) -> None:
    """Verify a catalogue (manifest, every binary's sha256, this nvcc, CUTLASS and templates) and list it."""
    from tuner.build.catalogue import check_catalogue, read_catalogue
    from tuner.space import load_space

    cat = read_catalogue(catalogue)
    check_catalogue(cat, load_space(space_file), arch)
    _catalogue_table(cat)
    tc = cat.toolchain
    console.print(f"catalogue {cat.path}: {len(cat.kernels)} kernels for {tc.arch}, nvcc {tc.nvcc}, CUTLASS "
                  f"{tc.cutlass}, hgemm-tune {tc.tool}, digest {cat.digest[:16]}: verified")


def _catalogue_table(cat) -> None:
    table = Table("family", "knobs", "acc", "registers", "spill bytes", "KB", "compile s", "why",
                  title=f"catalogue for {cat.toolchain.arch}")
    for k in cat.kernels:
        table.add_row(k.family, ",".join(f"{a}={b}" for a, b in k.config.items()), k.accumulate,
                      fmt(k.registers, "d"), fmt(k.spill_bytes, "d"), f"{k.size / 1e3:.0f}",
                      f"{k.compile_s:.1f}" if k.compile_s else "cached", escape("; ".join(k.reasons)))
    out_console.print(table)

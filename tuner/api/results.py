"""After tuning: re-measure an export against the vendors (`bench`) and build kernels ahead
on a machine without a GPU (`prebuild`)."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tuner.api.run import Options, check_family_names, families_for, make_backend
from tuner.build import CompilePool, CompileResult, cutlass_include, nvcc_path, render
from tuner.errors import UserError
from tuner.results import bench as bench_stage
from tuner.results import check_output, read_json, write_export
from tuner.space import load_space, parse_shape, target_for_arch

DEFAULT_STORAGE = "sqlite:///runs/hgemm.db"
BACKENDS = ("gpu", "replay")


def bench(export_file: Path, modes: list[str], opts: Options, *, out: Path, torch: bool = True, repeats: int = 1,
          on_start=None, on_shape=None, resume: bool = False, budget_s: float | None = None,
          autotune_sample: int | None = None) -> tuple[dict[str, Any], list[Path]]:
    """Re-verify and time every exported kernel for this GPU against the vendor libraries,
    `repeats` runs each in a fresh worker; writes bench.csv, bench_geomean.csv, bench.md and
    bench.json under `out`, and rewrites them every half minute while it runs. `resume`: keep
    the shapes an earlier, unfinished run of the same export, GPU model, regimes and repeats
    wrote to `out/bench.json`; `budget_s`: start no shape after this many seconds (the result
    says how many are `left`); `autotune_sample`: autotune cuBLASLt on a stratified sample of
    this many shapes only (its top-16 autotuning is the costliest baseline on a grid)."""
    import time

    if repeats < 1:
        raise UserError("--repeats must be >= 1")
    if autotune_sample is not None and autotune_sample < 1:
        raise UserError(f"--autotune-sample {autotune_sample}: must be at least 1 shape")
    if budget_s is not None and budget_s <= 0:
        raise UserError(f"--budget {budget_s:g}: must be above 0 seconds")
    earlier = (_earlier_bench(out / "bench.json", export_file, modes, repeats, torch, autotune_sample)
               if resume else None)
    started = time.perf_counter()
    data = read_json(export_file)
    if not data["entries"]:
        raise UserError(f"{export_file}: the export has no entries (no study had a verified kernel)")
    space = load_space(opts.space_file)
    check_entries(export_file, data, space)  # before the GPU starts
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write the bench results to {out}: {exc.strerror or exc}") from None
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
        if earlier is not None and earlier.get("gpu") != be.target.name:
            raise UserError(f"--resume: {out / 'bench.json'} was measured on {earlier.get('gpu')}, this GPU is "
                            f"{be.target.name}: one bench holds one GPU model (use another --out)")
        result = bench_stage.run_benchmark(
            data, be, builder, modes, torch=torch, repeats=repeats, on_shape=on_shape, earlier=earlier,
            deadline=started + budget_s if budget_s else None,
            autotune_shapes=(bench_stage.autotune_sample(_sample_population(space, chosen), autotune_sample)
                             if autotune_sample else None),
            checkpoint=lambda partial: bench_stage.write_outputs(partial, out, str(export_file)))
    finally:
        be.close()
        if pool:
            pool.close()
    return result, bench_stage.write_outputs(result, out, str(export_file))


def _sample_population(space, entries: list[dict]) -> list[str]:
    """Where the autotune sample is drawn from: the space's shape list that holds every shape of the
    export, the smallest such (a grid benched in slices: its sample must not depend on the slice),
    else the export's own shapes."""
    shapes = {e["shape"] for e in entries}
    lists = [names for names in ({str(s) for s in v} for v in space.shapes.values()) if shapes <= names]
    return sorted(min(lists, key=len) if lists else shapes)


def _earlier_bench(path: Path, export_file: Path, modes: list[str], repeats: int, torch: bool,
                   autotune_sample: int | None) -> dict[str, Any] | None:
    """An earlier run's bench.json to resume (None: there is none yet); refused, in one line, when
    it is damaged or measured another export path, other regimes, repeats, torch or autotune
    choice. (Shapes whose export entry changed since are benched again: run_benchmark.)"""
    from tuner.results.bench import regimes_of

    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        rows, source = data["rows"], data.get("source")
        same = (regimes_of(data["modes"]) == regimes_of(modes) and data.get("repeats", 1) == repeats
                and data.get("torch", True) == torch
                and (data.get("autotune_shapes") is None) == (autotune_sample is None)
                and isinstance(rows, list) and all(isinstance(r, dict) and isinstance(r.get("shape"), str)
                                                   and isinstance(r.get("family"), str)
                                                   and isinstance(r.get("knobs"), str) for r in rows))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"--resume: {path} cannot be read as a bench result ({type(exc).__name__}); move it away "
                        "or bench into another --out") from None
    if source != str(export_file) or not same:
        raise UserError(f"--resume: {path} holds another bench (export {source}, regimes "
                        f"{','.join(data['modes'])}, {data.get('repeats', 1)} repeats, torch "
                        f"{'on' if data.get('torch', True) else 'off'}, autotune "
                        f"{'sampled' if data.get('autotune_shapes') is not None else 'everywhere'}): resume with the "
                        "same export, --mode, --repeats, --torch and --autotune-sample, or bench into another --out")
    return data


def check_entries(export_file: Path, data: dict[str, Any], space) -> None:
    """Every entry of an export names a family of the space, knobs it has, and a shape."""
    for i, e in enumerate(data["entries"]):
        try:
            parse_shape(e["shape"])
            space.family(e["family"]).complete_stored(e["knobs"])
        except UserError as exc:
            raise UserError(f"{export_file}: entries/{i} ({e.get('shape')}, {e.get('family')}): {exc}") from None


def export(storage: str, output: Path, studies: list[str] | None = None) -> tuple[dict[str, Any], Path | None,
                                                                                   str | None]:
    """Export the best verified kernel of every study (or of `studies`) in a storage, opened
    read-only, to `output`: (the export, the file written or None, a note). Nothing is written
    when no study has a verified kernel; a storage without any study is a UserError."""
    from tuner.results.export import export_studies
    from tuner.search import load_studies

    check_output(output)
    found = load_studies(storage, studies, read_only=True)
    if not found:
        raise UserError(f"storage {storage} holds no study: nothing to export ({output} not written)")
    data = export_studies(found)
    if not data["entries"]:
        return data, None, None
    written, note = write_export(data, output)
    return data, written, note


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


def package(export_file: Path, out_dir: Path, arch: str, opts: Options, *, on_done=None):
    """Compile every kernel an export picks for `arch` into one shared library with a C API
    (DIR/libhgemm_tuned.so, DIR/hgemm_tuned.h, DIR/package.json): tuner.runtime.package."""
    from tuner.runtime.package import package as build_package

    return build_package(export_file, out_dir, arch, opts.space_file, opts.jobs, on_done=on_done)
def check_package(package_dir: Path, layers: list[tuple[int, int]] | None = None, m_max: int = 4096, on_layer=None):
    """Run every M from 1 to m_max of a package's layers through its C entry and its PyTorch
    operator on this GPU, against cuBLAS; a CUDA-graph capture; host time per call
    (tuner.runtime.check)."""
    from tuner.runtime.check import check_package as run_check

    return run_check(package_dir, layers, m_max, on_layer=on_layer)


def bench_model(package_dir: Path, layers: int = 2, prefill: tuple[int, ...] = (512, 1024, 2048, 4096),
                decode: tuple[int, ...] = (1, 8, 32, 64), repeats: int = 20, graphs: bool = True, on_row=None):
    """A Llama-3-8B-shaped transformers model, stock against its Linear layers on the package
    (tuner.runtime.model_bench)."""
    from tuner.runtime.model_bench import bench_model as run_bench

    return run_bench(package_dir, layers, prefill, decode, repeats, graphs, on_row=on_row)


def catalogue_curve(storage: str, studies: list[str] | None, tolerance: float, out: Path | None = None,
                    size: int | None = None):
    """The catalogue-size curve of a storage's studies (tuner.results.curve): (Measured, Curve, files
    written). With `out`: curve.json, curve.csv, the kernel list of the distilled set (or of the
    first `size` kernels) for `catalogue build --kernels`, and curve.png where matplotlib is."""
    from tuner.results.curve import greedy_curve, kernel_list, measured
    from tuner.search.studies import load_studies

    m = measured(load_studies(storage, studies, read_only=True))
    curve = greedy_curve(m, tolerance)
    if size is not None and not 0 <= size <= len(curve.points) - 1:
        raise UserError(f"--size {size}: the curve has sets of 0 to {len(curve.points) - 1} kernels")
    files: list[Path] = []
    if out is not None:
        from tuner.results.schema import check_writable_folder

        check_writable_folder(out, f"cannot write the curve to {out}")
        out.mkdir(parents=True, exist_ok=True)
        (out / "curve.json").write_text(json.dumps(curve.to_dict(), indent=1))
        with (out / "curve.csv").open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["size", "geomean_vs_cublas", "geomean_of_best", "within", "shapes", "added"])
            w.writerows([p.size, f"{p.geomean_vs_cublas:.5f}", f"{p.geomean_of_best:.5f}", p.within, curve.shapes,
                         p.added] for p in curve.points)
        files += [out / "curve.json", out / "curve.csv"]
        chosen = curve.keep if size is None else size
        if chosen:  # none: no set keeps every shape, or cuBLAS alone does (nothing to build)
            (out / "kernels.json").write_text(json.dumps(kernel_list(m, curve, chosen), indent=1))
            files.append(out / "kernels.json")
        try:
            from tuner.results.report import plot_curve
            files.append(plot_curve(curve, out / "curve.png"))
        except ImportError:
            pass  # no matplotlib: the table and the CSV say it all
    return m, curve, files


def catalogue_jobs(export_file: Path | None, shapes: list[str], arch: str, opts: Options,
                   kernels_file: Path | None = None, export: tuple[dict[str, Any], str] | None = None) -> list:
    """The configs a catalogue is asked to hold, each with why (tuner.build.catalogue.Job): every
    entry of an export for `arch` (a file, or `export`: its data and the label its kernels' reasons
    name), every kernel of a kernel list (`catalogue curve`), the seeds a fresh study of each shape
    tries first, and, when none is given, each family's default config and its seeds that hold for
    any shape."""
    from tuner.build.catalogue import Job
    from tuner.results.entries import entry_build
    from tuner.search.sampler import full_config, seed_configs

    space = load_space(opts.space_file)
    target = target_for_arch(arch)
    named = check_family_names(space, opts.families, opts.accumulate)
    jobs: list[Job] = []
    given = export_file is not None or export is not None or kernels_file is not None or bool(shapes)
    if export_file is not None:
        export = (read_json(export_file), f"export {export_file.name}")
    if export is not None:
        data, label = export
        for e in data["entries"]:
            if e["arch"] != arch or (named is not None and e["family"] not in named):
                continue
            b = entry_build(space, e, target)
            jobs.append(Job(b.family, space.family(b.family).compile_config(b.config), e.get("accumulate", "fp32"),
                            b.source, b.artifact, f"{label}: {e['shape']}"))
    if kernels_file is not None:
        from tuner.results.curve import read_kernel_list

        try:
            raw = kernels_file.read_bytes()
        except OSError as exc:
            raise UserError(f"--kernels {kernels_file}: cannot be read: {exc.strerror or exc}") from None
        for i, k in enumerate(read_kernel_list(raw, str(kernels_file))):
            try:
                fam = space.family(k["family"])
                full = full_config(fam, fam.complete_stored(k["config"]))  # a storage's retired knobs dropped
            except UserError as exc:
                raise UserError(f"{kernels_file}: kernels/{i}: {exc}") from None
            if named is not None and fam.name not in named:
                continue
            jobs.append(Job(fam.name, fam.compile_config(full), k["accumulate"],
                            render(fam, full, arch, accumulate=k["accumulate"]), fam.artifact, k["why"]))
    fams = [space.family(f) for f in families_for(space, opts.families, target, None, opts.accumulate)]

    def add(fam, cfg: dict, shape, reason: str) -> None:
        full = full_config(fam, cfg)
        if fam.violations(full, shape, target):
            return  # the search rejects it before nvcc too
        jobs.append(Job(fam.name, fam.compile_config(full), opts.accumulate,
                        render(fam, full, arch, accumulate=opts.accumulate), fam.artifact, reason))

    for text in shapes:
        shape = parse_shape(text)
        for fam in fams:
            for cfg in seed_configs(fam, shape):
                add(fam, cfg, shape, f"seed of {shape}")
    if not given:
        big = parse_shape("4096x4096x4096")  # resource limits only: these serve every shape
        for fam in fams:
            add(fam, fam.compile_config(fam.defaults()), big, "family default")
            for i, seed in enumerate(fam.seeds):
                if i not in fam.seed_when:
                    add(fam, fam.compile_config(fam.defaults() | seed), big, "space.yaml seed")
    return jobs


def catalogue_build(output: Path, export_file: Path | None, shapes: list[str], arch: str, opts: Options, *,
                    update: Path | None = None, cache_dir: Path | None = None, on_done=None,
                    kernels_file: Path | None = None, export: tuple[dict[str, Any], str] | None = None):
    """Compile, without a GPU, the chosen configs (`catalogue_jobs`) into one catalogue file at
    `output` (tuner.build.catalogue). Incremental: the kernels of `update`, or of `output` when
    it exists, are kept and not built again. Returns a tuner.build.catalogue.BuildSummary."""
    from tuner.build.catalogue import build_catalogue, read_catalogue
    from tuner.build.compile import DEFAULT_CACHE

    nvcc_path(), cutlass_include()  # missing toolchain: one clear error before anything is rendered
    space = load_space(opts.space_file)
    jobs = catalogue_jobs(export_file, shapes, arch, opts, kernels_file, export)
    if not jobs:
        raise UserError("no config to build: the export has no entry for this arch, the kernel list none of these "
                        "families, and no seed is valid")
    previous_path = update if update is not None else (output if output.exists() else None)
    previous = read_catalogue(previous_path) if previous_path is not None else None
    pool = CompilePool(opts.jobs, cache_dir=cache_dir or DEFAULT_CACHE)
    try:
        return build_catalogue(output, jobs, arch, space, pool, previous, on_done=on_done)
    finally:
        pool.close()


def grow_catalogue(opts: Options, export: dict[str, Any], arch: str, label: str, cache_dir: Path | None = None):
    """`--catalogue-out`: the run's catalogue (`opts.catalogue`, else the file itself where it
    exists, else none) plus each shape's best kernel of ours in its export that the catalogue
    lacks, written to `opts.catalogue_out`: a new winner joins the catalogue. Only kernels that
    (re-)verified and whose template is the current one join. Their binaries are in the compile
    cache from the run (nvcc runs only for one that is not). None when no kernel qualifies."""
    assert opts.catalogue_out is not None
    from tuner.results.entries import tuned_with_other_template

    space = load_space(opts.space_file)
    # Measured with today's template (an earlier run's study may predate an edit) and verified.
    joining = [e for e in export["entries"] if e["arch"] == arch and e["family"] in space.families
               and not tuned_with_other_template(space.family(e["family"]), e)
               and (e.get("speedup") or {}).get("cublas") is not None]
    if not joining:
        return None
    # With no --catalogue, catalogue_build extends the output file itself where it exists.
    return catalogue_build(opts.catalogue_out, None, [], arch, opts, update=opts.catalogue, cache_dir=cache_dir,
                           export=({**export, "entries": joining}, f"best at {label}"))


"""`hgemm-tune package`: an export's tuned kernels for one arch -> ONE shared library with a C API.

Every entry of the arch whose pick is our kernel becomes a pick: a compiled kernel (one per
compile-time config, shared by the picks that use it), its run-time knobs, and a validity test
(the family's constraints translated to C over M, N, K). A cubin family's kernel gets a
generated launcher (space.yaml's `launch` expressions in C); a library family (cute_sm90)
keeps its own host launcher, its names made unique per kernel. Each kernel's object has its
hidden symbols made local before the link, so no two kernels share a template instance. A
generated dispatch.cu holds the table; the link keeps only the API visible (a version script)
and links the CUDA runtime statically, so a program needs only the driver: no nvcc, no
CUTLASS, no Python.

Dispatch (docs/decisions/0035-packaged-library.md): for a call's (N, K), the exported M buckets
of that (N, K); an exact M runs its own pick; any other M runs the pick of the nearest bucket
(|M - M_bucket|, a tie goes to the larger bucket) among the buckets whose kernel's constraints
hold for (M, N, K) -- a bucket the vendor won is always valid and answers "use the vendor"; no
bucket, an M below half the smallest bucket, or another (N, K), answers status 1 (use the vendor).
"""


import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from tuner.build import cutlass_include, cutlass_version, nvcc_path, nvcc_version
from tuner.errors import UserError
from tuner.results.entries import entry_build
from tuner.results.schema import read_json
from tuner.runtime.codegen import (
    API,
    HEADER,
    INFO,
    LIBRARY,
    RULE,
    STATUS,
    CTranslator,
    Kernel,
    NotC,
    Packaged,
    Pick,
    dispatch_unit,
    header_text,
    kernel_unit,
)
from tuner.space import load_space, parse_shape, target_for_arch
from tuner.version import __version__


def _kernel_args(fam, variant: dict[str, Any]) -> tuple[int, int, int, int]:
    """A pick's run-time knobs as its launcher's four ints (the worker's own mapping for libraries)."""
    if fam.artifact == "library":
        from tuner.measure.candidates import LibraryCandidate as L

        return (L.RASTER[variant.get("RASTER", "heuristic")], int(variant.get("SWIZZLE", 1)),
                L.DECOMP[variant.get("DECOMP", "data_parallel")],
                L.REDUCTION[variant.get("REDUCTION", "deterministic")])
    return (int(next(iter(variant.values()), 0)), 0, 0, 0)


def plan(export_file: Path, arch: str, space_file: Path | None = None
         ) -> tuple[list[Kernel], list[Pick], list[str], list[str], list[dict[str, Any]], dict]:
    """(kernels, picks, vendor shapes, skipped notes, layers, export data); every refusal is a UserError.

    Picks that share a compile-time config share one compiled kernel."""
    data = read_json(export_file)
    if not data["entries"]:
        raise UserError(f"{export_file}: the export has no entries: nothing to package")
    target = target_for_arch(arch)
    space = load_space(space_file)
    mine = [(i, e) for i, e in enumerate(data["entries"]) if e["arch"] == arch]
    if not mine:
        held = sorted({e["arch"] for e in data["entries"]})
        raise UserError(f"{export_file}: no entry for {arch}; the export holds {', '.join(held)} "
                        f"(pass --arch {held[0]})")
    kernels: list[Kernel] = []
    by_source: dict[str, int] = {}
    picks: list[Pick] = []
    vendor: list[str] = []
    skipped: list[str] = []
    buckets: dict[tuple[int, int], dict[int, int | None]] = {}
    seen: dict[str, str] = {}
    for i, e in mine:
        where = f"{export_file}: entries/{i} ({e['shape']}, {e['family']})"
        if e.get("accumulate", "fp32") != "fp32" or e.get("layout", "TN") != "TN":
            skipped.append(f"{e['shape']}: {e.get('layout')} {e.get('accumulate')}-accumulate entries are "
                           "not packaged (the C API is TN with fp32 accumulation)")
            continue
        shape = parse_shape(e["shape"])
        if e["shape"] in seen:
            raise UserError(f"{where}: a second entry for {e['shape']} on {arch} (gpus {seen[e['shape']]} and "
                            f"{e['gpu']}): package an export of one GPU")
        seen[e["shape"]] = e["gpu"]
        try:
            fam = space.family(e["family"])
            fam.complete_stored(e["knobs"])
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None
        if e["pick"] != e["family"]:
            vendor.append(e["shape"])
            buckets.setdefault((shape.N, shape.K), {})[shape.M] = None
            continue
        build = entry_build(space, e, target)
        bad = fam.violations(build.config, shape, target)
        if bad:
            raise UserError(f"{where}: the space's constraints refuse this entry now: {bad[0]}")
        if fam.artifact == "cubin" and len(build.variant) > 1:
            raise UserError(f"{where}: a cubin family with {len(build.variant)} run-time knobs is not packaged yet "
                            "(its entry point takes one, swizzle_log)")
        tr = CTranslator(fam, build.config, target)
        try:
            valid = " && ".join(f"({tr.expr(cons.expr)})" for cons in fam.constraints) or "1"
            launch = {k: tr.expr(fam.launch[k]) for k in ("grid", "block", "smem")} if fam.artifact == "cubin" else {}
        except NotC as exc:
            raise UserError(f"{where}: not packaged yet: {exc}") from None
        if build.source not in by_source:
            by_source[build.source] = len(kernels)
            kernels.append(Kernel(len(kernels), fam.name, fam.compile_config(build.config), fam.artifact,
                                  build.source, **launch))
        picks.append(Pick(len(picks), shape, by_source[build.source], build.variant,
                          _kernel_args(fam, build.variant), valid))
        buckets.setdefault((shape.N, shape.K), {})[shape.M] = picks[-1].index
    if not picks:
        raise UserError(f"{export_file}: no {arch} entry picks a kernel that can be packaged "
                        f"({len(vendor)} vendor picks, {len(skipped)} left out): nothing to package")
    layers = [{"N": n, "K": k, "buckets": [{"M": m, "pick": ix} for m, ix in sorted(b.items())]}
              for (n, k), b in sorted(buckets.items())]
    return kernels, picks, vendor, skipped, layers, data


# A library kernel's host half is gcc parsing ~11 MB of CUTLASS: a larger collector heap saves ~0.5 s of ~6.
HOST_FLAGS = ["-Xcompiler=--param=ggc-min-expand=100,--param=ggc-min-heapsize=1048576"]


def _flags(arch: str, families: set[str]) -> list[str]:
    virtual = "compute_" + arch.removeprefix("sm_")
    flags = ["-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", f"-gencode=arch={virtual},code={arch}",
             "-Xcompiler=-fPIC,-fvisibility=hidden"]
    if any(f.startswith("cute") for f in families):
        flags.append(f"-I{cutlass_include()}")
    return flags


def _nvcc(args: list[str], what: str, timeout_s: float = 600) -> None:
    try:
        proc = subprocess.run([nvcc_path(), *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise UserError(f"{what} does not compile: nvcc timed out after {timeout_s:.0f} s") from None
    except OSError as exc:
        raise UserError(f"{what} does not compile: nvcc did not run: {exc}") from None
    if proc.returncode != 0:
        log = proc.stdout + proc.stderr
        first = next((ln for ln in log.splitlines() if "error" in ln.lower()), log.strip()[-300:])
        raise UserError(f"{what} does not compile: {first.strip()}")


def _run_tool(cmd: list[str], what: str) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"{what}: {cmd[0]} did not run: {exc} (binutils' ld, objcopy and nm are needed)") from None
    if proc.returncode != 0:
        raise UserError(f"{what}: {cmd[0]} failed: {(proc.stderr or proc.stdout).strip()[:300]}")
    return proc.stdout


def _localize(obj: Path, what: str) -> None:
    """Make every hidden symbol of one kernel's object local, section groups included, so that
    kernels compiled from different configs never share a definition at link time: CUTLASS's
    templates of the same name may differ between builds (a TMA_L2_PROMOTION build reroutes the
    descriptor encoding), and the linker would otherwise keep one copy of each for all. What
    stays global (libcu++'s and libstdc++'s default-visibility inline variables, the same in
    every object) is made weak, so that one copy serves."""
    tmp = obj.with_suffix(".r.o")
    _run_tool(["ld", "-r", "--force-group-allocation", "-o", str(tmp), str(obj)], what)
    _run_tool(["objcopy", "--localize-hidden", str(tmp)], what)
    names = [ln.split()[-1] for ln in _run_tool(["nm", "-g", "--defined-only", str(tmp)], what).splitlines()
             if ln.strip()]
    if names:
        listing = obj.with_suffix(".globals")
        listing.write_text("\n".join(names) + "\n")
        _run_tool(["objcopy", f"--weaken-symbols={listing}", str(tmp)], what)
    os.replace(tmp, obj)


def _info(export_file: Path, arch: str, target, data: dict, kernels: list[Kernel], picks: list[Pick],
          vendor: list[str], skipped: list[str], layers: list[dict[str, Any]]) -> str:
    return json.dumps({
        "library": "hgemm_tuned", "arch": arch, "cc": target.cc,
        "export": {"file": export_file.name, "sha256": hashlib.sha256(export_file.read_bytes()).hexdigest(),
                   "tool_version": data.get("tool_version"), "created": data.get("created")},
        "versions": {"hgemm_tune": __version__, "nvcc": nvcc_version(),
                     "cutlass": cutlass_version() if any(k.family.startswith("cute") for k in kernels) else None},
        "status": {str(k): v for k, v in STATUS.items()}, "dispatch_rule": RULE,
        "kernels": [{"id": k.index, "family": k.family, "artifact": k.artifact, "knobs": k.knobs,
                     "source_sha256": hashlib.sha256(k.source.encode()).hexdigest()} for k in kernels],
        "picks": [{"id": p.index, "shape": str(p.shape), "kernel": p.kernel, "variant": p.variant} for p in picks],
        "layers": layers, "vendor": vendor, "skipped": skipped,
    }, sort_keys=True, ensure_ascii=True)


def package(export_file: Path, out_dir: Path, arch: str = "sm_90a", space_file: Path | None = None,
            jobs: int | None = None, on_done=None) -> Packaged:
    """Build DIR/libhgemm_tuned.so, DIR/hgemm_tuned.h, DIR/package.json (the library's info) and
    DIR/src/ (the generated sources). A DIR that already holds this build (same info: export,
    versions, kernels) is kept as it is."""
    start = time.perf_counter()
    export_file = Path(export_file)
    kernels, picks, vendor, skipped, layers, data = plan(export_file, arch, space_file)
    target = target_for_arch(arch)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"cannot write {out_dir}: it is a file, not a folder")
    try:
        (out_dir / "src").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write {out_dir}: {exc.strerror or exc}") from None
    info = _info(export_file, arch, target, data, kernels, picks, vendor, skipped, layers)
    library, header, manifest = out_dir / LIBRARY, out_dir / HEADER, out_dir / INFO
    if library.is_file() and header.is_file() and manifest.is_file() and manifest.read_text() == info:
        return Packaged(out_dir, library, header, arch, kernels, picks, vendor, skipped, layers,
                        seconds=time.perf_counter() - start, size_bytes=library.stat().st_size, reused=True)
    src = out_dir / "src"
    units = {f"k{k.index}.cu": kernel_unit(k) for k in kernels}
    units["dispatch.cu"] = dispatch_unit(kernels, picks, layers, target.cc, info)
    for name, text in units.items():
        (src / name).write_text(text)
    (src / HEADER).write_text(header_text(arch))
    (src / "exports.map").write_text("{ global: " + " ".join(f"{s};" for s in API) + " local: *; };\n")
    flags = _flags(arch, {k.family for k in kernels})
    with tempfile.TemporaryDirectory(prefix="hgemm-package-") as tmp:
        objs = {name: Path(tmp) / (name.removesuffix(".cu") + ".o") for name in units}

        def build(name: str) -> None:
            if name == "dispatch.cu":
                _nvcc([*flags, f"-I{src}", "-c", "-o", str(objs[name]), str(src / name)], "the dispatch table")
            else:
                k = kernels[int(name[1:-3])]
                serves = ", ".join(str(p.shape) for p in picks if p.kernel == k.index)
                what = f"kernel {name.removesuffix('.cu')} ({k.family}, for {serves})"
                _nvcc([*flags, *(HOST_FLAGS if k.artifact == "library" else []), f"-I{src}", "-c",
                       "-o", str(objs[name]), str(src / name)], what)
                _localize(objs[name], what)

        with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
            # counted here, as each finishes: the callback runs on this thread only
            for done, f in enumerate(as_completed([pool.submit(build, name) for name in units]), 1):
                f.result()
                if on_done:
                    on_done(done, len(units))
        lib_tmp = Path(tmp) / LIBRARY
        _nvcc(["-shared", "-cudart=static", f"-gencode=arch=compute_{arch.removeprefix('sm_')},code={arch}",
               f"-Xlinker=--version-script={src / 'exports.map'}", "-o", str(lib_tmp), *map(str, objs.values())],
              "the library (link)")
        shutil.copyfile(lib_tmp, out_dir / f".{LIBRARY}.tmp")
        os.replace(out_dir / f".{LIBRARY}.tmp", library)
    shutil.copyfile(src / HEADER, header)
    (out_dir / f".{INFO}.tmp").write_text(info)  # last: a DIR with this info holds a finished build
    os.replace(out_dir / f".{INFO}.tmp", manifest)
    return Packaged(out_dir, library, header, arch, kernels, picks, vendor, skipped, layers,
                    seconds=time.perf_counter() - start, size_bytes=library.stat().st_size)


def package_info(package_dir: Path) -> dict[str, Any]:
    """DIR/package.json of a finished package; one clear line when DIR is not one."""
    info_file = Path(package_dir) / INFO
    if not (Path(package_dir) / LIBRARY).is_file() or not info_file.is_file():
        raise UserError(f"{package_dir} is not a package: it has no {LIBRARY} and {INFO} "
                        "(make one with `hgemm-tune package EXPORT -o DIR`)")
    try:
        return json.loads(info_file.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{info_file}: not readable JSON: {exc}") from None


def open_library(package_dir: Path) -> ctypes.CDLL:
    """The package's C API through ctypes, every entry point's arguments declared."""
    package_info(package_dir)
    lib = ctypes.CDLL(str(Path(package_dir) / LIBRARY), mode=os.RTLD_LOCAL)
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.hgemm_tuned_run.argtypes = [i, i, i, p, i, p, i, p, i, p, ctypes.c_size_t, p]
    lib.hgemm_tuned_run.restype = i
    lib.hgemm_tuned_workspace_size.argtypes = [i, i, i]
    lib.hgemm_tuned_workspace_size.restype = ctypes.c_size_t
    lib.hgemm_tuned_lookup.argtypes = [i, i, i]
    lib.hgemm_tuned_lookup.restype = i
    lib.hgemm_tuned_info.restype = ctypes.c_char_p
    return lib

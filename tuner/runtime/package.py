"""`hgemm-tune package`: an export's tuned kernels for one arch -> ONE shared library with a C API.

Every entry of the arch whose pick is our kernel is rendered, renamed (`hgemm` -> `hgemm_tuned_kN`,
internal symbols stay in the templates' anonymous namespaces), given a generated host launcher
(its grid, block and shared memory are space.yaml's `launch` expressions translated to C over
the call's M, N, K) and a validity test (the family's constraints translated to C the same way),
and compiled once. A generated dispatch.cpp holds the table; the link keeps only the API visible
(-fvisibility=hidden plus a version script) and links the CUDA runtime statically, so a program
needs only the driver: no nvcc, no CUTLASS, no Python.

Dispatch (docs/decisions/0035-packaged-library.md): for a call's (N, K), the exported M buckets
of that (N, K); an exact M runs its own pick; any other M runs the pick of the nearest bucket
(|M - M_bucket|, a tie goes to the larger bucket) among the buckets whose kernel's constraints
hold for (M, N, K) -- a bucket the vendor won is always valid and answers "use the vendor"; no
bucket, or another (N, K), answers status 1 (use the vendor).

Only cubin families (wmma, cute_sm80) are packaged in this first step; library families
(cute_sm90) are refused with one line, or left to the vendor with `skip_unsupported`.
"""


import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tuner.build import cutlass_include, cutlass_version, nvcc_path, nvcc_version
from tuner.errors import UserError
from tuner.results.entries import entry_build
from tuner.results.schema import read_json
from tuner.runtime.codegen import (
    API,
    HEADER,
    LIBRARY,
    RULE,
    STATUS,
    CTranslator,
    Kernel,
    NotC,
    Packaged,
    dispatch_unit,
    header_text,
    kernel_unit,
)
from tuner.space import load_space, parse_shape, target_for_arch
from tuner.version import __version__


def plan(export_file: Path, arch: str, space_file: Path | None = None,
         skip_unsupported: bool = False) -> tuple[list[Kernel], list[str], list[str], list[dict[str, Any]], dict]:
    """(kernels, vendor shapes, skipped notes, layers, export data); every refusal is a UserError."""
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
    vendor: list[str] = []
    skipped: list[str] = []
    unsupported: list[str] = []
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
        if fam.artifact != "cubin":
            unsupported.append(e["shape"])
            buckets.setdefault((shape.N, shape.K), {})[shape.M] = None
            continue
        build = entry_build(space, e, target)
        bad = fam.violations(build.config, shape, target)
        if bad:
            raise UserError(f"{where}: the space's constraints refuse this entry now: {bad[0]}")
        if len(build.variant) > 1:
            raise UserError(f"{where}: a cubin family with {len(build.variant)} run-time knobs is not packaged yet "
                            "(the entry point takes one, swizzle_log)")
        tr = CTranslator(fam, build.config, target)
        try:
            c = {k: tr.expr(fam.launch[k]) for k in ("grid", "block", "smem")}
            valid = " && ".join(f"({tr.expr(cons.expr)})" for cons in fam.constraints) or "1"
        except NotC as exc:
            raise UserError(f"{where}: not packaged yet: {exc}") from None
        kernels.append(Kernel(len(kernels), shape, fam.name, build.config,
                              int(next(iter(build.variant.values()), 0)), build.source, valid=valid, **c))
        buckets.setdefault((shape.N, shape.K), {})[shape.M] = kernels[-1].index
    if unsupported and not skip_unsupported:
        raise UserError(f"not packaged yet: library-family (cute_sm90) picks for {', '.join(unsupported)}; "
                        "pass --skip-unsupported to leave those shapes to the vendor")
    skipped += [f"{s}: cute_sm90 pick not packaged yet (left to the vendor)" for s in unsupported]
    if not kernels:
        raise UserError(f"{export_file}: no {arch} entry picks a kernel that can be packaged "
                        f"({len(vendor)} vendor picks, {len(unsupported) + len(skipped)} left out): nothing to package")
    layers = [{"N": n, "K": k, "buckets": [{"M": m, "kernel": ix} for m, ix in sorted(b.items())]}
              for (n, k), b in sorted(buckets.items())]
    return kernels, vendor, skipped, layers, data


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


def package(export_file: Path, out_dir: Path, arch: str = "sm_90a", space_file: Path | None = None,
            jobs: int | None = None, skip_unsupported: bool = False) -> Packaged:
    """Build DIR/libhgemm_tuned.so and DIR/hgemm_tuned.h (and DIR/src/, the generated sources)."""
    start = time.perf_counter()
    kernels, vendor, skipped, layers, data = plan(Path(export_file), arch, space_file, skip_unsupported)
    target = target_for_arch(arch)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"cannot write {out_dir}: it is a file, not a folder")
    try:
        (out_dir / "src").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write {out_dir}: {exc.strerror or exc}") from None
    info = json.dumps({
        "library": "hgemm_tuned", "arch": arch, "cc": target.cc,
        "export": {"file": Path(export_file).name, "sha256": hashlib.sha256(Path(export_file).read_bytes()).hexdigest(),
                   "tool_version": data.get("tool_version"), "created": data.get("created")},
        "versions": {"hgemm_tune": __version__, "nvcc": nvcc_version(),
                     "cutlass": cutlass_version() if any(k.family.startswith("cute") for k in kernels) else None},
        "status": {str(k): v for k, v in STATUS.items()}, "dispatch_rule": RULE,
        "kernels": [{"id": k.index, "shape": str(k.shape), "family": k.family, "knobs": k.knobs} for k in kernels],
        "layers": layers, "vendor": vendor, "skipped": skipped,
    }, sort_keys=True, ensure_ascii=True)
    src = out_dir / "src"
    units = {f"k{k.index}.cu": kernel_unit(k) for k in kernels}
    units["dispatch.cu"] = dispatch_unit(kernels, layers, target.cc, info)
    for name, text in units.items():
        (src / name).write_text(text)
    (src / HEADER).write_text(header_text(arch))
    (src / "exports.map").write_text("{ global: " + " ".join(f"{s};" for s in API) + " local: *; };\n")
    flags = _flags(arch, {k.family for k in kernels})
    with tempfile.TemporaryDirectory(prefix="hgemm-package-") as tmp:
        objs = {name: Path(tmp) / (name.removesuffix(".cu") + ".o") for name in units}

        def build(name: str) -> None:
            what = ("the dispatch table" if name == "dispatch.cu" else
                    f"kernel {name.removesuffix('.cu')} ({kernels[int(name[1:-3])].shape}, "
                    f"{kernels[int(name[1:-3])].family})")
            _nvcc([*flags, f"-I{src}", "-c", "-o", str(objs[name]), str(src / name)], what)

        with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
            for f in [pool.submit(build, name) for name in units]:
                f.result()
        lib_tmp = Path(tmp) / LIBRARY
        _nvcc(["-shared", "-cudart=static", f"-gencode=arch=compute_{arch.removeprefix('sm_')},code={arch}",
               f"-Xlinker=--version-script={src / 'exports.map'}", "-o", str(lib_tmp), *map(str, objs.values())],
              "the library (link)")
        library = out_dir / LIBRARY
        shutil.copyfile(lib_tmp, out_dir / f".{LIBRARY}.tmp")
        os.replace(out_dir / f".{LIBRARY}.tmp", library)
    header = out_dir / HEADER
    shutil.copyfile(src / HEADER, header)
    return Packaged(out_dir, library, header, arch, kernels, vendor, skipped, layers,
                    seconds=time.perf_counter() - start, size_bytes=library.stat().st_size)

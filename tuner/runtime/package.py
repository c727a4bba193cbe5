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

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.build import cutlass_include, cutlass_version, nvcc_path, nvcc_version
from tuner.errors import UserError
from tuner.results.entries import entry_build
from tuner.results.schema import read_json
from tuner.space import Shape, load_space, parse_shape, target_for_arch
from tuner.space.expr import Expr
from tuner.version import __version__

LIBRARY = "libhgemm_tuned.so"
HEADER = "hgemm_tuned.h"
API = ("hgemm_tuned_run", "hgemm_tuned_lookup", "hgemm_tuned_info", "hgemm_tuned_check_device")
STATUS = {0: "ok", 1: "no tuned kernel for this call: use the vendor library", 2: "bad argument",
          3: "launch failed", 4: "this GPU is not the library's arch", 5: "no CUDA device or runtime error"}
RULE = ("per (N, K): an exact M runs its bucket's pick; another M runs the pick of the nearest M bucket "
        "(|M - bucket|, ties to the larger bucket) among buckets whose kernel's constraints hold for (M, N, K); "
        "a bucket the vendor won answers 1 (use the vendor); no valid bucket or another (N, K) answers 1")
SHAPE_NAMES = ("M", "N", "K")


@dataclass
class Kernel:
    index: int
    shape: Shape
    family: str
    knobs: dict[str, Any]
    swizzle_log: int
    source: str
    grid: str           # C expressions over (long long) M, N, K
    block: str
    smem: str
    valid: str

    @property
    def symbol(self) -> str:
        return f"hgemm_tuned_k{self.index}"


@dataclass
class Packaged:
    directory: Path
    library: Path
    header: Path
    arch: str
    kernels: list[Kernel]
    vendor_shapes: list[str]            # buckets whose pick is the vendor (answer status 1)
    skipped: list[str]                  # entries left out, each with why
    layers: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    size_bytes: int = 0


# ---- space.yaml expressions -> C -------------------------------------------------------------

_C_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}
_C_FUNCS = {ast.FloorDiv: "hk_floordiv", ast.Mod: "hk_mod"}
_C_CMP = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
_C_CALLS = {"ceil_div": "hk_ceil_div", "min": "hk_min", "max": "hk_max", "abs": "hk_abs"}


class _NotC(Exception):
    pass


class CTranslator:
    """Partial evaluation of a family's expressions for one config: every part that does not
    depend on M, N, K is computed here (knob strings, limits, derived values); what is left is
    integer arithmetic over M, N, K, written as C (`long long`, with Python's floor division)."""

    def __init__(self, fam, config: dict[str, Any], target):
        self.derived = fam.derived
        self.env: dict[str, Any] = dict(config) | {
            "max_smem": target.max_smem, "max_threads": target.max_threads,
            "sm_count": target.sm_count, "cc": target.cc}
        self.shaped: set[str] = set(SHAPE_NAMES)   # names whose value depends on the shape
        for name, expr in fam.derived.items():
            if expr.names & self.shaped:
                self.shaped.add(name)
            else:
                self.env[name] = expr.eval(self.env)

    def _depends(self, node: ast.AST) -> bool:
        return any(isinstance(n, ast.Name) and n.id in self.shaped for n in ast.walk(node))

    def _const(self, node: ast.AST) -> str:
        value = Expr(ast.unparse(node)).eval(self.env)
        if isinstance(value, bool):
            return "1" if value else "0"
        if isinstance(value, int):
            return f"{value}LL"
        raise _NotC(f"{ast.unparse(node)} is {value!r}, not an integer")

    def c(self, node: ast.AST) -> str:
        if not self._depends(node):
            return self._const(node)
        if isinstance(node, ast.Name):
            if node.id in SHAPE_NAMES:
                return node.id
            return "(" + self.c(self.derived[node.id].tree) + ")"
        if isinstance(node, ast.BinOp) and type(node.op) in _C_BINOPS:
            return f"({self.c(node.left)} {_C_BINOPS[type(node.op)]} {self.c(node.right)})"
        if isinstance(node, ast.BinOp) and type(node.op) in _C_FUNCS:
            return f"{_C_FUNCS[type(node.op)]}({self.c(node.left)}, {self.c(node.right)})"
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return f"(-{self.c(node.operand)})"
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return f"(!{self.c(node.operand)})"
        if isinstance(node, ast.BoolOp):
            op = " && " if isinstance(node.op, ast.And) else " || "
            return "(" + op.join(self.c(v) for v in node.values) + ")"
        if isinstance(node, ast.Compare) and all(type(o) in _C_CMP for o in node.ops):
            parts, left = [], node.left
            for op, right in zip(node.ops, node.comparators, strict=True):
                parts.append(f"({self.c(left)} {_C_CMP[type(op)]} {self.c(right)})")
                left = right
            return "(" + " && ".join(parts) + ")"
        if isinstance(node, ast.IfExp):
            return f"({self.c(node.test)} ? {self.c(node.body)} : {self.c(node.orelse)})"
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _C_CALLS
                and len(node.args) == 2 - (node.func.id == "abs")):
            return f"{_C_CALLS[node.func.id]}(" + ", ".join(self.c(a) for a in node.args) + ")"
        raise _NotC(f"{ast.unparse(node)} cannot be computed in C at run time")

    def expr(self, expr: Expr) -> str:
        return self.c(expr.tree)


# ---- generated sources ---------------------------------------------------------------------

C_HELPERS = """\
static inline long long hk_floordiv(long long a, long long b) {
    if (b == 0) return 0;
    long long q = a / b; return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q; }
static inline long long hk_mod(long long a, long long b) { return b == 0 ? 0 : a - hk_floordiv(a, b) * b; }
static inline long long hk_ceil_div(long long a, long long b) { return b == 0 ? 0 : -hk_floordiv(-a, b); }
static inline long long hk_min(long long a, long long b) { return a < b ? a : b; }
static inline long long hk_max(long long a, long long b) { return a > b ? a : b; }
static inline long long hk_abs(long long a) { return a < 0 ? -a : a; }
"""


def kernel_unit(k: Kernel) -> str:
    """The family's rendered source with its entry renamed, plus its launcher and validity test."""
    return f"""// hgemm-tune package: kernel {k.index}, {k.shape} ({k.family}) {json.dumps(k.knobs, sort_keys=True)}
#define hgemm {k.symbol}
{k.source}
#undef hgemm
#include <cuda_runtime.h>
namespace {{
{C_HELPERS}}}  // namespace

extern "C" int {k.symbol}_valid(long long M, long long N, long long K) {{
    (void)M; (void)N; (void)K;
    return ({k.valid}) ? 1 : 0;
}}

static long long {k.symbol}_grid(long long M, long long N, long long K) {{
    (void)M; (void)N; (void)K; return {k.grid}; }}
static long long {k.symbol}_block(long long M, long long N, long long K) {{
    (void)M; (void)N; (void)K; return {k.block}; }}
static long long {k.symbol}_smem(long long M, long long N, long long K) {{
    (void)M; (void)N; (void)K; return {k.smem}; }}

extern "C" int {k.symbol}_launch(int M, int N, int K, const void* A, const void* B, void* C, cudaStream_t stream) {{
    const long long grid = {k.symbol}_grid(M, N, K), block = {k.symbol}_block(M, N, K),
                    smem = {k.symbol}_smem(M, N, K);
    if (grid < 1 || grid > 2147483647LL || block < 1 || block > 1024 || smem < 0) return 2;
    if (smem > 48 * 1024) {{
        cudaError_t e = cudaFuncSetAttribute((const void*){k.symbol}, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)smem);
        if (e != cudaSuccess) return 3;
    }}
    const __half* a = (const __half*)A;
    const __half* b = (const __half*)B;
    __half* c = (__half*)C;
    int swizzle_log = {k.swizzle_log};
    void* args[] = {{(void*)&a, (void*)&b, (void*)&c, (void*)&M, (void*)&N, (void*)&K, (void*)&swizzle_log}};
    cudaError_t e = cudaLaunchKernel((const void*){k.symbol}, dim3((unsigned)grid), dim3((unsigned)block), args,
                                     (size_t)smem, stream);
    return e == cudaSuccess ? 0 : 3;
}}
"""


def _c_string(text: str) -> str:
    """A C string literal (ASCII JSON: only backslashes and quotes need escaping), in chunks."""
    chunks = [text[i:i + 160].replace("\\", "\\\\").replace('"', '\\"') for i in range(0, len(text), 160)]
    return "\n".join(f'    "{c}"' for c in chunks) or '    ""'


def dispatch_unit(kernels: list[Kernel], layers: list[dict[str, Any]], cc: int, info: str) -> str:
    decls = "\n".join(
        f'extern "C" int {k.symbol}_valid(long long, long long, long long);\n'
        f'extern "C" int {k.symbol}_launch(int, int, int, const void*, const void*, void*, cudaStream_t);'
        for k in kernels)
    fns = ",\n".join(f"    {{{k.symbol}_valid, {k.symbol}_launch}}" for k in kernels) or "    {nullptr, nullptr}"
    buckets, rows = [], []
    for layer in layers:
        rows.append(f"    {{{layer['N']}, {layer['K']}, {len(buckets)}, {len(layer['buckets'])}}}")
        buckets += [f"    {{{b['M']}, {-1 if b['kernel'] is None else b['kernel']}}}" for b in layer["buckets"]]
    bucket_rows = ",\n".join(buckets) or "    {0, -1}"
    layer_rows = ",\n".join(rows) or "    {0, 0, 0, 0}"
    return f"""// Generated by hgemm-tune {__version__} package: the dispatch table and the C API.
#include <atomic>
#include <cuda_runtime.h>
#include "{HEADER}"

{decls}

namespace {{
struct KernelFns {{ int (*valid)(long long, long long, long long);
                   int (*launch)(int, int, int, const void*, const void*, void*, cudaStream_t); }};
struct Bucket {{ int M; int kernel; }};       // kernel -1: the vendor won this bucket
struct Layer {{ int N, K, first, count; }};   // buckets sorted by M
const KernelFns kKernels[] = {{
{fns}
}};
const Bucket kBuckets[] = {{
{bucket_rows}
}};
const Layer kLayers[] = {{
{layer_rows}
}};
const int kLayerCount = {len(layers)};
const int kCC = {cc};
const char kInfo[] =
{_c_string(info)};

int device_status() {{   // 0 this arch, 4 another arch, 5 no device; cached per device
    static std::atomic<int> cache[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return HGEMM_TUNED_NO_DEVICE;
    if (dev >= 0 && dev < 64 && cache[dev].load(std::memory_order_relaxed)) return cache[dev].load() - 1;
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
        return HGEMM_TUNED_NO_DEVICE;
    int status = (major * 10 + minor == kCC) ? HGEMM_TUNED_OK : HGEMM_TUNED_WRONG_ARCH;
    if (dev >= 0 && dev < 64) cache[dev].store(status + 1);
    return status;
}}
}}  // namespace

extern "C" HGEMM_TUNED_API int hgemm_tuned_lookup(int M, int N, int K) {{
    if (M < 1 || N < 1 || K < 1) return -2;
    for (int l = 0; l < kLayerCount; ++l) {{
        const Layer& layer = kLayers[l];
        if (layer.N != N || layer.K != K) continue;
        int best = -1;
        long long best_d = 0;
        for (int i = layer.first; i < layer.first + layer.count; ++i) {{
            const Bucket& b = kBuckets[i];
            if (b.kernel >= 0 && !kKernels[b.kernel].valid(M, N, K)) continue;
            long long d = (long long)M - b.M;
            if (d < 0) d = -d;
            if (best < 0 || d <= best_d) {{ best = i; best_d = d; }}   // ascending M: a tie goes to the larger
        }}
        return best < 0 ? -1 : kBuckets[best].kernel;
    }}
    return -1;
}}

extern "C" HGEMM_TUNED_API int hgemm_tuned_run(int M, int N, int K, const void* A, int lda, const void* B, int ldb,
                                               void* C, int ldc, void* stream) {{
    if (M < 1 || N < 1 || K < 1 || !A || !B || !C || lda < K || ldb < K || ldc < N) return HGEMM_TUNED_BAD_ARGUMENT;
    if (lda != K || ldb != K || ldc != N) return HGEMM_TUNED_NO_KERNEL;   // our kernels read dense rows
    const int k = hgemm_tuned_lookup(M, N, K);
    if (k < 0) return HGEMM_TUNED_NO_KERNEL;
    const int dev = device_status();
    if (dev != HGEMM_TUNED_OK) return dev;
    return kKernels[k].launch(M, N, K, A, B, C, (cudaStream_t)stream);
}}

extern "C" HGEMM_TUNED_API const char* hgemm_tuned_info(void) {{ return kInfo; }}

extern "C" HGEMM_TUNED_API int hgemm_tuned_check_device(void) {{ return device_status(); }}
"""


def header_text(arch: str) -> str:
    return f"""/* hgemm_tuned.h: tuned fp16 GEMMs packaged by hgemm-tune {__version__} for {arch}.
 *
 * C = A * B^T: A is M x K, B is N x K, C is M x N, all fp16 row-major (TN), fp32 accumulation.
 * Link libhgemm_tuned.so; at run time it needs the CUDA driver only (the runtime is linked in).
 * No call allocates or synchronizes; hgemm_tuned_run launches on `stream` (a cudaStream_t, NULL
 * for the legacy default stream) and returns a status, never throws. */
#ifndef HGEMM_TUNED_H
#define HGEMM_TUNED_H

#define HGEMM_TUNED_OK 0
#define HGEMM_TUNED_NO_KERNEL 1      /* no tuned kernel for this call: use the vendor (cuBLAS) */
#define HGEMM_TUNED_BAD_ARGUMENT 2   /* M, N, K < 1, a null pointer, or lda < K, ldb < K, ldc < N */
#define HGEMM_TUNED_LAUNCH_FAILED 3
#define HGEMM_TUNED_WRONG_ARCH 4     /* the current GPU is not {arch} */
#define HGEMM_TUNED_NO_DEVICE 5      /* no CUDA device, or the runtime failed */

#if defined(__GNUC__)
#define HGEMM_TUNED_API __attribute__((visibility("default")))
#else
#define HGEMM_TUNED_API
#endif

#ifdef __cplusplus
extern "C" {{
#endif

/* C = A B^T for any M >= 1 of a tuned (N, K). Strided operands (lda != K, ldb != K, ldc != N)
 * answer HGEMM_TUNED_NO_KERNEL. The first call on a device checks its arch. */
HGEMM_TUNED_API int hgemm_tuned_run(int M, int N, int K, const void* A, int lda, const void* B, int ldb,
                                    void* C, int ldc, void* stream);
/* The kernel hgemm_tuned_run would launch for (M, N, K): its index in the info's "kernels",
 * -1 for the vendor, -2 for a bad argument. Touches no device. */
HGEMM_TUNED_API int hgemm_tuned_lookup(int M, int N, int K);
/* JSON: arch, the export's sha256, the versions, the dispatch rule and table. Touches no device. */
HGEMM_TUNED_API const char* hgemm_tuned_info(void);
/* 0 when the current device is {arch}; HGEMM_TUNED_WRONG_ARCH or HGEMM_TUNED_NO_DEVICE otherwise. */
HGEMM_TUNED_API int hgemm_tuned_check_device(void);

#ifdef __cplusplus
}}
#endif
#endif
"""


# ---- the export -> the kernels and the table -----------------------------------------------

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
        except _NotC as exc:
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

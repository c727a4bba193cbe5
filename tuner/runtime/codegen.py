"""The C and C++ that `hgemm-tune package` generates: space.yaml's launch and constraint
expressions translated to C, one translation unit per kernel (renamed entry point, host
launcher, validity test), the dispatch table, and the public header."""


import ast
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.space import Shape
from tuner.space.expr import Expr
from tuner.version import __version__

LIBRARY = "libhgemm_tuned.so"
HEADER = "hgemm_tuned.h"
INFO = "package.json"
API = ("hgemm_tuned_run", "hgemm_tuned_workspace_size", "hgemm_tuned_lookup", "hgemm_tuned_info",
       "hgemm_tuned_check_device")
STATUS = {0: "ok", 1: "no tuned kernel for this call: use the vendor library", 2: "bad argument",
          3: "launch failed", 4: "this GPU is not the library's arch", 5: "no CUDA device or runtime error",
          6: "workspace too small (ask hgemm_tuned_workspace_size)"}
RULE = ("per (N, K): an exact M runs its bucket's pick; another M runs the pick of the nearest M bucket "
        "(|M - bucket|, ties to the larger bucket) among buckets whose kernel's constraints hold for (M, N, K); "
        "a bucket the vendor won answers 1 (use the vendor); an M below half the smallest bucket, no valid bucket "
        "or another (N, K) answers 1")
SHAPE_NAMES = ("M", "N", "K")


@dataclass
class Kernel:
    """One compiled unit: a family's compile-time config. Several picks (shapes, run-time knobs)
    may share it."""
    index: int
    family: str
    knobs: dict[str, Any]            # compile-time knobs
    artifact: str                    # cubin: a __global__ we launch; library: the family's own host launcher
    source: str
    grid: str = ""                   # cubin only: C expressions over (long long) M, N, K
    block: str = ""
    smem: str = ""

    @property
    def symbol(self) -> str:
        return f"hgemm_tuned_k{self.index}"


@dataclass
class Pick:
    """An export entry's choice: a kernel, its run-time knobs as the launcher's four ints, and
    the family's constraints for the full config as a C test over M, N, K."""
    index: int
    shape: Shape
    kernel: int
    variant: dict[str, Any]
    args: tuple[int, int, int, int]  # cubin: (swizzle_log, 0, 0, 0); library: (raster, swizzle, splits, reduction)
    valid: str


@dataclass
class Packaged:
    directory: Path
    library: Path
    header: Path
    arch: str
    kernels: list[Kernel]
    picks: list[Pick]
    vendor_shapes: list[str]            # buckets whose pick is the vendor (answer status 1)
    skipped: list[str]                  # entries left out, each with why
    layers: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    size_bytes: int = 0
    reused: bool = False                # the library in DIR was already this export's build


# ---- space.yaml expressions -> C -------------------------------------------------------------

_C_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}
_C_FUNCS = {ast.FloorDiv: "hk_floordiv", ast.Mod: "hk_mod"}
_C_CMP = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
_C_CALLS = {"ceil_div": "hk_ceil_div", "min": "hk_min", "max": "hk_max", "abs": "hk_abs"}


class NotC(Exception):
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
        raise NotC(f"{ast.unparse(node)} is {value!r}, not an integer")

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
        raise NotC(f"{ast.unparse(node)} cannot be computed in C at run time")

    def expr(self, expr: Expr) -> str:
        return self.c(expr.tree)


# ---- generated sources ---------------------------------------------------------------------

C_HELPERS = """\
#define HK [[maybe_unused]]
HK static inline long long hk_floordiv(long long a, long long b) {
    if (b == 0) return 0;
    long long q = a / b; return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q; }
HK static inline long long hk_mod(long long a, long long b) { return b == 0 ? 0 : a - hk_floordiv(a, b) * b; }
HK static inline long long hk_ceil_div(long long a, long long b) { return b == 0 ? 0 : -hk_floordiv(-a, b); }
HK static inline long long hk_min(long long a, long long b) { return a < b ? a : b; }
HK static inline long long hk_max(long long a, long long b) { return a > b ? a : b; }
HK static inline long long hk_abs(long long a) { return a < 0 ? -a : a; }
"""


EXPORT = 'extern "C" __attribute__((visibility("default")))'
# Every kernel unit's launcher has this signature; `args` are the pick's four ints.
LAUNCH_SIG = ("int M, int N, int K, const void* A, const void* B, void* C, const int* args, int sm_count, "
              "void* workspace, cudaStream_t stream")
WORKSPACE_SIG = "int M, int N, int K, const int* args, int sm_count"
# The names a library family's source defines outside anonymous namespaces: renamed per kernel,
# so two kernels' classes and entry points never meet at link time (each object's hidden
# symbols are made local after compiling as well: package.py).
LIBRARY_RENAMES = ("hgemm_run", "hgemm_workspace", "hgemm_info", "hgemm_timeline", "hgemm_tune",
                   "hgemm_tma_promotion")


def _cubin_unit(k: Kernel) -> str:
    return f"""#define hgemm {k.symbol}
{k.source}
#undef hgemm
#include <cuda_runtime.h>
namespace {{
{C_HELPERS}}}  // namespace

{EXPORT} size_t {k.symbol}_workspace({WORKSPACE_SIG}) {{
    (void)M; (void)N; (void)K; (void)args; (void)sm_count; return 0; }}

{EXPORT} int {k.symbol}_launch({LAUNCH_SIG}) {{
    (void)sm_count; (void)workspace;
    const long long grid = {k.grid}, block = {k.block}, smem = {k.smem};
    if (grid < 1 || grid > 2147483647LL || block < 1 || block > 1024 || smem < 0) return 2;
    if (smem > 48 * 1024) {{
        cudaError_t e = cudaFuncSetAttribute((const void*){k.symbol}, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)smem);
        if (e != cudaSuccess) return 3;
    }}
    const __half* a = (const __half*)A;
    const __half* b = (const __half*)B;
    __half* c = (__half*)C;
    int swizzle_log = args[0];
    void* params[] = {{(void*)&a, (void*)&b, (void*)&c, (void*)&M, (void*)&N, (void*)&K, (void*)&swizzle_log}};
    cudaError_t e = cudaLaunchKernel((const void*){k.symbol}, dim3((unsigned)grid), dim3((unsigned)block), params,
                                     (size_t)smem, stream);
    return e == cudaSuccess ? 0 : 3;
}}
"""


def _library_unit(k: Kernel) -> str:
    renames = "\n".join(f"#define {n} {n.replace('hgemm', k.symbol, 1)}" for n in LIBRARY_RENAMES)
    undefs = "\n".join(f"#undef {n}" for n in LIBRARY_RENAMES)
    run, ws = f"{k.symbol}_run", f"{k.symbol}_workspace"
    return f"""{renames}
{k.source}
{undefs}

{EXPORT} size_t {k.symbol}_ws({WORKSPACE_SIG}) {{
    return {ws}(M, N, K, args[0], args[1], args[2], args[3], sm_count); }}

{EXPORT} int {k.symbol}_launch({LAUNCH_SIG}) {{
    // the family's codes: 1 CUTLASS refuses the arguments (-> the vendor), 2 workspace set-up, 3 launch
    const int rc = {run}(A, B, C, M, N, K, args[0], args[1], args[2], args[3], 0, sm_count, workspace, stream);
    return rc == 0 ? 0 : rc == 1 ? 1 : 3;
}}
"""


def kernel_unit(k: Kernel) -> str:
    """The family's rendered source with its names made unique, plus the launcher the dispatch
    table calls (`<symbol>_launch`, `<symbol>_ws` for the workspace bytes)."""
    head = f"// hgemm-tune package: kernel {k.index} ({k.family}, {k.artifact}) {json.dumps(k.knobs, sort_keys=True)}\n"
    return head + (_library_unit(k) if k.artifact == "library" else _cubin_unit(k))


def _c_string(text: str) -> str:
    """A C string literal (ASCII JSON: only backslashes and quotes need escaping), in chunks."""
    chunks = [text[i:i + 160].replace("\\", "\\\\").replace('"', '\\"') for i in range(0, len(text), 160)]
    return "\n".join(f'    "{c}"' for c in chunks) or '    ""'


def dispatch_unit(kernels: list[Kernel], picks: list[Pick], layers: list[dict[str, Any]], cc: int, info: str) -> str:
    ws_name = {k.index: f"{k.symbol}_ws" if k.artifact == "library" else f"{k.symbol}_workspace" for k in kernels}
    decls = "\n".join(
        f'extern "C" size_t {ws_name[k.index]}({WORKSPACE_SIG});\n'
        f'extern "C" int {k.symbol}_launch({LAUNCH_SIG});'
        for k in kernels)
    valids = "\n".join(
        f"int pick{p.index}_valid(long long M, long long N, long long K) {{\n"
        f"    (void)M; (void)N; (void)K; return ({p.valid}) ? 1 : 0; }}" for p in picks)
    pick_rows = ",\n".join(
        f"    {{pick{p.index}_valid, {ws_name[p.kernel]}, {kernels[p.kernel].symbol}_launch, "
        f"{{{', '.join(map(str, p.args))}}}}}" for p in picks) or "    {nullptr, nullptr, nullptr, {0, 0, 0, 0}}"
    buckets, rows = [], []
    for layer in layers:
        rows.append(f"    {{{layer['N']}, {layer['K']}, {len(buckets)}, {len(layer['buckets'])}}}")
        buckets += [f"    {{{b['M']}, {-1 if b['pick'] is None else b['pick']}}}" for b in layer["buckets"]]
    bucket_rows = ",\n".join(buckets) or "    {0, -1}"
    layer_rows = ",\n".join(rows) or "    {0, 0, 0, 0}"
    return f"""// Generated by hgemm-tune {__version__} package: the dispatch table and the C API.
#include <atomic>
#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime.h>
#include "{HEADER}"

{decls}

namespace {{
{C_HELPERS}
{valids}

struct PickFns {{ int (*valid)(long long, long long, long long);
                 size_t (*workspace)({WORKSPACE_SIG});
                 int (*launch)({LAUNCH_SIG});
                 int args[4]; }};
struct Bucket {{ int M; int pick; }};         // pick -1: the vendor won this bucket
struct Layer {{ int N, K, first, count; }};   // buckets sorted by M
const PickFns kPicks[] = {{
{pick_rows}
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

struct DeviceState {{ int status; int sm_count; }};

// 0 this arch, 4 another arch, 5 no device; with the SM count. Asked once per device.
DeviceState device_state() {{
    static std::atomic<long long> cache[64];   // (status + 1) << 32 | sm_count; 0: not asked yet
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return {{HGEMM_TUNED_NO_DEVICE, 0}};
    if (dev >= 0 && dev < 64) {{
        const long long v = cache[dev].load(std::memory_order_relaxed);
        if (v) return {{(int)(v >> 32) - 1, (int)(v & 0xffffffff)}};
    }}
    int major = 0, minor = 0, sms = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
        return {{HGEMM_TUNED_NO_DEVICE, 0}};
    const int status = (major * 10 + minor == kCC) ? HGEMM_TUNED_OK : HGEMM_TUNED_WRONG_ARCH;
    if (dev >= 0 && dev < 64) cache[dev].store(((long long)(status + 1) << 32) | (long long)sms);
    return {{status, sms}};
}}
}}  // namespace

extern "C" HGEMM_TUNED_API int hgemm_tuned_lookup(int M, int N, int K) {{
    if (M < 1 || N < 1 || K < 1) return -2;
    for (int l = 0; l < kLayerCount; ++l) {{
        const Layer& layer = kLayers[l];
        if (layer.N != N || layer.K != K) continue;
        // A kernel tuned for M rows is not stretched to far fewer: tile shapes and splits that fill the
        // GPU at M waste it at M/4 (decode at M = 1 ran 0.86x cuBLAS on a 256-row pick). Untuned there: the vendor.
        if (2LL * M < kBuckets[layer.first].M) return -1;
        int best = -1;
        long long best_d = 0;
        for (int i = layer.first; i < layer.first + layer.count; ++i) {{
            const Bucket& b = kBuckets[i];
            if (b.pick >= 0 && !kPicks[b.pick].valid(M, N, K)) continue;
            long long d = (long long)M - b.M;
            if (d < 0) d = -d;
            if (best < 0 || d <= best_d) {{ best = i; best_d = d; }}   // ascending M: a tie goes to the larger
        }}
        return best < 0 ? -1 : kBuckets[best].pick;
    }}
    return -1;
}}

extern "C" HGEMM_TUNED_API size_t hgemm_tuned_workspace_size(int M, int N, int K) {{
    const int p = hgemm_tuned_lookup(M, N, K);
    if (p < 0) return 0;
    const DeviceState dev = device_state();
    if (dev.status != HGEMM_TUNED_OK) return 0;
    return kPicks[p].workspace(M, N, K, kPicks[p].args, dev.sm_count);
}}

extern "C" HGEMM_TUNED_API int hgemm_tuned_run(int M, int N, int K, const void* A, int lda, const void* B, int ldb,
                                               void* C, int ldc, void* workspace, size_t workspace_bytes,
                                               void* stream) {{
    if (M < 1 || N < 1 || K < 1 || !A || !B || !C || lda < K || ldb < K || ldc < N) return HGEMM_TUNED_BAD_ARGUMENT;
    if (lda != K || ldb != K || ldc != N) return HGEMM_TUNED_NO_KERNEL;   // our kernels read dense rows
    // 16-byte loads and TMA descriptors need 16-byte aligned operands (a view into a tensor may not be)
    if (((uintptr_t)A | (uintptr_t)B | (uintptr_t)C) & 15) return HGEMM_TUNED_NO_KERNEL;
    const int p = hgemm_tuned_lookup(M, N, K);
    if (p < 0) return HGEMM_TUNED_NO_KERNEL;
    const DeviceState dev = device_state();
    if (dev.status != HGEMM_TUNED_OK) return dev.status;
    const size_t need = kPicks[p].workspace(M, N, K, kPicks[p].args, dev.sm_count);
    if (need > 0 && (workspace == nullptr || workspace_bytes < need)) return HGEMM_TUNED_WORKSPACE_TOO_SMALL;
    return kPicks[p].launch(M, N, K, A, B, C, kPicks[p].args, dev.sm_count, need ? workspace : nullptr,
                            (cudaStream_t)stream);
}}

extern "C" HGEMM_TUNED_API const char* hgemm_tuned_info(void) {{ return kInfo; }}

extern "C" HGEMM_TUNED_API int hgemm_tuned_check_device(void) {{ return device_state().status; }}
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
#include <stddef.h>

#define HGEMM_TUNED_OK 0
#define HGEMM_TUNED_NO_KERNEL 1      /* no tuned kernel for this call: use the vendor (cuBLAS) */
#define HGEMM_TUNED_BAD_ARGUMENT 2   /* M, N, K < 1, a null pointer, or lda < K, ldb < K, ldc < N */
#define HGEMM_TUNED_LAUNCH_FAILED 3
#define HGEMM_TUNED_WRONG_ARCH 4     /* the current GPU is not {arch} */
#define HGEMM_TUNED_NO_DEVICE 5      /* no CUDA device, or the runtime failed */
#define HGEMM_TUNED_WORKSPACE_TOO_SMALL 6  /* see hgemm_tuned_workspace_size */

#if defined(__GNUC__)
#define HGEMM_TUNED_API __attribute__((visibility("default")))
#else
#define HGEMM_TUNED_API
#endif

#ifdef __cplusplus
extern "C" {{
#endif

/* C = A B^T for any M >= 1 of a tuned (N, K). Strided operands (lda != K, ldb != K, ldc != N)
 * and operands not 16-byte aligned answer HGEMM_TUNED_NO_KERNEL. The first call on a device
 * checks its arch. `workspace`: device memory of at least hgemm_tuned_workspace_size(M, N, K)
 * bytes (split-K / stream-K partials; most calls need none: NULL, 0), owned by the caller and
 * not used by another call at the same time. Nothing here allocates or synchronizes, so a call
 * can be captured into a CUDA graph. */
HGEMM_TUNED_API int hgemm_tuned_run(int M, int N, int K, const void* A, int lda, const void* B, int ldb,
                                    void* C, int ldc, void* workspace, size_t workspace_bytes, void* stream);
/* Bytes of workspace hgemm_tuned_run needs for (M, N, K) on the current device (0 for most). */
HGEMM_TUNED_API size_t hgemm_tuned_workspace_size(int M, int N, int K);
/* The pick hgemm_tuned_run would launch for (M, N, K): its index in the info's "picks",
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

"""Checks on an untrusted template, in order; the first failure is the proposal's outcome."""

from __future__ import annotations

import re

ALLOWED_INCLUDES = {"cuda_fp16.h", "cuda_bf16.h", "mma.h", "cstdint", "stdint.h", "cute/tensor.hpp",
                    "cuda/barrier", "cuda/pipeline", "cuda_pipeline.h"}
ALLOWED_INCLUDE_PREFIXES = ("cute/", "cutlass/")
ENTRY_RE = re.compile(r'extern\s+"C"\s+__global__\s+void(?:\s+__launch_bounds__\([^)]*\))?\s+hgemm\s*\(\s*'
                      r"const\s+__half\s*\*\s*(?:__restrict__\s+)?\w+\s*,\s*const\s+__half\s*\*\s*(?:__restrict__\s+)?"
                      r"\w+\s*,\s*__half\s*\*\s*(?:__restrict__\s+)?\w+\s*,\s*int\s+\w+\s*,\s*int\s+\w+\s*,\s*"
                      r"int\s+\w+\s*,\s*int\s+\w+\s*\)")
# Checked on the whole source, comments included: stripping comments first would let `"//"`
# inside an asm string hide the rest of its line from these checks.
FORBIDDEN = [
    (re.compile(r"\b(cublas|cublasLt|cudnn|cusparse|cufft|cusolver|curand|nccl|nvshmem)\w*"),
     "calls a vendor library (cuBLAS, cuDNN, ...): the kernel must compute the GEMM itself"),
    (re.compile(r"\bcuda(Malloc|Free|Memcpy|Memset|Stream|Event|Graph|Launch|DeviceSynchronize|Host|SetDevice)\w*"),
     "host/runtime API calls (allocation, copies, streams, launches) are not allowed in a kernel file"),
    (re.compile(r"\bcu(Launch|Mem|Ctx|Module|Stream|Event|Graph|Init|TensorMap|Device)\w*\s*\("),
     "CUDA driver API calls are not allowed in a kernel file"),
    (re.compile(r"<<<"), "kernel launches from the template are not allowed"),
    (re.compile(r"\bint\s+main\s*\(|\b__host__\b"), "host code (main, __host__ functions) is not allowed"),
    (re.compile(r"\b(system|popen|fopen|exec\w*|dlopen)\s*\("), "process or file calls are not allowed"),
    (re.compile(r"^\s*#\s*pragma\s+(comment|lib)", re.M), "linker pragmas are not allowed"),
    (re.compile(r"\basm\s*(volatile\s*)?\(\s*\"[^\"]*\b(trap|exit|brkpt)\b"), "trap/exit instructions"),
]
MAX_PRINTF = 0


def static_check(source: str) -> str | None:
    """None if the rendered CUDA is acceptable, else the reason it is not."""
    if not ENTRY_RE.search(source):
        return ('the entry point changed: it must stay extern "C" __global__ void hgemm(const __half* A, '
                "const __half* B, __half* C, int M, int N, int K, int swizzle_log)")
    for inc in re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', source, re.M):
        if inc not in ALLOWED_INCLUDES and not inc.startswith(ALLOWED_INCLUDE_PREFIXES):
            return f"include <{inc}> is not on the allowlist"
    for pattern, why in FORBIDDEN:
        found = pattern.search(source)
        if found:
            return f"{why} (found {found.group(0).strip()!r})"
    if len(re.findall(r"\bprintf\s*\(", source)) > MAX_PRINTF:
        return "printf in a kernel is not allowed"
    return None

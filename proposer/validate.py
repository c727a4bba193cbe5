"""Checks on an untrusted template, in order; the first failure is the proposal's outcome."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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
RENDER_TIMEOUT_S = 20.0
RENDER_MEMORY_BYTES = 2 << 30
MAX_SOURCE_CHARS = 4 << 20


def render_sandboxed(template: str, params: dict[str, Any], timeout_s: float = RENDER_TIMEOUT_S) -> str:
    """Render in a Jinja2 SandboxedEnvironment with no loader (no filesystem, no imports, no
    Python internals), in a child process bounded in time and memory: a template is code, and
    `{% for %}` nests or `'x' * 10**10` would otherwise stall or exhaust the tuner."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    try:
        proc = subprocess.run([sys.executable, "-m", "proposer.validate"], input=json.dumps(
            {"template": template, "params": params}), capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise ValueError(f"template does not render: rendering ran past {timeout_s:g} s") from None
    try:
        reply = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise ValueError(f"template does not render: the renderer died (exit code {proc.returncode}): "
                         f"{proc.stderr.strip()[-300:]}") from None
    if not reply["ok"]:
        raise ValueError(reply["error"])
    return reply["source"]


def _render(template: str, params: dict[str, Any]) -> str:
    import jinja2
    from jinja2.sandbox import SandboxedEnvironment

    # As tuner.render renders (same options): the same config gives the same source, one cache entry.
    env = SandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True,
                               loader=None)
    try:
        source = env.from_string(template).render(**params)
    except jinja2.exceptions.SecurityError as exc:
        raise ValueError(f"sandbox violation: {exc}") from None
    except MemoryError:
        raise ValueError(f"template does not render: over the {RENDER_MEMORY_BYTES >> 30} GiB memory limit") from None
    except Exception as exc:  # noqa: BLE001 - syntax errors, undefined names, `{% include %}` without a loader, ...
        raise ValueError(f"template does not render: {type(exc).__name__}: {exc}") from None
    if len(source) > MAX_SOURCE_CHARS:
        raise ValueError(f"template does not render: {len(source)} characters of CUDA is not a kernel")
    return source


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


def main() -> None:
    """The renderer child: one JSON job on stdin, one JSON reply on stdout."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (RENDER_MEMORY_BYTES, RENDER_MEMORY_BYTES))
    job = json.loads(sys.stdin.read())
    try:
        reply = {"ok": True, "source": _render(job["template"], job["params"])}
    except ValueError as exc:
        reply = {"ok": False, "error": str(exc)}
    sys.stdout.write(json.dumps(reply))


if __name__ == "__main__":
    main()

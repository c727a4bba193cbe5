"""Checks on an untrusted template, in order; the first failure is the proposal's outcome."""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import tempfile
from pathlib import Path

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
DEPS_TIMEOUT_S = 120.0
CANDIDATE = "kernel.cu"  # the file name nvcc sees for a candidate (as tuner.build.compile writes it)
INCLUDE_REJECTED = ("includes a file that is missing or outside the allowed headers (cute/, cutlass/, the CUDA "
                    "toolkit's and the compiler's system headers)")


def static_check(source: str) -> str | None:
    """None if the rendered CUDA is acceptable, else the reason it is not."""
    if not ENTRY_RE.search(source):
        return ('the entry point changed: it must stay extern "C" __global__ void hgemm(const __half* A, '
                "const __half* B, __half* C, int M, int N, int K, int swizzle_log)")
    why = _literal_includes(source)
    if why:
        return why
    for pattern, why in FORBIDDEN:
        found = pattern.search(source)
        if found:
            return f"{why} (found {found.group(0).strip()!r})"
    if len(re.findall(r"\bprintf\s*\(", source)) > MAX_PRINTF:
        return "printf in a kernel is not allowed"
    return None


# --- includes: a cheap literal filter, then what the preprocessor really reads -------------------

_DIRECTIVE = re.compile(r"^[ \t]*(?:#|%:|\?\?=)[ \t]*(\w+)(.*)$", re.M)  # `%:` digraph, `??=` trigraph
_LITERAL_INCLUDE = re.compile(r'[ \t]*(?:<([^<>"\n]+)>|"([^<>"\n]+)")[ \t]*(?://.*)?$')


def _strip_block_comments(text: str) -> str:
    """`/* ... */` replaced by a space, as the preprocessor does (a linear scan: no regex that
    could backtrack over thousands of unterminated openers)."""
    out, i = [], 0
    while True:
        j = text.find("/*", i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        k = text.find("*/", j + 2)
        if k < 0:
            return "".join(out)  # an unterminated comment runs to the end
        out.append(" ")
        i = k + 2


def _literal_includes(source: str) -> str | None:
    """The first filter, on the text: every include is a literal allowlisted name. It cannot see
    what macros build; `dependency_check` asks the preprocessor."""
    text = _strip_block_comments(re.sub(r"\\[ \t]*\r?\n", "", source))  # line splices first, as translation does
    for m in _DIRECTIVE.finditer(text):
        name, rest = m.group(1), m.group(2)
        if name in ("include_next", "import"):
            return f"#{name} is not allowed: use #include with an allowlisted header"
        if name != "include":
            continue
        lit = _LITERAL_INCLUDE.match(rest)
        if not lit:
            return "#include must name a header literally (<...> or \"...\"), not through a macro"
        inc = lit.group(1) or lit.group(2)
        if inc not in ALLOWED_INCLUDES and not inc.startswith(ALLOWED_INCLUDE_PREFIXES):
            return f"include <{inc}> is not on the allowlist"
        if ".." in re.split(r"[/\\]+", inc) or "\\" in inc:
            return f"include <{inc}> leaves its folder ('..' or a backslash in the path)"
    return None


@functools.cache
def allowed_header_roots() -> tuple[Path, ...]:
    """Folders a candidate's dependencies may lie in: CUTLASS/CuTe, the CUDA toolkit's include
    folders as nvcc itself passes them, and the host compiler's system include folders."""
    from tuner.build import cutlass_include, nvcc_path

    nvcc = nvcc_path()
    roots = [cutlass_include()]
    dry = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", "-"], input="", capture_output=True, text=True,
                         timeout=60, check=False).stderr
    host = "gcc"
    for line in dry.splitlines():
        line = line.removeprefix("#$ ").strip()
        try:
            words = shlex.split(line.split("=", 1)[1] if line.startswith(("INCLUDES=", "SYSTEM_INCLUDES=")) else line)
        except ValueError:
            continue
        if line.startswith(("INCLUDES=", "SYSTEM_INCLUDES=")):
            roots += [w[2:] for w in words if w.startswith("-I") and len(w) > 2]
            roots += [b for a, b in zip(words, words[1:], strict=False) if a in ("-I", "-isystem")]
        elif "-E" in words and words and not line.startswith("_"):
            host = words[0]
    top = Path(os.path.realpath(nvcc)).parent.parent
    roots += [top / "include", *(top / "targets").glob("*/include")]
    try:
        verbose = subprocess.run([host, "-x", "c++", "-E", "-v", "-"], input="", capture_output=True, text=True,
                                 timeout=60, check=False).stderr
        listing = verbose.split("#include <...> search starts here:", 1)[1].split("End of search list.", 1)[0]
        roots += [ln.strip() for ln in listing.splitlines() if ln.strip()]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        roots += ["/usr/include"]
    real = (Path(os.path.realpath(r)) for r in roots)
    return tuple(dict.fromkeys(r for r in real if r.is_dir() and r != Path("/")))


def _make_deps(listing: str) -> list[str]:
    """The prerequisites of a make rule as `-M` writes it (`target: dep dep \\` lines)."""
    deps = []
    for rule in listing.replace("\\\n", " ").splitlines():
        _, colon, rest = rule.partition(": ")
        if not colon:
            _, colon, rest = rule.partition(":")
        for word in re.findall(r"(?:\\.|[^\s\\])+", rest if colon else rule):
            deps.append(re.sub(r"\\(.)", r"\1", word).replace("$$", "$"))
    return deps


def dependency_check(source: str, arch: str, artifact: str = "cubin", timeout_s: float = DEPS_TIMEOUT_S) -> str | None:
    """None if every file the compiler reads for `source` (host and device passes, with
    tuner.build.compile's flags) lies under `allowed_header_roots`, else the reason. Macro-built,
    comment- or line-spliced, `#import` / `#include_next` and `cute/../..` includes all end
    here, as the preprocessor resolves them. The reason never holds another file's text."""
    from tuner.build import nvcc_flags, nvcc_path
    from tuner.errors import UserError

    try:
        nvcc, flags, roots = nvcc_path(), nvcc_flags(arch, artifact), allowed_header_roots()
    except (UserError, OSError, subprocess.TimeoutExpired) as exc:
        return f"its includes cannot be checked: {exc}"
    with tempfile.TemporaryDirectory(prefix="hgemm-deps-") as tmp:
        src = Path(tmp) / CANDIDATE
        src.write_text(source)
        try:
            proc = subprocess.run([nvcc, *flags, "-M", str(src)], capture_output=True, text=True, errors="replace",
                                  timeout=timeout_s, cwd=tmp, check=False)
        except subprocess.TimeoutExpired:
            return f"its includes cannot be checked: the preprocessor ran past {timeout_s:g} s"
        except OSError as exc:
            return f"its includes cannot be checked: nvcc did not run: {exc}"
        if proc.returncode != 0:
            log = proc.stderr + proc.stdout
            if re.search(r"No such file or directory|cannot open source file|Permission denied|Is a directory", log):
                return INCLUDE_REJECTED  # the same answer as outside the roots: no file-existence oracle
            return "the preprocessor rejects it: " + candidate_errors(log, src)
        me = Path(os.path.realpath(src))
        for dep in _make_deps(proc.stdout):
            path = Path(os.path.realpath(os.path.join(tmp, dep)))
            if path == me or path == me.with_suffix(".o"):
                continue
            if not any(path.is_relative_to(root) for root in roots):
                return INCLUDE_REJECTED
    return None


# --- compiler output: only the candidate's own lines go back to the model -------------------------

_CANDIDATE_LINE = re.compile(r"\s*((?:[^\s:()\"]*/)?" + re.escape(CANDIDATE) + r")(?=\(\d+\)|:\d+)")
_OWN_PREFIX = re.compile(r"(nvcc exit -?\d+|nvcc timed out after [\d.]+ s|rejected before nvcc|nvcc did not run)")


def candidate_errors(text: str, src: Path | str | None = None, max_lines: int = 12, max_line: int = 300,
                     max_chars: int = 1500) -> str:
    """Compiler output reduced to the lines about the candidate's own source (`kernel.cu(12):
    error ...`), the path shortened to its name, control characters removed, capped. Lines
    about any other file (headers, or a file a directive named) never pass: their text may be
    that file's content."""
    text = text or ""
    head = ""
    own = _OWN_PREFIX.match(text)
    if own:
        head = own.group(1)
        if head == "rejected before nvcc" or head.startswith("nvcc did not run"):
            return terminal_safe(text.splitlines()[0] if text else "", one_line=True)[:max_line]
        if head.startswith("nvcc timed out"):
            return head
        text = text[own.end():].lstrip(": ")
    keep: list[str] = []
    for line in text.splitlines():
        m = _CANDIDATE_LINE.match(line)
        if m and (src is None or m.group(1) in (CANDIDATE, str(src)) or m.group(1).endswith("/" + CANDIDATE)):
            keep.append(terminal_safe(CANDIDATE + line[m.end(1):], one_line=True)[:max_line])
        if len(keep) >= max_lines:
            break
    body = "\n".join(keep)[:max_chars] or "(no error reported in the candidate's own lines)"
    return f"{head}: {body}" if head else body


# --- anything printed or logged ---------------------------------------------------------------

_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]?"              # CSI: colours, cursor moves, erase
                      r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"     # OSC: window title, hyperlinks, clipboard
                      r"|\x1b[PX^_][^\x1b]*(?:\x1b\\)?"          # DCS, SOS, PM, APC strings
                      r"|\x1b.?", re.S)                          # any other escape
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2066-\u2069\ufeff"
                       r"\ud800-\udfff]")


def terminal_safe(text: str, one_line: bool = False) -> str:
    """`text` without terminal escape sequences, control characters (C0 but newline and tab, C1:
    `\\x9b` is a CSI on 8-bit terminals), bidi overrides and lone surrogates; `one_line` folds
    newlines and tabs into spaces too."""
    text = _CONTROLS.sub("", _ESCAPES.sub("", str(text)))
    if one_line:
        text = re.sub(r"[\n\t]+", " ", text).strip()
    return text


def sass_traps(binary: str | None) -> int:
    """BPT instructions (trap, breakpoint) in a built cubin's SASS: every spelling of a trap in
    the source (split string literals, __trap(), __brkpt(), a macro) compiles to one. The shipped
    cubin families have none. 0 when there is no binary to read; a missing cuobjdump is an error
    (tuner.build.sass says how to install it)."""
    if not binary:
        return 0
    from tuner.build.sass import dump_sass

    return sum(1 for line in dump_sass(binary).splitlines() if " BPT." in line or "\tBPT." in line)

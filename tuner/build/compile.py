"""nvcc: CUDA source -> device-only cubin (or a host+device shared library), cached, in
parallel, with a per-job timeout.

Most families are device-only cubins (fast to build, loaded by cupy). A family whose
kernel needs host-side set-up per call (TMA descriptors, tile-scheduler parameters:
cute_sm90) is built as a shared library instead; space.yaml says which (`artifact`)."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tuner.errors import UserError

DEFAULT_CACHE = Path(os.environ.get("HGEMM_TUNE_CACHE", Path.home() / ".cache" / "hgemm-tune" / "cubins"))
DEFAULT_TIMEOUT_S = 240.0


@dataclass
class CompileResult:
    ok: bool
    key: str
    cubin: str | None          # path of the cached binary: a .cubin, or a .so for library families
    seconds: float             # wall time of nvcc (0 for a cache hit)
    cached: bool
    error: str | None = None   # compiler output on failure (kept for the report and the proposer)
    registers: int | None = None
    spill_bytes: int | None = None
    digest: str | None = None  # sha256 of the binary when it was built: checked again before it is loaded

    def to_dict(self) -> dict:
        return asdict(self)


def nvcc_path() -> str:
    found = shutil.which("nvcc") or next(
        (p for p in ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc") if os.path.exists(p)), None)
    if not found:
        raise UserError("nvcc not found: install the CUDA toolkit or put nvcc on PATH")
    return found


@functools.cache
def nvcc_version() -> str:
    out = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True, check=False).stdout
    match = re.search(r"release [\d.]+, V([\d.]+)", out)
    return match.group(1) if match else out.strip().splitlines()[-1]


@functools.cache
def cutlass_include() -> Path:
    """CUTLASS/CuTe headers shipped inside the nvidia-cutlass wheel (package cutlass_library)."""
    override = os.environ.get("HGEMM_TUNE_CUTLASS_INCLUDE")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("CUTLASS headers not found: pip install nvidia-cutlass (or set HGEMM_TUNE_CUTLASS_INCLUDE)")
    include = Path(next(iter(spec.submodule_search_locations))) / "source" / "include"
    if not (include / "cute" / "tensor.hpp").is_file():
        raise UserError(f"CUTLASS headers not found under {include}: reinstall nvidia-cutlass")
    return include


@functools.cache
def cutlass_version() -> str:
    try:
        return importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


ARTIFACTS = {"cubin": ".cubin", "library": ".so"}


def nvcc_flags(arch: str, artifact: str = "cubin") -> list[str]:
    # -gencode with code=sm_XX only: one device pass and no embedded PTX (nothing to JIT later).
    virtual = "compute_" + arch.removeprefix("sm_")
    # A library links the CUDA runtime statically: it loads in any process, whatever cudart it has.
    # Its host pass is gcc parsing ~11 MB of CUTLASS: a larger garbage-collector heap (about
    # +140 MB per job) saves ~0.5 s of gcc's ~6 s and leaves the object file byte-identical.
    kind = ["-cubin"] if artifact == "cubin" else [
        "-shared", "-Xcompiler=-fPIC", "-cudart=static",
        "-Xcompiler=--param=ggc-min-expand=100,--param=ggc-min-heapsize=1048576"]
    return [*kind, "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
            f"-gencode=arch={virtual},code={arch}", "-Xptxas=-v", f"-I{cutlass_include()}"]


def cache_key(source: str, arch: str, artifact: str = "cubin") -> str:
    h = hashlib.sha256()
    # The CUTLASS include path is left out (its version is in): a cache built in one venv
    # or machine is valid in another with the same nvcc and CUTLASS.
    flags = [f for f in nvcc_flags(arch, artifact) if not f.startswith("-I")]
    for part in (source, " ".join(flags), nvcc_version(), cutlass_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _parse_ptxas(log: str) -> tuple[int | None, int | None]:
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return (int(regs[-1]) if regs else None, int(spills[-1]) if spills else None)


def file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def private_cache(cache_dir: Path) -> Path:
    """The cache folder, created for this user alone (0700). One that another user owns or may
    write to is refused: a binary planted there would be loaded and run (a library's
    constructors run on load)."""
    cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = cache_dir.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise UserError(f"compile cache {cache_dir} belongs to another user (uid {st.st_uid}); "
                        "set HGEMM_TUNE_CACHE to a folder of your own")
    if st.st_mode & 0o022:
        raise UserError(f"compile cache {cache_dir} is writable by other users (mode {oct(st.st_mode & 0o777)}); "
                        f"run `chmod go-w {cache_dir}` or set HGEMM_TUNE_CACHE to a private folder")
    return cache_dir


def _cached(binary: Path, digest_file: Path) -> str | None:
    """The recorded digest of a cached binary if the binary still has it, else None (absent,
    recorded by an older version, or changed since it was built: built again)."""
    if not binary.is_file() or not digest_file.is_file():
        return None
    recorded = digest_file.read_text().strip()
    return recorded if recorded == file_digest(binary) else None


def compile_source(source: str, arch: str, cache_dir: Path = DEFAULT_CACHE,
                   timeout_s: float = DEFAULT_TIMEOUT_S, artifact: str = "cubin") -> CompileResult:
    if artifact not in ARTIFACTS:
        raise UserError(f"unknown artifact {artifact!r}; one of {', '.join(ARTIFACTS)}")
    key = cache_key(source, arch, artifact)
    private_cache(cache_dir)
    cubin = cache_dir / f"{key}{ARTIFACTS[artifact]}"
    meta = cache_dir / f"{key}.log"
    digest_file = cache_dir / f"{key}.sha256"
    digest = _cached(cubin, digest_file)
    if digest is not None:
        regs, spills = _parse_ptxas(meta.read_text()) if meta.is_file() else (None, None)
        return CompileResult(True, key, str(cubin), 0.0, True, None, regs, spills, digest)
    with tempfile.TemporaryDirectory(prefix="hgemm-nvcc-") as tmp:
        src = Path(tmp) / "kernel.cu"
        src.write_text(source)
        out = Path(tmp) / f"kernel{ARTIFACTS[artifact]}"
        start = time.perf_counter()
        try:
            proc = subprocess.run([nvcc_path(), *nvcc_flags(arch, artifact), "-o", str(out), str(src)],
                                  capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return CompileResult(False, key, None, time.perf_counter() - start, False,
                                 f"nvcc timed out after {timeout_s:.0f} s")
        except OSError as exc:  # nvcc vanished or cannot run: this trial fails, the study goes on
            return CompileResult(False, key, None, time.perf_counter() - start, False, f"nvcc did not run: {exc}")
        seconds = time.perf_counter() - start
        log = proc.stdout + proc.stderr
        if proc.returncode != 0 or not out.is_file():
            # Keep the first errors: they name the line, the rest is usually template noise.
            errors = [ln for ln in log.splitlines() if "error" in ln.lower()]
            text = "\n".join(errors[:20]) or log[-4000:]
            return CompileResult(False, key, None, seconds, False, f"nvcc exit {proc.returncode}: {text}")
        digest = file_digest(out)
        tmp_cubin = cache_dir / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp_digest = tmp_cubin.with_suffix(".sha256tmp")
        shutil.copyfile(out, tmp_cubin)
        tmp_digest.write_text(digest + "\n")
        meta.write_text(log)
        os.replace(tmp_cubin, cubin)  # atomic: a concurrent reader never sees half a cubin
        os.replace(tmp_digest, digest_file)
    regs, spills = _parse_ptxas(log)
    return CompileResult(True, key, str(cubin), seconds, False, None, regs, spills, digest)


class CompilePool:
    """One nvcc job per core; jobs are (source, arch) and results come back as futures."""

    def __init__(self, jobs: int | None = None, cache_dir: Path = DEFAULT_CACHE,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.jobs = jobs or os.cpu_count() or 1
        self.cache_dir = cache_dir
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=self.jobs, thread_name_prefix="nvcc")
        self._in_flight: dict[tuple[str, str, str], Future] = {}
        self._lock = threading.RLock()  # a build done before add_done_callback calls back at once

    def submit(self, source: str, arch: str, artifact: str = "cubin") -> Future:
        # Two configs that differ only in run-time knobs render the same source: while its build
        # runs, they share one nvcc job (a finished one is looked up in the disk cache instead).
        job = (hashlib.sha256(source.encode()).hexdigest(), arch, artifact)
        with self._lock:
            future = self._in_flight.get(job)
            if future is None or future.done():
                future = self._pool.submit(compile_source, source, arch, self.cache_dir, self.timeout_s, artifact)
                self._in_flight[job] = future
                future.add_done_callback(lambda f, job=job: self._forget(job, f))
            return future

    def _forget(self, job: tuple[str, str, str], future: Future) -> None:
        with self._lock:
            if self._in_flight.get(job) is future:
                del self._in_flight[job]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

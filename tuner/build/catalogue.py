"""A kernel catalogue: compiled kernels of chosen compile-time configs, packed into one
content-addressed zip built on a machine without a GPU ([0034](../../docs/decisions/0034-kernel-catalogue.md)).

Every family's kernels take M, N, K and the run-time knobs as arguments, so one binary serves
every shape: a catalogue built once spares a GPU run the nvcc time of the configs it holds.

    manifest.json           the toolchain record and one record per kernel (see `Kernel`)
    kernels/<key>.cubin|.so the binaries, named by their compile-cache key
    kernels/<key>.log       nvcc's ptxas output (registers, spills), as the cache keeps it
    sources/<key>.cu        the rendered source: its hash and cache key are checked on reading

A catalogue is used only whole and only where it is exactly valid: same nvcc, same CUTLASS,
same arch, same templates (their hashes), same flags (each kernel's cache key recomputed from
its source), every binary's sha256 as recorded. Anything else is a `UserError`, never a
silent rebuild or a stale binary.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tuner.build.compile import (
    ARTIFACTS,
    DEFAULT_CACHE,
    CompilePool,
    CompileResult,
    _cached,
    cache_key,
    cutlass_version,
    nvcc_version,
    private_cache,
)
from tuner.build.render import source_hash, template_hash
from tuner.errors import UserError
from tuner.space import Space
from tuner.version import __version__

FORMAT = "hgemm-tune-catalogue/1"
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed member times: the same content packs to the same bytes


@dataclass(frozen=True)
class Toolchain:
    """What the catalogue's binaries were built with; a reader refuses any difference."""

    nvcc: str
    cutlass: str
    arch: str
    tool: str                                 # hgemm-tune's version (informative)
    template_hashes: dict[str, str]           # family -> template_hash of the families it holds

    @classmethod
    def current(cls, arch: str, families: list[Any]) -> Toolchain:
        return cls(nvcc_version(), cutlass_version(), arch, __version__,
                   {f.name: template_hash(f) for f in sorted(families, key=lambda f: f.name)})


@dataclass
class Kernel:
    """One compiled kernel of the catalogue."""

    family: str
    config: dict[str, Any]                    # compile-time knobs (run-time knobs are kernel arguments)
    accumulate: str
    template_hash: str
    source_hash: str                          # tuner.build.source_hash of the rendered source
    cache_key: str                            # tuner.build.cache_key(source, arch, artifact)
    artifact: str                             # cubin | library
    sha256: str                               # of the binary
    size: int                                 # bytes of the binary
    registers: int | None
    spill_bytes: int | None
    compile_s: float                          # nvcc wall time when it was built (0: taken from a cache)
    reasons: list[str] = field(default_factory=list)  # why it is here: export entries, seeds of shapes, defaults

    @property
    def binary(self) -> str:
        return f"kernels/{self.cache_key}{ARTIFACTS[self.artifact]}"

    @property
    def log(self) -> str:
        return f"kernels/{self.cache_key}.log"

    @property
    def source(self) -> str:
        return f"sources/{self.cache_key}.cu"


@dataclass
class Catalogue:
    path: Path
    toolchain: Toolchain
    kernels: list[Kernel]
    digest: str                               # content digest (toolchain + every kernel's key and sha256)

    def read(self, member: str) -> bytes:
        with zipfile.ZipFile(self.path) as z:
            return z.read(member)

    def by_source(self) -> dict[str, Kernel]:
        return {k.source_hash: k for k in self.kernels}

    def configs(self, families: list[str], accumulate: str) -> list[tuple[str, dict[str, Any]]]:
        """(family, compile config) of the kernels of these families for this accumulation, in
        catalogue order: what a fresh study tries first."""
        return [(k.family, dict(k.config)) for k in self.kernels if k.family in families and k.accumulate == accumulate]


@dataclass
class Job:
    """A config to put in a catalogue (built by tuner.api from an export, seeds or defaults)."""

    family: str
    config: dict[str, Any]
    accumulate: str
    source: str
    artifact: str
    reason: str


@dataclass
class BuildSummary:
    catalogue: Catalogue
    compiled: int                             # nvcc ran
    from_cache: int                           # found in the compile cache (built before, elsewhere)
    reused: int                               # already in the previous catalogue: not built at all
    failed: list[tuple[Job, str]]             # not in the catalogue: (job, nvcc's error)
    compile_s: list[float]                    # nvcc seconds of each kernel compiled now


def content_digest(toolchain: Toolchain, kernels: list[Kernel]) -> str:
    body = {"toolchain": asdict(toolchain), "kernels": sorted([k.cache_key, k.sha256] for k in kernels)}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# ---- reading ---------------------------------------------------------------------------

def read_catalogue(path: Path) -> Catalogue:
    """The catalogue at `path`, its manifest and every member checked against it (digests,
    source hashes); says nothing yet of whether it fits this toolchain (`check_catalogue`)."""
    path = Path(path)
    try:
        z = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise UserError(f"catalogue {path} does not exist") from None
    except (OSError, zipfile.BadZipFile) as exc:
        raise UserError(f"catalogue {path} cannot be read: {exc}") from None
    with z:
        try:
            manifest = json.loads(z.read("manifest.json"))
            if manifest.get("format") != FORMAT:
                raise UserError(f"catalogue {path}: format {manifest.get('format')!r}, not {FORMAT}")
            toolchain = Toolchain(**manifest["toolchain"])
            kernels = [Kernel(**k) for k in manifest["kernels"]]
        except UserError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"catalogue {path}: bad manifest.json ({type(exc).__name__}: {exc})") from None
        digest = content_digest(toolchain, kernels)
        if manifest.get("digest") != digest:
            raise UserError(f"catalogue {path}: manifest digest {str(manifest.get('digest'))[:12]} does not match "
                            f"its content ({digest[:12]}): the manifest was changed")
        names = set(z.namelist())
        for k in kernels:
            if k.artifact not in ARTIFACTS:
                raise UserError(f"catalogue {path}: kernel {k.cache_key}: unknown artifact {k.artifact!r}")
            missing = [m for m in (k.binary, k.log, k.source) if m not in names]
            if missing:
                raise UserError(f"catalogue {path}: kernel {k.cache_key} ({k.family}) lacks {missing[0]}")
            if hashlib.sha256(z.read(k.binary)).hexdigest() != k.sha256:
                raise UserError(f"catalogue {path}: {k.binary} ({k.family}) does not have its recorded sha256: "
                                "the binary was changed")
            if source_hash(z.read(k.source).decode()) != k.source_hash:
                raise UserError(f"catalogue {path}: {k.source} ({k.family}) does not have its recorded source hash")
    return Catalogue(path, toolchain, kernels, digest)


def check_catalogue(cat: Catalogue, space: Space, arch: str | None = None) -> None:
    """Refuse, in one line, a catalogue that this toolchain, arch or these templates would not
    have built byte for byte: its binaries would not be what a build here gives."""
    tc, where = cat.toolchain, f"catalogue {cat.path}"
    if arch is not None and tc.arch != arch:
        raise UserError(f"{where} was built for {tc.arch}, not {arch}: build one for {arch}")
    if tc.nvcc != nvcc_version():
        raise UserError(f"{where} was built with nvcc {tc.nvcc}, this machine has nvcc {nvcc_version()}: rebuild it")
    if tc.cutlass != cutlass_version():
        raise UserError(f"{where} was built with CUTLASS {tc.cutlass}, this machine has CUTLASS "
                        f"{cutlass_version()}: rebuild it")
    for name, recorded in sorted(tc.template_hashes.items()):
        if name not in space.families:
            raise UserError(f"{where} holds family {name}, which the space does not have")
        now = template_hash(space.family(name))
        if now != recorded:
            raise UserError(f"{where}: template of {name} has changed since it was built (hash {recorded}, "
                            f"now {now}): rebuild it")
    for k in cat.kernels:
        if k.family not in tc.template_hashes or k.template_hash != tc.template_hashes[k.family]:
            raise UserError(f"{where}: kernel {k.cache_key} ({k.family}) has template hash {k.template_hash}, "
                            "not the catalogue's")
    with zipfile.ZipFile(cat.path) as z:
        for k in cat.kernels:
            if cache_key(z.read(k.source).decode(), tc.arch, k.artifact) != k.cache_key:
                raise UserError(f"{where}: kernel {k.cache_key} ({k.family}) was built with other nvcc flags: "
                                "rebuild it")


def install(cat: Catalogue, cache_dir: Path = DEFAULT_CACHE) -> int:
    """Unpack the binaries into the compile cache under their cache keys, with their digests
    and ptxas logs, so `compile_source` finds each one built; returns how many were new there."""
    private_cache(cache_dir)
    added = 0
    with zipfile.ZipFile(cat.path) as z:
        for k in cat.kernels:
            binary = cache_dir / f"{k.cache_key}{ARTIFACTS[k.artifact]}"
            digest_file = cache_dir / f"{k.cache_key}.sha256"
            if _cached(binary, digest_file) == k.sha256:
                continue
            tmp = cache_dir / f".{k.cache_key}.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp_digest = tmp.with_suffix(".sha256tmp")
            tmp.write_bytes(z.read(k.binary))
            tmp_digest.write_text(k.sha256 + "\n")
            (cache_dir / f"{k.cache_key}.log").write_bytes(z.read(k.log))
            os.replace(tmp, binary)
            os.replace(tmp_digest, digest_file)
            added += 1
    return added


def open_catalogue(path: Path, space: Space, arch: str, cache_dir: Path = DEFAULT_CACHE) -> Catalogue:
    """Read, verify and check a catalogue, and load it into the compile cache."""
    cat = read_catalogue(path)
    check_catalogue(cat, space, arch)
    install(cat, cache_dir)
    return cat


# ---- writing ---------------------------------------------------------------------------

def write_catalogue(path: Path, toolchain: Toolchain, members: list[tuple[Kernel, bytes, bytes, bytes]]) -> Catalogue:
    """Pack (kernel, binary, ptxas log, source) into `path` (written beside it, then renamed)."""
    kernels = sorted((m[0] for m in members), key=lambda k: (k.family, k.cache_key))
    digest = content_digest(toolchain, kernels)
    manifest = {"format": FORMAT, "digest": digest, "toolchain": asdict(toolchain),
                "kernels": [asdict(k) for k in kernels]}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")

    def put(z: zipfile.ZipFile, name: str, data: bytes) -> None:
        z.writestr(zipfile.ZipInfo(name, _ZIP_TIME), data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)

    with zipfile.ZipFile(tmp, "w") as z:
        put(z, "manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())
        for k, binary, log, source in sorted(members, key=lambda m: (m[0].family, m[0].cache_key)):
            put(z, k.binary, binary)
            put(z, k.log, log)
            put(z, k.source, source)
    os.replace(tmp, path)
    return Catalogue(path, toolchain, kernels, digest)


def build_catalogue(output: Path, jobs: list[Job], arch: str, space: Space, pool: CompilePool,
                    previous: Catalogue | None = None,
                    on_done: Callable[[int, int], None] | None = None) -> BuildSummary:
    """Compile the jobs not already in `previous` (by source hash) in the pool and pack them,
    with every kernel of `previous`, into `output`. Jobs of one source become one kernel that
    keeps every reason. Failed builds are left out and reported."""
    if previous is not None:
        check_catalogue(previous, space, arch)
    kept: dict[str, tuple[Kernel, Catalogue | None, CompileResult | None, str]] = {}
    if previous is not None:
        for k in previous.kernels:
            kept[k.source_hash] = (k, previous, None, "")
    reused_hashes: set[str] = set()
    todo: dict[str, tuple[Job, list[str]]] = {}
    for job in jobs:
        h = source_hash(job.source)
        if h in kept:
            k = kept[h][0]
            if job.reason not in k.reasons:
                k.reasons.append(job.reason)
            reused_hashes.add(h)
        elif h in todo:
            if job.reason not in todo[h][1]:
                todo[h][1].append(job.reason)
        else:
            todo[h] = (job, [job.reason])
    futures = [(h, job, reasons, pool.submit(job.source, arch, job.artifact)) for h, (job, reasons) in todo.items()]
    compiled = from_cache = 0
    seconds: list[float] = []
    failed: list[tuple[Job, str]] = []
    for i, (h, job, reasons, future) in enumerate(futures):
        res: CompileResult = future.result()
        if on_done:
            on_done(i + 1, len(futures))
        if not res.ok or res.cubin is None:
            failed.append((job, res.error or "no binary"))
            continue
        if res.cached:
            from_cache += 1
        else:
            compiled += 1
            seconds.append(res.seconds)
        fam = space.family(job.family)
        binary = Path(res.cubin).read_bytes()
        sha = hashlib.sha256(binary).hexdigest()
        if res.digest and sha != res.digest:
            raise UserError(f"compile cache: {res.cubin} changed after it was built; remove it and build again")
        kernel = Kernel(job.family, fam.compile_config(job.config), job.accumulate, template_hash(fam), h, res.key,
                        job.artifact, sha, len(binary), res.registers, res.spill_bytes, round(res.seconds, 2),
                        reasons)
        kept[h] = (kernel, None, res, job.source)
    members = []
    for kernel, cat, res, source in kept.values():
        if cat is not None:
            with zipfile.ZipFile(cat.path) as z:
                members.append((kernel, z.read(kernel.binary), z.read(kernel.log), z.read(kernel.source)))
        else:
            assert res is not None and res.cubin is not None
            log = Path(res.cubin).with_suffix(".log")
            members.append((kernel, Path(res.cubin).read_bytes(), log.read_bytes() if log.is_file() else b"",
                            source.encode()))
    families = sorted({k.family for k, *_ in members})
    toolchain = Toolchain.current(arch, [space.family(f) for f in families])
    cat = write_catalogue(output, toolchain, members)
    return BuildSummary(cat, compiled, from_cache, len(reused_hashes), failed, seconds)


__all__ = ["BuildSummary", "Catalogue", "Job", "Kernel", "Toolchain", "build_catalogue", "check_catalogue",
           "content_digest", "install", "open_catalogue", "read_catalogue", "write_catalogue"]

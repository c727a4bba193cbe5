"""The kernel catalogue: built with nvcc on a CPU machine, read back and verified, refused when
built for other tools or templates, loaded into the compile cache so nothing is compiled again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from tuner.build import CompilePool, render
from tuner.build.catalogue import (
    Job,
    build_catalogue,
    check_catalogue,
    content_digest,
    install,
    open_catalogue,
    read_catalogue,
)
from tuner.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
REPLAY = ROOT / "tests" / "data" / "replay_h200_bench7.jsonl"
BIG = {"BM": 128, "BN": 128}  # with the default: two wmma kernels that the replay file has measured everywhere


def wmma_jobs(space) -> list[Job]:
    fam = space.family("wmma")
    jobs = []
    for extra, why in (({}, "default"), (BIG, "big tiles")):
        cfg = fam.compile_config(fam.defaults() | extra)
        full = cfg | {k.name: k.default for k in fam.runtime_knobs}
        jobs.append(Job("wmma", cfg, "fp32", render(fam, full, "sm_90a"), fam.artifact, why))
    return jobs


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A two-kernel wmma catalogue, built once with nvcc (about a second per kernel)."""
    from tuner.space import load_space

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    space = load_space(ROOT / "space.yaml")
    tmp = tmp_path_factory.mktemp("catalogue")
    pool = CompilePool(2, cache_dir=tmp / "cache")
    try:
        summary = build_catalogue(tmp / "cat.zip", wmma_jobs(space), "sm_90a", space, pool)
    finally:
        pool.close()
    return summary


def copy_with(path: Path, dest: Path, edit=None, binary: bytes | None = None, digest: bool = True) -> Path:
    """A copy of a catalogue with its manifest edited (and its digest made to match again), or
    one binary replaced."""
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(dest, "w") as out:
        manifest = json.loads(src.read("manifest.json"))
        if edit:
            edit(manifest)
            if digest:
                from tuner.build.catalogue import Kernel, Toolchain

                manifest["digest"] = content_digest(Toolchain(**manifest["toolchain"]),
                                                    [Kernel(**k) for k in manifest["kernels"]])
        first = manifest["kernels"][0]
        for name in src.namelist():
            data = json.dumps(manifest).encode() if name == "manifest.json" else src.read(name)
            if binary is not None and name.startswith(f"kernels/{first['cache_key']}.") and not name.endswith(".log"):
                data = binary
            out.writestr(name, data)
    return dest


@pytest.mark.nvcc
def test_build_and_read_back(built, space):
    cat = read_catalogue(built.catalogue.path)
    assert built.compiled == 2 and built.reused == 0 and not built.failed
    assert cat.digest == built.catalogue.digest and len(cat.kernels) == 2
    tc = cat.toolchain
    assert tc.arch == "sm_90a" and tc.nvcc and tc.cutlass and tc.tool and set(tc.template_hashes) == {"wmma"}
    manifest = json.loads(zipfile.ZipFile(cat.path).read("manifest.json"))
    assert manifest["digest"] == cat.digest
    for k in cat.kernels:
        assert k.family == "wmma" and k.artifact == "cubin" and k.accumulate == "fp32"
        assert k.registers and 0 < k.registers <= 255 and k.spill_bytes == 0 and k.compile_s > 0
        assert k.sha256 == __import__("hashlib").sha256(cat.read(k.binary)).hexdigest()
        assert k.template_hash == tc.template_hashes["wmma"] and len(k.reasons) == 1
    assert {k.reasons[0] for k in cat.kernels} == {"default", "big tiles"}
    check_catalogue(cat, space, "sm_90a")  # fits this machine


@pytest.mark.nvcc
def test_incremental_rebuild_compiles_nothing(built, space, tmp_path, monkeypatch):
    """Built again to the same file, with a compile cache that has nothing: every kernel comes
    from the catalogue, nvcc never runs, the content digest stays."""
    from tuner.build import compile as compile_mod

    monkeypatch.setattr(compile_mod.subprocess, "run", lambda *a, **k: pytest.fail("nvcc ran"))
    out = shutil.copy(built.catalogue.path, tmp_path / "cat.zip")
    previous = read_catalogue(out)
    pool = CompilePool(2, cache_dir=tmp_path / "empty-cache")
    try:
        again = build_catalogue(out, wmma_jobs(space), "sm_90a", space, pool, previous)
    finally:
        pool.close()
    assert (again.compiled, again.from_cache, again.reused) == (0, 0, 2)
    assert again.catalogue.digest == built.catalogue.digest


@pytest.mark.nvcc
@pytest.mark.parametrize("edit, needle", [
    (lambda m: m["toolchain"]["template_hashes"].update(wmma="0" * 16), "template of wmma has changed"),
    (lambda m: m["toolchain"].update(nvcc="12.4.131"), "was built with nvcc 12.4.131"),
    (lambda m: m["toolchain"].update(cutlass="3.5.0"), "was built with CUTLASS 3.5.0"),
])
def test_other_toolchain_or_template_is_refused(built, space, tmp_path, edit, needle):
    bad = read_catalogue(copy_with(built.catalogue.path, tmp_path / "bad.zip", edit))  # intact, but not ours
    with pytest.raises(UserError) as err:
        check_catalogue(bad, space, "sm_90a")
    assert needle in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError, match="not sm_80"):
        check_catalogue(read_catalogue(built.catalogue.path), space, "sm_80")


@pytest.mark.nvcc
def test_tampered_binary_or_manifest_is_refused(built, tmp_path):
    with pytest.raises(UserError, match="does not have its recorded sha256"):
        read_catalogue(copy_with(built.catalogue.path, tmp_path / "a.zip", binary=b"\x7fELF planted"))
    changed = copy_with(built.catalogue.path, tmp_path / "b.zip",
                        lambda m: m["kernels"][0].update(sha256="0" * 64), digest=False)
    with pytest.raises(UserError, match="the manifest was changed"):
        read_catalogue(changed)


@pytest.mark.nvcc
def test_loaded_catalogue_serves_the_gpu_build_path_without_nvcc(built, space, tmp_path, monkeypatch):
    """A backend that runs real code (needs_cubin) builds through the pool: over a cache the
    catalogue was loaded into, every catalogue config is a cache hit and nvcc never runs."""
    from tuner.build import compile as compile_mod
    from tuner.search.compile_queue import prepare
    from tuner.space import parse_shape, target_for_arch

    class NeedsCubin:
        target, needs_cubin, simulated = target_for_arch("sm_90a"), True, False

    cache = tmp_path / "gpu-cache"
    cat = open_catalogue(built.catalogue.path, space, "sm_90a", cache)
    assert install(cat, cache) == 0  # already there: nothing written twice
    monkeypatch.setattr(compile_mod.subprocess, "run", lambda *a, **k: pytest.fail("nvcc ran"))
    pool = CompilePool(2, cache_dir=cache)
    try:
        fam = space.family("wmma")
        for _, cfg in cat.configs(["wmma"], "fp32"):
            p = prepare(fam, cfg, parse_shape("1024x1024x1024"), NeedsCubin(), pool)
            res = p.future.result()
            kernel = cat.by_source()[p.record.source_hash]
            assert res.ok and res.cached and res.seconds == 0.0
            assert res.key == kernel.cache_key and res.digest == kernel.sha256
            assert res.registers == kernel.registers and res.spill_bytes == kernel.spill_bytes
    finally:
        pool.close()


@pytest.mark.nvcc
def test_replay_sweep_with_catalogue_tries_its_kernels_first(built, tmp_path, monkeypatch):
    """A sweep over several shapes: each fresh study measures the catalogue's configs first,
    each such trial names the catalogue, and nothing is compiled."""
    from tuner import api
    from tuner.build import compile as compile_mod
    from tuner.search import TrialRecord, load_studies

    monkeypatch.setattr(compile_mod, "DEFAULT_CACHE", tmp_path / "cache")
    monkeypatch.setattr(compile_mod.subprocess, "run", lambda *a, **k: pytest.fail("nvcc ran"))
    opts = api.Options(trials=4, storage=f"sqlite:///{tmp_path}/s.db", space_file=ROOT / "space.yaml",
                       families="wmma", backend="replay", replay=REPLAY, seed=0, confirm_top=0,
                       runs_dir=tmp_path / "runs", catalogue=built.catalogue.path)
    res = api.sweep(opts, "default", patience=None)
    assert len(res.studies) == 7
    held = {json.dumps(k.config, sort_keys=True) for k in built.catalogue.kernels}
    for st in load_studies(opts.storage):
        recs = [TrialRecord.of(t) for t in sorted(st.get_trials(), key=lambda t: t.number)]
        first = recs[:2]
        assert {json.dumps(r.config, sort_keys=True) for r in first} == held, st.study_name
        assert all(r.catalogue == built.catalogue.digest[:16] for r in first)
        assert all(r.catalogue == "" for r in recs[2:] if json.dumps(r.config, sort_keys=True) not in held)
    # The cache now holds the catalogue's binaries (a GPU run would find them built).
    assert all((tmp_path / "cache" / Path(k.binary).name).is_file() for k in built.catalogue.kernels)


@pytest.mark.nvcc
def test_cli_build_is_incremental_and_tune_refuses_a_bad_catalogue(built, tmp_path):
    env = {**__import__("os").environ, "HGEMM_TUNE_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "cli.zip"
    cmd = [sys.executable, "-m", "tuner.cli", "catalogue", "build", "--families", "wmma", "-o", str(out)]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "compiled 1" in " ".join((first.stdout + first.stderr).split())
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    text = " ".join((again.stdout + again.stderr).split())
    assert again.returncode == 0 and "compiled 0" in text and "reused from the catalogue 1" in text, text
    bad = copy_with(built.catalogue.path, tmp_path / "bad.zip", lambda m: m["toolchain"].update(nvcc="11.8.89"))
    res = subprocess.run([sys.executable, "-m", "tuner.cli", "tune", "--shape", "4096x4096x8192", "--trials", "2",
                          "--backend", "replay", "--replay", str(REPLAY), "--families", "wmma", "--catalogue", str(bad),
                          "--storage", f"sqlite:///{tmp_path}/t.db"],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2 and "built with nvcc 11.8.89" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.mark.nvcc
def test_sweep_catalogue_out_adds_the_winners(built, tmp_path, monkeypatch):
    """--catalogue-out: after a sweep, the catalogue plus every exported kernel it lacks, verified
    like any catalogue; a winner it already held is not built again, and a second run adds nothing."""
    from tuner import api
    from tuner.build import compile as compile_mod
    from tuner.search.sampler import full_config
    from tuner.space import load_space

    monkeypatch.setattr(compile_mod, "DEFAULT_CACHE", tmp_path / "cache")
    space = load_space(ROOT / "space.yaml")
    fam = space.family("wmma")
    # A one-kernel catalogue (the default tile): the big tiles win some shapes and must join it.
    pool = CompilePool(2, cache_dir=tmp_path / "cache")
    try:
        small = build_catalogue(tmp_path / "one.zip", wmma_jobs(space)[:1], "sm_90a", space, pool).catalogue
    finally:
        pool.close()
    out = tmp_path / "grown.zip"
    opts = api.Options(trials=5, storage=f"sqlite:///{tmp_path}/s.db", space_file=ROOT / "space.yaml",
                       families="wmma", backend="replay", replay=REPLAY, seed=0, confirm_top=0,
                       runs_dir=tmp_path / "runs", catalogue=small.path, catalogue_out=out)
    res = api.sweep(opts, "default", patience=None)
    grown = res.grown
    assert grown is not None and grown.catalogue.path == out and not grown.failed
    held = {json.dumps(k.config, sort_keys=True) for k in small.kernels}
    winners = {json.dumps(fam.compile_config(full_config(fam, e["knobs"])), sort_keys=True)
               for e in res.export["entries"]}
    now = {json.dumps(k.config, sort_keys=True) for k in read_catalogue(out).kernels}
    assert now == held | winners  # every winner joined, nothing of the catalogue was lost
    assert winners - held, "the replay sweep picked no config outside the catalogue: the test checks nothing new"
    assert grown.reused == len(winners & held) and grown.compiled + grown.from_cache == len(winners - held)
    check_catalogue(read_catalogue(out), space, "sm_90a")
    # The grown catalogue in its place: the same sweep again (every study already done, so only
    # the export and the grow run) adds nothing and compiles nothing.
    monkeypatch.setattr(compile_mod.subprocess, "run", lambda *a, **k: pytest.fail("nvcc ran"))
    again = api.sweep(replace(opts, catalogue=out), "default", patience=None)
    assert again.grown.compiled == 0 and again.grown.from_cache == 0
    assert {json.dumps(k.config, sort_keys=True) for k in read_catalogue(out).kernels} == now


def test_catalogue_out_is_checked_before_any_work(tmp_path):
    from tuner import api

    base = dict(trials=1, storage=f"sqlite:///{tmp_path}/s.db", space_file=ROOT / "space.yaml", families="wmma",
                backend="replay", replay=REPLAY, runs_dir=tmp_path / "runs")
    with pytest.raises(UserError, match="a catalogue is a .zip file"):
        api.sweep(api.Options(**base, catalogue_out=tmp_path / "cat.json"), "default")
    (tmp_path / "dir.zip").mkdir()
    with pytest.raises(UserError, match="is a folder"):
        api.sweep(api.Options(**base, catalogue_out=tmp_path / "dir.zip"), "default")
    (tmp_path / "other.zip").write_bytes(b"")
    with pytest.raises(UserError, match="exists and is not the --catalogue"):
        api.sweep(api.Options(**base, catalogue=tmp_path / "cat.zip", catalogue_out=tmp_path / "other.zip"),
                  "default")
    assert not (tmp_path / "s.db").exists()  # refused before the storage was touched


def test_an_export_alone_asks_for_its_kernels_only(tmp_path):
    """What a grow builds: the export's kernels, never the family defaults and seeds that a bare
    `catalogue build` falls back to (27 cute_sm90 configs)."""
    from tuner import api

    opts = api.Options(space_file=ROOT / "space.yaml", families="cute_sm90")
    assert api.catalogue_jobs(None, [], "sm_90a", opts, export=({"entries": []}, "sweep")) == []
    assert len(api.catalogue_jobs(None, [], "sm_90a", opts)) > 10

"""`hgemm-tune package`: an export's wmma picks -> one shared library with a C API, checked
without a GPU (exported symbols, header, the dispatch table through ctypes, one-line refusals)."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.runtime.package import API, CTranslator
from tuner.space import load_space, target_for_arch

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"BM": 32, "BN": 64, "BK": 32, "WARP_M": 1, "WARP_N": 2, "STAGES": 2, "PAD": 8, "SWIZZLE_LOG": 1}
LARGE = {"BM": 64, "BN": 64, "BK": 32, "WARP_M": 2, "WARP_N": 2, "STAGES": 2, "PAD": 8, "SWIZZLE_LOG": 2}


def entry(shape: str, family: str = "wmma", knobs: dict | None = None, pick: str | None = None,
          arch: str = "sm_90a") -> dict:
    M, N, K = map(int, shape.split("x"))
    return {"gpu": "NVIDIA H100 80GB HBM3", "arch": arch, "shape": shape, "M": M, "N": N, "K": K,
            "layout": "TN", "accumulate": "fp32", "family": family, "template_hash": None,
            "knobs": SMALL if knobs is None else knobs, "source_hash": None, "time_us": 10.0, "tflops": 1.0,
            "roofline_fraction": 0.5, "baselines_us": {"cublas": 12.0}, "speedup": {"cublas": 1.2},
            "beats_vendor": True, "pick": pick or family, "verification": {}, "simulated": False,
            "study": "s", "trial": 1}


def write_export(path: Path, entries: list[dict]) -> Path:
    path.write_text(json.dumps({"schema_version": 1, "tool": "hgemm-tune", "tool_version": "0.1.0",
                                "created": "2026-12-07T00:00:00Z", "simulated": False, "entries": entries}))
    return path


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def one_line_exit_2(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 2, res.stderr + res.stdout
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.replace("\n ", " ").splitlines() if ln.strip()]
    text = " ".join(lines)
    assert len(res.stderr.strip().split("\nerror")) == 1 and res.stderr.startswith("error: "), res.stderr
    for needle in needles:
        assert needle in text, text


@pytest.fixture(scope="module")
def packaged(tmp_path_factory):
    """Two wmma shapes sharing (N, K) = (256, 512) at M = 64 and 1024, one at (512, 256), and a
    vendor pick at M = 4096 of (256, 512)."""
    tmp = tmp_path_factory.mktemp("package")
    export = write_export(tmp / "best.json", [
        entry("64x256x512"), entry("1024x256x512", knobs=LARGE), entry("128x512x256"),
        entry("4096x256x512", pick="cublas")])
    res = run("package", str(export), "-o", str(tmp / "dist"), "--arch", "sm_90a")
    assert res.returncode == 0, res.stderr + res.stdout
    return tmp / "dist", export


@pytest.mark.nvcc
def test_library_exports_only_the_api(packaged):
    dist, _ = packaged
    lib = dist / "libhgemm_tuned.so"
    if shutil.which("nm") is None:
        pytest.skip("nm is not on PATH")
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    names = sorted(line.split()[-1] for line in out.splitlines() if line.strip())
    assert names == sorted(API)
    header = (dist / "hgemm_tuned.h").read_text()
    for name in API:
        assert f" {name}(" in header
    assert "HGEMM_TUNED_NO_KERNEL 1" in header and "HGEMM_TUNED_BAD_ARGUMENT 2" in header
    # no libcudart.so dependency: the runtime is linked in
    deps = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    assert "libcudart" not in deps


@pytest.mark.nvcc
def test_dispatch_table_and_info_without_a_gpu(packaged):
    dist, export = packaged
    lib = ctypes.CDLL(str(dist / "libhgemm_tuned.so"), mode=os.RTLD_LOCAL)  # loads with no GPU
    lib.hgemm_tuned_info.restype = ctypes.c_char_p
    info = json.loads(lib.hgemm_tuned_info())
    import hashlib

    assert info["arch"] == "sm_90a" and info["cc"] == 90
    assert info["export"]["sha256"] == hashlib.sha256(export.read_bytes()).hexdigest()
    assert info["versions"]["hgemm_tune"] and info["versions"]["nvcc"]
    kernels = {p["shape"]: p["id"] for p in info["picks"]}
    assert set(kernels) == {"64x256x512", "1024x256x512", "128x512x256"}
    # two picks share SMALL's compile-time config (SWIZZLE_LOG is a run-time knob): one kernel
    assert len(info["kernels"]) == 2
    assert info["picks"][kernels["64x256x512"]]["kernel"] == info["picks"][kernels["128x512x256"]]["kernel"]
    assert json.loads((dist / "package.json").read_text()) == info
    layer = next(x for x in info["layers"] if (x["N"], x["K"]) == (256, 512))
    assert [b["M"] for b in layer["buckets"]] == [64, 1024, 4096]
    assert layer["buckets"][2]["pick"] is None  # the vendor won there
    small, large = kernels["64x256x512"], kernels["1024x256x512"]
    look = lib.hgemm_tuned_lookup
    assert look(64, 256, 512) == small and look(1024, 256, 512) == large          # exact
    assert look(500, 256, 512) == small and look(600, 256, 512) == large          # between: nearest
    assert look(544, 256, 512) == large                                            # a tie: the larger bucket
    assert look(32, 256, 512) == small                                             # below the range: the smallest,
    assert look(31, 256, 512) == -1 and look(1, 256, 512) == -1                    # down to half of it; then the vendor
    assert look(3000, 256, 512) == -1 and look(100000, 256, 512) == -1            # nearest is the vendor's bucket
    assert look(64, 512, 256) == kernels["128x512x256"] and look(7, 512, 256) == -1
    assert look(64, 256, 520) == -1                                                # another (N, K)
    assert look(0, 256, 512) == -2
    # run: bad arguments and vendor answers never touch the device; a tuned call finds no GPU here
    run_ = lib.hgemm_tuned_run
    p = ctypes.c_void_p
    run_.argtypes = [ctypes.c_int] * 3 + [p, ctypes.c_int, p, ctypes.c_int, p, ctypes.c_int, p, ctypes.c_size_t, p]
    assert run_(0, 256, 512, 16, 512, 16, 512, 16, 256, None, 0, None) == 2
    assert run_(64, 256, 512, 16, 500, 16, 512, 16, 256, None, 0, None) == 2         # lda < K
    assert run_(64, 256, 512, 16, 1024, 16, 512, 16, 256, None, 0, None) == 1        # strided: the vendor
    assert run_(64, 256, 512, 8, 512, 16, 512, 16, 256, None, 0, None) == 1          # misaligned: the vendor
    assert run_(64, 256, 520, 16, 520, 16, 520, 16, 256, None, 0, None) == 1
    assert run_(4096, 256, 512, 16, 512, 16, 512, 16, 256, None, 0, None) == 1
    lib.hgemm_tuned_workspace_size.restype = ctypes.c_size_t
    assert lib.hgemm_tuned_workspace_size(64, 256, 520) == 0
    if not Path("/dev/nvidia0").exists():
        assert lib.hgemm_tuned_check_device() == 5
        assert run_(64, 256, 512, 16, 512, 16, 512, 16, 256, None, 0, None) == 5


def test_constraints_and_launch_translate_to_c():
    """cute_sm80's shape constraints stay run-time tests; cute_sm90's M-dependent cluster rule too."""
    space = load_space(None)
    target = target_for_arch("sm_90a")
    fam = space.family("cute_sm80")
    tr = CTranslator(fam, fam.defaults(), target)
    valid = " && ".join(tr.expr(c.expr) for c in fam.constraints)
    assert "hk_mod(K, 8LL)" in valid and "hk_mod(N, 8LL)" in valid
    assert tr.expr(fam.launch["grid"]) == "(hk_ceil_div(M, 128LL) * hk_ceil_div(N, 128LL))"
    assert tr.expr(fam.launch["smem"]).endswith("LL")  # no shape in it: a constant
    fam = space.family("cute_sm90")
    tr = CTranslator(fam, fam.defaults(), target)
    assert "hk_ceil_div(M, 128LL)" in " ".join(tr.expr(c.expr) for c in fam.constraints)


@pytest.mark.nvcc
def test_bad_inputs_one_line_exit_2(tmp_path):
    out = str(tmp_path / "dist")
    one_line_exit_2(run("package", str(write_export(tmp_path / "a.json", [entry("64x256x512", arch="sm_80")])),
                        "-o", out, "--arch", "sm_90a"), "no entry for sm_90a", "sm_80")
    one_line_exit_2(run("package", str(write_export(tmp_path / "e.json", [])), "-o", out), "no entries")
    one_line_exit_2(run("package", str(write_export(tmp_path / "f.json", [entry("64x256x512", family="nope")])),
                        "-o", out), "no family 'nope'")
    one_line_exit_2(run("package", str(write_export(tmp_path / "k.json", [entry("64x256x512", knobs={"BM": 48})])),
                        "-o", out), "BM=48")
    one_line_exit_2(run("package", str(tmp_path / "missing.json"), "-o", out), "missing.json")
    vendor_only = write_export(tmp_path / "v.json", [entry("64x256x512", pick="cublas")])
    one_line_exit_2(run("package", str(vendor_only), "-o", out), "nothing to package")


@pytest.mark.nvcc
def test_kernel_that_does_not_compile_is_one_line(tmp_path):
    templates = tmp_path / "templates"
    shutil.copytree(ROOT / "templates", templates)
    (templates / "wmma.cu.j2").write_text((templates / "wmma.cu.j2").read_text() + "\nthis is not C++;\n")
    space = tmp_path / "space.yaml"
    space.write_text((ROOT / "space.yaml").read_text())
    export = write_export(tmp_path / "best.json", [entry("64x256x512")])
    one_line_exit_2(run("package", str(export), "-o", str(tmp_path / "dist"), "--space", str(space)),
                    "kernel k0 (wmma, for 64x256x512) does not compile")


def test_cute_sm90_picks_share_a_kernel_and_keep_their_run_time_knobs(tmp_path):
    """Library-family picks: one kernel per compile-time config, the run-time knobs as the
    launcher's ints, the family's names renamed per kernel, the split-K rule as a C test."""
    from tuner.runtime.codegen import dispatch_unit, kernel_unit
    from tuner.runtime.package import plan

    fam = load_space(None).family("cute_sm90")
    a = fam.defaults() | {"CLUSTER_M": 1}
    b = a | {"TILE_N": 128, "STAGES": 6, "TMA_L2_PROMOTION": 256, "SCHEDULER": "streamk"}
    export = write_export(tmp_path / "best.json", [
        entry("128x4096x4096", family="cute_sm90", knobs=a),
        entry("1024x4096x4096", family="cute_sm90", knobs=a | {"RASTER": "along_m", "SWIZZLE": 2}),
        entry("256x256x8192", family="cute_sm90", knobs=b | {"DECOMP": "split_4", "REDUCTION": "nondeterministic"}),
        entry("1x4096x4096", family="cute_sm90", knobs=a, pick="cublas")])
    kernels, picks, vendor, skipped, layers, _ = plan(export, "sm_90a")
    assert len(kernels) == 2 and [p.kernel for p in picks] == [0, 0, 1]
    assert [p.args for p in picks] == [(2, 1, 1, 0), (1, 2, 1, 0), (2, 1, 4, 1)]  # raster, swizzle, splits, reduction
    assert vendor == ["1x4096x4096"] and not skipped
    assert "hk_ceil_div(M, 128LL)" in picks[2].valid   # split-K only where tiles leave SMs idle: a run-time test
    unit = kernel_unit(kernels[1])
    for name in ("hgemm_run", "hgemm_tune", "hgemm_tma_promotion"):
        assert f"#define {name} {name.replace('hgemm', 'hgemm_tuned_k1', 1)}" in unit
    assert 'extern "C" __attribute__((visibility("default"))) int hgemm_tuned_k1_launch(' in unit
    table = dispatch_unit(kernels, picks, layers, 90, "{}")
    assert "{pick2_valid, hgemm_tuned_k1_ws, hgemm_tuned_k1_launch, {2, 1, 4, 1}}" in table


def test_torch_operator_builds_and_checks_its_inputs_without_a_gpu(packaged):
    """The PyTorch shim compiles against the torch here, registers torch.ops.hgemm.linear with a
    Meta kernel (shapes for torch.compile and fake tensors) and refuses a wrong dtype in one line."""
    torch = pytest.importorskip("torch")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tuner.runtime import torch_op

    dist, _ = packaged
    shim = torch_op.build(dist)
    assert torch_op.build(dist) == shim   # the same torch: kept, not rebuilt
    info = torch_op.load(dist)
    assert info["arch"] == "sm_90a"
    x = torch.empty(3, 5, 512, dtype=torch.float16, device="meta")
    w = torch.empty(256, 512, dtype=torch.float16, device="meta")
    assert torch.ops.hgemm.linear(x, w).shape == (3, 5, 256)
    with FakeTensorMode():
        assert torch.ops.hgemm.linear(torch.empty(7, 512, dtype=torch.float16),
                                      torch.empty(256, 512, dtype=torch.float16)).shape == (7, 256)
    # what torch.compile's tracing does: the op lands in the graph with its output's shape
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(lambda a, b: torch.ops.hgemm.linear(a, b).relu(), tracing_mode="fake")(
        torch.empty(9, 512, dtype=torch.float16), torch.empty(256, 512, dtype=torch.float16))
    assert "hgemm.linear" in str(graph.code)
    # symbolic tracing (torch.compile with dynamic M): the output's rows stay the input's symbol, not
    # a number, so one compiled graph serves every token count
    sym = make_fx(lambda a, b: torch.ops.hgemm.linear(a, b), tracing_mode="symbolic")(
        torch.empty(9, 512, dtype=torch.float16), torch.empty(256, 512, dtype=torch.float16))
    out = [n for n in sym.graph.nodes if n.op == "call_function" and "hgemm" in str(n.target)][0].meta["val"]
    assert isinstance(out.shape[0], torch.SymInt) and not out.shape[0].node.is_constant(), out.shape
    with pytest.raises(RuntimeError, match="must be float16"):
        torch.ops.hgemm.linear(x.float(), w)
    with pytest.raises(RuntimeError, match="in_features"):
        torch.ops.hgemm.linear(torch.empty(3, 500, dtype=torch.float16, device="meta"), w)
    model = torch.nn.Sequential(torch.nn.Linear(512, 256).half())  # on the CPU: not swapped
    assert torch_op.swap_linear(model) == []

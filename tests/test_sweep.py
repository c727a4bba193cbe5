"""`hgemm-tune sweep` on the replay backend: resumable, warm-started, exported."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import kill9_after

from tuner.search import NOT_EVALUATED, load_studies
from tuner.space import load_space

ROOT = Path(__file__).resolve().parent.parent
REPLAY = ROOT / "tests" / "data" / "replay_h200_bench7.jsonl"


def sweep_args(tmp_path: Path, trials: int) -> list[str]:
    return [sys.executable, "-m", "tuner.cli", "sweep", str(ROOT / "space.yaml"), "--shapes", "default",
            "--trials-per-shape", str(trials), "--backend", "replay", "--replay", str(REPLAY), "--seed", "0",
            "--patience", "100", "--storage", f"sqlite:///{tmp_path}/sweep.db", "-o", str(tmp_path / "best.json")]


def measured(tmp_path: Path) -> dict[str, list]:
    out = {}
    for st in load_studies(f"sqlite:///{tmp_path}/sweep.db"):
        if "shape" not in st.user_attrs:  # created by a run killed before it set the attributes
            continue
        out[st.user_attrs["shape"]] = [(t.number, t.value) for t in st.get_trials()
                                       if t.state.is_finished() and t.user_attrs.get("status") not in NOT_EVALUATED]
    return out


def test_interrupted_sweep_resumes_without_repeating_or_losing(tmp_path):
    kill9_after(sweep_args(tmp_path, 10), tmp_path, tmp_path / "sweep.db", rows=40)
    before = measured(tmp_path)
    assert 0 < len(before) < 7, "killed mid-sweep"
    res = subprocess.run(sweep_args(tmp_path, 10), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    after = measured(tmp_path)
    shapes = {str(s) for s in load_space(ROOT / "space.yaml").shapes["default"]}
    assert set(after) == shapes
    for shape, trials in after.items():
        assert len(trials) == 10, shape
        assert set(before.get(shape, [])) <= set(trials), f"{shape}: finished trials lost or changed"
    data = json.loads((tmp_path / "best.json").read_text())
    assert {e["shape"] for e in data["entries"]} == shapes and data["simulated"]
    # The summary names the export's pick: ours only where it beat cuBLAS.
    ours = sum(e["pick"] != "cublas" for e in data["entries"])
    text = " ".join((res.stdout + res.stderr).split())
    assert f"our kernel is the pick for {ours} of {len(shapes)} shapes" in text
    # The resumed run's own work and rates: the shapes it searched and the trials it added.
    added = sum(len(after[s]) - len(before.get(s, [])) for s in shapes)
    rates = re.search(r"this run: (\d+) shapes searched, (\d+) trials measured in \d+ s \(([\d.]+) shapes/min", text)
    assert rates and int(rates.group(2)) == added and float(rates.group(3)) > 0, text
    # A finished sweep re-run does no work.
    again = subprocess.run(sweep_args(tmp_path, 10), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and measured(tmp_path) == after
    assert "this run:" not in again.stdout + again.stderr


def test_warm_start_seeds_from_nearest_tuned_shape(tmp_path):
    from tuner.api import nearest_tuned
    from tuner.space import parse_shape

    res = subprocess.run(sweep_args(tmp_path, 6), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    seeds = nearest_tuned(f"sqlite:///{tmp_path}/sweep.db", parse_shape("4096x4096x4096"), ["cute_sm80", "wmma"])
    assert seeds and all(fam in ("cute_sm80", "wmma") for fam, _ in seeds)
    # The replay file predates clock records: the sweep table says "unknown" for every exported shape.
    rows = [ln for ln in res.stdout.splitlines() if "cute_sm80" in ln or "wmma" in ln]
    assert "clock regime" in res.stdout and rows and all("unknown" in ln for ln in rows), res.stdout


@pytest.mark.parametrize("bad, needle", [("nope", "no shape list 'nope'"), (",", "--shapes ',' names no shape list"),
                                         (" ", "--shapes ' ' names no shape list")])
def test_unknown_shape_list(tmp_path, bad, needle):
    res = subprocess.run([sys.executable, "-m", "tuner.cli", "sweep", str(ROOT / "space.yaml"), "--shapes", bad,
                          "--backend", "replay", "--replay", str(REPLAY), "--storage", f"sqlite:///{tmp_path}/s.db"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "runs" / "sweep.json").exists()


def test_skipped_shape_leaves_no_study(tmp_path):
    """A shape the sweep skips (here: no baseline in the replay file) gets no study in the storage."""
    replay = tmp_path / "no_2048.jsonl"
    replay.write_text("".join(line + "\n" for line in REPLAY.read_text().splitlines()
                              if '"shape": "2048x2048x64"' not in line))
    args = sweep_args(tmp_path, 1)
    args[args.index(str(REPLAY))] = str(replay)
    res = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "skipped 2048x2048x64" in res.stderr
    shapes = {st.user_attrs.get("shape") for st in load_studies(f"sqlite:///{tmp_path}/sweep.db")}
    assert shapes == {str(s) for s in load_space(ROOT / "space.yaml").shapes["default"]} - {"2048x2048x64"}


def test_report_writes_plots_from_a_sweep(tmp_path):
    res = subprocess.run(sweep_args(tmp_path, 4), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    out = tmp_path / "report"
    res = subprocess.run([sys.executable, "-m", "tuner.cli", "report", str(tmp_path / "best.json"), "--out", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    for name in ("speedup_vs_flops.png", "roofline.png", "speedup_heatmap.png", "winner_knobs.png"):
        png = (out / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000, name
    md = (out / "report.md").read_text()
    assert "SIMULATED" in md and "Geomean speedup: cublas:" in md and "8192x8192x8192" in md
    assert "## By FLOP bucket" in md and "| sustained | 6.9e+10-1.1e+12 |" in md


def test_flop_buckets_follow_the_cuda_l2_table():
    """The report's per-bucket rows: the paper's edges, geomeans of our kernel per baseline,
    and the share of shapes the vendor keeps."""
    from tuner.results.report import bucket_rows

    def entry(m, n, k, s, pick="cute_sm90"):
        return {"M": m, "N": n, "K": k, "family": "cute_sm90", "pick": pick,
                "speedup": {"cublas": s, "cublaslt": s / 2}}

    rows = bucket_rows({"entries": [entry(64, 64, 64, 1.21), entry(128, 64, 64, 0.81, "cublas"),
                                    entry(8192, 8192, 8192, 1.0), entry(16384, 16384, 16384, 1.02)]})
    assert [(r["FLOPs"], r["shapes"]) for r in rows] == [("<1.7e+07", 2), ("6.9e+10-1.1e+12", 1), (">1.1e+12", 1)]
    assert rows[0]["vs cublas"] == pytest.approx((1.21 * 0.81) ** 0.5) and rows[0]["vendor keeps"] == 0.5
    assert rows[0]["vs cublaslt"] == pytest.approx((1.21 * 0.81) ** 0.5 / 2) and rows[2]["vendor keeps"] == 0.0

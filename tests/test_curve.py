"""The catalogue-size curve (tuner.results.curve) and `catalogue build --kernels`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuner.errors import UserError
from tuner.results.curve import KERNEL_LIST_KIND, Measured, greedy_curve, kernel_list, read_kernel_list

ROOT = Path(__file__).resolve().parent.parent


def _measured() -> Measured:
    # three shapes; cuBLAS 10 us everywhere. k1 wins two shapes by 20%, k2 one shape by 50%,
    # k3 is never better than k1 or k2 where they ran, k4 only 0.5% behind k1 at s1 (within 1%).
    times = {"s1": {"k1": 8.0, "k3": 9.0, "k4": 8.04}, "s2": {"k1": 8.0, "k2": 9.5}, "s3": {"k2": 5.0, "k3": 12.0}}
    kernels = {k: ("fam", {"X": i}, "fp32") for i, k in enumerate(("k1", "k2", "k3", "k4"))}
    return Measured(gpu="GPU", times=times, cublas={"s1": 10.0, "s2": 10.0, "s3": 10.0}, kernels=kernels)


def test_greedy_curve_adds_the_kernel_that_lifts_the_geomean_most():
    m = _measured()
    curve = greedy_curve(m, tolerance=0.01)
    assert [p.added for p in curve.points] == ["", "k2", "k1"]  # k2: log(2) at s3 beats k1's 2*log(1.25)
    empty, one, two = curve.points
    assert empty.geomean_vs_cublas == pytest.approx(1.0) and empty.within == 0
    assert one.geomean_vs_cublas == pytest.approx((1 * 10 / 9.5 * 2) ** (1 / 3))
    assert two.geomean_vs_cublas == pytest.approx((1.25 * 1.25 * 2) ** (1 / 3)) == curve.full_geomean_vs_cublas
    assert two.within == 3 and two.geomean_of_best == pytest.approx(1.0) and curve.keep == 2
    # k3 and k4 lift nothing once k1 and k2 are in: the curve stops, and the list holds the two
    listed = kernel_list(m, curve)
    assert listed["kind"] == KERNEL_LIST_KIND and [k["config"] for k in listed["kernels"]] == [{"X": 1}, {"X": 0}]


def test_a_tolerance_lets_a_near_kernel_stand_in_and_bad_tolerances_are_refused():
    m = _measured()
    m.times["s1"]["k1"], m.times["s2"]["k1"] = 8.0, 20.0  # k1 now only good at s1; k4 is within 1% there
    curve = greedy_curve(m, tolerance=0.01)
    assert curve.keep == len(curve.points) - 1
    with pytest.raises(UserError, match="--tolerance"):
        greedy_curve(m, tolerance=1.5)
    with pytest.raises(UserError, match="no shape"):
        greedy_curve(Measured(gpu=None), 0.01)


@pytest.mark.parametrize(("text", "match"), [
    ("{", "not valid JSON"),
    ('{"kernels": []}', "not a kernel list"),
    (json.dumps({"kind": KERNEL_LIST_KIND, "kernels": [{"family": 3, "config": {}}]}), "kernels/0"),
    (json.dumps({"kind": KERNEL_LIST_KIND, "kernels": [{"family": "f", "config": {}, "accumulate": "int8"}]}),
     "kernels/0"),
])
def test_a_bad_kernel_list_is_one_line_naming_the_entry(text, match):
    with pytest.raises(UserError, match=match) as err:
        read_kernel_list(text, "k.json")
    assert "\n" not in str(err.value)


def test_catalogue_jobs_from_a_kernel_list(tmp_path):
    """A kernel list becomes catalogue jobs (rendered, with their why); an unknown knob names the entry."""
    from tuner.api import Options, catalogue_jobs

    good = tmp_path / "k.json"
    good.write_text(json.dumps({"kind": KERNEL_LIST_KIND, "kernels": [
        {"family": "cute_sm90", "config": {"TILE_M": 64, "TILE_N": 64, "SCHEDULE": "basic", "STAGES": 6,
                                           "CLUSTER_M": 1}, "why": "curve kernel 1 of 1"}]}))
    (job,) = catalogue_jobs(None, [], "sm_90a", Options(space_file=ROOT / "space.yaml"), good)
    assert job.family == "cute_sm90" and job.config["SCHEDULE"] == "basic" and job.reason == "curve kernel 1 of 1"
    assert "hgemm_run" in job.source
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": KERNEL_LIST_KIND, "kernels": [{"family": "cute_sm90", "config": {"NOPE": 1}}]}))
    with pytest.raises(UserError, match="kernels/0: .*NOPE"):
        catalogue_jobs(None, [], "sm_90a", Options(space_file=ROOT / "space.yaml"), bad)


def test_catalogue_curve_cli_on_a_replayed_study(tmp_path):
    """End to end without a GPU: a replayed study, its curve as a table, CSV, JSON, kernel list."""
    import subprocess
    import sys

    replay = ROOT / "tests" / "data" / "replay_4096x4096x8192.jsonl"
    db = f"sqlite:///{tmp_path}/c.db"
    run = [sys.executable, "-m", "tuner.cli"]
    tuned = subprocess.run(run + ["tune", "--shape", "4096x4096x8192", "--trials", "12", "--backend", "replay",
                                  "--replay", str(replay), "--seed", "0", "--families", "cute_sm80", "--storage", db,
                                  "--confirm", "0", "--space", str(ROOT / "space.yaml")],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert tuned.returncode == 0, tuned.stderr[-1500:]
    res = subprocess.run(run + ["catalogue", "curve", db, "--out", str(tmp_path / "curve")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-1500:]
    assert "SIMULATED" in res.stdout and "(cuBLAS alone)" in res.stdout
    data = json.loads((tmp_path / "curve" / "curve.json").read_text())
    assert data["shapes"] == 1 and data["points"][0]["size"] == 0
    lines = (tmp_path / "curve" / "curve.csv").read_text().splitlines()
    assert lines[0].startswith("size,") and len(lines) == len(data["points"]) + 1
    bad = subprocess.run(run + ["catalogue", "curve", f"sqlite:///{tmp_path}/none.db"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "none.db" in bad.stdout + bad.stderr


def test_a_curve_is_one_problem_and_a_binary_kernel_list_is_one_line(tmp_path):
    """Studies of two objectives (or accumulations, or GPU models) cannot share a curve; a kernel
    list that is not UTF-8 text is refused in one line."""
    from tuner.measure import ReplayBackend
    from tuner.results.curve import measured
    from tuner.search import tune
    from tuner.space import load_space, parse_shape

    space = load_space(ROOT / "space.yaml")
    replay = ReplayBackend(ROOT / "tests" / "data" / "replay_4096x4096x8192.jsonl", "sm_90a")
    storage = f"sqlite:///{tmp_path}/two.db"
    shape = parse_shape("4096x4096x8192")
    a = tune(space, ["cute_sm80"], shape, replay, trials=3, storage=storage, seed=0)
    b = tune(space, ["cute_sm80"], shape, replay, trials=3, storage=storage, seed=0, objective="isolated")
    with pytest.raises(UserError, match="2 objectives"):
        measured([a, b])
    for raw in (b"\xff\xfe\x00{", b"\x80\x81{}", b"[" * 100_000):
        with pytest.raises(UserError, match="^k.json: not ") as err:
            read_kernel_list(raw, "k.json")
        assert "\n" not in str(err.value)

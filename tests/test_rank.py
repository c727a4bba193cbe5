"""The catalogue ranking (tuner.search.rank): the cost model orders tiles sensibly, constraints
drop configs, nearby winners move up, a replay sweep seeds studies in ranked order up to
--catalogue-top, and `rank-check` reports the ranking against the measured (SIMULATED) times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.errors import UserError
from tuner.search.rank import rank_catalogue, spearman
from tuner.search.sampler import NearPick, seed_configs
from tuner.space import parse_shape, target_for_arch

ROOT = Path(__file__).resolve().parent.parent
REPLAY = ROOT / "tests" / "data" / "replay_h200_bench7.jsonl"
H200 = target_for_arch("sm_90a")


def sm90_catalogue(space) -> list[tuple[str, dict]]:
    """Every cute_sm90 seed of shapes from tiny to large: a catalogue of ~30 configs."""
    fam = space.family("cute_sm90")
    out: list[tuple[str, dict]] = []
    for s in ("4096x4096x8192", "64x8192x4096", "16x4096x4096", "256x256x8192", "8192x512x2048",
              "128x16384x16384"):
        for cfg in seed_configs(fam, parse_shape(s)):
            if ("cute_sm90", cfg) not in out:
                out.append(("cute_sm90", cfg))
    return out


def rank_of(ranking, pred) -> list[int]:
    return [c.rank for c in ranking.candidates if pred(c.config, c.variant)]


def test_ranking_is_deterministic_and_numbered(space):
    cat = sm90_catalogue(space)
    a = rank_catalogue(space, cat, parse_shape("3000x5000x1000"), H200)
    b = rank_catalogue(space, cat, parse_shape("3000x5000x1000"), H200)
    assert a == b
    assert [c.rank for c in a.candidates] == list(range(1, len(a.candidates) + 1))
    scores = [c.score_us for c in a.candidates]
    assert scores == sorted(scores) and all(s > 0 for s in scores)


def test_a_config_the_constraints_reject_is_never_ranked(space):
    fam = space.family("cute_sm90")
    # A 4x1 cluster needs four 128-row tiles along M: M = 16 has one.
    bad = fam.compile_config(fam.defaults() | {"CLUSTER_M": 4})
    good = fam.compile_config(fam.defaults() | {"CLUSTER_M": 1, "TILE_M": 128, "TILE_N": 128})
    res = rank_catalogue(space, [("cute_sm90", bad), ("cute_sm90", good)], parse_shape("16x4096x4096"), H200)
    assert [c.config for c in res.candidates] == [good]
    assert res.dropped and res.dropped[0][1] == bad and "cluster" in res.dropped[0][2]
    # Every ranked candidate's named variant passes the constraints too.
    for shape in ("16x4096x4096", "256x256x8192", "8192x8192x8192"):
        for c in rank_catalogue(space, sm90_catalogue(space), parse_shape(shape), H200).candidates:
            assert not fam.violations(fam.complete(c.config | c.variant), parse_shape(shape), H200)


def test_big_shape_ranks_big_tiles_above_64_row_tiles(space):
    res = rank_catalogue(space, sm90_catalogue(space), parse_shape("8192x8192x8192"), H200)
    big = rank_of(res, lambda c, v: c["TILE_M"] * c["TILE_N"] >= 128 * 256)
    small = rank_of(res, lambda c, v: c["TILE_M"] == 64 and c["TILE_N"] <= 128)
    assert big and small and max(big) < min(small)
    assert res.candidates[0].config["TILE_M"] >= 128


def test_small_m_ranks_64_row_tiles_above_big_tiles(space):
    res = rank_catalogue(space, sm90_catalogue(space), parse_shape("16x4096x4096"), H200)
    small = rank_of(res, lambda c, v: c["TILE_M"] == 64 and c["TILE_N"] <= 128)
    big = rank_of(res, lambda c, v: c["TILE_M"] * c["TILE_N"] >= 128 * 256 and v["DECOMP"] == "data_parallel")
    assert big and small and max(small) < min(big)


def test_few_tiles_and_long_k_rank_split_k_first(space):
    res = rank_catalogue(space, sm90_catalogue(space), parse_shape("256x256x8192"), H200)
    top = res.candidates[0]
    # basic's one-wave split-K (measured best there on an H100, docs/decisions/0039)
    assert top.variant["DECOMP"].startswith("split_") and top.config["SCHEDULE"] == "basic"
    # The same configs with the K decomposition left out would be slower by the model.
    assert all(c.variant["DECOMP"] != "data_parallel" for c in res.candidates[:3])


def test_one_wave_small_shapes_rank_plain_grids_above_persistent_kernels(space):
    # A persistent kernel's set-up is much of a one-wave GEMM of a few tiles: `basic` beat pingpong
    # by 0.55-0.73 us at every such shape timed on an H100 (PERSISTENT_SETUP_US).
    for shape in ("64x64x64", "256x64x128", "64x128x512"):
        res = rank_catalogue(space, sm90_catalogue(space), parse_shape(shape), H200)
        plain = rank_of(res, lambda c, v: c["SCHEDULE"] == "basic")
        persistent = rank_of(res, lambda c, v: c["SCHEDULE"] != "basic")
        assert plain and persistent and min(plain) == 1, shape
    # The plain-grid families share the lower launch cost: at one tile, cute_sm80 64x64 ranks above
    # every persistent cute_sm90 kernel.
    fam = space.family("cute_sm80")
    sm80 = ("cute_sm80", fam.compile_config(fam.defaults() | {"BM": 64, "BN": 64}))
    res = rank_catalogue(space, [*sm90_catalogue(space), sm80], parse_shape("64x64x64"), H200)
    first_persistent = min(c.rank for c in res.candidates
                           if c.family == "cute_sm90" and c.config["SCHEDULE"] != "basic")
    assert next(c.rank for c in res.candidates if c.family == "cute_sm80") < first_persistent


def test_a_nearby_winner_moves_up(space):
    cat = sm90_catalogue(space)
    shape = parse_shape("4096x4096x4096")
    plain = rank_catalogue(space, cat, shape, H200).candidates
    last = plain[len(plain) // 2]
    pick = NearPick(last.family, last.config, "4096x4096x8192", 1.0, 1, 300.0)
    credited = rank_catalogue(space, cat, shape, H200, [pick]).candidates
    moved = next(c for c in credited if c.config == last.config)
    assert moved.rank < last.rank and moved.evidence == "won 4096x4096x8192"
    assert moved.predicted_us == last.predicted_us and moved.score_us < moved.predicted_us


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2], [1, 2]) is None and spearman([1, 1, 1], [1, 2, 3]) is None


# ---- seeding a replay sweep from a ranked catalogue --------------------------------------------

def wmma_catalogue(space, n: int = 6):
    """An in-memory catalogue of n wmma configs the replay file measured at every shape (no nvcc:
    the replay backend needs no binary)."""
    from tuner.build.catalogue import Catalogue, Kernel, Toolchain

    configs = []
    for line in REPLAY.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("family") == "wmma" and rec["shape"] == "2048x2048x64" and rec["config"] not in configs:
            configs.append(rec["config"])
    kernels = [Kernel("wmma", cfg, "fp32", "t", f"src{i}", f"key{i}", "cubin", "0" * 64, 1, 32, 0, 0.0)
               for i, cfg in enumerate(configs[:n])]
    return Catalogue(Path("fake.zip"), Toolchain("13.0", "4.2", "sm_90a", "x", {}), kernels, "f" * 64)


def replay_sweep(tmp_path, monkeypatch, space, top: int | None, trials: int):
    from tuner import api
    from tuner.api import tuning

    cat = wmma_catalogue(space)
    monkeypatch.setattr(tuning, "load_catalogue", lambda *a, **k: cat)
    opts = api.Options(trials=trials, storage=f"sqlite:///{tmp_path}/s.db", space_file=ROOT / "space.yaml",
                       families="wmma", backend="replay", replay=REPLAY, seed=0, confirm_top=0,
                       runs_dir=tmp_path / "runs", catalogue=Path("fake.zip"), catalogue_top=top)
    return api.sweep(opts, "default", patience=None), cat, opts


def test_replay_sweep_seeds_in_ranked_order_up_to_the_top(tmp_path, monkeypatch, space):
    from tuner.search import StudyMeta, TrialRecord, load_studies

    res, cat, opts = replay_sweep(tmp_path, monkeypatch, space, top=3, trials=5)
    assert len(res.studies) == 7
    held = {json.dumps(k.config, sort_keys=True) for k in cat.kernels}
    for st in load_studies(opts.storage):
        recs = [TrialRecord.of(t) for t in sorted(st.get_trials(), key=lambda t: t.number)]
        assert [r.catalogue_rank for r in recs[:3]] == [1, 2, 3], st.study_name
        # The first shape ran on an empty storage: its order is the cost model's alone.
        shape = StudyMeta.of(st).shape_record
        if str(shape) == "2048x2048x64":
            want = rank_catalogue(space, [("wmma", k.config) for k in cat.kernels], shape, H200).candidates
            assert [r.config for r in recs[:3]] == [c.config for c in want[:3]]
            assert [r.predicted_us for r in recs[:3]] == [c.predicted_us for c in want[:3]]
            # Ranks 4..6 were not enqueued: next come the family's seeds (nearby winners: none yet).
            seeds = [c for c in seed_configs(space.family("wmma"), shape) if c not in [r.config for r in recs[:3]]]
            assert recs[3].config == seeds[0]
        for r in recs[:3]:
            assert json.dumps(r.config, sort_keys=True) in held
            assert r.predicted_us and r.predicted_us > 0 and "SWIZZLE_LOG" in r.predicted_variant


def test_catalogue_top_zero_enqueues_none_and_needs_a_catalogue(tmp_path, monkeypatch, space):
    from tuner import api
    from tuner.search import TrialRecord, load_studies

    _, _, opts = replay_sweep(tmp_path, monkeypatch, space, top=0, trials=2)
    fam = space.family("wmma")
    (st,) = [s for s in load_studies(opts.storage) if s.study_name.startswith("2048x2048x64-")]
    recs = [TrialRecord.of(t) for t in sorted(st.get_trials(), key=lambda t: t.number)]
    # No catalogue config was enqueued: the first shape (empty storage) starts with its seeds.
    assert [r.config for r in recs[:2]] == seed_configs(fam, parse_shape("2048x2048x64"))[:2]
    with pytest.raises(UserError, match="--catalogue-top needs --catalogue"):
        api.Options(catalogue_top=2).check()
    with pytest.raises(UserError, match=">= 0"):
        api.Options(catalogue_top=-1, catalogue=Path("x.zip")).check()


def test_rank_check_reports_the_simulated_ranking(tmp_path, monkeypatch, space):
    from tuner import api

    _, cat, opts = replay_sweep(tmp_path, monkeypatch, space, top=None, trials=len(cat_configs(space)))
    rows = api.rank_check(opts.storage, top=2)
    assert len(rows) == 7 and all(q.simulated for q in rows)
    for q in rows:
        assert q.ranked == len(cat.kernels) and 1 <= q.measured <= q.ranked
        assert q.first_place is None or 1 <= q.first_place <= q.measured
        assert q.spearman is None or -1.0 <= q.spearman <= 1.0
        assert q.best_in_top == (q.best_rank <= 2)
    out = subprocess.run([sys.executable, "-m", "tuner.cli", "rank-check", opts.storage, "--top", "2"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "SIMULATED" in out.stdout and "2048x2048x64" in out.stdout
    empty = subprocess.run([sys.executable, "-m", "tuner.cli", "rank-check", f"sqlite:///{tmp_path}/none.db"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert empty.returncode == 2 and len(empty.stderr.strip().splitlines()) == 1


def cat_configs(space) -> list:
    return wmma_catalogue(space).kernels


# ---- the optional nvidia ranker (nvMatmulHeuristics, the `heuristics` extra) --------------------

def heuristic_first(space, shape) -> dict:
    """The heuristic's own best proposal for the shape that our cute_sm90 space can express (a
    compile config), trying its proposals in its order."""
    from tuner.search.nvidia_heuristics import gpu_for, heuristic
    from tuner.search.sampler import full_config

    fam = space.family("cute_sm90")
    for c, _ in heuristic(gpu_for(H200)).proposals(shape, 32):
        cfg = {"TILE_M": c.cta[0], "TILE_N": c.cta[1], "TILE_K": c.cta[2], "STAGES": c.stages,
               "CLUSTER_M": c.cluster[0], "CLUSTER_N": c.cluster[1],
               "SCHEDULE": "cooperative" if c.cta[0] % 128 == 0 else "pingpong"}
        try:
            cfg = fam.compile_config(full_config(fam, cfg))
        except UserError:
            continue
        if c.split_k == 1 and not fam.violations(full_config(fam, cfg), shape, H200):
            return cfg
    raise AssertionError(f"no proposal for {shape} our space can express")


@pytest.mark.parametrize("shape", ["4096x4096x4096", "3000x5000x1000", "1024x1024x1024"])
def test_nvidia_ranker_is_deterministic_and_puts_its_first_tile_near_the_top(space, shape):
    pytest.importorskip("nvMatmulHeuristics")
    shp = parse_shape(shape)
    first = heuristic_first(space, shp)
    cat = sm90_catalogue(space) + [("cute_sm90", first)]
    a = rank_catalogue(space, cat, shp, H200, ranker="nvidia")
    b = rank_catalogue(space, cat, shp, H200, ranker="nvidia")
    assert a == b
    assert [c.rank for c in a.candidates] == list(range(1, len(a.candidates) + 1))
    assert [c.score_us for c in a.candidates] == sorted(c.score_us for c in a.candidates)
    by = {c.predicted_by for c in a.candidates}
    assert "nvidia" in by and by <= {"nvidia", "model-scaled"}
    # stream-K is not the heuristic's to estimate: a config named at stream_k took our model's time.
    assert all(c.predicted_by == "model-scaled" for c in a.candidates if c.variant["DECOMP"] == "stream_k")
    assert next(c.rank for c in a.candidates if c.config == first) <= 3
    # The same configs, dropped alike, whichever ranker.
    model = rank_catalogue(space, cat, shp, H200)
    assert sorted(c.key for c in model.candidates) == sorted(c.key for c in a.candidates)
    assert all(c.predicted_by == "model" for c in model.candidates)


def test_nvidia_ranker_without_the_wheel_is_one_clear_line(space, monkeypatch):
    from tuner import api

    monkeypatch.setitem(sys.modules, "nvMatmulHeuristics", None)  # its import now fails
    with pytest.raises(UserError, match=r"pip install 'hgemm-tune\[heuristics\]'") as err:
        rank_catalogue(space, sm90_catalogue(space), parse_shape("4096x4096x4096"), H200, ranker="nvidia")
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="nvidia-matmul-heuristics"):
        api.Options(rank_by="nvidia", catalogue=Path("x.zip")).check()
    with pytest.raises(UserError, match="--rank-by needs --catalogue"):
        api.Options(rank_by="nvidia").check()
    with pytest.raises(UserError, match="choose one of model, nvidia"):
        api.Options(rank_by="cublas", catalogue=Path("x.zip")).check()
    # The model ranker never touches the wheel.
    assert rank_catalogue(space, sm90_catalogue(space), parse_shape("4096x4096x4096"), H200).candidates


def no_wheel_env(tmp_path) -> dict:
    """An environment whose `import nvMatmulHeuristics` fails, wheel installed or not."""
    import os

    fake = tmp_path / "nowheel"
    fake.mkdir(exist_ok=True)
    (fake / "nvMatmulHeuristics.py").write_text("raise ModuleNotFoundError('simulated: not installed')\n")
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(fake), str(ROOT)])}


def test_tune_rank_by_nvidia_without_the_wheel_fails_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tuner.cli", "tune", "--shape", "256x256x256", "--backend", "replay",
                          "--replay", str(REPLAY), "--catalogue", str(tmp_path / "none.zip"), "--rank-by", "nvidia",
                          "--storage", f"sqlite:///{tmp_path}/s.db"],
                         capture_output=True, text=True, cwd=tmp_path, env=no_wheel_env(tmp_path))
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and "hgemm-tune[heuristics]" in out.stderr


def synthetic_storage(tmp_path, space, shape: str, times: dict[str, float]) -> str:
    """A storage with one SIMULATED cute_sm90 study at `shape` that ranked the sm90 catalogue with
    the model (recorded ranks, as a sweep records them) and 'measured' each candidate at times[key]."""
    import optuna

    from tuner.search import Status, StudyMeta, TrialRecord

    storage = f"sqlite:///{tmp_path}/syn.db"
    shp = parse_shape(shape)
    st = optuna.create_study(study_name=f"{shape}-cute_sm90-syn", storage=storage)
    StudyMeta(shape=shape, families=["cute_sm90"], target=H200.to_dict(), backend="synthetic",
              simulated=True).write(st)
    for c in rank_catalogue(space, sm90_catalogue(space), shp, H200).candidates:
        rec = TrialRecord("cute_sm90", c.config, Status.OK, time_us=times[c.key], tflops=1.0, variant=c.variant,
                          simulated=True, catalogue_rank=c.rank, predicted_us=c.predicted_us,
                          predicted_variant=c.variant, predicted_by=c.predicted_by)
        st.add_trial(optuna.trial.create_trial(value=rec.time_us, user_attrs=rec.to_attrs(),
                                               state=optuna.trial.TrialState.COMPLETE))
    return storage


def ranked_times(ranking) -> dict[str, float]:
    """Times a ranking predicts perfectly: its own, strictly increasing with its rank."""
    return {c.key: c.predicted_us + 1e-3 * c.rank for c in ranking.candidates}


def test_rank_check_recomputes_the_model_ranking_from_configs(tmp_path, space):
    from tuner import api

    shape = "3000x5000x1000"
    storage = synthetic_storage(tmp_path, space, shape, ranked_times(
        rank_catalogue(space, sm90_catalogue(space), parse_shape(shape), H200)))
    ((asrun, by),) = api.rank_compare(storage, top=3, rankers=("model",))
    # Recorded with the model and no neighbours: recomputing it gives the same figures, all perfect.
    assert by["model"] == asrun
    assert asrun.spearman == pytest.approx(1.0) and asrun.first_place == 1 and asrun.best_rank == 1
    out = subprocess.run([sys.executable, "-m", "tuner.cli", "rank-check", storage, "--top", "3"],
                         capture_output=True, text=True, cwd=tmp_path, env=no_wheel_env(tmp_path))
    assert out.returncode == 0, out.stderr
    text = " ".join((out.stdout + out.stderr).split())  # rich wraps lines at the terminal's width
    assert "as run" in text and "model" in text and shape in text
    assert "nvidia ranker not compared" in text and "pip install 'hgemm-tune[heuristics]'" in text


def test_rank_check_puts_the_nvidia_ranking_beside_the_model(tmp_path, space):
    pytest.importorskip("nvMatmulHeuristics")
    from tuner import api

    shape = "3000x5000x1000"
    nv = rank_catalogue(space, sm90_catalogue(space), parse_shape(shape), H200, ranker="nvidia")
    storage = synthetic_storage(tmp_path, space, shape, ranked_times(nv))
    ((asrun, by),) = api.rank_compare(storage, top=3)
    assert set(by) == {"model", "nvidia"}
    # Times the heuristic predicts exactly: its recomputed order is perfect, the recorded (model) one is not.
    q = by["nvidia"]
    assert q is not None and q.spearman == pytest.approx(1.0) and q.first_place == 1 and q.best_rank == 1
    assert q.measured == asrun.measured == len(nv.candidates)
    assert by["model"] == asrun and asrun.spearman < 1.0
    out = subprocess.run([sys.executable, "-m", "tuner.cli", "rank-check", storage, "--top", "3"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = " ".join((out.stdout + out.stderr).split())
    assert "nvidia" in text and "nvidia ranker not compared" not in text
    assert "nvidia: measured fastest within the predicted top 3 at 1 of 1" in text


def test_tune_rank_by_nvidia_records_who_predicted(tmp_path, monkeypatch, space):
    pytest.importorskip("nvMatmulHeuristics")
    from tuner import api
    from tuner.api import tuning
    from tuner.search import TrialRecord

    cat = wmma_catalogue(space)
    monkeypatch.setattr(tuning, "load_catalogue", lambda *a, **k: cat)
    opts = api.Options(trials=3, storage=f"sqlite:///{tmp_path}/s.db", space_file=ROOT / "space.yaml",
                       families="wmma", backend="replay", replay=REPLAY, seed=0, confirm_top=0,
                       runs_dir=tmp_path / "runs", catalogue=Path("fake.zip"), catalogue_top=3, rank_by="nvidia")
    res = api.tune_shape("2048x2048x64", opts)
    recs = [TrialRecord.of(t) for t in sorted(res.study.get_trials(), key=lambda t: t.number)]
    # wmma is not the heuristic's to estimate: every candidate took the model's time (scale 1, so
    # the model's own order), and says so.
    assert [r.catalogue_rank for r in recs[:3]] == [1, 2, 3]
    assert {r.predicted_by for r in recs[:3]} == {"model-scaled"}
    want = rank_catalogue(space, [("wmma", k.config) for k in cat.kernels], parse_shape("2048x2048x64"), H200)
    assert [r.config for r in recs[:3]] == [c.config for c in want.candidates[:3]]

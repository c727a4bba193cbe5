"""The Optuna loop, resume and export, on the replay backend (real H200 measurements)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from tuner.measure import ReplayBackend
from tuner.results.export import export_studies
from tuner.search import best_trial, study_stats, tune
from tuner.space import parse_shape

DATA = Path(__file__).resolve().parent / "data"
REPLAY = DATA / "replay_4096x4096x8192.jsonl"
SHAPE = parse_shape("4096x4096x8192")


@pytest.fixture
def replay():
    return ReplayBackend(REPLAY, "sm_90a")


def test_replay_file_is_real_and_labelled(replay):
    assert replay.simulated and not replay.needs_cubin
    assert len(replay.records) >= 50
    assert replay.baseline(SHAPE)["cublas"] > 0
    gpus = {r["measurement"]["gpu"] for r in replay.records.values()}
    assert all("H200" in g for g in gpus), gpus


def test_tune_resume_and_export(space, replay, tmp_path):
    storage = f"sqlite:///{tmp_path}/s.db"
    study = tune(space, ["cute_sm80", "wmma"], SHAPE, replay, trials=30, storage=storage, seed=0)
    rows = [t for t in study.get_trials() if t.user_attrs.get("status") not in (None, "invalid", "duplicate")]
    assert len(rows) == 30
    numbers = {t.number for t in study.get_trials()}
    # Every evaluated trial is either a real (replayed) measurement or honestly not recorded.
    statuses = {t.user_attrs["status"] for t in rows}
    assert statuses <= {"ok", "not_recorded", "failed", "fault", "timeout", "compile_error", "duplicate"}
    assert any(t.user_attrs["status"] == "ok" for t in rows)
    for t in rows:
        if t.user_attrs["status"] == "ok":
            assert t.user_attrs["simulated"] is True
            assert t.value == pytest.approx(t.user_attrs["time_us"])
    best = best_trial(study)
    # Resume: the same study grows to 40 measured trials, keeping the first 30 unchanged.
    again = tune(space, ["cute_sm80", "wmma"], SHAPE, replay, trials=40, storage=storage, seed=0)
    assert again.study_name == study.study_name
    rows2 = [t for t in again.get_trials() if t.user_attrs.get("status") not in (None, "invalid", "duplicate")]
    assert len(rows2) == 40
    assert numbers <= {t.number for t in again.get_trials()}
    assert best_trial(again).value <= best.value
    # No compile-time config was measured twice.
    measured = [json.dumps([t.user_attrs["family"], t.user_attrs["config"]], sort_keys=True)
                for t in rows2 if t.user_attrs["status"] not in ("duplicate",)]
    assert len(measured) == len(set(measured))
    data = export_studies([again])
    (entry,) = data["entries"]
    assert data["simulated"] is True and entry["simulated"] is True
    assert entry["shape"] == "4096x4096x8192" and entry["family"] in ("cute_sm80", "wmma")
    assert entry["time_us"] == pytest.approx(best_trial(again).value)
    assert 0 < entry["roofline_fraction"] < 1
    assert entry["speedup"]["cublas"] == pytest.approx(entry["baselines_us"]["cublas"] / entry["time_us"])
    assert entry["pick"] == (entry["family"] if entry["speedup"]["cublas"] > 1 else "cublas")
    stats = study_stats(again)
    assert stats["trials"] + stats["not_recorded"] == 40  # configs the file lacks spend trials, unmeasured


def test_unrecorded_config_is_not_invented(space, replay):
    from tuner.search.compile_queue import finish, prepare

    fam = space.family("cute_sm80")
    cfg = fam.compile_config(fam.defaults() | {"BM": 96, "BN": 96, "WARP_M": 2, "WARP_N": 2, "STAGES": 5,
                                               "BK": 64, "REG_PREFETCH": 2, "STAGGER": 1, "EPILOGUE": "direct"})
    if any(k[1].endswith(json.dumps(cfg, sort_keys=True)) for k in replay.records):
        pytest.skip("that config happens to be recorded")
    rec = finish(prepare(fam, cfg, SHAPE, replay, None), SHAPE, replay, 60)
    assert rec.status == "not_recorded" and rec.time_us is None


def test_unrecorded_configs_spend_trials_but_are_not_measured(space, replay, tmp_path):
    from tuner.search import evaluated_trials, measured_trials

    study = tune(space, ["cute_sm80", "wmma"], SHAPE, replay, trials=12, storage=f"sqlite:///{tmp_path}/n.db", seed=0)
    unrecorded = [t for t in study.get_trials() if t.user_attrs.get("status") == "not_recorded"]
    assert unrecorded, "every proposed config was recorded: the test shows nothing"
    assert all(t.state == optuna.trial.TrialState.FAIL for t in unrecorded)
    # They spend the trial budget (a GPU run would have measured them), but are not measured.
    assert evaluated_trials(study) == 12
    assert measured_trials(study) == 12 - len(unrecorded)
    stats = study_stats(study)
    assert stats["trials"] == measured_trials(study) and stats["not_recorded"] == len(unrecorded)
    assert "not_recorded" not in stats["failures"]


def test_cli_replay_run_writes_json(tmp_path):
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "best.json"
    res = subprocess.run([sys.executable, "-m", "tuner.cli", "--shape", "4096x4096x8192", "--trials", "30",
                          "--backend", "replay", "--replay", str(REPLAY), "--seed", "0",
                          "--storage", f"sqlite:///{tmp_path}/cli.db", "-o", str(out),
                          "--space", str(root / "space.yaml")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "SIMULATED" in res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert data["entries"] and data["entries"][0]["simulated"]
    assert optuna.load_study(study_name=data["entries"][0]["study"], storage=f"sqlite:///{tmp_path}/cli.db")


def test_export_schema_rejects_damaged_files(tmp_path, space, replay):
    from tuner.errors import UserError
    from tuner.results import read_json, validate, write_json

    study = tune(space, ["cute_sm80"], SHAPE, replay, trials=8, storage=f"sqlite:///{tmp_path}/e.db", seed=0)
    data = export_studies([study])
    validate(data)
    path = write_json(data, tmp_path / "best.json")
    assert read_json(path)["entries"]
    bad = json.loads(path.read_text())
    bad["entries"][0]["time_us"] = -1
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(UserError, match="entries/0/time_us"):
        read_json(tmp_path / "bad.json")
    (tmp_path / "trunc.json").write_text(path.read_text()[:50])
    with pytest.raises(UserError, match="not valid JSON"):
        read_json(tmp_path / "trunc.json")


def test_invalid_configs_are_pruned_so_tpe_learns_the_constraints(space, replay, tmp_path):
    study = tune(space, ["cute_sm80", "wmma"], SHAPE, replay, trials=15, storage=f"sqlite:///{tmp_path}/p.db", seed=0)
    invalid = [t for t in study.get_trials() if t.user_attrs.get("status") == "invalid"]
    assert invalid, "the sampler proposed no invalid config: the test shows nothing"
    assert all(t.state == optuna.trial.TrialState.PRUNED for t in invalid)
    # Pruned trials never count as measured trials nor as the best.
    assert all(t.value is None for t in invalid)


def test_random_valid_config_is_valid_and_new(space, h200):
    import random

    from tuner.measure import config_key
    from tuner.search.sampler import random_valid_config

    fam = space.family("cute_sm90")
    shape = parse_shape("64x8192x4096")
    taken: set[str] = set()
    rng = random.Random(0)
    for _ in range(20):
        picked = random_valid_config([fam], shape, h200, taken, rng)
        assert picked is not None
        f, cfg = picked
        assert not f.violations(f.complete(cfg), shape, h200)
        key = config_key(f.name, cfg)
        assert key not in taken
        taken.add(key)
    # A shape no config of the family can run: nothing to offer.
    assert random_valid_config([fam], parse_shape("64x8190x4096"), h200, set(), rng, tries=200) is None


def test_a_trial_another_worker_finished_first_is_left_to_it(space, replay, tmp_path, monkeypatch):
    """Two workers on SQLite can pop the same enqueued trial (no row locks), and on the replay
    backend the other one may finish it before this one has suggested its params (CI saw a worker
    die of UpdateFinishedTrialError). The study goes on and leaves that trial as the other told it."""
    original_ask = optuna.Study.ask
    taken: list[int] = []

    def ask_raced(self, *args, **kwargs):
        trial = original_ask(self, *args, **kwargs)
        if not taken:  # the other worker tells the first trial before we touch it
            taken.append(trial.number)
            self.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        return trial

    monkeypatch.setattr(optuna.Study, "ask", ask_raced)
    study = tune(space, ["cute_sm80", "wmma"], SHAPE, replay, trials=6, storage=f"sqlite:///{tmp_path}/r.db", seed=0)
    trials = study.get_trials(deepcopy=False)
    assert taken == [0]
    assert trials[0].state == optuna.trial.TrialState.FAIL and not trials[0].params, "left as the other worker told it"
    assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials) >= 1, "the study went on"


def test_a_config_measured_on_other_code_is_measured_again(space, replay, tmp_path):
    """A resumed study after a template change: a config whose stored trial ran other code (its
    source hash differs from what the template renders now) is measured again, not skipped as a
    duplicate; one measured on the same code still is a duplicate."""
    from tuner.search import current_ok, evaluated_trials
    from tuner.search.sampler import _key_of, trial_params

    storage = f"sqlite:///{tmp_path}/s.db"
    study = tune(space, ["cute_sm80"], SHAPE, replay, trials=6, storage=storage, seed=0)
    done = [t for t in study.get_trials() if t.state == optuna.trial.TrialState.COMPLETE
            and t.user_attrs.get("status") == "ok"]
    assert len(done) >= 2
    old, same = done[0], done[1]
    fam = space.family("cute_sm80")
    with sqlite3.connect(tmp_path / "s.db") as db:  # Optuna keeps finished trials read-only
        db.execute("UPDATE trial_user_attributes SET value_json = ? WHERE trial_id = ? AND key = 'source_hash'",
                   (json.dumps("0" * 16), old._trial_id))  # as if measured on an older template
    before = len(study.get_trials())
    for t in (old, same):  # proposed again: the first two asks of the resumed study
        study.enqueue_trial(trial_params(fam, t.user_attrs["config"]))
    again = tune(space, ["cute_sm80"], SHAPE, replay, trials=evaluated_trials(study) + 2, storage=storage, seed=0)
    new = again.get_trials()[before:before + 2]
    by_config = {_key_of(t): t for t in new}
    remeasured = by_config[_key_of(old)]
    assert remeasured.user_attrs["status"] == "ok" and remeasured.user_attrs["source_hash"] != "0" * 16
    repeated = by_config[_key_of(same)]
    assert repeated.user_attrs["status"] == "duplicate" and repeated.user_attrs["duplicate_of"] == same.number
    # the stale trial's time no longer ranks; the new measurement of the same config does
    ranked = {t.number for t in current_ok(again.get_trials())}
    assert old.number not in ranked and remeasured.number in ranked and same.number in ranked


def test_progress_best_drops_a_time_measured_on_older_code(space, replay, tmp_path):
    """The live progress line shows the study's best that still describes its code: once a resumed
    study measures a stale fast trial's config again, its old time is no longer the best shown."""
    from tuner.search import evaluated_trials
    from tuner.search.sampler import trial_params

    storage = f"sqlite:///{tmp_path}/s.db"
    study = tune(space, ["cute_sm80"], SHAPE, replay, trials=4, storage=storage, seed=0)
    stale = next(t for t in study.get_trials() if t.user_attrs.get("status") == "ok")
    with sqlite3.connect(tmp_path / "s.db") as db:  # as if measured very fast on an older template
        db.execute("UPDATE trial_user_attributes SET value_json = ? WHERE trial_id = ? AND key = 'source_hash'",
                   (json.dumps("0" * 16), stale._trial_id))
        db.execute("UPDATE trial_values SET value = 0.001 WHERE trial_id = ?", (stale._trial_id,))
    study.enqueue_trial(trial_params(space.family("cute_sm80"), stale.user_attrs["config"]))
    shown: list[float | None] = []
    tune(space, ["cute_sm80"], SHAPE, replay, trials=evaluated_trials(study) + 2, storage=storage, seed=0,
         on_progress=lambda progress, rec: shown.append(progress.best_us))
    # the stale config is the first trial asked: from then on its old time is not the best shown
    assert shown and all(us is not None and us > 0.001 for us in shown)


def test_a_study_resumed_on_another_gpu_model_measures_again_and_ranks_its_own(space, replay, tmp_path):
    """A config measured on another GPU model is measured again, not taken as a duplicate (picks do not
    carry between cards); the study's best is then taken from this card's trials."""
    from tuner.search import best_trial, evaluated_trials, study_stats
    from tuner.search.sampler import trial_params

    storage = f"sqlite:///{tmp_path}/s.db"
    replay.name = "gpu:Card A"  # as if measured on a GPU of model "Card A"
    study = tune(space, ["cute_sm80"], SHAPE, replay, trials=4, storage=storage, seed=0)
    first = next(t for t in study.get_trials() if t.user_attrs.get("status") == "ok")
    assert first.user_attrs["gpu"] == "gpu:Card A"
    before = len(study.get_trials())
    study.enqueue_trial(trial_params(space.family("cute_sm80"), first.user_attrs["config"]))
    replay.name = "gpu:Card B#0"
    again = tune(space, ["cute_sm80"], SHAPE, replay, trials=evaluated_trials(study) + 1, storage=storage, seed=0)
    new = again.get_trials()[before]
    assert new.user_attrs["status"] == "ok" and new.user_attrs["gpu"] == "gpu:Card B#0"
    assert best_trial(again).number == new.number  # Card A's times do not rank on Card B
    card_a = sum(1 for t in again.get_trials() if t.user_attrs.get("status") == "ok"
                 and t.user_attrs.get("gpu") == "gpu:Card A")
    assert card_a >= 1 and study_stats(again)["other_gpu"] == card_a  # the summary says so

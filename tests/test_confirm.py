"""Confirm: the K best kernels re-timed in fresh runs; export takes the median winner."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import optuna
import pytest

from tuner.build import CompilePool
from tuner.measure import CompareReply, ReplayBackend
from tuner.results import write_json
from tuner.results.export import export_studies, exported_trial
from tuner.search import best_trial, tune
from tuner.search.confirm import confirm, confirmation, distinct_best, summarize
from tuner.space import parse_shape

REPLAY = Path(__file__).resolve().parent / "data" / "replay_4096x4096x8192.jsonl"
SHAPE = parse_shape("4096x4096x8192")


def _trial(number: int, value: float, family: str = "wmma", config: dict | None = None, status: str = "ok"):
    t = optuna.trial.create_trial(value=value, user_attrs={
        "family": family, "config": config or {"BM": 64 + number}, "variant": {}, "status": status})
    t.number = number
    return t


def _reply(times: dict, failed: tuple = ()) -> CompareReply:
    names = [n for n in times if n.startswith("#")]
    return CompareReply(times=times, verify={
        n: {"ok": n not in failed, "reason": "random check: max error 3.1" if n in failed else None} for n in names})


def test_a_time_measured_on_older_code_does_not_rank():
    """A config measured again after its template changed (another source hash, later) ranks by its
    new time only; a config measured once keeps its time whatever its hash."""
    import datetime as dt

    def at(t, minute: int, source_hash: str):
        t.datetime_complete = dt.datetime(2026, 12, 5, 12, minute)
        t.user_attrs["source_hash"] = source_hash
        return t

    stale = at(_trial(0, 5.0, config={"BM": 128}), 0, "aaaa")      # fast on the old code
    again = at(_trial(1, 12.0, config={"BM": 128}), 30, "bbbb")    # the same config now
    other = at(_trial(2, 9.0, config={"BM": 64}), 1, "cccc")
    study = optuna.create_study()
    for t in (stale, again, other):
        study.add_trial(t)
    assert best_trial(study).number == 2
    assert [t.number for t in distinct_best(study.get_trials(), 5)] == [2, 1]


def test_times_from_another_gpu_model_do_not_rank_with_this_ones():
    """A study resumed on another card: its best and confirm's candidates come from the trials measured
    on the card it now runs on (the study's last backend); with none there yet, from all of them."""
    h200 = [_trial(0, 5.0), _trial(1, 6.0)]
    h100 = [_trial(2, 9.0), _trial(3, 8.0)]
    for t in h200:
        t.user_attrs["gpu"] = "gpu:NVIDIA H200"
    for i, t in enumerate(h100):
        t.user_attrs["gpu"] = f"gpu:NVIDIA H100 80GB HBM3#{i}"  # two GPUs of one host: one model
    study = optuna.create_study()
    for t in h200 + h100:
        study.add_trial(t)
    study.set_user_attr("backend", "gpu:NVIDIA H100 80GB HBM3#1")
    assert best_trial(study).number == 3
    assert [t.number for t in distinct_best(study.get_trials(), 5, gpu="NVIDIA H100 80GB HBM3")] == [3, 2]
    assert [t.number for t in distinct_best(study.get_trials(), 5, gpu="NVIDIA A100")] == [0, 1, 3, 2]
    study.set_user_attr("backend", "replay:measurements.jsonl")  # replayed: no model to prefer
    assert best_trial(study).number == 0


def test_summarize_keeps_the_median_winner_verified_in_every_run():
    a, b, c = _trial(4, 9.8), _trial(7, 10.0), _trial(9, 10.2)
    runs = [_reply({"#4": 10.6, "#7": 10.1, "#9": 9.0, "cublas": 10.3}),
            _reply({"#4": 10.4, "#7": 10.0, "#9": 9.0, "cublas": 10.0}, failed=("#9",)),
            _reply({"#4": 10.5, "#7": 10.3, "#9": 9.0, "cublas": 10.3})]
    rec = summarize([a, b, c], runs, {}, "gpu:test")
    by = {k["trial"]: k for k in rec["kernels"]}
    # The in-study best (#4) is slower in every run; #9 is fastest but failed one verification.
    assert rec["winner"] == 7
    assert by[7]["median_us"] == pytest.approx(10.1)
    # Paired per run (10.3/10.1, 10.0/10.0, 10.3/10.3), then the median: not the medians' ratio (1.0198).
    assert by[7]["speedup_cublas"] == pytest.approx(1.0)
    assert by[7]["cublas_us"] == pytest.approx(10.3)
    assert by[9]["verified"] is False and by[9]["median_us"] is None and "max error" in by[9]["reason"]
    assert by[4]["median_us"] == pytest.approx(10.5) and by[4]["in_study_us"] == 9.8


def test_summarize_a_failed_run_or_build_confirms_nothing():
    a, b = _trial(1, 5.0), _trial(2, 5.1)
    rec = summarize([a, b], [CompareReply(status="fault", reason="worker died"), _reply({"#1": 5.0, "#2": 5.0})],
                    {"#2": "does not compile: error"}, "gpu:test")
    assert rec["winner"] is None
    assert [k["verified"] for k in rec["kernels"]] == [False, False]
    assert "worker died" in rec["kernels"][0]["reason"] and "compile" in rec["kernels"][1]["reason"]


def test_distinct_best_counts_a_kernel_once_and_only_verified_ones():
    same = {"BM": 64}
    trials = [_trial(0, 5.0, config=same), _trial(1, 4.0, config=same), _trial(2, 3.0, status="failed"),
              _trial(3, 6.0, family="cute_sm80", config=same), _trial(4, 7.0)]
    assert [t.number for t in distinct_best(trials, 3)] == [1, 3, 4]
    # A completion that maps two stored configs to one kernel merges them too.
    assert [t.number for t in distinct_best(trials, 5, lambda t: {})] == [1, 3]


class ScriptedBackend:
    """A GPU backend's confirm-side surface, answering from a script: run i -> {rank: us}, where
    rank 0 is the in-study best. Checks that every run gets fresh candidates built by nvcc."""

    simulated = False
    name = "gpu:scripted"

    def __init__(self, target, script, cublas=10.0, failed_ranks=()):
        self.target, self.script, self.cublas, self.failed_ranks = target, script, cublas, failed_ranks
        self.restarts, self.seen = 0, []
        self.order: list[str] = []

    def restart(self):
        self.restarts += 1

    def compare(self, shape, candidates, torch=True, modes=None):
        assert shape == SHAPE and torch is False
        assert modes == ["sustained"]  # confirmed in the regime the study minimized
        for cand in candidates.values():
            assert Path(cand.binary).is_file() and cand.launch.artifact == "cubin"
        self.seen.append(sorted(candidates))
        run = self.script[(len(self.seen) - 1) % len(self.script)]
        times = {self.order[r]: us for r, us in run.items()} | {"cublas": self.cublas}
        return _reply(times, failed=tuple(self.order[r] for r in self.failed_ranks))


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return tmp_path_factory.mktemp("cubins")  # shared: the second test's kernel is a cache hit


@pytest.fixture(scope="module")
def tuned_db(tmp_path_factory):
    from tuner.space import load_space

    db = tmp_path_factory.mktemp("tuned") / "c.db"
    st = tune(load_space(Path(__file__).resolve().parent.parent / "space.yaml"), ["wmma"], SHAPE,
              ReplayBackend(REPLAY, "sm_90a"), trials=12, storage=f"sqlite:///{db}", seed=0)
    return db, st.study_name


@pytest.fixture
def study(tuned_db, tmp_path):
    """A copy of one replayed wmma study per test (tests write to it)."""
    db, name = tuned_db
    shutil.copy(db, tmp_path / "c.db")
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/c.db")


@pytest.mark.nvcc
def test_confirm_builds_retimes_and_export_takes_the_winner(space, study, cubins, tmp_path):
    top = distinct_best(study.get_trials(), 3)
    assert len(top) == 3, "the replayed study has 3 verified wmma kernels"
    be = ScriptedBackend(ReplayBackend(REPLAY, "sm_90a").target,
                         [{0: 520.0, 1: 500.0, 2: 560.0}, {0: 522.0, 1: 501.0, 2: 560.0},
                          {0: 519.0, 1: 503.0, 2: 560.0}], cublas=450.0)
    be.order = [f"#{t.number}" for t in top]
    pool = CompilePool(2, cache_dir=cubins)
    try:
        rec = confirm(space, study, be, pool, top=3, runs=3)
    finally:
        pool.close()
    assert be.restarts == 3 and len(be.seen) == 3  # each run in a fresh worker
    assert rec["winner"] == top[1].number
    stored = optuna.load_study(study_name=study.study_name, storage=study._storage).user_attrs["confirm"]
    assert stored["winner"] == top[1].number

    data = export_studies([study])
    (e,) = data["entries"]
    assert e["trial"] == top[1].number and e["time_us"] == pytest.approx(501.0)
    assert e["speedup"]["cublas"] == pytest.approx(450.0 / 501.0) and e["pick"] == "cublas"
    assert e["confirm"]["runs"] == 3 and e["confirm"]["in_study_us"] == pytest.approx(top[1].value)
    # the objective the study minimized; these scripted runs sent no regime report: steady unknown
    assert e["objective"] == "sustained" and e["steady_state"]["steady"] is None and e["steady_state"]["runs"] == 3
    write_json(data, tmp_path / "best.json")  # the schema takes the confirm record

    # A faster trial after the confirmation: it no longer holds, the in-study best is exported.
    faster = optuna.trial.create_trial(value=top[0].value / 2, user_attrs=dict(top[0].user_attrs))
    study.add_trial(faster)
    trial, confirmed = exported_trial(study)
    assert confirmed is None and trial.number == best_trial(study).number
    assert "confirm" not in export_studies([study])["entries"][0]


@pytest.mark.nvcc
def test_a_best_that_fails_reverification_is_never_the_pick(space, study, cubins):
    (only,) = distinct_best(study.get_trials(), 1)
    be = ScriptedBackend(ReplayBackend(REPLAY, "sm_90a").target, [{0: 400.0}], cublas=450.0, failed_ranks=(0,))
    be.order = [f"#{only.number}"]
    pool = CompilePool(1, cache_dir=cubins)
    try:
        rec = confirm(space, study, be, pool, top=1, runs=1)
    finally:
        pool.close()
    assert rec["winner"] is None
    assert confirmation(study, best_trial(study))["verified"] is False
    (e,) = export_studies([study])["entries"]
    assert e["pick"] == "cublas" and not e["beats_vendor"] and e["confirm"]["verified"] is False
    assert "max error" in e["confirm"]["reason"]
    json.dumps(e)


def test_a_simulated_backend_confirms_nothing(space, study):
    assert confirm(space, study, ReplayBackend(REPLAY, "sm_90a"), None) is None
    assert "confirm" not in study.user_attrs


@pytest.mark.nvcc
def test_cli_confirm_prints_the_runs_and_keeps_a_holding_confirmation(space, study, cubins, capsys, tmp_path):
    from dataclasses import replace

    from tuner import api
    from tuner.cli.studies import studies
    from tuner.cli.views import CliListener

    top = distinct_best(study.get_trials(), 3)
    be = ScriptedBackend(ReplayBackend(REPLAY, "sm_90a").target,
                         [{0: 500.0, 1: 510.0, 2: 520.0}, {0: 505.0, 1: 509.0, 2: 521.0}], cublas=450.0)
    be.order = [f"#{t.number}" for t in top]
    pool = CompilePool(2, cache_dir=cubins)
    try:
        opts = api.Options(confirm_top=3, confirm_runs=2)
        with CliListener() as listener:
            api.confirm_best(space, study, be, pool, opts, listener)
        out = capsys.readouterr().out
        assert "3 kernels x 2 fresh runs" in out and "* exported" in out and "502.50" in out
        with CliListener() as listener:
            api.confirm_best(space, study, be, pool, opts, listener)  # holds: no run again
        assert len(be.seen) == 2 and "confirmed earlier" in capsys.readouterr().err
        with CliListener(sweep=True) as listener:  # a sweep's bar: a larger request confirms again, quietly
            api.confirm_best(space, study, be, pool, replace(opts, confirm_runs=3), listener)
        assert len(be.seen) == 5 and study.user_attrs["confirm"]["runs"] == 3
    finally:
        pool.close()
    capsys.readouterr()
    studies(storage=f"sqlite:///{tmp_path}/c.db")
    assert "median of 3 confirm runs" in capsys.readouterr().out.replace("\n", " ")

"""Batched trials (measure.evaluate_many): several ready binaries of one shape verified, screened
together and only the survivors timed in full; the rest recorded as screened (pruned)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import optuna
import pytest

from tuner.measure import Measurement, ReplayBackend
from tuner.measure.protocol import (
    EvaluateItem,
    EvaluateManyReply,
    EvaluateManyRequest,
    LaunchSpec,
    decode_reply,
    decode_request,
    encode_request,
)
from tuner.measure.regimes import RegimeReport
from tuner.results.export import export_studies
from tuner.search import best_trial, tune
from tuner.search.rank import order_time
from tuner.search.records import TrialRecord
from tuner.space import parse_shape

DATA = Path(__file__).resolve().parent / "data"
REPLAY = DATA / "replay_4096x4096x8192.jsonl"
SHAPE = parse_shape("4096x4096x8192")


def test_evaluate_many_request_round_trips():
    req = EvaluateManyRequest((64, 128, 256), [EvaluateItem("/x/a.so", LaunchSpec(artifact="library", sm_count=132),
                                                            [{"RASTER": "along_m"}], "ab" * 32),
                                               EvaluateItem("/x/b.cubin", LaunchSpec(grid=4, block=128, smem=0),
                                                            [{}], None)], "fp32", "isolated")
    back = decode_request(encode_request(req))
    assert back == req and isinstance(back.items[0].launch, LaunchSpec)
    reply = decode_reply(EvaluateManyReply, {"status": "ok", "items": [{"status": "screened"}], "unknown": 1})
    assert reply.items == [{"status": "screened"}]


def test_a_batch_report_splits_per_binary():
    shared = RegimeReport("sustained", rounds=5, steady=True, steady_after=5, screened=5, kept=2, batch=2,
                          spread={"0|{}": 0.01, "1|{\"S\": 2}": 0.02, "cublas": 0.005},
                          launches={"0|{}": 40, "1|{\"S\": 2}": 40, "cublas": 40},
                          energy_mj={"0|{}": 1.0, "1|{\"S\": 2}": 2.0, "cublas": 0.9},
                          screen_us={"0|{}": 10.0, "1|{\"S\": 1}": 12.0, "1|{\"S\": 2}": 11.0})
    one = shared.for_item("1|")
    assert one.screen_us == {"{\"S\": 1}": 12.0, "{\"S\": 2}": 11.0}
    assert one.spread == {"{\"S\": 2}": 0.02, "cublas": 0.005}
    assert one.launches == {"{\"S\": 2}": 40, "cublas": 40} and one.energy_mj == {"{\"S\": 2}": 2.0, "cublas": 0.9}
    assert (one.batch, one.kept, one.screened, one.steady) == (2, 2, 5, True)
    assert shared.for_item("0|").screen_us == {"{}": 10.0}


class ScreeningReplay:
    """The replay backend with a batch verb that behaves as the GPU worker's does: every binary of
    a batch is measured, the `keep` fastest stay "ok" with their times, the others come back
    "screened" with only screen times (here their replayed times, 1% apart so the screen and the
    full protocol differ)."""

    def __init__(self, keep: int = 2):
        self.inner = ReplayBackend(REPLAY, "sm_90a")
        self.keep, self.batches = keep, []
        self.name, self.target, self.simulated, self.needs_cubin = (self.inner.name, self.inner.target, True, False)

    def baseline(self, *a, **k):
        return self.inner.baseline(*a, **k)

    def evaluate(self, req, timeout_s: float = 60.0) -> Measurement:
        return self.inner.evaluate(req, timeout_s)

    def evaluate_many(self, reqs, timeout_s: float = 60.0) -> list[Measurement]:
        self.batches.append(len(reqs))
        ms = [self.inner.evaluate(r, timeout_s) for r in reqs]
        timed = sorted((i for i, m in enumerate(ms) if m.ok), key=lambda i: ms[i].best()[1])
        kept = set(timed[:self.keep])
        out = []
        for i, m in enumerate(ms):
            if not m.ok:
                out.append(m)
                continue
            screen = {k: t * 0.99 for k, t in m.times_us.items()}
            report = RegimeReport("sustained", rounds=5, steady=True, screened=len(timed), kept=len(kept),
                                  batch=len(reqs), screen_us=screen).to_dict()
            if i in kept:
                out.append(dataclasses.replace(m, regime=report))
            else:
                out.append(dataclasses.replace(m, status="screened", kind="screened", times_us={},
                                               reason="screened out", regime=report))
        return out

    def close(self) -> None:
        self.inner.close()


def test_a_catalogue_study_measures_ready_trials_in_batches(space, tmp_path):
    """Trials that are ready together go to the backend as one batch; the screened-out ones are
    told PRUNED with their screen time as the intermediate value, count toward --trials, never
    become the best or the export, and rank-check ranks the batch by its screen times."""
    be = ScreeningReplay(keep=2)
    storage = f"sqlite:///{tmp_path}/b.db"
    study = tune(space, ["cute_sm80", "wmma"], SHAPE, be, trials=16, storage=storage, seed=0, batch=4)
    assert be.batches and max(be.batches) > 1, "no batch reached the backend: the test shows nothing"
    assert max(be.batches) <= 4
    trials = study.get_trials()
    screened = [t for t in trials if t.user_attrs.get("status") == "screened"]
    ok = [t for t in trials if t.user_attrs.get("status") == "ok"]
    assert screened and ok
    for t in screened:
        rec = TrialRecord.of(t)
        screen = min(rec.regime_report["screen_us"].values())
        # Optuna gives a pruned trial its last intermediate value: the screen time, never a trial time
        assert t.state == optuna.trial.TrialState.PRUNED and t.value == pytest.approx(screen)
        assert t.intermediate_values == {0: pytest.approx(screen)}
        assert rec.time_us is None and rec.regime_report["batch"] > 1
        assert order_time(rec) == pytest.approx(min(rec.regime_report["screen_us"].values()))
    evaluated = [t for t in trials if t.user_attrs.get("status") not in (None, "invalid", "duplicate")]
    assert len(evaluated) == 16
    best = best_trial(study)
    assert best.user_attrs["status"] == "ok" and best.value == min(t.value for t in ok)
    (entry,) = export_studies([study])["entries"]
    assert entry["time_us"] == pytest.approx(best.value)


def test_batch_one_and_backends_without_a_batch_verb_measure_one_by_one(space, tmp_path):
    be = ScreeningReplay()
    tune(space, ["cute_sm80"], SHAPE, be, trials=6, storage=f"sqlite:///{tmp_path}/one.db", seed=0, batch=1)
    assert be.batches == []
    plain = ReplayBackend(REPLAY, "sm_90a")  # no evaluate_many: batch asks for nothing it cannot do
    study = tune(space, ["cute_sm80"], SHAPE, plain, trials=6, storage=f"sqlite:///{tmp_path}/p.db", seed=0,
                 batch=8)
    assert not [t for t in study.get_trials() if t.user_attrs.get("status") == "screened"]


def test_batch_option_is_checked():
    from tuner.api import Options
    from tuner.errors import UserError

    assert Options().batch_size == 1 and Options(catalogue=Path("c.zip")).batch_size == 8
    assert Options(batch=3).batch_size == 3
    with pytest.raises(UserError, match="--batch 0"):
        Options(batch=0).check()

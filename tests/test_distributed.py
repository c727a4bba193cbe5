"""Several workers on one study, and a tuner killed with SIGKILL, on the replay backend."""

from __future__ import annotations

import collections
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from helpers import kill9_after

from tuner.search import NOT_MEASURED
from tuner.shapes import parse_shape
from tuner.space import load_space
from tuner.target import target_for_arch

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
REPLAY = DATA / "replay_4096x4096x8192.jsonl"
SHAPE = "4096x4096x8192"


@pytest.fixture
def small_space(tmp_path) -> Path:
    (tmp_path / "templates").mkdir()
    shutil.copy(ROOT / "templates" / "cute_sm80.cu.j2", tmp_path / "templates")
    shutil.copy(DATA / "space_small.yaml", tmp_path / "space.yaml")
    return tmp_path / "space.yaml"


def grid_size(space_path: Path) -> int:
    fam = load_space(space_path).family("cute_sm80")
    knobs = fam.compile_knobs
    target, shape = target_for_arch("sm_90a"), parse_shape(SHAPE)
    names = [k.name for k in knobs]
    configs = [dict(zip(names, c, strict=True)) for c in itertools.product(*(k.values for k in knobs))]
    return sum(1 for c in configs if not fam.violations(c | {"SWIZZLE_LOG": 0}, shape, target))


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def measured(storage: str) -> list[optuna.trial.FrozenTrial]:
    from tuner.storage import open_storage

    st = open_storage(storage)
    (name,) = optuna.get_all_study_names(st)
    study = optuna.load_study(study_name=name, storage=st)
    return [t for t in study.get_trials() if t.state.is_finished()
            and t.user_attrs.get("status") not in NOT_MEASURED]


def run_grid(storage: str, workers: int, space: Path, cwd: Path) -> list[optuna.trial.FrozenTrial]:
    n = grid_size(space)
    res = cli("--shape", SHAPE, "--trials", str(n), "--workers", str(workers), "--families", "cute_sm80",
              "--sampler", "grid", "--seed", "0", "--backend", "replay", "--replay", str(REPLAY),
              "--space", str(space), "--storage", storage, cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    return measured(storage)


def _configs(trials) -> collections.Counter:
    return collections.Counter(json.dumps(t.user_attrs["config"], sort_keys=True) for t in trials)


def _best(trials) -> float:
    return min(t.value for t in trials if t.value is not None)


@pytest.mark.parametrize("kind", ["journal", "postgresql"])
def test_two_workers_do_every_trial_once(kind, small_space, tmp_path):
    if kind == "postgresql":
        url = os.environ.get("HGEMM_TEST_POSTGRES_URL")
        if not url:
            pytest.skip("needs a PostgreSQL server: set HGEMM_TEST_POSTGRES_URL (.ci/run starts one)")
        from sqlalchemy import create_engine, text

        with create_engine(url, isolation_level="AUTOCOMMIT").connect() as conn:
            for table in ("trial_heartbeats", "trial_intermediate_values", "trial_params", "trial_system_attributes",
                          "trial_user_attributes", "trial_values", "trials", "study_directions",
                          "study_system_attributes", "study_user_attributes", "studies", "version_info",
                          "alembic_version"):
                conn.execute(text(f"DROP TABLE IF EXISTS {table} CASCADE"))
        storage = url
    else:
        storage = f"journal:{tmp_path}/two.log"
    single = run_grid(f"sqlite:///{tmp_path}/single.db", 1, small_space, tmp_path)
    both = run_grid(storage, 2, small_space, tmp_path)
    n = grid_size(small_space)
    assert len(_configs(single)) == n
    counts = _configs(both)
    assert len(counts) == n, "every config of the grid measured"
    assert max(counts.values()) == 1, "no config measured twice"
    assert len(both) == n
    assert _best(both) == pytest.approx(_best(single))


def test_kill9_keeps_every_finished_trial(tmp_path):
    storage = f"sqlite:///{tmp_path}/k.db"
    args = [sys.executable, "-m", "tuner.cli", "--shape", SHAPE, "--trials", "60", "--backend", "replay",
            "--replay", str(REPLAY), "--seed", "1", "--storage", storage, "--space", str(ROOT / "space.yaml")]
    kill9_after(args, tmp_path, tmp_path / "k.db", rows=30)
    before = measured(storage)
    assert 8 <= len(before) < 60, "killed mid-study"
    res = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    after = measured(storage)
    assert len(after) >= 60
    after_by_number = {t.number: t for t in after}
    for t in before:  # nothing finished before the kill was lost or changed
        assert t.number in after_by_number and after_by_number[t.number].value == t.value
    assert max(_configs(after).values()) == 1, "no config measured twice across the kill"

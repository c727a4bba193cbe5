"""Several workers on one study, and a tuner killed with SIGKILL, on the replay backend."""

from __future__ import annotations

import collections
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from helpers import kill9_after

from tuner.search import NOT_EVALUATED
from tuner.space import load_space, parse_shape, target_for_arch

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
    from tuner.search.storage import open_storage

    st = open_storage(storage)
    (name,) = optuna.get_all_study_names(st)
    study = optuna.load_study(study_name=name, storage=st)
    return [t for t in study.get_trials() if t.state.is_finished()
            and t.user_attrs.get("status") not in NOT_EVALUATED]


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


DEAD_WORKER = """
import sys, time, optuna
from tuner.search.sampler import trial_params
from tuner.space import load_space
from tuner.search.storage import Heartbeat, open_storage
storage, name, space_file, config = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
backing = open_storage(storage)
study = optuna.load_study(study_name=name, storage=backing)
study.enqueue_trial(trial_params(load_space(space_file).family("cute_sm80"), config))
trial = study.ask()
backing.record_heartbeat(trial._trial_id)  # beat once before saying which trial it holds
with Heartbeat(backing, lambda: [trial._trial_id]):
    print(trial.number, flush=True)
    time.sleep(600)  # holds the trial until SIGKILL
"""


def test_killed_worker_trial_is_failed_and_retried(small_space, tmp_path):
    """A worker SIGKILLed while it holds a trial: once its heartbeat is older than the grace
    period, the next worker fails that trial, re-queues its config and measures it once."""
    env = os.environ | {"HGEMM_TUNE_HEARTBEAT_S": "1", "HGEMM_TUNE_GRACE_S": "2"}
    db = tmp_path / "dead.db"
    storage = f"sqlite:///{db}"
    common = ["--backend", "replay", "--replay", str(REPLAY), "--sampler", "grid", "--space", str(small_space),
              "--storage", storage]
    res = subprocess.run([sys.executable, "-m", "tuner.cli", "--shape", SHAPE, "--trials", "3", "--families",
                          "cute_sm80", "--seed", "0", *common], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    (name,) = optuna.get_all_study_names(storage)
    taken = _configs(measured(storage))
    fam = load_space(small_space).family("cute_sm80")
    names = [k.name for k in fam.compile_knobs]
    shape, target = parse_shape(SHAPE), target_for_arch("sm_90a")
    recorded = [json.loads(line) for line in REPLAY.read_text().splitlines()]
    config = next(c for c in (dict(zip(names, v, strict=True))
                              for v in itertools.product(*(k.values for k in fam.compile_knobs)))
                  if json.dumps(c, sort_keys=True) not in taken
                  and any(r.get("config") == c and r["measurement"]["status"] == "ok" for r in recorded)
                  and not fam.violations(c | {"SWIZZLE_LOG": 0}, shape, target))

    child = subprocess.Popen([sys.executable, "-c", "import json\n" + DEAD_WORKER, storage, name, str(small_space),
                              json.dumps(config)], cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)
    dead = int(child.stdout.readline())  # printed after its first heartbeat
    child.kill()  # SIGKILL: no chance to tell the trial
    child.wait()
    time.sleep(3)  # past the 2 s grace

    res = subprocess.run([sys.executable, "-m", "tuner.cli", "worker", "--study", name, "--trials", "6", *common],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    study = optuna.load_study(study_name=name, storage=storage)
    trials = study.get_trials()
    assert trials[dead].state == optuna.trial.TrialState.FAIL, "the dead worker's trial is failed"
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == dead]
    assert len(retries) == 1
    assert retries[0].state == optuna.trial.TrialState.COMPLETE, retries[0].user_attrs.get("reason")
    assert retries[0].user_attrs["config"] == config, "the retry measures the dead trial's config"
    assert max(_configs(measured(storage)).values()) == 1, "no config measured twice"



@pytest.mark.parametrize("who", ["parent", "group"])
def test_interrupted_workers_leave_no_trial_running(who, tmp_path):
    """Ctrl-C of `tune --workers 2` (SIGINT to the parent, which SIGTERMs its workers; or to the whole
    process group, as a terminal sends it): every trial a worker held is told FAIL ("interrupted")."""
    import signal

    from helpers import finished_rows, trial_states, user_attr_counts

    db = tmp_path / "w.db"
    args = [sys.executable, "-m", "tuner.cli", "--shape", SHAPE, "--trials", "5000", "--workers", "2",
            "--backend", "replay", "--replay", str(REPLAY), "--seed", "0", "--storage", f"sqlite:///{db}",
            "--space", str(ROOT / "space.yaml")]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and finished_rows(db) < 60:  # both workers well into the study
        time.sleep(0.3)
    if who == "parent":
        proc.send_signal(signal.SIGINT)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err
    states = trial_states(db)
    assert "RUNNING" not in states, states
    assert user_attr_counts(db, "status").get('"interrupted"'), "no trial was in flight: the test shows nothing"
    for i in range(2):
        assert "interrupted" in (tmp_path / "runs" / f"worker-{i}.log").read_text()


def test_an_interrupt_inside_tell_leaves_no_trial_running(tmp_path, monkeypatch):
    """Ctrl-C between a trial's attributes and its tell: the trial ends FAIL ("interrupted")."""
    from tuner.search import TrialRecord
    from tuner.search.tell import tell as _tell

    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/t.db")
    trial = study.ask()
    real_tell = optuna.Study.tell
    calls = []

    def interrupted_tell(self, *args, **kwargs):
        calls.append(kwargs.get("state"))
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_tell(self, *args, **kwargs)

    monkeypatch.setattr(optuna.Study, "tell", interrupted_tell)
    with pytest.raises(KeyboardInterrupt):
        _tell(study, trial, TrialRecord("wmma", {"BM": 64}, "invalid", kind="invalid", reason="too big"))
    (t,) = study.get_trials()
    assert t.state == optuna.trial.TrialState.FAIL and t.user_attrs["status"] == "interrupted"


def test_signals_wait_for_the_end_of_a_storage_section():
    """SIGTERM inside a deferred section (ask..tell) is raised as KeyboardInterrupt when the section
    ends; a second signal while the process stops is ignored."""
    import signal

    from tuner.search import INTERRUPTS

    before = signal.getsignal(signal.SIGTERM)
    with INTERRUPTS.handled():
        reached_end = False
        with pytest.raises(KeyboardInterrupt), INTERRUPTS.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler has run: nothing raised inside the section
            reached_end = True
        assert reached_end
        os.kill(os.getpid(), signal.SIGTERM)  # stopping already: ignored
        time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) == before

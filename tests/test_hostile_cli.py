"""The command line as a new user (or an attacker) drives it: kill -9 and resume, two workers on
one study, corrupt and foreign storages, read-only commands, exports that would be clobbered,
bytes that are not UTF-8, an unwritable report folder, matplotlib missing, inputs a GPU run
would find wrong only after the GPU started. Each ends safely: a one-line error (exit 2, or 1
where nothing was wrong with the input), no traceback, no file written or clobbered, no lost
trial."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import pytest
from helpers import finished_rows

from tuner.errors import UserError
from tuner.search import NOT_EVALUATED, evaluated_trials, measured_trials

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
REPLAY = DATA / "replay_4096x4096x8192.jsonl"
SPACE = ROOT / "space.yaml"
SHAPE = "4096x4096x8192"
STUDY = f"{SHAPE}-TN-f32acc-sm_90a-cute_sm80+wmma"  # the default study of a replay tune of SHAPE


def cli(*args: str, cwd: Path, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner.cli", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


def tune_args(storage: str, trials: int = 4, *extra: str) -> list[str]:
    return ["--shape", SHAPE, "--trials", str(trials), "--backend", "replay", "--replay", str(REPLAY),
            "--storage", storage, "--space", str(SPACE), "--seed", "1", *extra]


def one_line_error(res: subprocess.CompletedProcess, needle: str, code: int = 2) -> str:
    """Exit `code`, no traceback, exactly one `error:` line holding `needle`; returns it."""
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.returncode == code, (res.returncode, res.stderr[-3000:])
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, res.stderr[-3000:]
    assert needle in errors[0], errors[0]
    return errors[0]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load(storage: str) -> optuna.Study:
    from tuner.search.storage import open_storage

    st = open_storage(storage)
    (name,) = optuna.get_all_study_names(st)
    return optuna.load_study(study_name=name, storage=st)


# ---- 1. reliability ----------------------------------------------------------------------

def _journal_finished(path: Path) -> int:
    """Finished trials in a journal file, read without Optuna (op 6: a trial's state)."""
    n = 0
    try:
        for line in path.read_bytes().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            n += rec.get("op_code") == 6 and rec.get("state") in (1, 2, 3)
    except OSError:
        return 0
    return n


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_kill9_resume_fails_requeues_and_measures_the_killed_trials(kind, tmp_path):
    """kill -9 mid-study, then the same command: the trials the dead process held are failed at
    once (no heartbeat grace to wait out; the journal has no heartbeat at all), their configs are
    measured on resume, and the study ends at exactly its trial count."""
    path = tmp_path / ("k.log" if kind == "journal" else "k.db")
    storage = f"journal:{path}" if kind == "journal" else f"sqlite:///{path}"
    args = [sys.executable, "-m", "tuner.cli", *tune_args(storage, 24, "--confirm", "0")]
    env = os.environ | {"HGEMM_TUNE_OWNERLESS_GRACE_S": "1"}
    count = _journal_finished if kind == "journal" else finished_rows
    dead: list[optuna.trial.FrozenTrial] = []
    for _ in range(3):  # a kill between two trials may find nothing held: try again
        proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.time() + 15
        target = count(path) + 6
        while time.time() < deadline and count(path) < target and proc.poll() is None:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        study = load(storage)
        dead = [t for t in study.get_trials() if t.state == optuna.trial.TrialState.RUNNING and t.params]
        if dead and evaluated_trials(study) < 24:
            break
    assert dead, "no trial was held at the kill: the test shows nothing"
    assert evaluated_trials(study) < 24
    time.sleep(1.1)  # past the (shortened) grace of a trial killed before it recorded its owner
    started = time.time()
    res = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode in (0, 1) and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert time.time() - started < 40, "resume waited out a heartbeat grace (45 s) or a stale lock (30 s)"
    study = load(storage)
    trials = study.get_trials()
    assert not [t.number for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    assert evaluated_trials(study) == 24, "exactly the trial count"
    for t in dead:
        assert trials[t.number].state == optuna.trial.TrialState.FAIL
        assert trials[t.number].user_attrs["status"] == "interrupted"
        # Its re-queued twin: asked on resume, once. A kill between two suggest() calls leaves a
        # trial with part of its knobs: the twin fixes those and samples the rest.
        (twin,) = [u for u in trials if u.system_attrs.get("failed_trial") == t.number]
        assert twin.state.is_finished() and twin.user_attrs.get("status") is not None
        assert {k: twin.params[k] for k in t.params} == t.params
        family = t.params["family"]
        if len([k for k in t.params if k.startswith(family + ".")]) == len(
                [k for k in twin.params if k.startswith(family + ".")]):  # the whole config was asked
            if twin.user_attrs["status"] == "invalid":  # killed before telling a rejected config: rejected again
                assert twin.state == optuna.trial.TrialState.PRUNED
                continue
            again = [u for u in trials if u.params == t.params and u.state.is_finished()
                     and u.user_attrs.get("status") not in NOT_EVALUATED]
            assert len(again) == 1, f"the killed trial #{t.number}'s config is measured once on resume"


def _search(storage: str, trials: int, backend=None, lookahead: int | None = None):
    from tuner.measure import ReplayBackend
    from tuner.search import Search
    from tuner.space import load_space, parse_shape

    return Search(load_space(SPACE), ["cute_sm80", "wmma"], parse_shape(SHAPE), backend or ReplayBackend(REPLAY),
                  trials=trials, storage=storage, seed=3, lookahead=lookahead)


def test_a_trial_measured_while_another_worker_fills_the_study_is_handed_back(tmp_path):
    """The count read before measuring is stale by the time the trial is told: another worker
    filled the study during the measurement. The trial is handed back (surplus), not told."""
    from tuner.measure import ReplayBackend

    storage = f"sqlite:///{tmp_path}/fill.db"
    _search(storage, 5).run()

    class FillsDuringMeasurement(ReplayBackend):
        filled = False

        def evaluate(self, req, timeout_s=60.0):
            if not self.filled:
                self.filled = True
                _search(storage, 8).run()  # the other worker: fills the study to 8
            return super().evaluate(req, timeout_s)

    _search(storage, 8, FillsDuringMeasurement(REPLAY), lookahead=1).run()
    study = load(storage)
    assert evaluated_trials(study) == 8
    assert "RUNNING" not in {t.state.name for t in study.get_trials()}


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_two_workers_telling_the_last_trial_at_once_do_not_overshoot(kind, tmp_path):
    """Two workers pass the count check together and measure the study's last slot at the same
    moment, then tell: exactly one of them is counted."""
    from tuner.measure import ReplayBackend

    storage = f"sqlite:///{tmp_path}/two.db" if kind == "sqlite" else f"journal:{tmp_path}/two.log"
    _search(storage, 6).run()
    # Slots left for the two: one, unless the first run stopped short of its count (its sampler can
    # spend its proposals on configs it holds already); then both fit and neither is surplus.
    free = 7 - evaluated_trials(load(storage))
    assert free in (1, 2)
    barrier = threading.Barrier(2, timeout=20)

    class Together(ReplayBackend):
        def evaluate(self, req, timeout_s=60.0):
            barrier.wait()  # both measured the last slot: now both tell
            return super().evaluate(req, timeout_s)

    searches = [_search(storage, 7, Together(REPLAY), lookahead=1) for _ in range(2)]
    errors: list[BaseException] = []

    def run(s):
        try:
            s.run()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in searches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    study = load(storage)
    assert evaluated_trials(study) == 7, "one of the two is counted, never both"
    assert "RUNNING" not in {t.state.name for t in study.get_trials()}
    statuses = [t.user_attrs.get("status") for t in study.get_trials()]
    # The one that did not fit is handed back as surplus; or both popped the same queued trial
    # (SQLite cannot lock rows), one told it and the other found it told: then none is surplus.
    assert statuses.count("surplus") <= 2 - free


def test_two_tune_processes_on_one_study_end_at_exactly_its_count(tmp_path):
    storage = f"journal:{tmp_path}/pair.log"
    cli(*tune_args(storage, 0, "--confirm", "0"), cwd=tmp_path)  # the study exists before both start
    args = [sys.executable, "-m", "tuner.cli", *tune_args(storage, 30, "--confirm", "0")]
    procs = [subprocess.Popen([*args[:-6], "--seed", str(i), *args[-4:]], cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode in (0, 1) and "Traceback" not in err, err[-3000:]
    assert evaluated_trials(load(storage)) == 30


def _good_db(tmp_path: Path) -> Path:
    db = tmp_path / "good.db"
    res = cli(*tune_args(f"sqlite:///{db}", 6), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    return db


def _damage(tmp_path: Path, how: str) -> tuple[str, Path]:
    """A storage URL and its file, damaged `how`."""
    if how == "garbage":
        bad = tmp_path / "bad.db"
        bad.write_bytes(b"this is not a database\n" * 100)
    elif how == "binary_garbage":
        bad = tmp_path / "bad.db"
        bad.write_bytes(bytes(range(256)) * 64)
    elif how.startswith("truncated"):
        good = _good_db(tmp_path)
        bad = tmp_path / "bad.db"
        data = good.read_bytes()
        bad.write_bytes(data[: {"truncated_header": 60, "truncated_half": len(data) // 2}[how]])
    elif how == "pages_overwritten":
        good = _good_db(tmp_path)
        bad = tmp_path / "bad.db"
        data = bytearray(good.read_bytes())
        data[len(data) // 3: len(data) // 3 + 20000] = b"\xab" * 20000
        bad.write_bytes(bytes(data))
    elif how == "foreign_sqlite":
        bad = tmp_path / "bad.db"
        with sqlite3.connect(bad) as conn:
            conn.execute("CREATE TABLE invoices (id INTEGER, amount REAL)")
            conn.execute("INSERT INTO invoices VALUES (1, 9.5)")
        conn.close()
    elif how == "journal_garbage":
        bad = tmp_path / "bad.log"
        bad.write_text('{"op_code": 0, "worker_id": "x", "study_name": "s", "directions": [1]}\nnot json\n')
        return f"journal:{bad}", bad
    elif how == "journal_not_utf8":
        bad = tmp_path / "bad.log"
        bad.write_bytes(b'{"op_code": 0}\n\xff\xfe\xfa garbage\n')
        return f"journal:{bad}", bad
    elif how == "sqlite_as_journal":
        bad = _good_db(tmp_path)
        return f"journal:{bad}", bad
    elif how == "journal_as_sqlite":
        bad = tmp_path / "bad.log"
        res = cli(*tune_args(f"journal:{bad}", 3), cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
    else:
        raise AssertionError(how)
    return f"sqlite:///{bad}", bad


DAMAGE = ["garbage", "binary_garbage", "truncated_header", "truncated_half", "pages_overwritten", "foreign_sqlite",
          "journal_garbage", "journal_not_utf8", "sqlite_as_journal", "journal_as_sqlite"]


@pytest.mark.parametrize("how", DAMAGE)
def test_tune_on_a_corrupt_or_foreign_storage_is_one_line_naming_it(how, tmp_path):
    url, bad = _damage(tmp_path, how)
    before = digest(bad)
    run = tmp_path / "run"
    run.mkdir()
    res = cli(*tune_args(url, 4), cwd=run)
    one_line_error(res, str(bad))
    assert len([ln for ln in res.stderr.splitlines() if ln.strip()]) == 1, "checked before any work"
    assert digest(bad) == before, "the damaged file is left as it was"
    assert not (run / "runs").exists()


@pytest.mark.parametrize("how", ["garbage", "truncated_half", "pages_overwritten", "foreign_sqlite",
                                 "journal_garbage", "sqlite_as_journal"])
@pytest.mark.parametrize("command", ["studies", "export", "show", "report", "record"])
def test_read_commands_on_a_corrupt_or_foreign_storage_are_one_line(how, command, tmp_path):
    url, bad = _damage(tmp_path, how)
    before = digest(bad)
    args = {"studies": ["studies", "--storage", url], "export": ["export", url, "-o", "out.json"],
            "show": ["show", "--storage", url], "report": ["report", url, "--out", "rep"],
            "record": ["record", url, "-o", "r.jsonl"]}[command]
    res = cli(*args, cwd=tmp_path)
    one_line_error(res, str(bad))
    assert digest(bad) == before
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "r.jsonl").exists()


@pytest.mark.parametrize("command", ["studies", "export", "show", "report", "record"])
@pytest.mark.parametrize("kind", ["empty_sqlite", "empty_journal", "missing_journal"])
def test_read_commands_never_create_or_modify_a_storage(command, kind, tmp_path):
    """A read-only command on an empty or missing file: no schema written, no file created."""
    path = tmp_path / ("s.db" if "sqlite" in kind else "s.log")
    if not kind.startswith("missing"):
        path.write_bytes(b"")
    url = f"sqlite:///{path}" if "sqlite" in kind else f"journal:{path}"
    args = {"studies": ["studies", "--storage", url], "export": ["export", url, "-o", "out.json"],
            "show": ["show", "--storage", url], "report": ["report", url, "--out", "rep"],
            "record": ["record", url, "-o", "r.jsonl"]}[command]
    res = cli(*args, cwd=tmp_path)
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    if kind.startswith("missing"):
        assert not path.exists()
    else:
        assert path.read_bytes() == b"", "the empty file got a schema"
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "rep").exists()
    if command != "studies" or kind != "empty_journal":  # an empty journal is a valid storage of no study
        assert res.returncode in (1, 2), res.stderr
        assert len([ln for ln in res.stderr.splitlines() if ln.startswith("error:")]) == 1, res.stderr


def test_read_commands_do_not_write_a_healthy_storage(tmp_path):
    db = _good_db(tmp_path)
    before = digest(db)
    for args in (["studies", "--storage", f"sqlite:///{db}"], ["export", f"sqlite:///{db}", "-o", "e.json"],
                 ["show", "--storage", f"sqlite:///{db}"], ["record", f"sqlite:///{db}", "-o", "r.jsonl"]):
        res = cli(*args, cwd=tmp_path)
        # record: exit 1, a replayed study holds no real GPU measurement to record
        assert res.returncode == (1 if args[0] == "record" else 0), res.stderr[-2000:]
        assert "Traceback" not in res.stderr
    assert digest(db) == before


# ---- 2. lost and clobbered work ----------------------------------------------------------

def test_trials_0_on_a_fresh_storage_keeps_the_earlier_export(tmp_path):
    res = cli(*tune_args(f"sqlite:///{tmp_path}/a.db", 6, "-o", "best.json"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    runs_json, best = tmp_path / "runs" / f"{STUDY}.json", tmp_path / "best.json"
    assert json.loads(runs_json.read_text())["entries"]
    kept = {p: digest(p) for p in (runs_json, best)}
    res = cli(*tune_args(f"sqlite:///{tmp_path}/fresh.db", 0, "-o", "best.json"), cwd=tmp_path)
    assert "Traceback" not in res.stderr and res.returncode == 1, res.stderr[-2000:]
    assert "not written" in res.stderr
    for p, d in kept.items():
        assert digest(p) == d, f"{p} was clobbered by an empty export"


def test_an_export_with_fewer_entries_says_so_and_keeps_the_old_one(tmp_path):
    res = cli(*tune_args(f"sqlite:///{tmp_path}/a.db", 6, "-o", "best.json"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    best = tmp_path / "best.json"
    data = json.loads(best.read_text())
    data["entries"].append(dict(data["entries"][0], shape="8192x8192x8192", M=8192, N=8192, K=8192))
    best.write_text(json.dumps(data))
    old = digest(best)
    res = cli(*tune_args(f"sqlite:///{tmp_path}/a.db", 6, "-o", "best.json"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    text = " ".join(res.stderr.split())
    assert "held 2 entries" in text and "best.prev.json" in text, text
    assert digest(tmp_path / "best.prev.json") == old
    assert len(json.loads(best.read_text())["entries"]) == 1


@pytest.mark.parametrize("target", ["space_copy", "folder", "under_a_file"])
def test_an_output_that_is_not_an_export_is_refused_before_any_work(target, tmp_path):
    storage = tmp_path / "never.db"
    if target == "space_copy":
        out = tmp_path / "space.yaml"
        shutil.copy(SPACE, out)
        needle = "not an hgemm-tune export"
    elif target == "folder":
        out = tmp_path / "outdir"
        out.mkdir()
        needle = "is a folder"
    else:
        (tmp_path / "plain.txt").write_text("x")
        out = tmp_path / "plain.txt" / "best.json"
        needle = "plain.txt"
    before = digest(out) if out.is_file() else None
    res = cli(*tune_args(f"sqlite:///{storage}", 3, "-o", str(out)), cwd=tmp_path)
    one_line_error(res, needle)
    assert not storage.exists(), "nothing was tuned"
    if before:
        assert digest(out) == before


@pytest.mark.parametrize("kind", ["no_study", "nothing_verified"])
def test_export_of_an_empty_storage_writes_nothing(kind, tmp_path):
    if kind == "no_study":
        url = f"journal:{tmp_path}/empty.log"
        (tmp_path / "empty.log").write_bytes(b"")
        code, needle = 2, "holds no study"
    else:
        url = f"sqlite:///{tmp_path}/z.db"
        res = cli(*tune_args(url, 0), cwd=tmp_path)
        assert res.returncode == 1, res.stderr[-2000:]
        code, needle = 1, "no verified kernel"
    res = cli("export", url, "-o", "best.json", cwd=tmp_path)
    one_line_error(res, needle, code)
    assert not (tmp_path / "best.json").exists()
    (tmp_path / "best.json").write_text("{}")  # an existing file (not an export) stays as it is
    res = cli("export", url, "-o", "best.json", cwd=tmp_path)
    assert res.returncode in (1, 2) and (tmp_path / "best.json").read_text() == "{}"


def _latin1_copy(src: Path, dst: Path, line: int) -> Path:
    lines = src.read_bytes().splitlines(keepends=True)
    lines[line - 1] = lines[line - 1].replace(b'"', b'"\xe9', 1)
    dst.write_bytes(b"".join(lines))
    return dst


def test_a_replay_file_that_is_not_utf8_names_the_file_and_line(tmp_path):
    bad = _latin1_copy(REPLAY, tmp_path / "r.jsonl", 3)
    res = cli("--shape", SHAPE, "--trials", "2", "--backend", "replay", "--replay", bad, "--storage",
              f"sqlite:///{tmp_path}/x.db", cwd=tmp_path)
    one_line_error(res, f"{bad}:3: not UTF-8")
    res = cli("--shape", SHAPE, "--trials", "2", "--backend", "replay", "--replay", _good_db(tmp_path),
              "--storage", f"sqlite:///{tmp_path}/y.db", cwd=tmp_path)
    one_line_error(res, "good.db")


def _export(tmp_path: Path) -> Path:
    res = cli(*tune_args(f"sqlite:///{tmp_path}/e.db", 6, "-o", "best.json"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    return tmp_path / "best.json"


@pytest.mark.parametrize("command", ["report", "bench", "prebuild"])
def test_an_export_that_is_not_utf8_names_the_file_and_line(command, tmp_path):
    good = _export(tmp_path)
    text = json.dumps(json.loads(good.read_text()), indent=1).encode()
    bad = tmp_path / "bad.json"
    bad.write_bytes(text.replace(b'"gpu"', b'"g\xe9pu"', 1))
    line = text[: text.index(b'"gpu"')].count(b"\n") + 1
    args = {"report": ["report", bad, "--out", "rep"], "bench": ["bench", bad, "--out", "b"],
            "prebuild": ["prebuild", bad]}[command]
    res = cli(*args, cwd=tmp_path)
    one_line_error(res, f"{bad}:{line}: not UTF-8")
    assert not (tmp_path / "rep").exists() and not (tmp_path / "b").exists()


def test_a_bench_json_that_is_not_utf8_is_one_line(tmp_path):
    bad = tmp_path / "bench.json"
    bad.write_bytes(b'{"rows": [], "modes": ["offline"], "gpu": "H\xe9"}\n')
    one_line_error(cli("report", bad, "--out", "rep", cwd=tmp_path), f"{bad}:1: not UTF-8")


@pytest.mark.parametrize("where", ["under_a_file", "is_a_file"])
def test_report_into_an_unwritable_place_is_one_line(where, tmp_path):
    good = _export(tmp_path)
    (tmp_path / "plain.txt").write_text("keep me")
    out = tmp_path / "plain.txt" / "rep" if where == "under_a_file" else tmp_path / "plain.txt"
    res = cli("report", good, "--out", out, cwd=tmp_path)
    one_line_error(res, "cannot write the report")
    assert (tmp_path / "plain.txt").read_text() == "keep me"


def test_report_without_matplotlib_names_the_extra(tmp_path):
    good = _export(tmp_path)
    shim = tmp_path / "shim"
    (shim / "matplotlib").mkdir(parents=True)
    (shim / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    env = os.environ | {"PYTHONPATH": f"{shim}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = cli("report", good, "--out", "rep", cwd=tmp_path, env=env)
    one_line_error(res, "pip install 'hgemm-tune[report]'")
    assert not (tmp_path / "rep").exists()


def test_studies_counts_trials_as_tune_does(tmp_path):
    """`studies` shows the measured trials, as the tune and sweep tables do; the rest apart."""
    import re

    url = f"sqlite:///{tmp_path}/c.db"
    res = cli(*tune_args(url, 12, "--seed", "0"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    held = int(re.search(r"study holds (\d+) measured trials", " ".join(res.stderr.split())).group(1))
    study = load(url)
    assert held == measured_trials(study) < len(study.trials), "nothing to tell apart: the test shows nothing"
    res = cli("studies", "--storage", url, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    header = next(ln for ln in res.stdout.splitlines() if "study" in ln and "trials" in ln)
    row = next(ln for ln in res.stdout.splitlines() if STUDY in ln)
    cols = [c.strip() for c in re.split(r"[│┃|]", header)]
    cells = [c.strip() for c in re.split(r"[│┃|]", row)]
    assert cells[cols.index("trials")] == str(held)
    assert cells[cols.index("all")] == str(len(study.trials))


# ---- every input checked before the GPU starts ---------------------------------------------

@pytest.fixture
def no_gpu(monkeypatch):
    """Starting the GPU worker fails the test: every check must come first."""
    import tuner.api.results
    import tuner.api.tuning

    def started(*a, **k):
        raise AssertionError("the GPU worker was started before the inputs were checked")

    monkeypatch.setattr(tuner.api.tuning, "make_backend", started)
    monkeypatch.setattr(tuner.api.results, "make_backend", started)


def _opts(tmp_path: Path, **kw):
    from tuner.api import Options

    return Options(**{"trials": 3, "storage": f"sqlite:///{tmp_path}/g.db", "space_file": SPACE,
                      "runs_dir": tmp_path / "runs"} | kw)


@pytest.mark.parametrize("change, needle", [
    ({"families": "cute_sm80,nosuch"}, "no family 'nosuch'"),
    ({"families": ","}, "names no family"),
    ({"accumulate": "fp16", "families": "wmma"}, "does not build it"),
    ({"storage": "sqlite:///{tmp}/bad.db"}, "bad.db"),
    ({"storage": "journal:{tmp}/bad.db"}, "bad.db"),
    ({"space_file": "{tmp}/bad.db"}, "bad.db"),
])
def test_tune_and_sweep_check_every_input_before_the_gpu(change, needle, tmp_path, no_gpu):
    from tuner import api

    (tmp_path / "bad.db").write_bytes(b"\x00garbage" * 64)
    change = {k: (Path(v.format(tmp=tmp_path)) if k == "space_file" else v.format(tmp=tmp_path))
              if isinstance(v, str) and "{tmp}" in v else v for k, v in change.items()}
    with pytest.raises(UserError, match=None) as exc:
        api.tune_shape(SHAPE, _opts(tmp_path, **change))
    assert needle in str(exc.value)
    with pytest.raises(UserError) as exc:
        api.sweep(_opts(tmp_path, **change), "default")
    assert needle in str(exc.value)


def test_tune_checks_its_output_before_the_gpu(tmp_path, no_gpu):
    from tuner import api

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not an hgemm-tune export"):
        api.tune_shape(SHAPE, _opts(tmp_path), output=tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("edit, needle", [
    (lambda e: e.update(family="nosuch"), "no family 'nosuch'"),
    (lambda e: e["knobs"].update(BOGUS=1), "unknown knob(s) BOGUS"),
    (lambda e: e.update(shape="4096x4096"), "4096x4096"),
])
def test_bench_checks_the_export_against_the_space_before_the_gpu(edit, needle, tmp_path, no_gpu):
    from tuner import api

    data = json.loads(_export(tmp_path).read_text())
    edit(data["entries"][0])
    bad = tmp_path / "edited.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(UserError) as exc:
        api.bench(bad, ["offline"], _opts(tmp_path), out=tmp_path / "b")
    assert needle in str(exc.value) and str(bad) in str(exc.value)
    assert not (tmp_path / "b").exists()


def test_the_cli_names_a_bad_family_not_the_missing_gpu(tmp_path):
    """Without --backend replay on a machine without a GPU: the family is the error, not the GPU."""
    res = cli("--shape", SHAPE, "--trials", "2", "--families", "nosuch", "--storage", f"sqlite:///{tmp_path}/n.db",
              cwd=tmp_path)
    one_line_error(res, "no family 'nosuch'")

"""The command line: bad input gives one clear line and exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("shape", ["4096x4096", "0x1x1", "axbxc"])
def test_bad_shape_one_line_exit_2(shape):
    res = run("--shape", shape, "--trials", "3", "--backend", "replay", "--replay", "x.jsonl")
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "bad shape" in lines[0] and shape in lines[0]


def test_broken_space_one_line_exit_2(tmp_path):
    bad = tmp_path / "space.yaml"
    bad.write_text("version: 1\nfamilies:\n  wmma:\n    template: wmma.cu.j2\n    knobs: [1, 2]\n    launch: {}\n")
    res = run("render", "--family", "wmma", "--space", str(bad))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert f"{bad}:5: families.wmma.knobs: expected a mapping" in res.stderr.replace("\n", "")


def test_render_prints_the_source_with_overrides():
    res = run("render", "--family", "cute_sm80", "--shape", "4096x4096x8192", "--set", "BM=256", "--set", "WARP_M=4")
    assert res.returncode == 0, res.stderr
    assert "constexpr int BM = 256;" in res.stdout and 'extern "C" __global__' in res.stdout
    assert "grid=" in res.stderr


def test_render_rejects_invalid_config_with_the_reason():
    res = run("render", "--family", "cute_sm80", "--shape", "4096x4095x8192")
    assert res.returncode == 2 and "divisible by 8" in res.stderr


def test_unknown_knob():
    res = run("render", "--family", "wmma", "--set", "BQ=3")
    assert res.returncode == 2 and "unknown knob" in res.stderr


def test_default_command_is_tune():
    res = run("--help")
    assert res.returncode == 0 and "tune" in res.stdout
    res = run("--shape", "64x64x64", "--backend", "replay")
    assert res.returncode == 2 and "--replay FILE" in res.stderr


@pytest.mark.parametrize("url, needle", [("redis://x", "unsupported storage URL"),
                                         ("sqlite:////nonexistent/dir/x.db", "cannot open storage")])
def test_bad_storage_url(url, needle):
    res = run("studies", "--storage", url)
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr


def test_no_gpu_is_one_line_exit_2():
    pytest.importorskip("tests.conftest")
    from tests.conftest import _gpu_reason

    if _gpu_reason() is None:
        pytest.skip("a GPU is present here")
    res = run("--shape", "64x64x64", "--trials", "1")
    assert res.returncode == 2 and "GPU worker cannot start" in res.stderr and "Traceback" not in res.stderr


def replay_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """A 2-trial tune of 4096x4096x8192 on the recorded H200 measurements, in tmp_path."""
    replay = ROOT / "tests" / "data" / "replay_4096x4096x8192.jsonl"
    return run("--shape", "4096x4096x8192", "--trials", "2", "--backend", "replay", "--replay", str(replay),
               "--storage", f"sqlite:///{tmp_path}/a.db", "--space", str(ROOT / "space.yaml"), *args, cwd=tmp_path)


@pytest.mark.parametrize("args, needle", [
    (["--accumulate", "fp64"], "--accumulate 'fp64': choose one of fp32, fp16"),
    (["--accumulate", "fp16", "--families", "wmma"], "fp16 accumulation: family wmma does not build it "
                                                     "(families that do: cute_sm90)"),
    (["--families", ","], "--families ',' names no family"),
    (["--families", "cute_sm90", "--arch", "sm_80"], "family cute_sm90 needs a newer GPU than sm_80"),
    (["--sampler", "grid"], "--sampler grid searches one family at a time"),
])
def test_accumulate_family_and_sampler_choices_fail_cleanly(args, needle, tmp_path):
    res = replay_run(tmp_path, *args)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert needle in " ".join(res.stderr.split()), res.stderr


def test_fp16_accumulate_is_its_own_problem_in_replay(tmp_path):
    """An fp32 replay file cannot answer an fp16-accumulate study: it says so, nothing invented."""
    res = replay_run(tmp_path, "--accumulate", "fp16", "--families", "cute_sm90", "--arch", "sm_90a")
    assert res.returncode == 2 and "no baseline for shape 4096x4096x8192 with fp16 accumulation" in res.stderr


def test_report_on_a_database_path_says_how_to_pass_it(tmp_path):
    db = tmp_path / "hgemm.db"
    db.write_bytes(b"SQLite format 3\x00\xff\xfe\x00binary")
    res = run("report", str(db), "--out", str(tmp_path / "rep"), cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"pass it as sqlite:///{db}" in " ".join(res.stderr.split()), res.stderr


def test_worker_joins_only_an_existing_study(tmp_path):
    """`worker --study <typo>` is one line and exit 2, and creates neither the study nor the file."""
    res = replay_run(tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    storage = f"sqlite:///{tmp_path}/a.db"
    before = subprocess.run([sys.executable, "-c", f"import optuna; print(optuna.get_all_study_names({storage!r}))"],
                            capture_output=True, text=True, timeout=60).stdout
    replay = str(ROOT / "tests" / "data" / "replay_4096x4096x8192.jsonl")
    res = run("worker", "--study", "no-such-study", "--storage", storage, "--backend", "replay", "--replay", replay,
              cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "has no study 'no-such-study'" in lines[0], res.stderr
    after = subprocess.run([sys.executable, "-c", f"import optuna; print(optuna.get_all_study_names({storage!r}))"],
                           capture_output=True, text=True, timeout=60).stdout
    assert after == before and "no-such-study" not in after
    missing = tmp_path / "missing.db"
    res = run("worker", "--study", "x", "--storage", f"sqlite:///{missing}", "--backend", "replay", "--replay", replay,
              cwd=tmp_path)
    assert res.returncode == 2 and "no such file" in res.stderr and "Traceback" not in res.stderr
    assert not missing.exists()


@pytest.mark.parametrize("command", [["export", "-o", "best.json"], ["report", "--out", "rep"], ["studies"],
                                     ["record", "-o", "r.jsonl"]])
def test_read_only_commands_do_not_create_a_missing_storage(command, tmp_path):
    missing = tmp_path / "typo.db"
    url = f"sqlite:///{missing}"
    args = [command[0], "--storage", url, *command[1:]] if command[0] == "studies" else [command[0], url, *command[1:]]
    res = run(*args, cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"no such file {missing}" in " ".join(res.stderr.split()), res.stderr
    assert not missing.exists() and not (tmp_path / "best.json").exists()


def test_replay_summary_does_not_count_unrecorded_configs_as_measured(tmp_path):
    """A config the replay file has no measurement for is a failed trial, reported as not recorded,
    never among the measured trials."""
    import re

    from helpers import user_attr_counts

    res = replay_run(tmp_path, "--trials", "12", "--seed", "0")
    assert res.returncode == 0, res.stderr[-2000:]
    statuses = user_attr_counts(tmp_path / "a.db", "status")
    unrecorded = statuses.get('"not_recorded"', 0)
    assert unrecorded, "every proposed config was recorded: the test shows nothing"
    text = " ".join((res.stdout + res.stderr).split())
    measured = int(re.search(r"(\d+) trials measured", text).group(1))
    real = sum(n for s, n in statuses.items() if s not in ('"invalid"', '"duplicate"', '"not_recorded"'))
    assert measured == real
    assert f"{unrecorded} not recorded in the replay file (not measured)" in text
    assert "'not_recorded'" not in text  # not listed among the measured trials' failures either
    assert f"study holds {real} measured trials" in text

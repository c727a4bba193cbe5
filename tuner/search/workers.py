"""Several worker processes on one study: one `hgemm-tune worker` per GPU (round robin), sharing
the compile cache on disk; the parent only watches their joint progress."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tuner.search.interrupts import INTERRUPTS
from tuner.search.studies import best_trial, evaluated_trials, open_study

WORKER_STOP_S = 20.0  # how long an interrupted parent waits for its workers to tell their trials
WORKER_MAIN = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
               "from tuner.cli import main; main()")


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
        return max(1, sum(1 for line in out.splitlines() if line.startswith("GPU ")))
    except (OSError, subprocess.TimeoutExpired):
        return 1


class WorkersStopped(KeyboardInterrupt):
    """The parent was interrupted; `killed` workers did not stop in time (their trials stay
    RUNNING until the next run fails them as stale)."""

    def __init__(self, killed: int):
        super().__init__()
        self.killed = killed


def run_workers(n: int, name: str, storage: str, trials: int, args: list[str], jobs: int | None, backend: str,
                log_dir: Path, on_tick: Callable[[int, float | None], None] | None = None) -> list[int | None]:
    """Start n workers, wait for them, return their exit codes. `on_tick(done, best_us)` every second.
    Ctrl-C (or SIGTERM) stops every worker, each telling the trials it holds as interrupted,
    and raises WorkersStopped."""
    gpus = gpu_count() if backend == "gpu" else 1
    per_jobs = jobs or max(1, (os.cpu_count() or 1) // n)
    procs = []
    for i in range(n):
        # Not `python -m`: that puts the working directory first on sys.path, and a `tuner/` there would
        # run instead of ours. The directory stays the working one (relative storage and space paths).
        cmd = [sys.executable, "-c", WORKER_MAIN, "worker", "--study", name, "--storage", storage,
               "--trials", str(trials), "--jobs", str(per_jobs), *args]
        if backend == "gpu":
            cmd += ["--gpu", str(i % gpus)]
        log = open(log_dir / f"worker-{i}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    study = open_study(name, storage)
    with INTERRUPTS.handled():
        try:
            while any(p.poll() is None for p, _ in procs):
                time.sleep(1.0)
                # Ctrl-C inside a storage read can leave this process holding SQLite's read lock
                # (the traceback keeps the cursor alive), and then no worker can write its FAIL
                # "interrupted" before we kill it (CI: 16 trials left RUNNING). Deferred, the
                # interrupt lands between reads.
                with INTERRUPTS.deferred():
                    b = best_trial(study)
                    done = evaluated_trials(study)
                if on_tick:
                    on_tick(done, b.value if b else None)
        except KeyboardInterrupt:
            # Each worker tells the trials it holds as FAIL ("interrupted") on SIGTERM, then exits:
            # give them that time before killing any, so no trial stays RUNNING.
            for p, _ in procs:
                p.terminate()
            deadline = time.monotonic() + WORKER_STOP_S
            killed = 0
            for p, log in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                    killed += 1
                log.close()
            raise WorkersStopped(killed) from None
    for _, log in procs:
        log.close()
    return [p.returncode for p, _ in procs]

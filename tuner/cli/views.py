"""What the CLI shows: progress bars fed by the API's Listener, and the tables at the end."""

from __future__ import annotations

import json
import sys
from typing import Any

import optuna
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from tuner.api import Listener
from tuner.measure import CompareReply
from tuner.measure.clocks import combine, regime_text
from tuner.measure.regimes import steady_text
from tuner.search import Progress as SearchProgress
from tuner.search import StudyMeta, TrialRecord, best_per_family, study_stats
from tuner.space import Shape

console = Console(stderr=True)
# Tables go to stdout; when that is a file or pipe, do not squeeze them to 80 columns.
out_console = Console(width=None if sys.stdout.isatty() else 220)


def fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def progress_bar(transient: bool = False) -> Progress:
    """transient: the bar goes away when it stops (work whose summary follows, or whose error does)."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=console, transient=transient)


class CliListener(Listener):
    """Draws the API's events: a line per started search, a bar for trials (and one for the
    shapes of a sweep), a bar for confirmation runs, and the confirmation's table."""

    def __init__(self, sweep: bool = False):
        self.bar = progress_bar()
        self.sweep = sweep
        self.shapes: TaskID | None = None
        self.task: TaskID | None = None
        self.trials = 0
        self.simulated_said = False

    def __enter__(self) -> CliListener:
        return self  # the bar starts with the work, after every input has been checked

    def __exit__(self, *exc) -> None:
        self.bar.stop()

    def started(self, shape: Shape, baselines: dict[str, float], backend: str, families: list[str],
                accumulate: str) -> None:
        if backend.startswith("replay:") and not self.simulated_said:
            console.print("[yellow]SIMULATED[/]: replaying recorded measurements, no GPU runs.")
            self.simulated_said = True
        self.bar.start()
        if self.sweep:
            return
        acc = "" if accumulate == "fp32" else f" ({accumulate} compute)"
        console.print(f"{shape}: {shape.flops / 1e9:.1f} GFLOP; cuBLAS{acc} {baselines['cublas']:.2f} us "
                      f"({shape.tflops(baselines['cublas']):.1f} TFLOP/s) on {backend}; families {', '.join(families)}")

    def search(self, label: str, trials: int) -> None:
        self.trials = trials
        if self.task is None:
            self.task = self.bar.add_task("trials" if self.sweep else label, total=trials, status="")
        else:
            self.bar.reset(self.task, total=trials, status="")

    def trial(self, progress: SearchProgress, rec: TrialRecord | None) -> None:
        if self.task is None:
            self.search("tuning", self.trials)
        best = (f"best {progress.best_us:.2f} us" + (f" {progress.best_tflops:.1f} TFLOP/s"
                                                     if progress.best_tflops and not self.sweep else "")
                if progress.best_us else "no verified kernel yet")
        extra = "" if self.sweep or rec is None else f" | rejected {progress.invalid}"
        failed = "" if rec is None else f" | failed {progress.failed}"
        if rec is not None and progress.screened:
            failed += f" | screened out {progress.screened}"
        assert self.task is not None
        self.bar.update(self.task, completed=min(progress.done, self.trials), status=f"{best}{failed}{extra}")

    def confirming(self, top: int, runs: int) -> None:
        self.bar.start()
        if self.sweep and self.task is not None:  # a sweep's trial bar shows the shape's confirmation
            self.bar.reset(self.task, total=runs, status=f"confirming the top {top}")
        else:  # its own bar: the search's bar keeps its final count
            self.task = self.bar.add_task(f"confirming the top {top}", total=runs, status="")

    def confirm_run(self, i: int, reply: CompareReply) -> None:
        assert self.task is not None
        self.bar.update(self.task, completed=i + 1, status=reply.status)

    def confirmed(self, record: dict[str, Any], earlier: bool) -> None:
        if self.sweep:  # the sweep's table shows what was exported
            return
        if earlier:
            console.print(f"confirmed earlier ({record['top']} kernels, {record['runs']} runs): "
                          f"trial #{record['trial']}")
            return
        self.bar.stop()
        out_console.print(confirm_table(record))

    def sweep_shape(self, i: int, total: int, shape: Shape | None) -> None:
        self.bar.start()
        if self.shapes is None:
            self.shapes = self.bar.add_task("shapes", total=total, status="")
        self.bar.update(self.shapes, completed=i, status=str(shape) if shape else "done")

    def message(self, text: str) -> None:
        console.print(f"[yellow]{escape(text)}[/]")


def confirm_table(record: dict[str, Any]) -> Table:
    table = Table(title=f"confirmation: {record['top']} kernels x {record['runs']} fresh runs, medians")
    for col in ("trial", "family", "in-study us", "median us", "runs us", "vs cuBLAS", "verified"):
        table.add_column(col, justify="left" if col in ("family", "verified") else "right")
    for k in sorted(record["kernels"], key=lambda k: (k["median_us"] is None, k["median_us"] or 0)):
        mark = " *" if k["trial"] == record["winner"] else ""
        table.add_row(f"#{k['trial']}{mark}", k["family"], fmt(k["in_study_us"], ".2f"), fmt(k["median_us"], ".2f"),
                      " ".join(fmt(t, ".2f") for t in k["times_us"]), fmt(k["speedup_cublas"], ".3f"),
                      "yes" if k["verified"] else f"[red]no[/]: {escape(str(k['reason']))}")
    table.caption = "* exported" if record["winner"] is not None else "[red]no kernel passed every run[/]"
    table.caption += f"; clock regime of the runs: {escape(regime_text(combine(record.get('clocks') or [])))}"
    return table


def summary_table(study: optuna.Study) -> Table:
    """One shape's study: the best kernel per family, and what the search did."""
    meta = StudyMeta.of(study)
    shape, target = meta.shape_record, meta.target_record
    roof = target.roofline_us(shape.flops, shape.min_bytes)
    title = f"{shape} on {target.name} ({target.arch}), {meta.objective} time" + (
        "  [SIMULATED: replayed measurements]" if meta.simulated else "")
    table = Table(title=title)
    for col in ("family", "trial", "time us", "TFLOP/s", "% roofline", "cuBLAS us", "vs cuBLAS", "clock regime",
                "steady", "config"):
        table.add_column(col, justify="right" if col not in ("family", "clock regime", "steady", "config") else "left")
    for t in sorted(best_per_family(study).values(), key=lambda t: t.value):
        a = TrialRecord.of(t)
        table.add_row(a.family, str(t.number), fmt(t.value, ".2f"), fmt(a.tflops, ".1f"),
                      fmt(100 * roof / t.value, ".1f"), fmt(a.cublas_us, ".2f"), fmt(a.speedup_cublas, ".3f") + "x",
                      escape(regime_text(a.clocks)), steady_text(a.regime_report or None),
                      json.dumps(a.kernel, separators=(",", ":")))
    stats = study_stats(study)
    table.caption = (f"{stats['trials']} trials measured, {stats['ok'] + stats['screened']} verified"
                     + (f" ({stats['screened']} of them screened out in a batch: verified, slower than the "
                        "kept ones in the shared screen, not timed in full)" if stats["screened"] else "") + ", "
                     f"{stats['invalid_rejected']} rejected before nvcc, {stats['duplicates']} duplicates; "
                     f"failures: {stats['failures'] or 'none'}; median cold compile "
                     f"{fmt(stats['compile_s_cold_median'], '.1f')} s"
                     + (f"; {stats['not_recorded']} not recorded in the replay file (not measured)"
                        if stats["not_recorded"] else "")
                     + (f"; {stats['other_gpu']} verified trials measured on another GPU model are not ranked"
                        if stats["other_gpu"] else "")
                     + "; clock regime: the SM clock's regime while the trial was timed (unknown: not recorded); "
                     "steady: whether its timing settled, after how many rounds, and how many of its variants a "
                     "screen kept for those rounds (tuner.measure.regimes)")
    return table

"""Commands that read what was tuned: `record`, `render`, `show`, `studies`, `export`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from tuner.cli import options as o
from tuner.cli.views import console, fmt, out_console
from tuner.errors import UserError
from tuner.search.rank import RankQuality


def _parse_sets(sets: list[str]) -> dict:
    config: dict = {}
    for item in sets:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected KNOB=VALUE")
        key, value = item.split("=", 1)
        try:
            config[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            config[key.strip()] = value.strip()
    return config


def record(
    output: Annotated[Path, typer.Option("-o", "--output", help="Replay file (JSON lines) to write.")],
    storage: Annotated[str, typer.Argument(help="Storage whose real (GPU) trials to write out.")] = o.DEFAULT_STORAGE,
) -> None:
    """Write a storage's real GPU measurements as a replay file for --backend replay."""
    from tuner.search import load_studies
    from tuner.search.studies import replay_records

    found = load_studies(storage, read_only=True)
    if not found:
        raise UserError(f"storage {storage} holds no study: nothing to record ({output} not written)")
    lines = [json.dumps(r) for st in found for r in replay_records(st)]
    if not lines:
        print(f"error: no real GPU measurement in {storage}: nothing to record ({output} not written)",
              file=sys.stderr)
        raise typer.Exit(1)
    try:
        output.write_text("".join(line + "\n" for line in lines))
    except OSError as exc:
        raise UserError(f"cannot write {output}: {exc.strerror or exc}") from None
    console.print(f"{len(lines)} records -> {output}")


def render(
    family: Annotated[str, typer.Option("--family", "-f", help="Kernel family (see space.yaml).")],
    shape: Annotated[str, typer.Option("--shape", "-s", help="Shape the config is checked against.")
                     ] = "4096x4096x8192",
    sets: Annotated[list[str] | None, typer.Option(
        "--set", help="KNOB=VALUE; unset knobs take the family default.")] = None,
    arch: o.Arch = "sm_90a",
    space_file: o.SpaceFile = None,
) -> None:
    """Print the CUDA source of one config, as the tuner would build it."""
    from tuner.build import render as render_source
    from tuner.space import load_space, parse_shape, target_for_arch

    fam = load_space(space_file).family(family)
    config = fam.complete(_parse_sets(sets or []))
    target = target_for_arch(arch)
    why = fam.violations(config, parse_shape(shape), target)
    if why:
        raise UserError(f"config rejected for {shape} on {arch}: {'; '.join(why)}")
    launch = fam.launch_geometry(config, parse_shape(shape), target)
    where = (f"grid={launch.grid} block={launch.block} smem={launch.smem}" if launch
             else "set by the library's host code (artifact: library)")
    console.print(f"// launch: {where} "
                  f"runtime knobs: {{{', '.join(f'{k.name}={config[k.name]}' for k in fam.runtime_knobs)}}}")
    sys.stdout.write(render_source(fam, config, arch))


def show(
    shape: Annotated[str | None, typer.Option("--shape", "-s", help="Show the best trial of this shape's study.")
                     ] = None,
    study: o.Study = None,
    trial: Annotated[int | None, typer.Option(help="Trial number (default: the exported one).")] = None,
    storage: o.Storage = o.DEFAULT_STORAGE,
    space_file: o.SpaceFile = None,
) -> None:
    """Print the CUDA source of a finished trial (by default the one export takes: the confirmed
    winner, else the in-study best)."""
    from tuner.build import render as render_source
    from tuner.build import source_hash
    from tuner.results.export import exported_trial
    from tuner.search import StudyMeta, TrialRecord, load_studies
    from tuner.search.records import holds_kernel, study_shape
    from tuner.space import load_space, parse_shape

    studies = load_studies(storage, [study] if study else None, read_only=True)
    if shape and not study:
        want = str(parse_shape(shape))
        studies = [s for s in studies if study_shape(s) == want]
    if len(studies) != 1:
        names = ", ".join(s.study_name for s in studies) or "none"
        raise UserError(f"pick one study with --study (matching: {names})")
    st = studies[0]
    if trial is not None and not 0 <= trial < len(st.trials):
        raise UserError(f"study {st.study_name} has no trial {trial} (it has 0..{len(st.trials) - 1})")
    t = st.trials[trial] if trial is not None else exported_trial(st)[0]
    rec = TrialRecord.of(t) if t is not None else None
    if rec is None or not rec.family or not holds_kernel(t):
        raise UserError(f"study {st.study_name}: no kernel to show for "
                        + (f"trial {trial} (a duplicate or interrupted trial)" if trial is not None else "its best"))
    meta = StudyMeta.of(st)
    fam = load_space(space_file).family(rec.family)
    source = render_source(fam, fam.complete_stored(rec.config), meta.target_record.arch, accumulate=meta.accumulate)
    if rec.source_hash and source_hash(source) != rec.source_hash:
        console.print("[yellow]warning[/]: the template changed since this trial ran; this is today's rendering")
    console.print(f"// trial {t.number}: {rec.status} {rec.time_us} us, variant {rec.variant or None}")
    sys.stdout.write(source)


def studies(storage: o.Storage = o.DEFAULT_STORAGE) -> None:
    """List the studies in a storage with their best time (in-study) and what export takes.

    trials: the measured trials, as `tune` and `sweep` count them; all: every trial the study
    holds (also those rejected before nvcc, duplicates, not recorded, handed back, running)."""
    from tuner.results.export import exported_trial
    from tuner.search import TrialRecord, best_trial, load_studies, measured_trials

    table = Table("study", "trials", "all", "best us", "TFLOP/s", "vs cuBLAS", "exported",
                  caption="trials: measured (as tune and sweep count them); all: every trial the study holds")
    for st in load_studies(storage, read_only=True):
        b = best_trial(st)
        rb = TrialRecord.of(b) if b else None
        t, confirmed = exported_trial(st)
        if confirmed is not None:
            what = (f"#{t.number}: {confirmed['median_us']:.2f} us, median of {confirmed['runs']} confirm runs"
                    if confirmed["median_us"] is not None else f"cuBLAS (#{t.number} failed confirmation)")
        else:
            what = f"#{t.number} (unconfirmed)" if t else "-"
        table.add_row(st.study_name, str(measured_trials(st)), str(len(st.trials)), fmt(b.value if b else None, ".2f"),
                      fmt(rb.tflops if rb else None, ".1f"), fmt(rb.speedup_cublas if rb else None, ".3f"), what)
    out_console.print(table)


def rank_check(
    storage: Annotated[str, typer.Argument(help="Optuna storage URL holding the studies.")] = o.DEFAULT_STORAGE,
    top: Annotated[int, typer.Option("--top", min=1, help="Was the measured fastest among the predicted top N?")
                   ] = 5,
    study: Annotated[list[str] | None, typer.Option(help="Only these studies (default: all).")] = None,
    space_file: o.SpaceFile = None,
) -> None:
    """How well the catalogue ranking (`tune`/`sweep --catalogue`) predicted what was measured, per
    study that timed ranked catalogue candidates: the Spearman rank correlation of predicted order
    and measured times (1: perfect, 0: none), the measured place of the predicted #1, and the
    predicted rank of the measured fastest (red: outside the top N). "as run" is the ranking the
    study recorded (neighbour credit included); each ranker column is that ranker's order
    recomputed from the same candidates' configs, shape and target, without neighbour credit:
    our cost model, and NVIDIA's nvMatmulHeuristics where its wheel is installed. To measure the
    whole ranking, let a study time every candidate (default --catalogue-top, --trials at least
    the catalogue's size, --patience 0)."""
    from tuner import api
    from tuner.search import nvidia_heuristics

    rows = api.rank_compare(storage, top, study or None, space_file)
    if not rows:
        raise UserError(f"storage {storage} holds no study with ranked catalogue trials "
                        "(run tune or sweep with --catalogue)")
    rankers = list(rows[0][1])
    simulated = any(q.simulated for q, _ in rows)

    def cell(q: RankQuality | None) -> str:
        if q is None:
            return "-"
        first = "-" if q.first_place is None else f"{q.first_place} of {q.measured}"
        best = "-" if q.best_rank is None else (str(q.best_rank) if q.best_in_top else f"[red]{q.best_rank}[/]")
        return f"{fmt(q.spearman, '+.2f')} / {first} / {best}"

    table = Table("shape", "study", "ranked", "measured", "as run", *rankers,
                  title="catalogue ranking vs measured" + ("  [SIMULATED]" if simulated else ""),
                  caption=f"each ranking: Spearman / measured place of its predicted #1 / its rank of the measured "
                          f"fastest (red: outside the top {top}); measured: ranked candidates verified and timed")
    for q, by in rows:
        table.add_row(q.shape + (" [SIMULATED]" if q.simulated else ""), q.study, str(q.ranked), str(q.measured),
                      cell(q), *(cell(by[r]) for r in rankers))
    out_console.print(table)
    for label, got in [("as run", [q for q, _ in rows])] + [(r, [by[r] for _, by in rows]) for r in rankers]:
        hits = [q.best_in_top for q in got if q is not None and q.best_in_top is not None]
        rhos = sorted(q.spearman for q in got if q is not None and q.spearman is not None)
        if hits:
            console.print(f"{label}: measured fastest within the predicted top {top} at {sum(hits)} of {len(hits)} "
                          f"studies" + (f", median Spearman {rhos[len(rhos) // 2]:+.2f}" if rhos else "")
                          + ("  [SIMULATED: replayed measurements]" if simulated else ""))
    if "nvidia" not in rankers:
        console.print(escape(f"nvidia ranker not compared: its wheel is not installed ({nvidia_heuristics.EXTRA})"))


def export(
    storage: Annotated[str, typer.Argument(help="Optuna storage URL holding the studies.")] = o.DEFAULT_STORAGE,
    output: Annotated[Path, typer.Option("-o", "--output", help="JSON file to write.")] = Path("best.json"),
    study: Annotated[list[str] | None, typer.Option(help="Only these studies (default: all).")] = None,
) -> None:
    """Write the best verified config of every study as JSON (the confirmed winner where the
    study's confirmation holds, else its in-study best). Exit 1, writing nothing, when no study
    has a verified kernel."""
    from tuner import api

    data, written, note = api.export(storage, output, study or None)
    if note:
        console.print(f"[yellow]{note}[/]")
    if written is None:
        print(f"error: no verified kernel in {storage}: nothing to export ({output} not written)", file=sys.stderr)
        raise typer.Exit(1)
    console.print(f"{len(data['entries'])} entries -> {written}" + ("  [SIMULATED]" if data["simulated"] else ""))

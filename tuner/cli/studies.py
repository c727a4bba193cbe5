"""Commands that read what was tuned: `record`, `render`, `show`, `studies`, `export`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tuner.cli import options as o
from tuner.cli.views import console, fmt, out_console
from tuner.errors import UserError


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
) -> None:
    """How well the catalogue ranking (`tune`/`sweep --catalogue`) predicted what was measured, per
    study that timed ranked catalogue candidates: the measured place of the predicted #1, the
    Spearman rank correlation of predicted order and measured times (1: perfect, 0: none), and
    whether the measured fastest was in the predicted top N. To measure the whole ranking, let a
    study time every candidate (default --catalogue-top, --trials at least the catalogue's size)."""
    from tuner import api

    rows = api.rank_check(storage, top, study or None)
    if not rows:
        raise UserError(f"storage {storage} holds no study with ranked catalogue trials "
                        "(run tune or sweep with --catalogue)")
    simulated = any(q.simulated for q in rows)
    table = Table("shape", "study", "ranked", "measured", "predicted #1 measured", "Spearman", f"best in top {top}",
                  "best's rank", title="catalogue ranking vs measured" + ("  [SIMULATED]" if simulated else ""),
                  caption="measured: ranked candidates verified and timed; predicted #1 measured: its place "
                          "among them (1: fastest)")
    for q in rows:
        inside = {None: "-", True: "yes", False: "[red]no[/]"}[q.best_in_top]
        table.add_row(q.shape + (" [SIMULATED]" if q.simulated else ""), q.study, str(q.ranked), str(q.measured),
                      "-" if q.first_place is None else f"{q.first_place} of {q.measured}",
                      fmt(q.spearman, "+.2f"), inside, "-" if q.best_rank is None else str(q.best_rank))
    out_console.print(table)
    hits = [q.best_in_top for q in rows if q.best_in_top is not None]
    if hits:
        console.print(f"measured fastest within the predicted top {top}: {sum(hits)} of {len(hits)} studies"
                      + ("  [SIMULATED: replayed measurements]" if simulated else ""))


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

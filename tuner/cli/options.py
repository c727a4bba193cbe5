"""Every command-line option, declared once (typer `Annotated` aliases shared by the commands)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tuner.api import DEFAULT_STORAGE
from tuner.measure.regimes import SUSTAINED_BENCH as _SP

Storage = Annotated[str, typer.Option("--storage", help="Optuna storage: sqlite:///F, postgresql://..., journal:F.")]
SpaceFile = Annotated[Path | None, typer.Option(
    "--space", help="Search-space file (families, knobs, constraints); default: the packaged space.yaml.")]
Families = Annotated[str | None, typer.Option("--families", "-f", help="Comma list (default: all for this GPU).")]
Sampler = Annotated[str, typer.Option("--sampler", help="tpe | random | gp | cmaes | grid.")]
Seed = Annotated[int | None, typer.Option("--seed", help="Sampler seed, for reproducible searches.")]
Timeout = Annotated[float | None, typer.Option("--timeout", help="Stop asking for new trials after this many seconds.")]
Backend = Annotated[str, typer.Option(
    "--backend", help="gpu: measure on this machine's GPU; replay: recorded measurements (no GPU; SIMULATED).")]
Replay = Annotated[Path | None, typer.Option("--replay", help="Recorded-measurements file for --backend replay.")]
Arch = Annotated[str, typer.Option("--arch", help="Target arch without a GPU (replay backend, prebuild, package).")]
Gpu = Annotated[int | None, typer.Option("--gpu", help="GPU index (sets CUDA_VISIBLE_DEVICES for the worker).")]
OutDir = Annotated[Path, typer.Option("-o", "--out", help="Folder to write into.")]
Jobs = Annotated[int | None, typer.Option("--jobs", help="Parallel nvcc jobs (default: one per core).")]
Record = Annotated[Path | None, typer.Option("--record", help="Append every measurement to this replay file.")]
Output = Annotated[Path | None, typer.Option("-o", "--output", help="Also write the export JSON here.")]
Accumulate = Annotated[str, typer.Option(
    "--accumulate", help="fp32 (default) or fp16 accumulation. fp16 is a different problem: its own study, only "
                         "families that build it, verified and timed against cuBLAS in fp16 compute.")]
Confirm = Annotated[int, typer.Option(
    "--confirm", min=0,
    help="After the search, re-verify and re-time the K best distinct kernels with cuBLAS and cuBLASLt in "
         "--confirm-runs fresh worker runs and export the fastest by median time (a trial's time is one "
         "measurement; near-equal kernels swap places by a few percent from run to run). 0: export the "
         "in-study best.")]
ConfirmRuns = Annotated[int, typer.Option("--confirm-runs", min=1, help="Fresh worker runs of the confirmation.")]
Catalogue = Annotated[Path | None, typer.Option(
    "--catalogue", help="Kernel catalogue (`hgemm-tune catalogue build`): verified, refused if built with another "
                        "nvcc, CUTLASS, arch or template, loaded into the compile cache; a fresh study tries its "
                        "configs first (no nvcc), ranked for its shape (--catalogue-top).")]
CatalogueGrow = Annotated[Path | None, typer.Option(
    "--catalogue-out", metavar="ZIP",
    help="After the run, write the --catalogue (or a new one) plus every exported kernel it lacks to this file: "
         "the winners the search compiled join the catalogue for the next run (their binaries come from the "
         "compile cache). May name the --catalogue file itself, replaced whole.")]
CatalogueTop = Annotated[int | None, typer.Option(
    "--catalogue-top", min=0,
    help="With --catalogue: a fresh study first times the catalogue's N best configs for its shape (no nvcc), "
         "ranked by a cost model (tiles, waves over the SMs, split-K, roofline) and by the winners of the nearest "
         "tuned shapes in --storage; then the sampler compiles new configs. Default: every catalogue config, "
         "ranked; 0: none (the catalogue only fills the compile cache). `hgemm-tune rank-check` shows how well "
         "the ranking predicted the measured order.")]
Batch = Annotated[int | None, typer.Option(
    "--batch", min=1,
    help="Binaries measured together: each verified, then all their run-time variants ranked in one shared "
         "screen, and only the few best timed in full against cuBLAS in one section; the rest are recorded as "
         "screened (pruned). Default: 8 with --catalogue (its kernels are ready at once), else 1.")]
RankBy = Annotated[str, typer.Option(
    "--rank-by", help="With --catalogue: what orders its configs. model: our cost model; nvidia: NVIDIA's "
                      "nvMatmulHeuristics estimates (optional, NVIDIA-licensed wheel: pip install "
                      "'hgemm-tune[heuristics]'), our model for what it cannot express (stream-K, families "
                      "other than cute_sm90). Nearby winners move up either way; `hgemm-tune rank-check` "
                      "compares the two on measured studies.")]
CatalogueOut = Annotated[Path, typer.Option("-o", "--output", help="The catalogue file to write (a zip); when "
                                                                  "it exists, its kernels are kept, not rebuilt.")]
Update = Annotated[Path | None, typer.Option(
    "--update", help="An existing catalogue to extend: its kernels are kept, only configs it lacks are compiled.")]
Objective = Annotated[str, typer.Option(
    "--objective", help="The time the search minimizes, in one of two timing regimes (docs/decisions/0036): "
                        "sustained = back-to-back launches in interleaved slices until steady, the power-capped "
                        "state a busy service runs in; isolated = single launches, each after an L2 flush and an idle "
                        "gap, at full clocks (the latency of one cold GEMM). A study minimizes one regime's time: "
                        "an isolated study is its own study (its name ends in -isolated). offline and server are "
                        "accepted as their older names.")]
JoinObjective = Annotated[str | None, typer.Option(
    "--objective", help="The study's objective (sustained or isolated; default: the one the study was created "
                        "with). A worker never measures a study in another regime: naming another is an error.")]
Modes = Annotated[str, typer.Option(
    "--mode", "-m",
    help="Timing regimes (docs/decisions/0036): sustained = per contender a CUDA graph of back-to-back launches, "
         f"replayed in ~{_SP.slice_ms:g} ms slices round-robin over all contenders (reshuffled each round, equal "
         f"warm-up) until {_SP.window} rounds agree within {100 * _SP.tol:g}%: the power-capped steady state, host "
         "overhead excluded; isolated = single launches, each after an L2 flush and a random 20-500 us idle gap, "
         "interleaved per launch: cold, full clocks; both. offline and server are accepted as their older names.")]
Shape = Annotated[str, typer.Option("--shape", "-s", help="MxNxK, e.g. 4096x4096x8192 (A: MxK, B: NxK, C: MxN).")]
Study = Annotated[str | None, typer.Option("--study", help="Study name (see `hgemm-tune studies`).")]

__all__ = ["DEFAULT_STORAGE"]

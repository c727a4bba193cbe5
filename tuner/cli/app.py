"""hgemm-tune's commands: each parses its options, calls tuner.api (or a stage's public
function) and prints. No tuning logic lives here.

    hgemm-tune --shape 4096x4096x8192 --trials 500     # tune one shape (same as `tune`)
    hgemm-tune sweep --shapes subgrid27                # every shape of a list in the space file
    hgemm-tune bench runs/sweep.json --repeats 3       # re-verify and time an export vs the vendors
    hgemm-tune catalogue build --seeds-for 4096x4096x8192   # compile kernels into one file, no GPU
    hgemm-tune rank-check                              # how well the catalogue ranking predicted the times
    hgemm-tune doctor                                  # GPU, arch, nvcc, headers, space, templates
"""

from __future__ import annotations

import typer

from tuner.cli import results, studies, tools, tuning

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="rich",
                  pretty_exceptions_enable=False,
                  help="Find, verify and export the fastest fp16 GEMM kernel per shape on your NVIDIA GPU.")

for command in (tuning.tune, tuning.worker, tuning.sweep, studies.record, studies.render, studies.show,
                studies.studies, studies.rank_check, studies.export, results.report, results.bench, results.prebuild,
                results.package, results.check_package, results.bench_model,
                tools.propose, tools.proposals, tools.doctor):
    app.command(help=results.BENCH_HELP if command is results.bench else None)(command)
app.add_typer(results.catalogue_app, name="catalogue")

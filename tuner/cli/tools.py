"""The proposer's commands (`propose`, `proposals`) and `doctor`."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from tuner.cli import options as o
from tuner.cli.views import console, out_console
from tuner.errors import UserError


def propose(
    family: Annotated[str, typer.Option("--family", "-f", help="Family whose template the LLM rewrites.")],
    shape: Annotated[list[str], typer.Option("--shape", "-s", help="Target shape(s) the child must win on.")],
    rounds: Annotated[int, typer.Option(min=1, help="Rounds; each round's failures are fed back to the next.")] = 1,
    candidates: Annotated[int, typer.Option(min=1, help="Proposals asked per round.")] = 1,
    base_url: Annotated[str | None, typer.Option(help="OpenAI-compatible endpoint (or OPENAI_BASE_URL).")] = None,
    model: Annotated[str | None, typer.Option(help="Model name (or OPENAI_MODEL).")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds per LLM request: a deadline for the whole answer.")] = 120.0,
    backend: Annotated[str, typer.Option(help="auto: the GPU if present, else compile-only; gpu; none.")] = "auto",
    trials: Annotated[int, typer.Option(help="Trials of the short tune of parent and child per shape.")] = 12,
    arch: o.Arch = "sm_90a",
    storage: Annotated[str, typer.Option(help="Studies whose results and errors the prompt reports (read only).")
                       ] = o.DEFAULT_STORAGE,
    space_file: o.SpaceFile = None,
    out: Annotated[Path, typer.Option(help="Where prompts, replies and outcomes are kept.")] = Path("runs/proposals"),
    versions_dir: Annotated[Path | None, typer.Option(
        help="Where an accepted child is written as a family version (default: the family's templates folder).")
    ] = None,
) -> None:
    """Ask an LLM for a template improvement, validate it, and keep it only if it wins."""
    from proposer.client import ChatClient
    from proposer.evidence import gather
    from proposer.loop import proposable, run_rounds
    from proposer.validate import terminal_safe
    from tuner.measure import GpuBackend
    from tuner.space import load_space, parse_shape

    space = load_space(space_file)
    proposable(space, family)  # before any endpoint is asked or GPU started
    shapes = [parse_shape(s) for s in shape]
    client = ChatClient(base_url, model, timeout_s=timeout)
    evidence = gather(storage, family, shapes)
    be = None
    if backend in ("auto", "gpu"):
        try:
            be = GpuBackend(log_path=Path("runs") / "worker.log")
        except UserError as exc:
            if backend == "gpu":
                raise
            console.print(f"[yellow]no GPU[/] ({escape(str(exc))}): proposals are validated up to nvcc only")
    target_arch = be.target.arch if be else arch
    try:
        outcomes = run_rounds(space, family, shapes, client, rounds=rounds, candidates=candidates, out_dir=out,
                              backend=be, arch=target_arch, trials=trials, evidence=evidence,
                              versions_dir=versions_dir,
                              log=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True))
    finally:
        if be:
            be.close()
    table = Table("proposal", "status", "reason", title=f"proposals for {family}")
    for oc in outcomes:
        table.add_row(escape(terminal_safe(oc.id)), oc.status, escape(terminal_safe(oc.reason, one_line=True)[:160]))
    out_console.print(table)
    if outcomes and all(oc.status == "endpoint_error" for oc in outcomes):
        # One plain line: the endpoint never gave a usable answer (unreachable, or no chat completion).
        print(f"error: the LLM endpoint never answered usefully: "
              f"{terminal_safe(outcomes[-1].reason, one_line=True)[:300]}", file=sys.stderr)
        raise typer.Exit(1)


def proposals(out: Annotated[Path, typer.Option(help="Folder of recorded proposals.")] = Path("runs/proposals")
              ) -> None:
    """List recorded proposals, their outcomes and the family versions they became."""
    from proposer.loop import list_proposals
    from proposer.validate import terminal_safe

    def cell(value, width: int = 80) -> str:  # outcome.json is a file: anything may be in it
        return escape(terminal_safe(str(value), one_line=True)[:width])

    table = Table("proposal", "round", "status", "version", "reason")
    for oc in list_proposals(out):
        metrics = oc.get("metrics") if isinstance(oc.get("metrics"), dict) else {}
        table.add_row(cell(oc["id"]), cell(oc["round"]), cell(oc["status"]), cell(metrics.get("version", "-")),
                      cell(oc["reason"], 120))
    out_console.print(table)


def doctor() -> None:
    """Check the GPU, its arch, nvcc, the CUTLASS headers, cupy, and the packaged space and templates."""
    from tuner.build import cutlass_include, cutlass_version, nvcc_path, nvcc_version
    from tuner.space import default_space_path, load_space

    table = Table("check", "status", "detail")
    ok = True

    def row(name: str, good: bool, detail: str, required: bool = True) -> None:
        nonlocal ok
        ok &= good or not required
        status = "[green]ok[/]" if good else ("[red]missing[/]" if required else "[yellow]optional[/]")
        table.add_row(name, status, escape(detail))

    try:
        space = load_space()
        row("space and templates", True, f"{default_space_path()}: {len(space.families)} families "
            f"({', '.join(space.families)}), their templates found")
    except UserError as exc:
        row("space and templates", False, str(exc))
    try:
        row("nvcc", True, f"{nvcc_path()} (CUDA {nvcc_version()})")
    except UserError as exc:
        row("nvcc", False, str(exc))
    try:
        row("CUTLASS/CuTe headers", True, f"{cutlass_include()} (nvidia-cutlass {cutlass_version()})")
    except UserError as exc:
        row("CUTLASS/CuTe headers", False, str(exc))
    try:
        import cupy

        row("cupy", True, cupy.__version__)
        try:
            from tuner.space import target_from_device

            props = cupy.cuda.runtime.getDeviceProperties(0)
            name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
            t = target_from_device(props, name)
            row("GPU", True, f"{name}: cc {t.cc}, build {t.arch}, {t.sm_count} SMs, "
                f"{t.max_smem // 1024} KiB smem/block, driver {cupy.cuda.runtime.driverGetVersion()}")
        except Exception as exc:  # noqa: BLE001 - any CUDA failure means: no usable GPU
            row("GPU", False, f"no usable CUDA device: {exc}")
    except ImportError:
        row("cupy", False, "pip install 'hgemm-tune[gpu]' (cupy-cuda13x) to measure on a GPU")
    for mod, why in (("optuna", "search"), ("nvmath", "cuBLASLt baselines"), ("openai", "LLM proposer"),
                     ("matplotlib", "report plots: pip install 'hgemm-tune[report]'")):
        try:
            m = __import__(mod)
            row(mod, True, getattr(m, "__version__", "installed"))
        except ImportError:
            row(mod, False, f"not installed ({why})", required=mod == "optuna")
    row("cpu cores", True, f"{os.cpu_count()} (one nvcc job each)")
    row("disk", True, f"{shutil.disk_usage('.').free // 2**30} GiB free here")
    out_console.print(table)
    if not ok:
        raise typer.Exit(1)

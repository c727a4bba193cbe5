"""Tables and plots from an export: where we win, where we lose, what the winners look like."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tuner.errors import UserError
from tuner.results.bench import bucket_index, contender_rows, flop_bucket, geomean, markdown, regimes_of
from tuner.results.schema import check_writable_folder


def require_matplotlib() -> None:
    """The plots need matplotlib, the [report] extra: one line saying how to install it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("report needs matplotlib, which is not installed: pip install 'hgemm-tune[report]'") from None


def check_report_out(out: Path) -> None:
    """Before anything is read: the report folder is, or can be made, a writable folder."""
    check_writable_folder(out, f"cannot write the report to {out}")


def _make_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write the report to {out}: {exc.strerror or exc}") from None


def frame(data: dict[str, Any]) -> pd.DataFrame:
    """One row per exported entry, knobs as `knob.NAME` columns."""
    rows = []
    for e in data["entries"]:
        row = {k: e[k] for k in ("shape", "M", "N", "K", "family", "time_us", "tflops", "roofline_fraction",
                                  "pick", "simulated")}
        row["gflop"] = 2 * e["M"] * e["N"] * e["K"] / 1e9
        for base, sp in e["speedup"].items():
            row[f"speedup.{base}"] = sp
        for knob, value in e["knobs"].items():
            row[f"knob.{knob}"] = value
        rows.append(row)
    return pd.DataFrame(rows)


def bucket_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per regime and FLOP bucket: shapes, the geomean speedup of our best kernel over each
    baseline (the vendor fallback not counted), and the share of shapes the vendor keeps."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for e in data["entries"]:
        flops = 2.0 * e["M"] * e["N"] * e["K"]
        key = (str(e.get("objective") or "sustained"), bucket_index(flops), flop_bucket(flops))
        groups.setdefault(key, []).append(e)
    rows = []
    for (regime, _, label), entries in sorted(groups.items()):
        bases = sorted({b for e in entries for b in e["speedup"]})
        row: dict[str, Any] = {"regime": regime, "FLOPs": label, "shapes": len(entries)}
        for b in bases:
            row[f"vs {b}"] = geomean([e["speedup"][b] for e in entries if e["speedup"].get(b)])
        row["vendor keeps"] = sum(e["pick"] != e["family"] for e in entries) / len(entries)
        rows.append(row)
    return rows


def bucket_markdown(rows: list[dict[str, Any]]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def write_report(data: dict[str, Any], out: Path) -> list[Path]:
    """PNG plots and a markdown table under `out`; returns the files written."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = frame(data)
    if df.empty:
        return []
    _make_out(out)
    tag = "  [SIMULATED]" if data.get("simulated") else ""
    written = []
    bases = [c.removeprefix("speedup.") for c in df.columns if c.startswith("speedup.")]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for base in bases:
        ax.scatter(df["gflop"], df[f"speedup.{base}"], label=f"vs {base}", alpha=0.8)
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("GFLOP per GEMM (log)")
    ax.set_ylabel("speedup (baseline time / ours)")
    ax.set_title("Speedup over the vendor libraries, same run" + tag)
    ax.legend()
    written.append(_save(fig, out / "speedup_vs_flops.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter(df["gflop"], df["roofline_fraction"] * 100, c="tab:green")
    ax.set_xscale("log")
    ax.set_xlabel("GFLOP per GEMM (log)")
    ax.set_ylabel("% of roofline (datasheet peak / bandwidth)")
    ax.set_title("Distance to the roofline" + tag)
    written.append(_save(fig, out / "roofline.png"))

    if "speedup.cublas" in df:
        from matplotlib.colors import TwoSlopeNorm

        ks = sorted(df["K"].unique())
        # Centred on 1.0 (red: cuBLAS faster, green: ours), clipped at 0.5x / 1.5x, with the
        # value in each cell: a 3% win and a 3% loss must not look alike.
        norm = TwoSlopeNorm(vcenter=1.0, vmin=0.5, vmax=1.5)
        fig, axes = plt.subplots(1, len(ks), figsize=(4 * len(ks), 3.8), squeeze=False, layout="constrained")
        for ax, k in zip(axes[0], ks, strict=True):
            sub = df[df["K"] == k].pivot_table(index="M", columns="N", values="speedup.cublas")
            im = ax.imshow(sub.values, cmap="RdYlGn", norm=norm, origin="lower")
            if sub.size <= 100:
                for (i, j), v in np.ndenumerate(sub.values):
                    if np.isfinite(v):
                        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(sub.columns)), [str(c) for c in sub.columns], rotation=45)
            ax.set_yticks(range(len(sub.index)), [str(i) for i in sub.index])
            ax.set_xlabel("N")
            ax.set_ylabel("M")
            ax.set_title(f"K={k}")
        fig.colorbar(im, ax=axes[0].tolist(), label="speedup vs cuBLAS")
        fig.suptitle("Speedup over cuBLAS by M x N" + tag)
        written.append(_save(fig, out / "speedup_heatmap.png"))

    # The winners' tile and stage choices against the shape (as the CUDA-L2 paper plots
    # them); the families name their tile knobs differently (BM / TILE_M).
    knob_pairs = [(("knob.BM", "knob.TILE_M"), "tile M", "M"), (("knob.BN", "knob.TILE_N"), "tile N", "N"),
                  (("knob.STAGES",), "stages", "K")]
    present = []
    for names, label, dim in knob_pairs:
        cols_here = [c for c in names if c in df]
        if cols_here:
            values = df[cols_here].bfill(axis=1).iloc[:, 0]
            present.append((values, label, dim))
    if present:
        fig, axes = plt.subplots(1, len(present), figsize=(4 * len(present), 3.5), squeeze=False)
        for ax, (values, label, dim) in zip(axes[0], present, strict=True):
            pts = pd.DataFrame({"x": df[dim], "y": values}).dropna()
            counts = pts.value_counts().reset_index(name="n")  # overlapping winners: bigger dots
            ax.scatter(counts["x"], counts["y"], s=25 * counts["n"], alpha=0.7)
            ax.set_xscale("log", base=2)
            ax.set_xlabel(dim)
            ax.set_ylabel(label)
        fig.suptitle("Knobs of the winners (dot area: number of shapes)" + tag)
        written.append(_save(fig, out / "winner_knobs.png"))

    cols = ["shape", "family", "time_us", "tflops", "roofline_fraction"] + [f"speedup.{b}" for b in bases]
    table = df[cols].sort_values("shape").to_markdown(index=False, floatfmt=".3f") if _has_tabulate() else \
        df[cols].sort_values("shape").to_string(index=False)
    geo = ", ".join(f"{b}: {geomean(list(df[f'speedup.{b}'])) or float('nan'):.3f}x" for b in bases)
    md = out / "report.md"
    try:
        md.write_text(f"# hgemm-tune report{tag}\n\nGeomean speedup: {geo}\n\n"
                      f"## By FLOP bucket (our best kernel, the vendor fallback not counted; "
                      f"'vendor keeps': share of shapes whose pick is the vendor)\n\n"
                      f"{bucket_markdown(bucket_rows(data))}\n\n{table}\n")
    except OSError as exc:
        raise UserError(f"cannot write the report to {md}: {exc.strerror or exc}") from None
    written.append(md)
    return written


def write_bench_report(bench: dict[str, Any], out: Path) -> list[Path]:
    """From `hgemm-tune bench`'s bench.json: speedup over every baseline against GFLOP (log), one
    panel per timing regime (sustained, isolated; an older file's offline and server are those),
    and bench_report.md: the kernel table and the table per contender and regime (time,
    TFLOP/s, ratio, SM clock, power, energy per GEMM, steady state). Failed rows are not plotted."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = pd.DataFrame([r for r in bench["rows"] if r.get("status") == "ok"])
    if df.empty:
        return []
    _make_out(out)
    df["mode"] = regimes_of(list(df["mode"]))
    df["gflop"] = 2 * df["M"] * df["N"] * df["K"] / 1e9
    bases = [c.removeprefix("speedup_") for c in df.columns if c.startswith("speedup_") and df[c].notna().any()]
    modes = [m for m in regimes_of(bench["modes"]) if m in set(df["mode"])]
    tag = "  [SIMULATED]" if bench.get("simulated") else ""
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.5), squeeze=False, sharey=True)
    for ax, mode in zip(axes[0], modes, strict=True):
        sub = df[df["mode"] == mode]
        for base, marker in zip(bases, "osD^v", strict=False):
            ax.scatter(sub["gflop"], sub[f"speedup_{base}"], label=f"vs {base}", marker=marker, alpha=0.75)
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set_xscale("log")
        ax.set_xlabel("GFLOP per GEMM (log)")
        ax.set_title(f"{mode} regime")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("speedup (baseline us / ours us)")
    fig.suptitle(f"{bench['gpu']}: tuned kernels against the vendor libraries, same run{tag}")
    written = [_save(fig, out / "bench_speedup_vs_flops.png")]
    md = out / "bench_report.md"
    text = markdown(bench | {"contenders": bench.get("contenders") or contender_rows(bench["rows"])},
                    str(bench.get("source", "")))
    try:
        md.write_text(text)
    except OSError as exc:
        raise UserError(f"cannot write the report to {md}: {exc.strerror or exc}") from None
    return written + [md]


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
    except ImportError:
        return False
    return True


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    if fig.get_layout_engine() is None:
        fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise UserError(f"cannot write the report to {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return path


def plot_curve(curve, path: Path) -> Path:
    """The catalogue-size curve (tuner.results.curve.Curve): geomean against cuBLAS an export reaches,
    and shapes within the tolerance of their best, against the number of kernels. ImportError
    without matplotlib (the caller writes the table and the CSV only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [p.size for p in curve.points]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot(sizes, [p.geomean_vs_cublas for p in curve.points], marker="o", label="geomean vs cuBLAS (export)")
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xlabel("kernels in the catalogue (greedy order)")
    ax.set_ylabel("geomean speedup vs cuBLAS")
    share = ax.twinx()
    share.plot(sizes, [p.within / curve.shapes for p in curve.points], color="tab:orange", marker="s",
               label=f"shapes within {curve.tolerance:.0%} of their best")
    share.set_ylabel("share of shapes")
    share.set_ylim(0, 1.05)
    if curve.keep is not None:
        ax.axvline(curve.keep, color="tab:green", lw=1, ls=":")
    lines = ax.get_legend_handles_labels()[0] + share.get_legend_handles_labels()[0]
    ax.legend(lines, [str(h.get_label()) for h in lines], fontsize=8, loc="lower right")
    ax.set_title(f"{curve.gpu or 'replayed'}: {curve.shapes} shapes, {curve.kernels} kernels timed in full")
    return _save(fig, path)

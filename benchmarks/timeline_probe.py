"""Where a cute_sm90 kernel's time goes, CTA by CTA: a timeline from in-kernel clock stamps.

    python benchmarks/timeline_probe.py --shape 16384x128x4096 --config '{"TILE_M": 128, ...}' \\
        [--config ...] [--runs 7] [--out DIR]
    python benchmarks/timeline_probe.py --plot-from DIR/timeline_16384x128x4096.json   (no GPU)

Each config is rendered with TIMELINE=1 (templates/cute_sm90.cu.j2): the same kernel, with
every CTA stamping its SM clock at entry, when its producer enters our load() and issues its
first TMA load, when its consumers enter the mainloop and see the first stage full, when the
last load is issued, when the last tile's wgmmas are issued, and at exit (after the
epilogue's stores), plus the global timer at entry and exit and its SM id. Each run times,
with events around single launches queued behind a spin kernel (so the host's launch cost
is not measured), the stamped kernel, the same kernel unstamped and cuBLAS, interleaved.

What it answers (NOTES.md, session 9): in a one-wave skinny GEMM such as 16384x128x4096,
is the time lost to cuBLAS spent before the first load (launch, prologue), in the
streaming itself, in the spread of CTA finish times, or after the last load (the last
tiles' math and the epilogue)?
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tuner.compile import compile_source
from tuner.gpu_worker import Buffers, Cublas, _cp, load_candidate
from tuner.render import render
from tuner.search import launch_spec
from tuner.shapes import parse_shape
from tuner.space import load_space
from tuner.target import target_for_arch

# One row per CTA, in the template's order (timeline::k*): SM-clock stamps, then the global timer and SM id.
# init_done .. consumer_regs are stamped by our kernel body only (PROLOGUE=early_load), unset
# elsewhere: the producer done with the barrier init, the consumers past their wait for it, the
# producer done with load_init and the scheduler, past its register release (setmaxnreg.dec, and
# the cluster wait), past griddepcontrol.wait; the consumers past their register allocation.
EVENTS = ["entry", "load_entry", "first_load", "mma_entry", "first_full", "last_load", "mma_done", "exit",
          "init_done", "consumers_ready", "setup_done", "producer_regs", "deps_done", "consumer_regs"]
FIELDS = [*EVENTS, "global_entry", "global_exit", "sm"]
UNSET = (0, 2**64 - 1)  # a max-stamp never written, a min-stamp never written
# Derived spans (us) the summary prints: (name, from, to).
SPANS = [("barrier init (entry -> producer done with it)", "entry", "init_done"),
         ("  then load_init + scheduler", "init_done", "setup_done"),
         ("  then register release (+ cluster wait)", "setup_done", "producer_regs"),
         ("  then work tile + griddepcontrol.wait", "producer_regs", "deps_done"),
         ("  then to load()", "deps_done", "load_entry"),
         ("consumers wait for the init (entry -> past it)", "entry", "consumers_ready"),
         ("  then work tile + register allocation", "consumers_ready", "consumer_regs"),
         ("  then to the mainloop", "consumer_regs", "mma_entry"),
         ("prologue (entry -> producer in load)", "entry", "load_entry"),
         ("producer set-up (load -> first load issued)", "load_entry", "first_load"),
         ("first load's latency (issued -> stage full)", "first_load", "first_full"),
         ("consumers ready (entry -> mainloop)", "entry", "mma_entry"),
         ("epilogue (last wgmmas issued -> exit)", "mma_done", "exit")]
SPIN = r"""
extern "C" __global__ void spin(long long ns) {
  long long start = clock64();
  while (clock64() - start < ns * 2) {}  // about ns at 2 GHz: long enough to queue what follows
}
"""


def build(fam, full: dict, arch: str, timeline: bool):
    built = compile_source(render(fam, full, arch, probe={"TIMELINE": timeline}), arch, artifact=fam.artifact)
    if not built.ok:
        raise SystemExit(f"build failed ({'stamped' if timeline else 'plain'}): {built.error}")
    return built


def timeline_of(rows: list[list[int]]) -> dict:
    """Per-CTA times in us from the first CTA's entry: each CTA's clock stamps converted with
    the SM clock rate measured over its own lifetime (clock ticks / global-timer ns)."""
    ctas = [dict(zip(FIELDS, r, strict=True)) for r in rows if r[FIELDS.index("global_entry")]]
    ghz = statistics.median((c["exit"] - c["entry"]) / max(1, c["global_exit"] - c["global_entry"]) for c in ctas)
    t0 = min(c["global_entry"] for c in ctas)
    per_cta = [{e: None if c[e] in UNSET else (c["global_entry"] - t0 + (c[e] - c["entry"]) / ghz) / 1e3
                for e in EVENTS} | {"sm": c["sm"]} for c in ctas]
    entries = sorted({c["global_entry"] for c in ctas})
    tick = min((b - a for a, b in zip(entries, entries[1:], strict=False)), default=0)
    return {"ctas": len(ctas), "sm_ghz": ghz, "global_timer_tick_ns": tick, "per_cta": per_cta}


def median_run(runs: list[dict]) -> dict:
    """The run with the median event time (the upper one of an even count)."""
    return sorted(runs, key=lambda r: r["event_us"])[len(runs) // 2]


def summary(tl: dict) -> dict:
    out = {}
    for e in EVENTS:
        v = sorted(c[e] for c in tl["per_cta"] if c[e] is not None)
        if v:
            out[e] = (v[0], statistics.median(v), v[-1])
    for name, start, end in SPANS:
        v = sorted(c[end] - c[start] for c in tl["per_cta"] if c[start] is not None and c[end] is not None)
        if v:
            out[name] = (v[0], statistics.median(v), v[-1])
    return out


PHASES = [("entry", "first_load", "prologue", "tab:red"), ("first_load", "last_load", "loads issued", "tab:blue"),
          ("last_load", "mma_done", "last stages' math", "tab:orange"), ("mma_done", "exit", "epilogue", "tab:green")]


def plot(report: list[dict], path: Path) -> None:
    """One panel per config: every CTA of its median run as a bar, split into its phases."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(report), 1, figsize=(10, 3.2 * len(report)), squeeze=False)
    for ax, entry in zip(axes[:, 0], report, strict=True):
        run = median_run(entry["runs"])
        ctas = sorted(run["per_cta"], key=lambda c: c["exit"])
        for start, end, label, color in PHASES:
            ax.barh(range(len(ctas)), [c[end] - c[start] for c in ctas], left=[c[start] for c in ctas],
                    height=1.0, color=color, label=label, linewidth=0)
        ax.axvline(run["event_us"], color="black", linestyle="--",
                   label="event time (launch to end, drawn from the first entry)")
        cfg = entry["config"]
        body = "" if cfg.get("PROLOGUE", "cutlass") == "cutlass" else f", {cfg['PROLOGUE']}"
        ax.set_title(f"{entry['shape']}: {cfg['TILE_M']}x{cfg['TILE_N']} {cfg['CLUSTER_M']}x{cfg['CLUSTER_N']} "
                     f"{cfg['STAGES']} st. {cfg['SCHEDULER']}{body}, median of {len(entry['runs'])} runs", fontsize=10)
        ax.set_ylabel("CTA (by exit time)")
        ax.set_xlim(0, run["event_us"] * 1.02)
    axes[-1, 0].set_xlabel("us since the first CTA's entry")
    axes[0, 0].legend(loc="lower left", fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape")
    ap.add_argument("--config", action="append", help="a cute_sm90 config as JSON (repeatable)")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None, help="write every run's per-CTA stamps (JSON) and a plot here")
    ap.add_argument("--plot-from", type=Path, default=None, help="only plot a JSON an earlier run wrote (no GPU)")
    args = ap.parse_args()
    if args.plot_from:
        out = args.plot_from.with_suffix(".png")
        plot(json.loads(args.plot_from.read_text()), out)
        print(f"wrote {out}")
        return
    if not args.shape or not args.config:
        ap.error("--shape and at least one --config are required (or --plot-from)")
    cp = _cp()
    shape = parse_shape(args.shape)
    target = target_for_arch("sm_90a")
    fam = load_space("space.yaml").family("cute_sm90")
    sm_count = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    buf = Buffers(shape.M, shape.N, shape.K)
    buf.A[...] = cp.random.standard_normal(buf.A.shape, dtype=cp.float32).astype(cp.float16)
    buf.B[...] = cp.random.standard_normal(buf.B.shape, dtype=cp.float32).astype(cp.float16)
    stream = cp.cuda.Stream(non_blocking=True)
    cublas = Cublas(stream)
    spin = cp.RawKernel(SPIN, "spin")
    flops = 2.0 * shape.M * shape.N * shape.K
    configs = [fam.complete(json.loads(text)) for text in args.config]
    with ThreadPoolExecutor() as pool:  # nvcc runs: every build at once
        builds = list(pool.map(lambda job: build(fam, job[0], target.arch, job[1]),
                               [(full, stamped) for full in configs for stamped in (True, False)]))
    report = []
    for i, (text, full) in enumerate(zip(args.config, configs, strict=True)):
        spec = launch_spec(fam, full, shape, target) | {"sm_count": sm_count}
        stamped = load_candidate(builds[2 * i].cubin, spec)
        plain = load_candidate(builds[2 * i + 1].cubin, spec)
        stamped.lib.hgemm_timeline.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        variant = fam.runtime_config(full)
        contenders = {"stamped": stamped.launcher(variant), "plain": plain.launcher(variant), "cuBLAS": cublas}
        times: dict[str, list[float]] = {k: [] for k in contenders}
        runs = []
        fields = stamped.lib.hgemm_timeline(None, 0, 0)
        if fields != len(FIELDS):
            raise SystemExit(f"the template stamps {fields} fields per CTA, this script reads {len(FIELDS)}")
        host = (ctypes.c_ulonglong * (4096 * len(FIELDS)))()
        with stream:
            for launch in contenders.values():  # warm-up: module load, first-call set-up
                launch(buf, stream)
            stream.synchronize()
            for _ in range(args.runs):
                for name, launch in contenders.items():
                    if name == "stamped" and stamped.lib.hgemm_timeline(None, 0, 1):
                        raise SystemExit("timeline reset failed")
                    start, end = cp.cuda.Event(), cp.cuda.Event()
                    spin((1,), (1,), (cp.int64(50_000),), stream=stream)
                    start.record(stream)
                    launch(buf, stream)
                    end.record(stream)
                    end.synchronize()
                    times[name].append(cp.cuda.get_elapsed_time(start, end) * 1e3)
                    if name == "stamped":
                        if stamped.lib.hgemm_timeline(ctypes.addressof(host), 4096, 0):
                            raise SystemExit("timeline read failed")
                        rows = [list(host[i * len(FIELDS):(i + 1) * len(FIELDS)]) for i in range(4096)]
                        runs.append(timeline_of(rows) | {"event_us": times[name][-1]})
        mid = median_run(runs)
        s = summary(mid)
        print(f"\n{shape} {text}")
        print("  event-timed single launches, median of", args.runs, "(us):",
              ", ".join(f"{k} {statistics.median(v):.2f} ({flops / statistics.median(v) / 1e6:.0f} TFLOP/s)"
                        for k, v in times.items()))
        print(f"  median stamped run: {mid['ctas']} CTAs, SM clock {mid['sm_ghz']:.3f} GHz, global timer tick "
              f"{mid['global_timer_tick_ns']} ns, event {mid['event_us']:.2f} us")
        print(f"  {'us since the first CTA entered, or span':<48}  min   median      max")
        for key, (lo, med, hi) in s.items():
            print(f"    {key:<46} {lo:8.2f} {med:8.2f} {hi:8.2f}")
        outside = mid["event_us"] - s["exit"][2]
        print(f"  event time not inside any CTA (launch, teardown): {outside:.2f} us")
        report.append({"shape": str(shape), "config": full, "times_us": times, "runs": runs})
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"timeline_{shape}.json").write_text(json.dumps(report))
        plot(report, args.out / f"timeline_{shape}.png")


if __name__ == "__main__":
    main()

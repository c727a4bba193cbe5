"""The GPU worker: a subprocess that loads built kernels, verifies and times them.

Run as `python -m tuner.measure.worker`. It reads one request per line on stdin and writes one
reply per line on its original stdout (tuner.measure.protocol; everything else goes to
stderr). A kernel that faults poisons the CUDA context, so after a fault the worker replies
and exits; the parent (tuner.measure.gpu.GpuBackend) starts a new one. A hang is handled by
the parent's timeout. Nothing here decides what to try next: it measures what it is told.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import time
import traceback
from dataclasses import asdict
from typing import Any

from tuner.measure import verify
from tuner.measure.buffers import Buffers
from tuner.measure.candidates import LaunchRefused, LibraryCandidate, load_candidate
from tuner.measure.clocks import ClockSampler, gpu_state
from tuner.measure.device import KernelFault
from tuner.measure.device import cp as _cp
from tuner.measure.protocol import (
    MODES,
    PROTOCOL_VERSION,
    REPLIES,
    BaselineReply,
    BaselineRequest,
    CompareReply,
    CompareRequest,
    EvaluateManyReply,
    EvaluateManyRequest,
    EvaluateReply,
    EvaluateRequest,
    HelloReply,
    HelloRequest,
    ItemResult,
    ProtocolError,
    Reply,
    decode_request,
    encode_reply,
)
from tuner.measure.regimes import (
    ISOLATED,
    SUSTAINED,
    SUSTAINED_BENCH,
    SUSTAINED_TRIAL,
    Plan,
    Screen,
    canonical,
    trial_screen,
)
from tuner.measure.timing import SERVER_GAP_US, L2Flush, time_isolated, time_sustained, time_trial
from tuner.measure.vendors import BASELINES, Cublas, CublasLt, torch_contender


class Worker:
    def __init__(self):
        cp = _cp()
        self.cp = cp
        self.device = cp.cuda.Device()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.stream.use()  # every cupy op (inputs, references, checks) is ordered with the kernels
        self.buffers: Buffers | None = None
        self.cublas = Cublas(self.stream, "fp32")
        self.rng = random.Random(int.from_bytes(os.urandom(4), "little"))
        self._l2_flush: L2Flush | None = None
        self._cublas16: Cublas | None = None

    def buffers_for(self, shape: tuple[int, int, int]) -> Buffers:
        M, N, K = shape
        if self.buffers is None or (self.buffers.M, self.buffers.N, self.buffers.K) != (M, N, K):
            self.buffers = None
            gc.collect()  # the last shape's contenders (torch's tensors, graphs) may hold its buffers in cycles
            self.cp.get_default_memory_pool().free_all_blocks()
            self.buffers = Buffers(M, N, K)
        return self.buffers

    def hello(self, req: HelloRequest) -> HelloReply:
        cp = self.cp
        if req.version != PROTOCOL_VERSION:
            return HelloReply(status="error", kind="protocol", fatal=True,
                              reason=f"the tuner speaks protocol {req.version}, this worker {PROTOCOL_VERSION}")
        props = cp.cuda.runtime.getDeviceProperties(self.device.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        keep = ("major", "minor", "multiProcessorCount", "sharedMemPerBlockOptin", "maxThreadsPerBlock",
                "l2CacheSize", "totalGlobalMem")
        return HelloReply(version=PROTOCOL_VERSION, name=name, props={k: int(props[k]) for k in keep if k in props},
                          cupy=cp.__version__, cuda_runtime=cp.cuda.runtime.runtimeGetVersion(),
                          driver=cp.cuda.runtime.driverGetVersion(),
                          visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES", ""))

    def cublas_for(self, accumulate: str) -> Cublas:
        """cuBLAS in the problem's compute mode: fp32 (the default), or fp16 for an fp16-accumulate
        study, whose kernels are verified against and timed with cuBLAS's own fp16 compute."""
        if accumulate == "fp32":
            return self.cublas
        if self._cublas16 is None:
            self._cublas16 = Cublas(self.stream, "fp16")
        return self._cublas16

    def timed(self, mode: str, contenders: dict, buf: Buffers, notes: dict[str, str] | None = None,
              plan: Plan = SUSTAINED_BENCH) -> tuple[dict[str, float], dict, dict]:
        """Time `contenders` in one regime (tuner.measure.regimes): (times, clock record, report)."""
        sampler = ClockSampler(mode)
        if mode == SUSTAINED:
            times, report = time_sustained(contenders, buf, self.stream, self.rng, notes=notes, sampler=sampler,
                                           plan=plan)
        else:
            times, report = time_isolated(contenders, buf, self.stream, self.rng, flush=self.l2_flush(),
                                          notes=notes, sampler=sampler)
        return times, sampler.result, report.to_dict()

    def timed_trial(self, mode: str, variants: dict, others: dict, buf: Buffers,
                    screen: Screen | None = None) -> tuple[dict[str, float], dict, dict]:
        """Time a search trial's `variants` against `others` (cuBLAS): screened first where there
        are more than `screen.keep` of them (timing.time_trial); (times, clock record, report)."""
        sampler = ClockSampler(mode)
        screen = screen or trial_screen(dict(os.environ))
        times, report = time_trial(variants, others, buf, self.stream, self.rng, screen, mode=mode,
                                   plan=SUSTAINED_TRIAL, sampler=sampler,
                                   flush=self.l2_flush() if mode == ISOLATED else None)
        return times, sampler.result, report.to_dict()

    def baseline(self, req: BaselineRequest) -> BaselineReply:
        try:
            mode = canonical(req.mode)
        except ValueError as exc:
            return BaselineReply(status="error", kind="protocol", reason=str(exc))
        buf = self.buffers_for(req.shape)
        verify.fill_normal(buf)
        cublas = self.cublas_for(req.accumulate)
        times, clocks, report = self.timed(mode, {"cublas": lambda b, s: cublas(b, s)}, buf, plan=SUSTAINED_TRIAL)
        return BaselineReply(baselines=times, clocks=clocks, regime=report)

    def _checked(self, binary: str, launch, variants: list, digest: str | None, buf: Buffers, cublas,
                 accumulate: str) -> tuple[dict[str, Any], dict[str, Any] | None, EvaluateReply | None]:
        """Load one binary and verify it at every run-time variant: (variant JSON -> launcher, the
        verification report, None), or ({}, report, the failure reply). A KernelFault propagates."""
        try:
            cand = load_candidate(binary, launch, digest)
        except Exception as exc:  # noqa: BLE001 - a binary that will not load is a failed trial
            return {}, None, EvaluateReply(status="failed", kind="load", reason=f"binary does not load: {exc}")
        launchers = {json.dumps(v, sort_keys=True): cand.launcher(v) for v in variants}
        try:
            if isinstance(cand, LibraryCandidate):
                cand.reserve(buf.M, buf.N, buf.K, variants)  # allocate before any graph capture
            # Verify the first variant fully and every variant on fresh random data:
            # run-time knobs change the tile order, so each must still be right.
            first = next(iter(launchers.values()))
            report = verify.full_check(first, cublas, buf, self.stream, accumulate)
            if report["ok"]:
                for key, launch_fn in list(launchers.items())[1:]:
                    sub = verify.random_check(launch_fn, cublas, buf, self.stream, accumulate)
                    if not sub["ok"]:
                        report = sub | {"variant": json.loads(key)}
                        break
        except LaunchRefused as exc:
            return {}, None, EvaluateReply(status="failed", kind="refused", reason=str(exc))
        if not report["ok"]:
            return {}, report, EvaluateReply(status="failed", kind=report.get("kind", "wrong"),
                                             reason=report["reason"], verify=report)
        return launchers, report, None

    def evaluate(self, req: EvaluateRequest) -> EvaluateReply:
        """Verify then time one binary (all its run-time variants) against cuBLAS, in the
        request's regime (the search's objective)."""
        try:
            mode = canonical(req.mode)
        except ValueError as exc:
            return EvaluateReply(status="error", kind="protocol", reason=str(exc))
        buf = self.buffers_for(req.shape)
        cublas = self.cublas_for(req.accumulate)
        try:
            launchers, report, failed = self._checked(req.binary, req.launch, req.variants, req.digest, buf, cublas,
                                                      req.accumulate)
            if failed is not None:
                return failed
            if not req.time:
                return EvaluateReply(verify=report or {})
            verify.fill_normal(buf)
            # Only the variants the screen keeps are timed in full: `times` holds those, the
            # report every screened variant's screen time (regime report's screen_us).
            times, clocks, timing_report = self.timed_trial(mode, launchers, {"cublas": cublas}, buf)
        except KernelFault as exc:
            return EvaluateReply(status="fault", kind="fault", reason=f"CUDA error: {exc}", fatal=True)
        except LaunchRefused as exc:
            return EvaluateReply(status="failed", kind="refused", reason=str(exc))
        baselines = {"cublas": times.pop("cublas")}
        return EvaluateReply(verify=report or {}, times=dict(times), baselines=baselines, clocks=clocks,
                             gpu_state=gpu_state(clocks), mode=mode, regime=timing_report)

    def evaluate_many(self, req: EvaluateManyRequest) -> EvaluateManyReply:
        """Verify each binary, then screen every variant of every verified binary together and
        time the survivors against cuBLAS in one section (timing.time_trial with the trial screen):
        each item is "ok" with its steady-stage times, "screened" (verified, none of its variants
        kept; their screen times only) or "failed". A fault in any binary poisons the context: the
        reply is fatal and the parent measures the items one by one to find it."""
        try:
            mode = canonical(req.mode)
        except ValueError as exc:
            return EvaluateManyReply(status="error", kind="protocol", reason=str(exc))
        buf = self.buffers_for(req.shape)
        cublas = self.cublas_for(req.accumulate)
        results = [ItemResult() for _ in req.items]
        contenders: dict[str, Any] = {}
        for i, item in enumerate(req.items):
            launchers, report, failed = self._checked(item.binary, item.launch, item.variants, item.digest, buf,
                                                      cublas, req.accumulate)
            if failed is not None:
                results[i] = ItemResult(status="failed", kind=failed.kind, reason=failed.reason,
                                        verify=failed.verify)
                continue
            results[i].verify = report or {}
            contenders |= {f"{i}|{key}": fn for key, fn in launchers.items()}
        if not contenders:
            return EvaluateManyReply(items=[asdict(r) for r in results], mode=mode)
        verify.fill_normal(buf)
        try:
            times, clocks, timing_report = self.timed_trial(mode, contenders, {"cublas": cublas}, buf)
        except LaunchRefused as exc:  # refused only at timing (a graph capture): every item shares the section
            return EvaluateManyReply(status="failed", kind="refused", reason=str(exc))
        baselines = {"cublas": times.pop("cublas")}
        screen_us = timing_report.get("screen_us") or {}
        for name, t in times.items():
            i, key = name.split("|", 1)
            results[int(i)].times[key] = t
        for name, t in screen_us.items():
            i, key = name.split("|", 1)
            results[int(i)].screen_us[key] = t
        for r in results:
            if r.status == "ok" and not r.times:
                r.status = "screened"
        return EvaluateManyReply(items=[asdict(r) for r in results], baselines=baselines, clocks=clocks,
                                 gpu_state=gpu_state(clocks), mode=mode, regime=timing_report)

    def l2_flush(self) -> L2Flush:
        """The isolated regime's flush buffer: allocated once per worker, outside any shape's pool churn."""
        if self._l2_flush is None:
            self._l2_flush = L2Flush()
        return self._l2_flush
    def compare(self, req: CompareRequest) -> CompareReply:
        """Benchmark: verify several candidates, then time them and the vendor baselines
        (cuBLAS, cuBLASLt heuristic and autotuned, torch.matmul when installed) interleaved
        in one run, in each requested regime (`modes`: sustained, isolated; tuner.measure.regimes).

        Replies `times_by_mode` {regime: {name: us}} and `times` (sustained if requested, else
        the first regime), `clocks_by_mode` {regime: clock record of its timing section}
        (tuner.measure.clocks) and `regimes_by_mode` {regime: its report: steady state, each
        contender's energy}. A baseline that could not be measured is named in `notes`."""
        try:
            modes = [canonical(m) for m in (req.modes or [SUSTAINED])]
        except ValueError as exc:
            return CompareReply(status="error", reason=str(exc))
        if len(set(modes)) != len(modes) or any(m not in MODES for m in modes):
            return CompareReply(status="error",
                                reason=f"bad timing regimes {req.modes}: each of sustained, isolated at most once")
        clash = sorted(set(req.candidates) & set(BASELINES))
        if clash:
            return CompareReply(status="error", reason=f"candidate names {clash} clash with the baselines' names")
        buf = self.buffers_for(req.shape)
        contenders, reports, notes = {}, {}, {}
        keep = []  # the candidates' modules must outlive the timing
        for name, spec in req.candidates.items():
            try:
                cand = load_candidate(spec.binary, spec.launch, spec.digest)
            except Exception as exc:  # noqa: BLE001 - a binary that will not load fails its row only
                reports[name] = {"ok": False, "kind": "load", "reason": f"binary does not load: {exc}"}
                continue
            keep.append(cand)
            try:
                if isinstance(cand, LibraryCandidate):
                    cand.reserve(buf.M, buf.N, buf.K, [spec.variant])
                launch = cand.launcher(spec.variant)
                report = verify.full_check(launch, lambda b, s: self.cublas(b, s), buf, self.stream)
            except LaunchRefused as exc:
                report = {"ok": False, "kind": "refused", "reason": str(exc)}
            reports[name] = report
            if report["ok"]:
                contenders[name] = launch
        contenders["cublas"] = lambda b, s: self.cublas(b, s)
        try:
            lt = CublasLt(self.stream, buf)
            contenders["cublaslt"] = lt.heuristic()
            if req.autotune:
                contenders["cublaslt_auto"] = lt.autotuned(buf, self.stream)
                notes["cublaslt_algos"] = str(len(lt.algos))
            else:
                notes["cublaslt_auto"] = "not measured: not requested (outside the autotune sample)"
        except (OSError, RuntimeError) as exc:  # no cuBLASLt here: the table says so, cuBLAS still counts
            notes["cublaslt"] = notes["cublaslt_auto"] = f"not measured: {exc}"
        if req.torch:
            torch_launch = torch_contender(buf, self.stream, self.cublas, self.device.id, notes)
            if torch_launch is not None:
                contenders["torch"] = torch_launch
        else:
            notes["torch"] = "not measured: not requested"
        verify.fill_normal(buf)
        times_by_mode, clocks, regimes = {}, {}, {}
        for mode in modes:
            times_by_mode[mode], clocks[mode], regimes[mode] = self.timed(mode, contenders, buf, notes=notes)
            if mode == ISOLATED:
                notes[ISOLATED] = (f"single launches, each a 1-launch CUDA graph after an L2 flush "
                                   f"({self.l2_flush().nbytes >> 20} MiB overwritten), a synchronize and an idle "
                                   f"gap of {SERVER_GAP_US[0]:g}-{SERVER_GAP_US[1]:g} us; median")
            for name in BASELINES:
                if name not in times_by_mode[mode] and name not in notes:
                    notes[name] = f"not measured ({mode}): no time came back"
        first = SUSTAINED if SUSTAINED in modes else modes[0]
        states = {mode: gpu_state(rec) for mode, rec in clocks.items()}
        return CompareReply(modes=modes, times=times_by_mode[first], times_by_mode=times_by_mode, verify=reports,
                            clocks=clocks[first], clocks_by_mode=clocks, gpu_state=states[first],
                            gpu_state_by_mode=states, notes=notes, regimes_by_mode=regimes)


def serve(worker: Worker, req) -> Reply:
    """One request -> its reply; a CUDA error anywhere is the kernel's fault (fatal)."""
    handler = {HelloRequest: worker.hello, BaselineRequest: worker.baseline, EvaluateRequest: worker.evaluate,
               EvaluateManyRequest: worker.evaluate_many, CompareRequest: worker.compare}[type(req)]
    try:
        return handler(req)
    except KernelFault as exc:
        return REPLIES[type(req)](status="fault", kind="fault", reason=f"CUDA error: {exc}", fatal=True)
    except Exception as exc:  # noqa: BLE001 - report, then let the parent decide
        traceback.print_exc()
        # A CUDA error surfacing outside a launch (e.g. in a later cupy call) is still the kernel's fault.
        cuda = "CUDA" in type(exc).__name__ or "cudaError" in str(exc)
        return REPLIES[type(req)](status="fault" if cuda else "error", kind="fault" if cuda else "worker",
                                  reason=f"{type(exc).__name__}: {exc}", fatal=True)


def main() -> None:
    # Replies go to the real stdout; anything a library prints goes to stderr.
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(reply_fd, "w", buffering=1)
    try:
        worker = Worker()
    except Exception as exc:  # noqa: BLE001 - no GPU, no cupy: tell the parent in one line
        out.write(encode_reply(Reply(status="error", kind="no_gpu", reason=f"GPU worker cannot start: {exc}",
                                     fatal=True)) + "\n")
        return
    for line in sys.stdin:
        if not line.strip():
            continue
        started = time.perf_counter()
        try:
            reply = serve(worker, decode_request(line))
        except ProtocolError as exc:
            reply = Reply(status="error", kind="protocol", reason=str(exc))
        reply.worker_s = time.perf_counter() - started
        out.write(encode_reply(reply) + "\n")
        if reply.fatal:
            return


if __name__ == "__main__":
    main()

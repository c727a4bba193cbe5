"""GpuBackend: one long-lived worker process (tuner.measure.worker) on one GPU.

A candidate that faults or hangs is killed together with its worker, scored as failed with
the reason, and a fresh worker starts: nothing stops the study.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tuner.errors import UserError
from tuner.measure.backend import EvalRequest, Measurement
from tuner.measure.protocol import (
    PROTOCOL_VERSION,
    REPLIES,
    BaselineRequest,
    CandidateSpec,
    CompareReply,
    CompareRequest,
    EvaluateItem,
    EvaluateManyRequest,
    EvaluateRequest,
    HelloReply,
    HelloRequest,
    ItemResult,
    Request,
    decode_reply,
    encode_request,
)
from tuner.measure.regimes import SUSTAINED, RegimeReport
from tuner.space import Shape, Target, target_from_device

# The directory that holds the `tuner` package this process runs (a checkout or site-packages).
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def worker_env(gpu: int | None = None) -> dict[str, str]:
    """The worker's environment: the caller's (CUDA and cupy settings), with this package's root
    first on PYTHONPATH, so that nothing else can stand in for it, and the caller's entries after
    it made absolute (the worker runs in another directory; an empty entry, the working
    directory, is dropped)."""
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    env.setdefault("CUPY_TF32", "0")  # the fp32 reference must be real fp32
    rest = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([PACKAGE_ROOT, *rest]))
    return env


def _absolute(path: str | None) -> str | None:
    """A binary's path as the worker (in its own directory) must be given it."""
    return os.path.abspath(path) if path else path


class GpuBackend:
    """One long-lived worker subprocess on one GPU (CUDA_VISIBLE_DEVICES=gpu if given)."""

    simulated = False
    needs_cubin = True

    def __init__(self, gpu: int | None = None, log_path: Path | None = None):
        self.gpu = gpu
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.replies: queue.Queue = queue.Queue()
        self.restarts = 0
        self.workdir: str | None = None
        self.info: HelloReply = self._start()
        self.target: Target = target_from_device(self.info.props, self.info.name)
        self.name = f"gpu:{self.info.name}" + (f"#{gpu}" if gpu is not None else "")

    def _start(self) -> HelloReply:
        env = worker_env(self.gpu)
        log = open(self.log_path, "a") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        # `python -m` puts the working directory first on sys.path: a `tuner/` planted in the
        # caller's would be imported instead of ours. The worker runs in a fresh, private, empty
        # directory (as the render child does), with our package first on PYTHONPATH.
        self._remove_workdir()
        self.workdir = tempfile.mkdtemp(prefix="hgemm-worker-")
        self.proc = subprocess.Popen([sys.executable, "-m", "tuner.measure.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=self.workdir,
                                     start_new_session=True)
        self.replies = queue.Queue()
        threading.Thread(target=self._reader, args=(self.proc, self.replies), daemon=True).start()
        reply = self._call(HelloRequest(PROTOCOL_VERSION), timeout_s=120)
        if not reply.ok:
            self._kill()
            raise UserError(reply.reason or "GPU worker failed to start")
        return reply

    @staticmethod
    def _reader(proc: subprocess.Popen, replies: queue.Queue) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                replies.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        replies.put(None)  # EOF: the worker died

    def _kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._remove_workdir()

    def _remove_workdir(self) -> None:
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def _call(self, req: Request, timeout_s: float):
        """Send one request; its typed reply, or a fatal one saying how the worker failed."""
        cls: type = REPLIES[type(req)]
        assert self.proc and self.proc.stdin
        try:
            self.proc.stdin.write(encode_request(req) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return cls(status="fault", kind="worker_died", reason="GPU worker is gone", fatal=True)
        try:
            raw = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            self._kill()
            return cls(status="timeout", kind="hang", fatal=True,
                       reason=f"no answer in {timeout_s:.0f} s: kernel hang or worker stuck; worker killed")
        if raw is None:
            code = self.proc.wait()
            return cls(status="fault", kind="worker_died", fatal=True,
                       reason=f"GPU worker exited (code {code}) during the request")
        return decode_reply(cls, raw)

    def _call_restarting(self, req: Request, timeout_s: float):
        reply = self._call(req, timeout_s)
        if reply.fatal:
            self._kill()
            self.restarts += 1
            self._start()
        return reply

    def baseline(self, shape: Shape, accumulate: str = "fp32", mode: str = SUSTAINED) -> dict[str, float]:
        reply = self._call_restarting(BaselineRequest((shape.M, shape.N, shape.K), accumulate, mode), 300)
        if not reply.ok:
            raise UserError(f"cuBLAS baseline failed for {shape}: {reply.reason}")
        return reply.baselines

    def evaluate(self, req: EvalRequest, timeout_s: float = 60.0) -> Measurement:
        start = time.perf_counter()
        assert req.cubin is not None, "a GPU evaluation needs a built binary"
        reply = self._call_restarting(EvaluateRequest(_absolute(req.cubin), (req.shape.M, req.shape.N, req.shape.K),
                                                      req.launch, req.variants, req.accumulate, digest=req.digest,
                                                      mode=req.mode),
                                      timeout_s)
        status = reply.status if reply.status in ("ok", "timeout", "fault") else "failed"
        return Measurement(status=status, kind=reply.kind, reason=reply.reason, times_us=reply.times,
                           baselines_us=reply.baselines, verify=reply.verify, gpu=self.name,
                           seconds=time.perf_counter() - start, gpu_state=reply.gpu_state, clocks=reply.clocks,
                           mode=reply.mode, regime=reply.regime)

    def evaluate_many(self, reqs: list[EvalRequest], timeout_s: float = 60.0) -> list[Measurement]:
        """Several binaries of one shape in one request (worker.evaluate_many): each verified, all
        their variants screened together, the survivors timed with cuBLAS in one section.
        `timeout_s` is per binary. A fault, hang or refusal of the batch as a whole (which
        binary is unknown) measures the binaries one by one instead, so the culprit fails alone."""
        start = time.perf_counter()
        first = reqs[0]
        if any(r.cubin is None for r in reqs) or len({(r.shape, r.accumulate, r.mode) for r in reqs}) > 1:
            raise ValueError("evaluate_many: built binaries of one shape, accumulation and regime only")
        items = [EvaluateItem(_absolute(r.cubin), r.launch, r.variants, r.digest) for r in reqs]  # type: ignore[arg-type]
        reply = self._call_restarting(EvaluateManyRequest((first.shape.M, first.shape.N, first.shape.K), items,
                                                          first.accumulate, first.mode), timeout_s * len(reqs))
        if not reply.ok or len(reply.items) != len(reqs):
            return [self.evaluate(r, timeout_s) for r in reqs]
        seconds = (time.perf_counter() - start) / len(reqs)
        shared = RegimeReport.from_dict(reply.regime, reply.mode)
        shared.batch = len(reqs)
        out = []
        for i, raw in enumerate(reply.items):
            item = ItemResult(**{k: v for k, v in raw.items() if k in ItemResult.__dataclass_fields__})
            status = item.status if item.status in ("ok", "screened") else "failed"
            reason = item.reason
            if status == "screened":
                best = min(item.screen_us.values()) if item.screen_us else None
                reason = (f"screened out: its best variant took {best:.2f} us in the screen of {len(reqs)} binaries,"
                          f" behind the {shared.kept} variants kept" if best else "screened out")
            out.append(Measurement(status=status, kind=item.kind or (status if status == "screened" else None),
                                   reason=reason, times_us=item.times, baselines_us=reply.baselines,
                                   verify=item.verify, gpu=self.name, seconds=seconds, gpu_state=reply.gpu_state,
                                   clocks=reply.clocks, mode=reply.mode,
                                   regime=shared.for_item(f"{i}|").to_dict() if reply.regime else {}))
        return out

    def compare(self, shape: Shape, candidates: dict[str, CandidateSpec], timeout_s: float = 300.0,
                modes: list[str] | None = None, torch: bool = True, autotune: bool = True) -> CompareReply:
        """Verify each candidate, then time all of them and the vendor baselines together, in
        each of `modes` (regimes, default sustained; tuner.measure.regimes). `notes` names every
        baseline that could not be measured. `torch=False` leaves torch.matmul out."""
        candidates = {name: dataclasses.replace(c, binary=_absolute(c.binary)) if isinstance(c, CandidateSpec) else c
                      for name, c in candidates.items()}
        req = CompareRequest((shape.M, shape.N, shape.K), candidates, list(modes or [SUSTAINED]), torch, autotune)
        return self._call_restarting(req, timeout_s)

    def restart(self) -> None:
        """A fresh worker process: new CUDA context, new buffers at new addresses. Repeated
        benchmark runs restart between runs so that one allocation's luck is not every run's."""
        self.close()
        self.info = self._start()

    def close(self) -> None:
        if self.proc and self.proc.stdin:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._kill()
        self._remove_workdir()

"""Backends that turn a compiled candidate into a Measurement.

- GpuBackend: drives a tuner.gpu_worker subprocess on one GPU. A candidate that faults
  or hangs is killed together with its worker, scored as failed with the reason, and
  a fresh worker starts: nothing stops the study.
- ReplayBackend: answers from a file of real GPU measurements (recorded by this
  pipeline), so the search, resume and export run without a GPU. Everything it returns
  is marked simulated; a config that is not in the file is reported as not recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tuner.errors import UserError
from tuner.shapes import Shape
from tuner.target import Target, target_for_arch, target_from_device


@dataclass
class EvalRequest:
    family: str
    config: dict[str, Any]          # compile-time knobs
    shape: Shape
    cubin: str | None
    launch: dict[str, int]
    variants: list[dict[str, Any]]  # run-time knob combinations to time
    accumulate: str = "fp32"        # fp16: verified and timed against cuBLAS in fp16 compute mode


@dataclass
class Measurement:
    status: str                      # ok | failed | fault | timeout | not_recorded
    kind: str | None = None          # failure kind: wrong, out_of_bounds, unwritten, fault, hang, ...
    reason: str | None = None
    times_us: dict[str, float] = field(default_factory=dict)   # variant (JSON) -> us
    baselines_us: dict[str, float] = field(default_factory=dict)
    verify: dict[str, Any] = field(default_factory=dict)
    simulated: bool = False
    gpu: str = ""
    seconds: float = 0.0
    gpu_state: dict[str, Any] = field(default_factory=dict)  # SM clock / power / temperature after timing

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.times_us)

    def best(self) -> tuple[dict[str, Any], float]:
        key = min(self.times_us, key=self.times_us.__getitem__)
        return json.loads(key), self.times_us[key]

    def to_dict(self) -> dict:
        return asdict(self)


def variant_key(variant: dict[str, Any]) -> str:
    return json.dumps(variant, sort_keys=True)


def config_key(family: str, config: dict[str, Any]) -> str:
    return f"{family}:{json.dumps(config, sort_keys=True)}"


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
        info = self._start()
        self.info = info
        self.target: Target = target_from_device(info["props"], info["name"])
        self.name = f"gpu:{info['name']}" + (f"#{gpu}" if gpu is not None else "")

    def _start(self) -> dict:
        env = dict(os.environ)
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        env.setdefault("CUPY_TF32", "0")  # the fp32 reference must be real fp32
        log = open(self.log_path, "a") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "tuner.gpu_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                     start_new_session=True)
        self.replies = queue.Queue()
        threading.Thread(target=self._reader, args=(self.proc, self.replies), daemon=True).start()
        reply = self._call({"op": "hello"}, timeout_s=120)
        if reply.get("status") != "ok":
            self._kill()
            raise UserError(reply.get("reason", "GPU worker failed to start"))
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

    def _call(self, req: dict, timeout_s: float) -> dict:
        assert self.proc and self.proc.stdin
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return {"status": "fault", "kind": "worker_died", "reason": "GPU worker is gone", "fatal": True}
        try:
            reply = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            self._kill()
            return {"status": "timeout", "kind": "hang", "fatal": True,
                    "reason": f"no answer in {timeout_s:.0f} s: kernel hang or worker stuck; worker killed"}
        if reply is None:
            code = self.proc.wait()
            return {"status": "fault", "kind": "worker_died", "fatal": True,
                    "reason": f"GPU worker exited (code {code}) during the request"}
        return reply

    def _call_restarting(self, req: dict, timeout_s: float) -> dict:
        reply = self._call(req, timeout_s)
        if reply.get("fatal"):
            self._kill()
            self.restarts += 1
            self._start()
        return reply

    def baseline(self, shape: Shape, accumulate: str = "fp32") -> dict[str, float]:
        reply = self._call_restarting({"op": "baseline", "shape": [shape.M, shape.N, shape.K],
                                       "accumulate": accumulate}, 300)
        if reply.get("status") != "ok":
            raise UserError(f"cuBLAS baseline failed for {shape}: {reply.get('reason')}")
        return reply["baselines"]

    def evaluate(self, req: EvalRequest, timeout_s: float = 60.0) -> Measurement:
        start = time.perf_counter()
        reply = self._call_restarting({
            "op": "evaluate", "cubin": req.cubin, "shape": [req.shape.M, req.shape.N, req.shape.K],
            "launch": req.launch, "variants": req.variants, "accumulate": req.accumulate}, timeout_s)
        status = reply.get("status", "error")
        return Measurement(
            status="ok" if status == "ok" else ("timeout" if status == "timeout" else
                                                "fault" if status == "fault" else "failed"),
            kind=reply.get("kind"), reason=reply.get("reason"), times_us=reply.get("times", {}),
            baselines_us=reply.get("baselines", {}), verify=reply.get("verify", {}), gpu=self.name,
            seconds=time.perf_counter() - start, gpu_state=reply.get("gpu_state", {}))

    def compare(self, shape: Shape, candidates: dict[str, dict], timeout_s: float = 300.0,
                modes: list[str] | None = None, torch: bool = True) -> dict:
        """Verify each candidate ({name: {cubin, launch, variant}}), then time all of them and the
        vendor baselines together. `modes` (default ["offline"]): offline and/or server; the reply
        has `times` (offline, else the first mode) and `times_by_mode`; `notes` names every
        baseline that could not be measured. `torch=False` leaves torch.matmul out."""
        req: dict[str, Any] = {"op": "compare", "shape": [shape.M, shape.N, shape.K], "candidates": candidates}
        if modes:
            req["modes"] = list(modes)
        if not torch:
            req["torch"] = False
        return self._call_restarting(req, timeout_s)

    def restart(self) -> None:
        """A fresh worker process: new CUDA context, new buffers at new addresses. Repeated
        benchmark runs restart between runs so that one allocation's luck is not every run's."""
        self.close()
        self._start()

    def close(self) -> None:
        if self.proc and self.proc.stdin:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._kill()


class ReplayBackend:
    """Measurements replayed from a JSONL file written by `record_measurement`."""

    simulated = True
    needs_cubin = False

    def __init__(self, path: str | Path, arch: str = "sm_90a"):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"replay file {self.path} not found")
        self.records: dict[tuple[str, str], dict] = {}
        self.baselines: dict[str, dict[str, float]] = {}
        for lineno, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                shape = _replay_key(rec["shape"], rec.get("accumulate", "fp32"))
                if rec.get("type") == "baseline":
                    if not isinstance(rec["baselines_us"]["cublas"], (int, float)):
                        raise TypeError("baselines_us.cublas is not a number")
                    self.baselines[shape] = rec["baselines_us"]
                else:
                    m = rec["measurement"]
                    if not isinstance(m["status"], str) or not isinstance(m.get("times_us", {}), dict):
                        raise TypeError("measurement needs a status and a times_us mapping")
                    for variant in m.get("times_us", {}):
                        json.loads(variant)  # variant keys are JSON objects of run-time knobs
                    self.records[(shape, config_key(rec["family"], rec["config"]))] = rec
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise UserError(f"{self.path}:{lineno}: not a measurement record ({exc})") from None
        self.target = target_for_arch(arch)
        self.name = f"replay:{self.path.name}"
        self.families = {family for _, key in self.records for family in [key.split(":", 1)[0]]}

    def baseline(self, shape: Shape, accumulate: str = "fp32") -> dict[str, float]:
        key = _replay_key(str(shape), accumulate)
        if key not in self.baselines:
            raise UserError(f"replay file {self.path} has no baseline for shape {shape}"
                            + ("" if accumulate == "fp32" else f" with {accumulate} accumulation"))
        return self.baselines[key]

    def evaluate(self, req: EvalRequest, timeout_s: float = 60.0) -> Measurement:
        rec = self.records.get((_replay_key(str(req.shape), req.accumulate), config_key(req.family, req.config)))
        if rec is None:
            return Measurement(status="not_recorded", kind="not_recorded", simulated=True, gpu=self.name,
                               reason="config not recorded in the replay file (no time is invented)")
        m = Measurement(**{k: v for k, v in rec["measurement"].items() if k in Measurement.__dataclass_fields__})
        m.simulated, m.gpu = True, self.name
        return m

    def close(self) -> None:
        pass


def _replay_key(shape: str, accumulate: str) -> str:
    """Replay records of fp16 accumulation answer only fp16 requests (older files hold fp32 only)."""
    return shape if accumulate == "fp32" else f"{shape}/{accumulate}"


def record_measurement(path: Path, req: EvalRequest, m: Measurement) -> None:
    """Append one real measurement to a replay file."""
    rec = {"shape": str(req.shape), "family": req.family, "config": req.config, "measurement": m.to_dict()}
    if req.accumulate != "fp32":
        rec["accumulate"] = req.accumulate
    with open(path, "a") as fh:
        fh.write(json.dumps(rec) + "\n")


def record_baseline(path: Path, shape: Shape, baselines: dict[str, float], accumulate: str = "fp32") -> None:
    rec = {"type": "baseline", "shape": str(shape), "baselines_us": baselines}
    if accumulate != "fp32":
        rec["accumulate"] = accumulate
    with open(path, "a") as fh:
        fh.write(json.dumps(rec) + "\n")


def records_from_study(study) -> list[dict]:
    """Replay records (and one baseline per shape) from the real trials of a study."""
    from tuner.search import NOT_MEASURED  # search imports this module: import here

    skip = (*NOT_MEASURED, "compile_error")  # nothing was measured on a GPU (NOT_MEASURED has not_recorded)
    shape = study.user_attrs.get("shape")
    acc = study.user_attrs.get("accumulate", "fp32")
    tag = {} if acc == "fp32" else {"accumulate": acc}
    out: list[dict] = []
    cublas = []
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        if not t.state.is_finished() or a.get("simulated") or a.get("status") in skip:
            continue
        m = Measurement(status="ok" if a["status"] == "ok" else a["status"], kind=a.get("kind"),
                        reason=a.get("reason"), times_us=a.get("variant_times_us", {}),
                        baselines_us={"cublas": a["cublas_us"]} if a.get("cublas_us") else {},
                        verify=a.get("verify", {}), gpu=a.get("gpu", ""), gpu_state=a.get("gpu_state", {}))
        out.append({"shape": shape, "family": a["family"], "config": a["config"], "measurement": m.to_dict(), **tag})
        if a.get("cublas_us"):
            cublas.append(a["cublas_us"])
    if cublas:
        cublas.sort()
        out.insert(0, {"type": "baseline", "shape": shape, "baselines_us": {"cublas": cublas[len(cublas) // 2]}, **tag})
    return out

"""ReplayBackend: measurements replayed from a JSONL file of real GPU measurements.

Everything it returns is marked simulated; a config that is not in the file is reported as
not recorded (no time is invented). A record carries the clock regime it was measured in
(`clocks`, tuner.measure.clocks) and the timing regime (`regime`: sustained or isolated,
tuner.measure.regimes; its report in the measurement's `regime`): a request in one timing
regime is answered only by records of that regime. Files written before either load as
sustained (the older offline timing), with no clock record ({}) and steady state unknown.
`record_measurement` and `record_baseline` write the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from tuner.errors import UserError
from tuner.measure.backend import EvalRequest, Measurement, config_key
from tuner.measure.regimes import SUSTAINED, canonical
from tuner.space import Shape, target_for_arch


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
        try:
            raw = self.path.read_bytes()
        except OSError as exc:
            raise UserError(f"cannot read replay file {self.path}: {exc.strerror or exc}") from None
        if raw.startswith(b"SQLite format 3\x00"):
            raise UserError(f"{self.path}: a SQLite database, not a replay file (JSON lines of recorded "
                            "measurements; `hgemm-tune record` writes one from a storage)")
        for lineno, bline in enumerate(raw.splitlines(), 1):
            try:
                line = bline.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(f"{self.path}:{lineno}: not UTF-8 text (byte 0x{bline[exc.start]:02x} at column "
                                f"{exc.start + 1}); a replay file is JSON lines") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                regime = canonical(rec.get("regime", SUSTAINED))  # older files: sustained (offline) only
                shape = _replay_key(rec["shape"], rec.get("accumulate", "fp32"), regime)
                if rec.get("type") == "baseline":
                    if not isinstance(rec["baselines_us"]["cublas"], (int, float)):
                        raise TypeError("baselines_us.cublas is not a number")
                    self.baselines[shape] = rec["baselines_us"]
                else:
                    m = rec["measurement"]
                    if not isinstance(m["status"], str) or not isinstance(m.get("times_us", {}), dict):
                        raise TypeError("measurement needs a status and a times_us mapping")
                    if not isinstance(m.get("clocks", {}), dict):
                        raise TypeError("measurement clocks is not a mapping")
                    if not isinstance(m.get("regime", {}), dict):
                        raise TypeError("measurement regime is not a mapping")
                    for variant in m.get("times_us", {}):
                        json.loads(variant)  # variant keys are JSON objects of run-time knobs
                    self.records[(shape, config_key(rec["family"], rec["config"]))] = rec
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise UserError(f"{self.path}:{lineno}: not a measurement record ({exc})") from None
        self.target = target_for_arch(arch)
        self.name = f"replay:{self.path.name}"
        self.families = {family for _, key in self.records for family in [key.split(":", 1)[0]]}

    def baseline(self, shape: Shape, accumulate: str = "fp32", mode: str = SUSTAINED) -> dict[str, float]:
        mode = canonical(mode)
        key = _replay_key(str(shape), accumulate, mode)
        if key not in self.baselines:
            raise UserError(f"replay file {self.path} has no baseline for shape {shape}"
                            + ("" if accumulate == "fp32" else f" with {accumulate} accumulation")
                            + ("" if mode == SUSTAINED else f" in the {mode} regime"))
        return self.baselines[key]

    def evaluate(self, req: EvalRequest, timeout_s: float = 60.0) -> Measurement:
        mode = canonical(req.mode)
        rec = self.records.get((_replay_key(str(req.shape), req.accumulate, mode), config_key(req.family, req.config)))
        if rec is None:
            return Measurement(status="not_recorded", kind="not_recorded", simulated=True, gpu=self.name, mode=mode,
                               reason="config not recorded in the replay file"
                                      + ("" if mode == SUSTAINED else f" in the {mode} regime")
                                      + " (no time is invented)")
        m = Measurement(**{k: v for k, v in rec["measurement"].items() if k in Measurement.__dataclass_fields__})
        m.simulated, m.gpu, m.mode = True, self.name, mode
        return m

    def close(self) -> None:
        pass


def _replay_key(shape: str, accumulate: str, mode: str = SUSTAINED) -> str:
    """Replay records of fp16 accumulation answer only fp16 requests, and records of one timing
    regime only requests in it (older files hold fp32, sustained only)."""
    key = shape if accumulate == "fp32" else f"{shape}/{accumulate}"
    return key if mode == SUSTAINED else f"{key}@{mode}"


def record_measurement(path: Path, req: EvalRequest, m: Measurement) -> None:
    """Append one real measurement to a replay file."""
    rec = {"shape": str(req.shape), "family": req.family, "config": req.config, "measurement": m.to_dict()}
    if req.accumulate != "fp32":
        rec["accumulate"] = req.accumulate
    if canonical(req.mode) != SUSTAINED:
        rec["regime"] = canonical(req.mode)
    with open(path, "a") as fh:
        fh.write(json.dumps(rec) + "\n")


def record_baseline(path: Path, shape: Shape, baselines: dict[str, float], accumulate: str = "fp32",
                    mode: str = SUSTAINED) -> None:
    rec = {"type": "baseline", "shape": str(shape), "baselines_us": baselines}
    if accumulate != "fp32":
        rec["accumulate"] = accumulate
    if canonical(mode) != SUSTAINED:
        rec["regime"] = canonical(mode)
    with open(path, "a") as fh:
        fh.write(json.dumps(rec) + "\n")

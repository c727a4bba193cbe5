"""What the search asks of a measuring backend, and what comes back.

A backend turns a built kernel into a Measurement: `GpuBackend` (tuner.measure.gpu) drives a
worker process on one GPU; `ReplayBackend` (tuner.measure.replay) answers from a file of real
measurements, so the search, resume, sweep and export run without a GPU (labelled simulated).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from tuner.measure.protocol import CandidateSpec, LaunchSpec
from tuner.measure.regimes import SUSTAINED
from tuner.space import Family, Shape, Target


@dataclass
class EvalRequest:
    family: str
    config: dict[str, Any]          # compile-time knobs
    shape: Shape
    cubin: str | None               # the built binary (a .cubin or a library .so); None for replay
    launch: LaunchSpec
    variants: list[dict[str, Any]]  # run-time knob combinations to time
    accumulate: str = "fp32"        # fp16: verified and timed against cuBLAS in fp16 compute mode
    digest: str | None = None       # the binary's sha256 when it was built (checked before it is loaded)
    mode: str = SUSTAINED           # the timing regime (tuner.measure.regimes): the search's objective


@dataclass
class Measurement:
    # screened: verified, and a batch's shared screen kept none of its variants (regime screen_us)
    status: str                      # ok | screened | failed | fault | timeout | not_recorded
    kind: str | None = None          # failure kind: wrong, out_of_bounds, unwritten, fault, hang, ...
    reason: str | None = None
    times_us: dict[str, float] = field(default_factory=dict)   # variant (JSON) -> us
    baselines_us: dict[str, float] = field(default_factory=dict)
    verify: dict[str, Any] = field(default_factory=dict)
    simulated: bool = False
    gpu: str = ""
    seconds: float = 0.0
    gpu_state: dict[str, Any] = field(default_factory=dict)  # SM clock / power / temperature after timing
    # The clock regime while it was timed (tuner.measure.clocks record); {} from older replay files.
    clocks: dict[str, Any] = field(default_factory=dict)
    mode: str = SUSTAINED           # the timing regime of times_us and baselines_us
    # How that regime's timing went (RegimeReport.to_dict(): steady state, energy); {} when unknown.
    regime: dict[str, Any] = field(default_factory=dict)

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


class Backend(Protocol):
    """The verbs the search, confirm and bench use. `compare` and `restart` exist where real
    kernels run (GpuBackend); a simulated backend has neither."""

    name: str
    target: Target
    simulated: bool    # replayed measurements: labelled everywhere they appear
    needs_cubin: bool  # False: nothing is compiled (the replay backend answers by config)

    def baseline(self, shape: Shape, accumulate: str = "fp32", mode: str = SUSTAINED) -> dict[str, float]: ...

    def evaluate(self, req: EvalRequest, timeout_s: float = 60.0) -> Measurement: ...

    def close(self) -> None: ...


def evaluate_many(backend: Backend, reqs: list[EvalRequest], timeout_s: float = 60.0) -> list[Measurement]:
    """Several binaries of one shape: in one shared screen and section where the backend can
    (GpuBackend.evaluate_many), else one by one (the replay backend answers per config)."""
    many = getattr(backend, "evaluate_many", None)
    if many is not None and len(reqs) > 1:
        return many(reqs, timeout_s=timeout_s)
    return [backend.evaluate(r, timeout_s=timeout_s) for r in reqs]


def launch_spec(fam: Family, config: dict[str, Any], shape: Shape, target: Target) -> LaunchSpec:
    """How the GPU worker launches this family's binary: a cubin's 1-D geometry, or, for a
    library, only the SM count its persistent scheduler sizes the grid by."""
    launch = fam.launch_geometry(config, shape, target)
    if launch is None:
        return LaunchSpec(artifact="library", sm_count=target.sm_count)
    return LaunchSpec(artifact="cubin", grid=launch.grid, block=launch.block, smem=launch.smem)


def candidate_spec(fam: Family, config: dict[str, Any], shape: Shape, target: Target, binary: str,
                   digest: str | None, pdl: bool = False) -> CandidateSpec:
    """One candidate of `GpuBackend.compare`: the built binary of a full config, how to launch
    it on `shape`, and the run-time knobs it runs with."""
    spec = launch_spec(fam, config, shape, target)
    return CandidateSpec(binary, LaunchSpec(**(asdict(spec) | {"pdl": pdl})), fam.runtime_config(config), digest)

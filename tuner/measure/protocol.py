"""The messages between the tuner and its GPU worker, one JSON object per line each way.

Requests carry shapes, file paths and knobs, never device objects (the worker is another
process, and may die). Every reply has a status; `fatal` means the worker exits after it
(a fault poisons its CUDA context) and the parent starts a fresh one. `HelloRequest`
carries the protocol version: a worker of another version refuses to serve.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tuner.measure.regimes import ALIASES, REGIMES, SUSTAINED, RegimeReport

# 4: clock records (clocks, clocks_by_mode). 5: the named regimes (sustained, isolated) replace
# offline and server; evaluate and baseline take a regime; replies carry each regime's report.
# 6: evaluate_many, several binaries of one shape verified, screened together and timed in one section.
PROTOCOL_VERSION = 6
MODES = REGIMES


@dataclass(frozen=True)
class LaunchSpec:
    """How the worker launches a built binary: a cubin's 1-D geometry, or, for a library
    family, only the SM count its persistent scheduler sizes the grid by."""

    artifact: str = "cubin"  # cubin | library
    grid: int = 0
    block: int = 0
    smem: int = 0
    sm_count: int = 0
    pdl: bool = False        # library kernels: programmatic dependent launch (cubins ignore it)


@dataclass(frozen=True)
class CandidateSpec:
    """One kernel to verify and time: its binary, its launch and the run-time knobs it runs with."""

    binary: str
    launch: LaunchSpec
    variant: dict[str, Any] = field(default_factory=dict)
    digest: str | None = None  # sha256 recorded when the binary was built; the worker loads nothing else


@dataclass(frozen=True)
class HelloRequest:
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class BaselineRequest:
    shape: tuple[int, int, int]
    accumulate: str = "fp32"
    mode: str = SUSTAINED       # the regime cuBLAS is timed in (tuner.measure.regimes)


@dataclass(frozen=True)
class EvaluateRequest:
    """Verify one binary at every run-time variant, then time them all against cuBLAS."""

    binary: str
    shape: tuple[int, int, int]
    launch: LaunchSpec
    variants: list[dict[str, Any]]
    accumulate: str = "fp32"
    time: bool = True         # False: verify only
    digest: str | None = None  # sha256 recorded when the binary was built; the worker loads nothing else
    mode: str = SUSTAINED       # the regime the variants and cuBLAS are timed in: the search's objective


@dataclass(frozen=True)
class EvaluateItem:
    """One binary of an EvaluateManyRequest, with the run-time variants to time it at."""

    binary: str
    launch: LaunchSpec
    variants: list[dict[str, Any]]
    digest: str | None = None


@dataclass(frozen=True)
class EvaluateManyRequest:
    """Verify several binaries of one shape (each at every run-time variant), then screen all
    their variants together and time the survivors against cuBLAS in one section: a batch of
    search trials that costs one screen and one steady stage instead of one of each per binary."""

    shape: tuple[int, int, int]
    items: list[EvaluateItem]
    accumulate: str = "fp32"
    mode: str = SUSTAINED


@dataclass(frozen=True)
class CompareRequest:
    """Verify each candidate, then time them with every vendor baseline in each regime."""

    shape: tuple[int, int, int]
    candidates: dict[str, CandidateSpec]
    modes: list[str] = field(default_factory=lambda: [SUSTAINED])  # regimes (tuner.measure.regimes)
    torch: bool = True
    autotune: bool = True  # False: no cuBLASLt-auto (its top-16 autotuning), e.g. outside a grid's sample


Request = HelloRequest | BaselineRequest | EvaluateRequest | EvaluateManyRequest | CompareRequest
OPS: dict[str, type] = {"hello": HelloRequest, "baseline": BaselineRequest, "evaluate": EvaluateRequest,
                        "evaluate_many": EvaluateManyRequest, "compare": CompareRequest}


@dataclass
class Reply:
    status: str = "ok"         # ok | failed | fault | timeout | error
    kind: str | None = None    # failure kind: wrong, out_of_bounds, unwritten, fault, hang, worker_died, ...
    reason: str | None = None
    fatal: bool = False        # the worker is gone (or exits now): the parent restarts it
    worker_s: float = 0.0      # seconds the worker spent on the request

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class HelloReply(Reply):
    version: int = 0
    name: str = ""
    props: dict[str, int] = field(default_factory=dict)  # cudaGetDeviceProperties fields the tuner uses
    cupy: str = ""
    cuda_runtime: int = 0
    driver: int = 0
    visible_devices: str = ""


@dataclass
class BaselineReply(Reply):
    baselines: dict[str, float] = field(default_factory=dict)
    clocks: dict[str, Any] = field(default_factory=dict)          # tuner.measure.clocks record of the timing
    regime: dict[str, Any] = field(default_factory=dict)          # RegimeReport.to_dict() of the timing


@dataclass
class EvaluateReply(Reply):
    times: dict[str, float] = field(default_factory=dict)       # variant (JSON) -> us
    baselines: dict[str, float] = field(default_factory=dict)
    verify: dict[str, Any] = field(default_factory=dict)
    # SM clock, power, throttle reasons and energy while the variants and cuBLAS were timed:
    # a tuner.measure.clocks record ({"available": false, "reason": ...} without NVML).
    clocks: dict[str, Any] = field(default_factory=dict)
    gpu_state: dict[str, Any] = field(default_factory=dict)     # older summary of `clocks` (SM, power, temp)
    mode: str = SUSTAINED                                        # the regime `times` were taken in
    regime: dict[str, Any] = field(default_factory=dict)        # its RegimeReport.to_dict(): steady, energy


@dataclass
class ItemResult:
    """One binary's part of an EvaluateManyReply. status "screened": verified, and every one of its
    variants was left behind by the shared screen (`screen_us` has their screen times); "ok": at
    least one variant went on to the steady stage (`times`)."""

    status: str = "ok"         # ok | screened | failed
    kind: str | None = None
    reason: str | None = None
    verify: dict[str, Any] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)       # variant (JSON) -> us, steady stage
    screen_us: dict[str, float] = field(default_factory=dict)   # variant (JSON) -> us, the screen's


@dataclass
class EvaluateManyReply(Reply):
    items: list[dict[str, Any]] = field(default_factory=list)   # ItemResult as dicts, in request order
    baselines: dict[str, float] = field(default_factory=dict)
    clocks: dict[str, Any] = field(default_factory=dict)
    gpu_state: dict[str, Any] = field(default_factory=dict)
    mode: str = SUSTAINED
    regime: dict[str, Any] = field(default_factory=dict)        # the shared section's RegimeReport.to_dict()


@dataclass
class CompareReply(Reply):
    modes: list[str] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)        # sustained if timed, else the first regime
    times_by_mode: dict[str, dict[str, float]] = field(default_factory=dict)
    verify: dict[str, dict[str, Any]] = field(default_factory=dict)  # candidate -> its verification report
    clocks: dict[str, Any] = field(default_factory=dict)         # the clock record of `times`' mode
    clocks_by_mode: dict[str, dict[str, Any]] = field(default_factory=dict)  # mode -> tuner.measure.clocks record
    gpu_state: dict[str, Any] = field(default_factory=dict)
    gpu_state_by_mode: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)          # baselines not measured, how torch was timed
    # regime -> RegimeReport.to_dict(): rounds, warm-up, steady state, each contender's energy
    regimes_by_mode: dict[str, dict[str, Any]] = field(default_factory=dict)

    @staticmethod
    def _in(by_mode: dict[str, Any], mode: str) -> Any:
        """`by_mode[mode]` under the regime's name or its older alias (offline, server)."""
        key = ALIASES.get(mode, mode)
        if key in by_mode:
            return by_mode[key]
        return next((v for old, v in by_mode.items() if ALIASES.get(old) == key), None)

    def times_in(self, mode: str) -> dict[str, float]:
        if not self.times_by_mode and ALIASES.get(mode, mode) == SUSTAINED:
            return self.times  # a reply of sustained (offline) timing only
        return self._in(self.times_by_mode, mode) or {}

    def clocks_in(self, mode: str) -> dict[str, Any]:
        """The clock record of one regime's timing ({} where the worker sent none: an older reply)."""
        if not self.clocks_by_mode and ALIASES.get(mode, mode) == SUSTAINED:
            return self.clocks
        return self._in(self.clocks_by_mode, mode) or {}

    def regime_in(self, mode: str) -> RegimeReport:
        """How one regime's timing went (steady unknown where the worker sent no report)."""
        key = ALIASES.get(mode, mode)
        return RegimeReport.from_dict(self._in(self.regimes_by_mode, mode), key)


REPLIES: dict[type, type] = {HelloRequest: HelloReply, BaselineRequest: BaselineReply,
                             EvaluateRequest: EvaluateReply, EvaluateManyRequest: EvaluateManyReply,
                             CompareRequest: CompareReply}
R = TypeVar("R", bound=Reply)


class ProtocolError(ValueError):
    """A line that is not a message of this protocol."""


def encode_request(req: Request) -> str:
    op = next(name for name, cls in OPS.items() if isinstance(req, cls))
    return json.dumps({"op": op, **dataclasses.asdict(req)})


def decode_request(line: str) -> Request:
    try:
        raw = json.loads(line)
        cls = OPS[raw.pop("op")]
        if cls is EvaluateRequest:
            raw["launch"] = LaunchSpec(**raw["launch"])
        elif cls is EvaluateManyRequest:
            raw["items"] = [EvaluateItem(i["binary"], LaunchSpec(**i["launch"]), list(i["variants"]), i.get("digest"))
                            for i in raw["items"]]
        elif cls is CompareRequest:
            raw["candidates"] = {name: CandidateSpec(c["binary"], LaunchSpec(**c["launch"]), c.get("variant", {}),
                                                     c.get("digest"))
                                 for name, c in raw["candidates"].items()}
        if "shape" in raw:
            raw["shape"] = tuple(int(d) for d in raw["shape"])
        return cls(**raw)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"not a request: {type(exc).__name__}: {exc}") from None


def encode_reply(reply: Reply) -> str:
    return json.dumps(dataclasses.asdict(reply))


def decode_reply(cls: type[R], raw: dict[str, Any]) -> R:
    """A reply of the type the request expects; fields it does not know are dropped, so that
    an error reply (status, kind, reason) decodes as any reply type."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in raw.items() if k in names})

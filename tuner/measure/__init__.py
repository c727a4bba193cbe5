"""Measure: verify a built kernel and time it against the vendor libraries, on a GPU worker
process (GpuBackend) or from recorded measurements (ReplayBackend).

The parent side (backends, protocol) imports no GPU library; the worker side (worker,
timing, verify, vendors, candidates, buffers) runs in the worker process with cupy."""

from tuner.measure.backend import (
    Backend,
    EvalRequest,
    Measurement,
    candidate_spec,
    config_key,
    evaluate_many,
    launch_spec,
    variant_key,
)
from tuner.measure.gpu import GpuBackend
from tuner.measure.protocol import CandidateSpec, CompareReply, LaunchSpec
from tuner.measure.replay import ReplayBackend, record_baseline, record_measurement

__all__ = [
    "Backend", "CandidateSpec", "CompareReply", "EvalRequest", "GpuBackend", "LaunchSpec", "Measurement",
    "ReplayBackend", "candidate_spec", "config_key", "evaluate_many", "launch_spec", "record_baseline",
    "record_measurement", "variant_key",
]

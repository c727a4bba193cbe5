"""Runtime: run exported kernels from Python (`tuner.load`). Needs cupy, nvcc and the CUTLASS
headers where it runs (kernels are built on first use); never Optuna or the search."""

from tuner.runtime.loader import Gemm, load

__all__ = ["Gemm", "load"]

"""hgemm-tune: find, verify and export the fastest fp16 GEMM kernel per shape.

The library's entry points live in `tuner.api` (tune_shape, sweep, confirm, bench); `load`
runs exported kernels. Importing `tuner` itself loads nothing else: each stage package
(space, build, measure, search, results, runtime) is imported where it is used.
"""

from tuner.version import __version__

__all__ = ["__version__", "load"]


def load(path, space_file=None, accumulate="fp32", pdl=False):
    """`gemm = load("best.json"); C = gemm(A, B)`: run exported kernels (see tuner.runtime.loader.load)."""
    from tuner.runtime import loader

    return loader.load(path, space_file, accumulate, pdl)

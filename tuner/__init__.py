"""hgemm-tune: find, verify and export the fastest fp16 GEMM kernel per shape."""

__version__ = "0.1.0"


def load(path, space_file=None, accumulate="fp32"):
    """`gemm = load("best.json"); C = gemm(A, B)`: run exported kernels (see tuner.loader.load)."""
    from tuner import loader

    return loader.load(path, space_file or loader.DEFAULT_SPACE, accumulate)

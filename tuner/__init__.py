"""hgemm-tune: find, verify and export the fastest fp16 GEMM kernel per shape."""

__version__ = "0.1.0"


def load(path, space_file=None):
    """`gemm = load("best.json"); C = gemm(A, B)`: run exported kernels (see tuner.loader)."""
    from tuner.loader import DEFAULT_SPACE, Gemm

    return Gemm(path, space_file or DEFAULT_SPACE)

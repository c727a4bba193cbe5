"""hgemm-tune: find, verify and export the fastest fp16 GEMM kernel per shape."""

__version__ = "0.1.0"

"""Build: a config of a family -> CUDA source (Jinja2 sandbox) -> cubin or shared library (nvcc),
content-addressed and cached, in a pool of compile jobs; SASS checks on what was built."""

from tuner.build.compile import (
    CompilePool,
    CompileResult,
    cache_key,
    compile_source,
    cutlass_include,
    cutlass_version,
    nvcc_flags,
    nvcc_path,
    nvcc_version,
)
from tuner.build.render import RenderError, render, source_hash, template_hash, template_vars

__all__ = [
    "CompilePool", "CompileResult", "RenderError", "cache_key", "compile_source", "cutlass_include",
    "cutlass_version", "nvcc_flags", "nvcc_path", "nvcc_version", "render", "source_hash", "template_hash",
    "template_vars",
]

"""Shared fixtures. GPU tests are marked `gpu` and skip with the reason when no GPU is present."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"


def _gpu_reason() -> str | None:
    try:
        import cupy
    except ImportError:
        return "cupy is not installed (pip install 'hgemm-tune[gpu]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:  # noqa: BLE001 - any CUDA failure means no usable GPU
        return f"no usable CUDA device ({type(exc).__name__})"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_reason = _gpu_reason() if any("gpu" in item.keywords for item in items) else None
    nvcc_missing = shutil.which("nvcc") is None
    for item in items:
        if "gpu" in item.keywords and gpu_reason:
            item.add_marker(pytest.mark.skip(reason=f"needs a GPU: {gpu_reason}"))
        if "nvcc" in item.keywords and nvcc_missing:
            item.add_marker(pytest.mark.skip(reason="nvcc is not on PATH"))


@pytest.fixture
def space():
    from tuner.space import load_space

    return load_space(ROOT / "space.yaml")


@pytest.fixture
def h200():
    from tuner.space import target_for_arch

    return target_for_arch("sm_90a")

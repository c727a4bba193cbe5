"""The random check's error bound (CPU: the bound is plain arithmetic, checked against a
numpy model of an fp16-accumulating MMA kernel)."""

from __future__ import annotations

import numpy as np
import pytest

from tuner.measure.verify import MMA_K, random_tolerance


def fp16_accumulate(a: np.ndarray, b: np.ndarray, skip_step: int | None = None) -> np.ndarray:
    """C = A B^T as an fp16-accumulating tensor-core kernel computes it: each 16-deep MMA step
    is summed exactly, then added into an fp16 accumulator (one rounding per step)."""
    acc = np.zeros((a.shape[0], b.shape[0]), np.float16)
    for step, k in enumerate(range(0, a.shape[1], MMA_K)):
        if step == skip_step:
            continue
        part = a[:, k:k + MMA_K].astype(np.float64) @ b[:, k:k + MMA_K].astype(np.float64).T
        acc = (acc.astype(np.float64) + part).astype(np.float16)
    return acc


def rel_errors(c: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    diff = c.astype(np.float64) - ref
    return float(np.linalg.norm(diff) / np.linalg.norm(ref)), float(np.abs(diff).max() / np.abs(ref).max())


def test_fp32_bound_is_a_factor_of_cublas():
    assert random_tolerance(1e-3, 2e-3, 4096, "fp32") == (2e-3, 8e-3)
    # cuBLAS bit-exact on a tiny K: the floor, not zero
    assert random_tolerance(0.0, 0.0, 16, "fp32") == (2.0 ** -11, 2.0 ** -9)


@pytest.mark.parametrize("K", [1000, 4096])
def test_fp16_bound_admits_fp16_accumulation_and_rejects_a_skipped_k_step(K):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, K)).astype(np.float16)
    b = rng.standard_normal((48, K)).astype(np.float16)
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    # A cuBLAS whose fp16 mode is more precise than a plain fp16 accumulator (as measured on
    # the H200): its error is that of fp32 accumulation rounded once to fp16.
    cublas_rel, cublas_max = rel_errors(ref.astype(np.float16), ref)
    tol_rel, tol_max = random_tolerance(cublas_rel, cublas_max, K, "fp16")

    good_rel, good_max = rel_errors(fp16_accumulate(a, b), ref)
    assert good_rel <= tol_rel and good_max <= tol_max
    # The same kernel would fail the fp32-accumulation bound: the model is what admits it.
    assert good_rel > random_tolerance(cublas_rel, cublas_max, K, "fp32")[0]

    bad_rel, _ = rel_errors(fp16_accumulate(a, b, skip_step=K // MMA_K // 2), ref)
    assert bad_rel > tol_rel


def test_h200_measurement_passes_fp16_but_not_fp32():
    """The numbers of the failing H200 run (512x384x4096, fp16 accumulation)."""
    rel, worst, cublas_rel, cublas_max = 0.00235, 0.00521, 0.00112, 0.00162
    tol_rel, tol_max = random_tolerance(cublas_rel, cublas_max, 4096, "fp16")
    assert rel <= tol_rel and worst <= tol_max
    assert rel > random_tolerance(cublas_rel, cublas_max, 4096, "fp32")[0]

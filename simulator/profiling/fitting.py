"""Least-squares fitting shared by the profiling scripts (they run in different
environments, each with numpy)."""

from __future__ import annotations

import numpy as np


def fit(rows: list[list[float]], times: list[float]) -> tuple[list[float], float]:
    """Least squares on relative error (each point weighted by 1/time, so short steps count
    as much as long ones); negative coefficients are dropped to 0. Returns the coefficients
    and the largest relative error of the fit."""
    weights = 1 / np.array(times)
    coefficients, *_ = np.linalg.lstsq(np.array(rows) * weights[:, None],
                                       np.array(times) * weights, rcond=None)
    kept = [max(0.0, float(c)) for c in coefficients]
    error = max(abs(float(np.dot(row, kept)) - t) / t for row, t in zip(rows, times, strict=True))
    return kept, error

"""Fitting measured collective times to the alpha-beta model and to efficiency curves (numpy only).

The measuring is done by ``moe_compile.tools.calibrate`` (a torchrun command); this module only turns
(size, time) samples into the numbers a :class:`Topology` holds.

Model (HierMoE Eq. 1, fitted by least squares as in its Section V-B): one collective over a level's
group of g ranks takes

    t = alpha_s + x * beta_s_per_byte,      x = n * (g - 1) / g

where n is the collective's buffer on one rank (the all-to-all send buffer, own share included --
HierMoE's n_a2a of Eq. 2, 4, 5 and HybridEP's D; the all-gather output) and x the bytes of it that
leave the rank over the level's link (HybridEP Eq. 3: V = D (g-1)/g; MoNTA Eq. 8-9: I (e-1)/e).
So ``beta_s_per_byte`` is the time per byte crossing the link, ``1 / beta`` the link bandwidth one
rank gets while every group of the level communicates at once -- the meaning ``Topology`` gives
``bandwidth_gbps``.  HierMoE's own Fig. 9 betas are per byte of n: ``beta_paper = beta * (g-1)/g``.
(g = 1 moves nothing over a link; there x = n, the cost of the local copy.)

Efficiency (MoNTA Eq. 8-9, Fig. 13): r(n) is the fraction of a reference link bandwidth
B = 1 / beta_ref a collective reaches at buffer size n: ``t(n) = x(n) / (B * r(n))``, hence
``r(n) = x(n) * beta_ref / t_measured(n)``.  MoNTA's B is the hardware's line rate; calibration's is
the fitted beta of the level's all-to-all, so r -> 1 for large all-to-all messages and r -> 0 where
the start-up time dominates.

Assumptions: times are wall-clock seconds agreed across ranks (the slowest rank's), sizes are exact
byte counts; nothing here checks that the samples came from one collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moe_compile.cost.topology import EfficiencyCurve


def link_fraction(group_size: int) -> float:
    """Share of a collective's per-rank buffer that leaves the rank: (g-1)/g, or 1 for g = 1."""
    if group_size < 1:
        raise ValueError(f"a group has at least one rank, got {group_size}")
    return (group_size - 1) / group_size if group_size > 1 else 1.0


def fit_alpha_beta(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares fit of ``t = alpha_s + n * beta_s_per_byte`` (HierMoE Eq. 1, Section V-B) with
    alpha, beta >= 0 (``scipy.optimize.nnls``): a start-up time or a cost per byte below zero has no
    meaning, and noisy small-message times (an all-gather's, often) otherwise fit a negative alpha.

    Returns ``(alpha_s, beta_s_per_byte, r2)`` where r2 is the coefficient of determination
    (1.0 for a perfect fit, also when every time is equal and the fit reproduces them)."""
    n = np.asarray(sizes_bytes, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    if n.ndim != 1 or n.shape != t.shape:
        raise ValueError(f"sizes_bytes and times_s must be equally long 1-d sequences, got shapes {n.shape} and {t.shape}")
    if not (np.all(np.isfinite(n)) and np.all(np.isfinite(t))):
        raise ValueError("fit_alpha_beta: sizes and times must be finite numbers")
    if np.unique(n).size < 2:
        raise ValueError("fit_alpha_beta needs samples at two or more distinct sizes to separate alpha from beta")
    design = np.stack([np.ones_like(n), n], axis=1)
    scale = np.array([1.0, n.max()])  # columns of one magnitude for the solver
    from scipy.optimize import nnls  # here, not with the module: see netmoe._balanced_assignment

    (alpha, beta_scaled), _ = nnls(design / scale, t)
    beta = beta_scaled / scale[1]
    residual = t - design @ np.array([alpha, beta])
    ss_res = float(residual @ residual)
    ss_tot = float(((t - t.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return float(alpha), float(beta), r2


def fit_expert_compute(flops: Sequence[float], row_bytes: Sequence[float],
                       times_s: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares fit of the expert op's time ``t = flops / F + row_bytes / R`` (both rates > 0,
    ``scipy.optimize.nnls`` on the inverse rates) to runs of the op at shapes that vary its matmul
    FLOPs and its (token, expert) row bytes independently (``tools.calibrate.measure_expert_compute``).
    ``F`` is the rate of its matmuls, ``R`` the rate of the work on whole H-wide rows (gather,
    weighting, scatter-add into the tokens) that a slice of the FFN columns does not shrink
    (HEXA-MoE's model-centric mode computes S times the rows on F / S columns, Section 4.3).

    Returns ``(F, R, r2)``; a fit that finds no cost for one term (the shapes did not separate them,
    or the times are noise) is an error naming it."""
    a = np.asarray(flops, dtype=np.float64)
    b = np.asarray(row_bytes, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    if not (a.ndim == 1 and a.shape == b.shape == t.shape and a.size >= 2):
        raise ValueError("fit_expert_compute: flops, row_bytes and times_s must be equally long 1-d sequences "
                         "of two or more runs")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b)) and np.all(np.isfinite(t))) or np.any(t <= 0):
        raise ValueError("fit_expert_compute: FLOPs and bytes must be finite and times positive")
    design = np.stack([a, b], axis=1)
    scale = design.max(axis=0)
    if np.any(scale <= 0) or np.linalg.matrix_rank(design / scale) < 2:
        raise ValueError("fit_expert_compute needs runs whose FLOPs and row bytes vary independently")
    from scipy.optimize import nnls  # here, not with the module: see netmoe._balanced_assignment

    coef, _ = nnls(design / scale, t)
    per_flop, per_byte = coef / scale
    for value, what in ((per_flop, "matmul FLOPs"), (per_byte, "row bytes")):
        if value <= 0:
            raise ValueError(f"fit_expert_compute: the runs show no cost for the {what} (times {t.tolist()}); "
                             "time larger shapes or more repetitions")
    residual = t - design @ np.array([per_flop, per_byte])
    ss_res, ss_tot = float(residual @ residual), float(((t - t.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return float(1.0 / per_flop), float(1.0 / per_byte), r2


def fit_collective(buffer_bytes: Sequence[float], times_s: Sequence[float],
                   group_size: int) -> tuple[float, float, float]:
    """:func:`fit_alpha_beta` against the bytes leaving each rank, ``n * (g-1)/g`` (module docstring):
    ``(alpha_s, beta_s_per_byte of the link, r2)``.  r2 is the same as for a fit against n."""
    frac = link_fraction(group_size)
    return fit_alpha_beta([n * frac for n in buffer_bytes], times_s)


def efficiency_curve(buffer_bytes: Sequence[float], times_s: Sequence[float], beta_ref_s_per_byte: float,
                     moved_fraction: float = 1.0) -> EfficiencyCurve:
    """MoNTA's r(n) from measured times: ``r(n) = n * moved_fraction * beta_ref / t(n)``, n the
    buffer size (the curve's x axis, as MoNTA looks r up), ``moved_fraction`` the share of it that
    crosses the reference link (:func:`link_fraction`).

    Samples are sorted by size; repeated sizes keep their median time, so the curve's sizes are
    strictly increasing as :class:`EfficiencyCurve` requires."""
    if beta_ref_s_per_byte <= 0:
        raise ValueError(f"efficiency_curve: the reference beta must be > 0 seconds per byte, got {beta_ref_s_per_byte}")
    n = np.asarray(buffer_bytes, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    if n.ndim != 1 or n.shape != t.shape or n.size == 0:
        raise ValueError("efficiency_curve: sizes and times must be equally long, non-empty 1-d sequences")
    if np.any(t <= 0) or np.any(n <= 0):
        raise ValueError("efficiency_curve: sizes and times must be positive")
    unique_n = np.unique(n)
    median_t = np.array([np.median(t[n == size]) for size in unique_n])
    values = unique_n * moved_fraction * beta_ref_s_per_byte / median_t
    return EfficiencyCurve(tuple(float(x) for x in unique_n), tuple(float(v) for v in values))


def message_sizes(min_bytes: int, max_bytes: int, steps: int, multiple_of: int = 1) -> list[int]:
    """``steps`` sizes spaced geometrically from ``min_bytes`` to ``max_bytes``, each rounded to a
    multiple of ``multiple_of`` (a collective's buffer must split evenly over its group and its
    element size); duplicates after rounding are dropped."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(f"message sizes need 1 <= min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
    if steps < 2:
        raise ValueError(f"at least 2 message sizes are needed to fit alpha and beta, got steps={steps}")
    raw = np.geomspace(min_bytes, max_bytes, steps)
    return sorted({max(multiple_of, int(round(x / multiple_of)) * multiple_of) for x in raw})

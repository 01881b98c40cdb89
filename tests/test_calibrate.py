"""Calibration: the alpha-beta fit and efficiency curves (cost/calibrate.py), the command's argument
checks, and one real 4-process gloo run of ``python -m torch.distributed.run -m moe_compile.tools.calibrate``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from dist_utils import run_ranks

from moe_compile.cost import Topology
from moe_compile.cost.calibrate import (
    efficiency_curve,
    fit_alpha_beta,
    fit_collective,
    fit_expert_compute,
    message_sizes,
)
from moe_compile.tools.calibrate import (
    Measurement,
    build_topology,
    check_world_size,
    fit_measurements,
    main,
    parse_mesh,
)

SIZES = np.geomspace(1e3, 1e8, 12)


def test_fit_recovers_alpha_beta() -> None:
    # HierMoE Fig. 9(a) inter-node fit, in seconds: alpha 0.497 ms, beta 5.29e-7 ms/B
    alpha, beta, r2 = fit_alpha_beta(SIZES, 4.97e-4 + SIZES * 5.29e-10)
    assert alpha == pytest.approx(4.97e-4, rel=1e-9)
    assert beta == pytest.approx(5.29e-10, rel=1e-9)
    assert r2 == pytest.approx(1.0, abs=1e-12)


def test_expert_fit_recovers_both_rates() -> None:
    """t = flops / F + row_bytes / R over runs that vary the two independently (the probe's
    (K, F) grid): both rates back exactly; runs whose FLOPs and bytes grow together cannot
    separate them, and runs with no cost for the rows are an error, not an infinite rate."""
    flops = np.array([1.0e7, 4.0e7, 8.0e7, 3.2e8])
    rows = np.array([1.0e6, 4.0e6, 1.0e6, 4.0e6])
    f_rate, r_rate, r2 = fit_expert_compute(flops, rows, flops / 1.2e11 + rows / 1.6e9)
    assert f_rate == pytest.approx(1.2e11, rel=1e-9) and r_rate == pytest.approx(1.6e9, rel=1e-9)
    assert r2 == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(ValueError, match="vary independently"):
        fit_expert_compute(flops, flops / 10, flops / 1e11)
    with pytest.raises(ValueError, match="no cost for the row bytes"):
        fit_expert_compute(flops, rows, flops / 1e11 - rows * 1e-12)


def test_noise_lowers_r2() -> None:
    times = 4.97e-4 + SIZES * 5.29e-10
    # jitter of 5 % of the largest time, as on a shared network
    noisy = times + 0.05 * times.max() * np.random.default_rng(0).standard_normal(SIZES.size)
    _, beta, r2 = fit_alpha_beta(SIZES, noisy)
    assert r2 < 0.99  # below every fit HierMoE reports (>= 0.997)
    assert beta == pytest.approx(5.29e-10, rel=0.1)  # large sizes still pin beta down


def test_fit_collective_is_per_link_byte() -> None:
    """Of a 4-rank all-to-all buffer n, 3n/4 leaves the rank: the link beta is 4/3 the paper's."""
    alpha, beta, r2 = fit_collective(SIZES, 4.97e-4 + SIZES * 5.29e-10, group_size=4)
    assert alpha == pytest.approx(4.97e-4, rel=1e-9)
    assert beta == pytest.approx(5.29e-10 * 4 / 3, rel=1e-9)
    assert r2 == pytest.approx(1.0, abs=1e-12)


def test_fit_is_non_negative() -> None:
    """Times that grow faster than linearly with the size (the largest all-gathers slowed by
    contention) made the plain least-squares fit an intercept below zero; the fit keeps alpha >= 0
    and is then the best line through the origin (beta = sum(n t) / sum(n^2), the constrained
    optimum)."""
    sizes = np.array([1e3, 1e4, 1e5, 1e6, 1e7])
    times = sizes * 1e-9 * np.array([1.0, 1.0, 1.1, 1.3, 1.6])
    (free_alpha, _), *_ = np.linalg.lstsq(np.stack([np.ones_like(sizes), sizes], 1), times, rcond=None)
    assert free_alpha < 0  # the case the constraint is for
    alpha, beta, r2 = fit_alpha_beta(sizes, times)
    assert alpha == 0.0
    assert beta == pytest.approx(float(sizes @ times / (sizes @ sizes)), rel=1e-9)
    assert 0.99 < r2 <= 1.0


def test_fit_needs_two_sizes() -> None:
    with pytest.raises(ValueError, match="two or more distinct sizes"):
        fit_alpha_beta([1024, 1024], [1e-3, 2e-3])
    with pytest.raises(ValueError, match="equally long"):
        fit_alpha_beta([1, 2, 3], [1e-3, 2e-3])


def test_efficiency_curve_follows_alpha_beta() -> None:
    alpha, beta = 1e-5, 1e-10
    sizes = [1e3, 1e5, 1e5, 1e7]
    times = [alpha + n * beta for n in sizes]
    times[2] *= 3  # a repeated size keeps the median of its times
    curve = efficiency_curve(sizes + [1e5], times + [times[1]], beta)
    assert curve.sizes_bytes == (1e3, 1e5, 1e7)
    expected = [n * beta / (alpha + n * beta) for n in (1e3, 1e5, 1e7)]
    assert curve.values == pytest.approx(expected)
    assert curve(1e9) == pytest.approx(expected[-1])  # flat beyond the last sample
    # against a link beta, only the moved share of the buffer counts
    half = efficiency_curve(sizes + [1e5], times + [times[1]], 2 * beta, moved_fraction=0.5)
    assert half.values == pytest.approx(expected)


def test_message_sizes_split_evenly() -> None:
    sizes = message_sizes(1000, 1 << 20, 6, multiple_of=16)
    assert len(sizes) == 6 and sizes == sorted(sizes)
    assert all(s % 16 == 0 for s in sizes) and sizes[-1] == 1 << 20
    with pytest.raises(ValueError, match="at least 2"):
        message_sizes(1, 10, 1)


def test_parse_mesh() -> None:
    assert parse_mesh("node=2,socket=2, gpu=4") == (("node", "socket", "gpu"), (2, 2, 4))


@pytest.mark.parametrize("spec", ["node2,gpu=2", "node=0", "node=2,node=2", "node=x", "", "=2", "world=4"])
def test_parse_mesh_rejects(spec: str) -> None:
    with pytest.raises(ValueError, match="--mesh"):
        parse_mesh(spec)


def test_world_size_mismatch() -> None:
    with pytest.raises(ValueError, match="4 ranks but the world size is 3"):
        check_world_size(("node", "gpu"), (2, 2), 3)


def test_main_reports_bad_setup_before_any_collective(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert main(["--mesh", "node=2,gpu=2"]) == 2
    assert "world size is 3" in capsys.readouterr().err
    assert main(["--mesh", "node=2;gpu=2"]) == 2
    assert "NAME=SIZE" in capsys.readouterr().err


def synthetic(collective: str, group: str, size: int, alpha: float, beta: float) -> Measurement:
    sizes = (4096, 65536, 1 << 20)
    return Measurement(collective, group, size, sizes, tuple(alpha + n * beta for n in sizes))


def test_build_topology_from_fits() -> None:
    ms = [synthetic("all_to_all", "node", 2, 2e-5, 1e-9), synthetic("all_gather", "node", 2, 3e-5, 1e-9),
          synthetic("all_to_all", "gpu", 4, 5e-6, 1e-10), synthetic("all_gather", "gpu", 4, 5e-6, 2e-10),
          synthetic("all_to_all", "world", 8, 3e-5, 1e-9)]
    topo = build_topology(fit_measurements(ms), ("node", "gpu"), (2, 4), flops_per_s=[1e12], mem_bw_bytes_per_s=[1e11],
                          name="t")
    assert topo.sizes == (2, 4)
    gpu = topo.level("gpu")
    assert gpu.alpha_s == pytest.approx(5e-6) and gpu.beta_s_per_byte == pytest.approx(1e-10 * 4 / 3)
    # all-gather at twice the all-to-all's per-byte time reaches at most half the level's bandwidth
    assert topo.efficiency["all_gather"](1 << 20) == pytest.approx((1 << 20) * 1e-10 / (5e-6 + (1 << 20) * 2e-10))
    assert topo.efficiency["all_to_all"] == topo.efficiency["all_to_all_node"]
    assert set(topo.efficiency) >= {"all_to_all_world", "all_gather_node", "all_to_all_gpu"}


def test_build_topology_rejects_flat_times() -> None:
    ms = [synthetic("all_to_all", "gpu", 2, 1e-3, -1e-12), synthetic("all_gather", "gpu", 2, 1e-3, 1e-10),
          synthetic("all_to_all", "world", 2, 1e-3, 1e-10)]
    with pytest.raises(ValueError, match="raise --max-bytes"):
        build_topology(fit_measurements(ms), ("gpu",), (2,), flops_per_s=[1e12], mem_bw_bytes_per_s=[1e11], name="")


@pytest.mark.ranks
def test_flat_level_is_timed_again() -> None:
    """A level whose all-to-all time falls with the size (noise) is timed again, ``--retries``
    times at most, on every rank alike; the other collectives are not."""
    results = run_ranks(2, "calibrate_retime", worker="plan_worker.py", shape=[2])
    for rank, r in enumerate(results):
        kept, again = r["0"], r["1"]
        assert kept["beta"] <= 0 and kept["times"] == [3.0, 2.0, 1.0] and kept["notes"] == [], (rank, kept)
        assert again["times"] != [3.0, 2.0, 1.0] and max(again["times"]) < 1.0, (rank, again)
        assert again["sizes_same"] and again["others_same"], (rank, again)
        assert len(again["notes"]) == 1 and "level gpu" in again["notes"][0] and "(1/1)" in again["notes"][0]
    assert results[0]["1"]["times"] == results[1]["1"]["times"]  # agreed times: the ranks decide alike


@pytest.mark.ranks
def test_torchrun_four_gloo_ranks(tmp_path: Path) -> None:
    """The real command: 4 CPU processes, mesh node=2 x gpu=2, three sizes up to 8 MiB (large enough
    that the bytes, not scheduling noise on 2 shared cores, set the time, so beta comes out > 0;
    5 repetitions: with 3, a busy moment of the other pytest worker once left the node fit flat);
    with --chunk-overhead, the probe layer timed in 1, 2 and 4 chunks and the fitted fixed cost
    of a chunk written to the file."""
    out = tmp_path / "cluster.toml"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "moe_compile.tools.calibrate", "--mesh", "node=2,gpu=2", "--out", str(out),
           "--min-bytes", "4096", "--max-bytes", str(8 << 20), "--steps", "3", "--reps", "5", "--warmup", "1",
           "--chunk-overhead"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "r^2" in proc.stdout and "wrote" in proc.stdout
    topo = Topology.load(out)
    assert topo.level_names == ("node", "gpu") and topo.sizes == (2, 2)
    assert all(lv.alpha_s > 0 and lv.beta_s_per_byte > 0 for lv in topo.levels)
    assert {"all_to_all", "all_gather", "all_to_all_world", "all_gather_node"} <= set(topo.efficiency)
    assert len(topo.efficiency["all_to_all_gpu"].sizes_bytes) == 3
    assert all(f"n={n} " in proc.stdout for n in (1, 2, 4)) and "fixed cost fitted" in proc.stdout
    assert topo.chunk_overhead_s is not None and 0.0 <= topo.chunk_overhead_s <= 0.1
    # the expert op measured (rates of this CPU, one thread per rank: well inside these bounds)
    assert "expert op (hiermoe::experts forward" in proc.stdout
    assert topo.expert_flops_per_s is not None and 1e8 < topo.expert_flops_per_s < 1e13
    assert topo.expert_row_bytes_per_s is not None and 1e6 < topo.expert_row_bytes_per_s < 1e12

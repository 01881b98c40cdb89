"""Topology files: the shipped examples, save/load, from_mesh, and errors that name the bad field."""

from __future__ import annotations

import dataclasses
import importlib.resources
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from moe_compile.cost import Topology

SHIPPED = importlib.resources.files("moe_compile.cost") / "topologies"
LINKS = {"node": {"alpha_s": 5e-6, "beta_s_per_byte": 2.5e-11}, "gpu": {"alpha_s": 1e-6, "bandwidth_gbps": 3600}}


def shipped_files() -> list[str]:
    return sorted(p.name for p in SHIPPED.iterdir() if p.name.endswith(".toml"))


def load_shipped(name: str) -> Topology:
    with importlib.resources.as_file(SHIPPED / name) as path:
        return Topology.load(path)


def test_every_example_ships() -> None:
    assert {"hiermoe_testbed.toml", "dgx_h100_2node.toml", "hybridep_cross_dc.toml"} <= set(shipped_files())


@pytest.mark.parametrize("name", shipped_files())
def test_shipped_file_loads_and_round_trips(name: str, tmp_path: Path) -> None:
    topo = load_shipped(name)
    assert topo.name
    assert all(lv.alpha_s >= 0 and lv.beta_s_per_byte > 0 for lv in topo.levels)
    # slowest level first: per-byte cost does not grow towards the inner levels
    betas = [lv.beta_s_per_byte for lv in topo.levels]
    assert betas == sorted(betas, reverse=True)
    topo.save(tmp_path / name)
    assert Topology.load(tmp_path / name) == topo


def test_hiermoe_testbed_has_the_papers_fits() -> None:
    """HierMoE Fig. 9 caption (ms and ms per buffer byte there; seconds per link byte here, so
    beta * (g-1)/g is the paper's number); U = [1, 4, 8, 16] over 32 GPUs."""
    topo = load_shipped("hiermoe_testbed.toml")
    assert topo.sizes == (4, 2, 2, 2) and topo.world_size == 32
    paper = {"node": (4.97e-4, 5.29e-10), "socket": (3.01e-4, 1.17e-10),
             "pcie": (1.49e-4, 2.06e-11), "nvlink": (2.04e-4, 1.64e-11)}
    for lv in topo.levels:
        alpha, beta_per_buffer_byte = paper[lv.name]
        assert lv.alpha_s == alpha
        assert lv.beta_s_per_byte * (lv.size - 1) / lv.size == pytest.approx(beta_per_buffer_byte, rel=1e-4)


@pytest.mark.parametrize("text,match", [
    ("[[levles]]\nname = 'node'\nsize = 2\nalpha_s = 1e-6\nbeta_s_per_byte = 1e-9\n",
     r"unknown key\(s\) 'levles' \(did you mean 'levels'\?\) in the top level"),
    ("[[levels]]\nname = 'node'\nsize = 2\nalpha_s = 1e-6\nbeta_s_per_byte = 1e-9\nbandwidth_gbps = 100\n",
     r"levels\[0\] gives both beta_s_per_byte and bandwidth_gbps"),
    ("[[levels]]\nname = 'node'\nsize = 2\nalpha = 1e-6\nbeta_s_per_byte = 1e-9\n",
     r"unknown key\(s\) 'alpha' \(did you mean 'alpha_s'\?\) in levels\[0\]"),
    ("[[levels]]\nname = 'node'\nsize = 2\nalpha_s = 1e-6\nbeta_s_per_byte = 1e-9\n[compute]\nflops = 1e12\n",
     r"unknown key\(s\) 'flops' .* in compute"),
])
def test_unknown_and_conflicting_keys_are_errors(text: str, match: str, tmp_path: Path) -> None:
    """A misspelled table or field was silently ignored (a [[levles]] file loaded the default-less
    levels error at best, an extra level field never); two fields for one value kept one of them."""
    (tmp_path / "t.toml").write_text(text)
    with pytest.raises(ValueError, match=match):
        Topology.load(tmp_path / "t.toml")


def test_dgx_and_hybridep_shapes() -> None:
    dgx = load_shipped("dgx_h100_2node.toml")
    assert dgx.level_names == ("node", "gpu") and dgx.sizes == (2, 8)
    assert [lv.bandwidth_gbps for lv in dgx.levels] == pytest.approx([400, 3600])
    assert dgx.device_flops(15) == pytest.approx(989e12) and dgx.device_mem_bw(0) == pytest.approx(3.35e12)
    # MoNTA Table 8: 74.1 % at 256 MB, 42.7 % at 8 MB, linear in between
    assert dgx.efficiency["all_to_all"](256e6) == pytest.approx(0.741)
    assert 0.427 < dgx.efficiency["all_to_all"](16e6) < 0.633
    hyb = load_shipped("hybridep_cross_dc.toml")
    assert hyb.level_names == ("dc", "gpu") and hyb.sizes == (4, 8)
    # the 8 GPUs of a DC share its 10 Gb/s link; each has its own 128 Gb/s PCIe link
    assert [lv.bandwidth_gbps for lv in hyb.levels] == pytest.approx([10 / 8, 128])


def test_from_fake_mesh() -> None:
    mesh = SimpleNamespace(mesh_dim_names=("node", "gpu"), mesh=np.zeros((2, 4)))
    topo = Topology.from_mesh(mesh, LINKS, world_size=8, flops_per_s=2e12)
    assert topo.level_names == ("node", "gpu") and topo.sizes == (2, 4)
    assert topo.level("gpu").bandwidth_gbps == pytest.approx(3600)
    assert topo.device_flops(7) == 2e12


def test_from_mesh_world_size_mismatch() -> None:
    mesh = SimpleNamespace(mesh_dim_names=("node", "gpu"), mesh=np.zeros((2, 4)))
    with pytest.raises(ValueError, match="8 devices .* world size is 6"):
        Topology.from_mesh(mesh, LINKS, world_size=6)


def test_from_mesh_needs_links_for_every_level() -> None:
    mesh = SimpleNamespace(mesh_dim_names=("node", "gpu"), mesh=np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"no link parameters for level\(s\) \['gpu'\]"):
        Topology.from_mesh(mesh, {"node": LINKS["node"]}, world_size=8)


def test_from_real_one_process_device_mesh() -> None:
    from dist_utils import one_rank_group
    from torch.distributed.device_mesh import init_device_mesh

    with one_rank_group():
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("node", "gpu"))
        topo = Topology.from_mesh(mesh, LINKS)
        assert topo.level_names == ("node", "gpu") and topo.world_size == 1


GOOD_LEVEL = 'name = "node"\nsize = 2\nalpha_s = 5e-6\nbeta_s_per_byte = 2.5e-11\n'


@pytest.mark.parametrize(("text", "field"), [
    ('[[levels]]\nname = "node"\nalpha_s = 5e-6\nbeta_s_per_byte = 1e-11\n', "levels[0].size"),
    (f'[[levels]]\n{GOOD_LEVEL}[[levels]]\nname = "gpu"\nsize = 4\nalpha_s = -1e-6\nbeta_s_per_byte = 1e-12\n',
     "levels[1].alpha_s"),
    ('[[levels]]\nname = "node"\nsize = 2\nalpha_s = 5e-6\n', "levels[0] needs beta_s_per_byte"),
    ('[[levels]]\nname = "node"\nsize = 2\nalpha_s = 5e-6\nbandwidth_gbps = -4\n', "levels[0].bandwidth_gbps"),
    (f'[[levels]]\n{GOOD_LEVEL}[efficiency.all_to_all]\nsizes_bytes = [1, 2]\nvalues = [0.5]\n',
     "efficiency.all_to_all needs equally long"),
    (f'[[levels]]\n{GOOD_LEVEL}[efficiency.all_gather]\nsizes_bytes = [4, 2]\nvalues = [0.5, 0.6]\n',
     "efficiency.all_gather.sizes_bytes"),
    (f'[[levels]]\n{GOOD_LEVEL}[compute]\nflops_per_s = [1e12, 1e12, 1e12]\n', "compute.flops_per_s"),
    (f'[[levels]]\n{GOOD_LEVEL}[compute]\nchunk_overhead_s = -1e-3\n', "compute.chunk_overhead_s"),
    (f'[[levels]]\n{GOOD_LEVEL}[compute]\nchunk_overhead_s = "2 ms"\n', "compute.chunk_overhead_s"),
    (f'[[levels]]\n{GOOD_LEVEL}[compute]\nexpert_flops_per_s = 1e11\n', "give both or neither"),
    (f'[[levels]]\n{GOOD_LEVEL}[compute]\nexpert_flops_per_s = 1e11\nexpert_row_bytes_per_s = 0\n',
     "compute.expert_flops_per_s and compute.expert_row_bytes_per_s must be positive"),
    (f'[[levels]]\n{GOOD_LEVEL}[compute]\nexpert_flops_per_s = "fast"\nexpert_row_bytes_per_s = 1e9\n',
     "compute.expert_flops_per_s must be a number"),
    ('name = "x"\n', "'levels'"),
    ('[[levels]\nname = "node"\n', "not valid TOML"),
])
def test_malformed_file_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        Topology.load(path)
    assert field in str(info.value)


def test_bandwidth_instead_of_beta(tmp_path: Path) -> None:
    path = tmp_path / "bw.toml"
    path.write_text('[[levels]]\nname = "node"\nsize = 2\nalpha_s = 0\nbandwidth_gbps = 400\n')
    assert Topology.load(path).level("node").beta_s_per_byte == pytest.approx(8 / 400e9)


def test_chunk_overhead_round_trips_and_is_optional(tmp_path: Path) -> None:
    """compute.chunk_overhead_s (moe-calibrate --chunk-overhead) is written and read back; a file
    without it leaves the pipeline model's default (None)."""
    path = tmp_path / "t.toml"
    path.write_text(f"[[levels]]\n{GOOD_LEVEL}")
    plain = Topology.load(path)
    assert plain.chunk_overhead_s is None and "chunk_overhead_s" not in plain.to_dict()["compute"]
    calibrated = dataclasses.replace(plain, chunk_overhead_s=0.0061)
    calibrated.save(path)
    assert "chunk_overhead_s = 0.0061" in path.read_text()
    assert Topology.load(path) == calibrated


def test_measured_expert_op_round_trips_and_charges_its_rows(tmp_path: Path) -> None:
    """compute.expert_flops_per_s / expert_row_bytes_per_s (the expert op measured by
    moe-calibrate or the probe) are written and read back, and expert_compute_s charges the
    matmul FLOPs at the first and the rows' bytes at the second; without them, FLOPs alone at
    flops_per_s."""
    path = tmp_path / "t.toml"
    path.write_text(f"[[levels]]\n{GOOD_LEVEL}[compute]\nflops_per_s = 2e11\n")
    plain = Topology.load(path)
    assert plain.expert_compute_s(4e9, 1e9) == pytest.approx(4e9 / 2e11, rel=1e-12)
    measured = dataclasses.replace(plain, expert_flops_per_s=1e11, expert_row_bytes_per_s=2e9)
    measured.save(path)
    assert "expert_row_bytes_per_s = 2000000000.0" in path.read_text()
    assert Topology.load(path) == measured
    assert measured.expert_compute_s(4e9, 1e9) == pytest.approx(4e9 / 1e11 + 1e9 / 2e9, rel=1e-12)

"""HybridEP cost model: the derived optimum against the paper's closed forms, Table IV choices,
Table VI regimes, Table VII frequencies, Eq. 13 / Alg. 1 on the Fig. 8(b) example."""

import random

import pytest
import sympy as sp

from moe_compile.cost import hybridep as h
from moe_compile.cost.topology import Level, Topology
from moe_compile.cost.workload import Workload

D, P, B, G, LAT, p = h.D_bytes, h.P_E_bytes, h.B_bytes_per_s, h.G, h.lat_pe_s, h.p


def test_derived_boundary_and_optimum_equal_paper_closed_forms():
    m = h.stream_model()
    # Eq. 11 / Eq. 12 region bound and the Summary's "p = 1 - B Lat_PE / (P_E (G-1))"
    assert sp.simplify(m.p_boundary - (P * (G - 1) - B * LAT) / (P * (G - 1))) == 0
    assert sp.simplify(m.p_boundary - (1 - B * LAT / (P * (G - 1)))) == 0
    assert sp.expand(m.case21_discriminant - (2 * D - G * P)) == 0  # Case 2.1 iff 2D - G P_E < 0
    paper = sp.Piecewise((0, 2 * D - G * P >= 0), (sp.Max(0, 1 - B * LAT / (P * (G - 1))), True))
    derived_fn, paper_fn = (sp.lambdify((D, P, B, G, LAT), e, modules="math") for e in (m.p_opt, paper))
    rng = random.Random(0)
    for _ in range(500):
        vals = (rng.uniform(1e5, 1e8), rng.uniform(1e4, 3e7), rng.uniform(1e9, 1e11),
                rng.choice([2, 4, 8, 16, 32]), rng.uniform(1e-6, 1e-2))
        assert derived_fn(*vals) == pytest.approx(paper_fn(*vals), abs=1e-12)


def test_case_expressions_equal_eq11_eq12_and_eq8_equals_eq10():
    m = h.stream_model()
    assert sp.simplify(m.case1_s - (LAT + 2 * D * (G - 1) / (G * B) * p)) == 0  # Eq. 11
    assert sp.simplify(m.case2_s - (p * (G - 1) * (2 * D - G * P) / (B * G) + (G - 1) * P / B)) == 0  # Eq. 12
    assert sp.simplify(m.v_a2a_bytes.subs(p, 1) - D / G * (G - 1)) == 0  # Eq. 3, plain EP
    assert sp.simplify(m.v_ag_bytes.subs(p, 0) - P * (G - 1)) == 0  # Eq. 4, AG only
    eq10 = sp.Max(LAT, m.lat_ag_s) + 2 * m.lat_a2a_s
    args = (D, P, B, G, LAT, p, h.n_experts, h.lat_ep_s)
    eq8_fn, eq10_fn = (sp.lambdify(args, e, modules="math") for e in (m.lat_final_s, eq10))
    rng = random.Random(1)
    for _ in range(500):
        vals = (rng.uniform(1e5, 1e8), rng.uniform(1e4, 3e7), 1e10, 8, rng.uniform(1e-5, 1e-2),
                rng.uniform(0, 1), 3, 1e-3)
        assert eq8_fn(*vals) == pytest.approx(eq10_fn(*vals), rel=1e-12)


def test_derived_p_is_the_argmin_over_a_grid():
    rng = random.Random(2)
    for _ in range(50):
        d, pe, bw = rng.uniform(1e5, 1e8), rng.uniform(1e4, 3e7), rng.uniform(1e9, 1e11)
        g, lat = rng.choice([2, 4, 8, 32]), rng.uniform(1e-6, 1e-2)
        best = min(h.stream_time_s(i / 1000, d, pe, bw, g, lat) for i in range(1001))
        assert h.stream_time_s(h.optimal_p(d, pe, bw, g, lat), d, pe, bw, g, lat) <= best * (1 + 1e-12)


# Table IV (Cluster-S, G = 8, B = 128 Gbps).  Read literally (MB = 1e6 bytes, 128 Gbit/s) the model
# picks plain EP for Mix-1; the table's choices come out when D and P_E are megabits (equivalently
# B = 128 GB/s): only the ratio B * Lat_PE : D : P_E matters.  Candidate labels in the paper:
# S_ED = 8, 4, 2, 1 <-> p = 0, 0.5, 0.75, 1.
MBIT = 1e6 / 8
TABLE_IV = [  # name, label p, Lat_PE s, D, P_E (megabits), regime
    ("Mix-1", 0.75, 0.049e-3, 8, 4.7, "2.1"),
    ("Mix-2", 0.5, 0.049e-3, 8, 2.35, "2.1"),
    ("AG-only-1", 0.0, 0.099e-3, 3, 0.094, "2.2"),
    ("AG-only-2", 0.0, 0.099e-3, 3, 0.047, "2.2"),
]
LABEL = {8: 0.0, 4: 0.5, 2: 0.75, 1: 1.0}


@pytest.mark.parametrize("name,label,lat,d,pe,reg", TABLE_IV)
def test_table_iv_choices(name, label, lat, d, pe, reg):
    bw = 128e9 / 8
    assert h.regime(d * MBIT, pe * MBIT, 8) == reg
    s = h.best_domain_size(d * MBIT, pe * MBIT, bw, 8, lat)
    assert LABEL[s] == label, name
    # the chosen feasible p is a neighbour of the continuous optimum
    p_star = h.optimal_p(d * MBIT, pe * MBIT, bw, 8, lat)
    feasible = sorted(h.p_of_domain_size(8, k) for k in (1, 2, 4, 8))
    below = max(q for q in feasible if q <= p_star)
    above = min(q for q in feasible if q >= p_star)
    assert h.p_of_domain_size(8, s) in (below, above)
    # the same choice through a one-level Topology
    topo = Topology((Level("gpu", 8, 0.0, 1 / bw),))
    plan = h.choose_partition(topo, h.StreamSizes(d * MBIT, pe * MBIT), pre_expert_s=lat)
    assert plan.partition.domain_sizes == (s,)


def test_table_iv_literal_bytes_picks_plain_ep_for_mix1():
    assert h.best_domain_size(8e6, 4.7e6, 128e9 / 8, 8, 0.049e-3) == 1


def test_case_regions():
    d, pe, bw, lat = 8 * MBIT, 4.7 * MBIT, 16e9, 0.049e-3
    p_b = h.stream_model().p_boundary.subs({D: d, P: pe, B: bw, G: 8, LAT: lat})
    assert h.case_at(float(p_b) + 0.01, d, pe, bw, 8, lat) == "1"
    assert h.case_at(float(p_b) - 0.01, d, pe, bw, 8, lat) == "2.1"
    assert h.case_at(0.0, 3 * MBIT, 0.094 * MBIT, bw, 8, 1e-9) == "2.2"
    # AG-only-1 at p = 0: the whole AG hides under pre-expert compute, so p = 0 is already Case 1
    assert h.case_at(0.0, 3 * MBIT, 0.094 * MBIT, bw, 8, 0.099e-3) == "1"


# Table VII: ordered GPU-to-GPU communications for EP size G and domain size S_ED.
TABLE_VII = {
    8: {1: (56, 0), 2: (24, 8), 4: (8, 24), 8: (0, 56)},
    16: {1: (240, 0), 2: (112, 16), 4: (48, 48), 8: (16, 112), 16: (0, 240)},
    32: {1: (992, 0), 2: (480, 32), 4: (224, 96), 8: (96, 224), 16: (32, 480), 32: (0, 992)},
}


@pytest.mark.parametrize("g", sorted(TABLE_VII))
def test_table_vii_frequencies(g):
    for s, (a2a, ag) in TABLE_VII[g].items():
        part = h.DomainPartition(("dc",), (g,), (s,))
        assert part.frequencies() == {"A2A": a2a, "AG": ag}
        kinds = [k for _, _, k, _ in part.pairs()]
        assert (kinds.count("A2A"), kinds.count("AG")) == (a2a, ag)


def test_eq13_and_alg1_on_fig8b():
    part = h.DomainPartition(("dc", "gpu"), (4, 4), (2, 4))  # Fig. 8(b): 4 DCs x 4 GPUs
    assert part.location(0) == (0, 0) and part.location(6) == (1, 2) and part.location(15) == (3, 3)
    assert part.comm_type(0, 1) == ("AG", "gpu")
    assert part.comm_type(0, 4) == ("AG", "dc")  # DC 0 and DC 1 share a domain
    assert part.comm_type(0, 8) == ("A2A", "dc")  # DC 2: other domain, same offset
    assert part.comm_type(0, 12) is None  # DC 3: other domain, other offset
    assert part.comm_type(0, 5) is None  # differs at two levels
    assert part.expert_domain(0) == list(range(8))
    assert "S_ED" in part.describe()


def test_one_level_multilevel_model_is_the_flat_model():
    ag, a2a, (sf, s, alpha, beta) = h.multilevel_model(1)
    flat = h.stream_model()
    at = {p: (G - s) / (G - 1), B: 1 / beta}
    assert sp.simplify(ag.subs({alpha: 0, sf: G}) - flat.lat_ag_s.subs(at)) == 0
    assert sp.simplify(a2a.subs({alpha: 0, sf: G}) - flat.lat_a2a_s.subs(at)) == 0
    topo = Topology((Level("gpu", 8, 0.0, 1 / 16e9),))
    sizes = h.StreamSizes(3e6, 1e6)
    for k in (1, 2, 4, 8):
        t = h.partition_time_s(topo, h.DomainPartition.of(topo, (k,)), sizes, pre_expert_s=1e-4).total_s
        assert t == pytest.approx(h.stream_time_s(h.p_of_domain_size(8, k), 3e6, 1e6, 16e9, 8, 1e-4))


def _cluster(num_dcs):
    """Section V-A: 8 GPUs per DC on PCIe 3.0 x16 (128 Gbps), DCs on 10 Gbps Ethernet."""
    gpu = Level("gpu", 8, 0.0, 8 / 128e9)
    return Topology(((Level("dc", num_dcs, 0.0, 8 / 10e9),) if num_dcs > 1 else ()) + (gpu,))


def test_table_vi_regimes_and_partitions():
    for g in (8, 16, 32):  # Cluster-S, -M, -L
        assert h.regime(24e6, 8e6, g) == "2.1"
        assert h.regime(48e6, 2e6, g) == "2.2"
    # 48&2 MB: p = 0 (one domain over everything) on every cluster
    for dcs in (1, 2, 4):
        topo = _cluster(dcs)
        plan = h.choose_partition(topo, h.StreamSizes(48e6, 2e6), pre_expert_s=1e-3)
        assert plan.partition.domain_sizes == topo.sizes
        assert plan.partition.frequencies()["A2A"] == 0
    # 24&8 MB with a 1 ms pre-expert compute (the paper gives none): Cluster-S S_ED = 4 (p = 0.5),
    # Cluster-L S_ED^0 = 4, S_ED^1 = 1, as in Section V-D.
    assert h.choose_partition(_cluster(1), h.StreamSizes(24e6, 8e6), pre_expert_s=1e-3).partition.domain_sizes == (4,)
    assert h.choose_partition(_cluster(4), h.StreamSizes(24e6, 8e6),
                              pre_expert_s=1e-3).partition.domain_sizes == (4, 1)


def test_sizes_from_workload_and_bad_domain():
    w = Workload(num_tokens=1024, hidden_size=512, ffn_size=1024, num_experts=16, top_k=2, dtype_bytes=2)
    sizes = h.StreamSizes.from_workload(w, world_size=8, compression_ratio=2.0)
    assert sizes.data_bytes == 1024 * 2 * 512 * 2
    assert sizes.expert_bytes == 2 * 3 * 512 * 1024 * 2 / 2
    with pytest.raises(ValueError, match="must divide"):
        h.DomainPartition(("gpu",), (8,), (3,))

"""Sample placement (NetMoE, cost/netmoe.py) as the cost model predicts it: inter-node units of one
all-to-all with and without placement, deduplicated as HD-d sends them, over K in 2/4/8.

    python bench/bench_placement.py                       # -> bench/results/placement.md / .json
    python bench/bench_placement.py --nodes 4 --ranks-per-node 8 --samples-per-rank 8

Routing (synthetic, seeded): "zipf": each sample prefers its own experts (a random permutation of
the experts per sample, Zipf(s) weights over it), each token draws K distinct experts from those
weights; "node_affine": each sample has a home node whose experts get ``--affinity`` of its
choices (the sample-affine routing NetMoE exploits, in its strongest form); "uniform": every token
draws K distinct experts uniformly. Experts are spread evenly over
the ranks; samples start S / R per rank. Reported per (routing, K): units crossing nodes before and
after (the all-to-all's total and the slowest rank's), the ratio, the predicted all-to-all time
ratio, whether moving the samples pays over the two exchanges a placement serves, samples moved,
and the solve time. These are the cost model's predictions: no runtime counts (the rewrite that
moves samples does not exist yet).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from moe_compile.cost.netmoe import place_samples, traffic_from_routing
from moe_compile.cost.topology import Level, Topology


def routing(kind: str, num_samples: int, seq: int, num_e: int, k: int, zipf_s: float, affinity: float,
            expert_node: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    idx = np.empty((num_samples * seq, k), dtype=np.int64)
    num_nodes = int(expert_node.max()) + 1
    for s in range(num_samples):
        if kind == "zipf":
            w = np.empty(num_e)
            w[rng.permutation(num_e)] = 1.0 / np.arange(1, num_e + 1) ** zipf_s
        elif kind == "node_affine":  # the experts of one random node get `affinity` of the mass
            home = expert_node == rng.integers(num_nodes)
            w = np.where(home, affinity / home.sum(), (1 - affinity) / (~home).sum())
        else:
            w = np.ones(num_e)
        w /= w.sum()
        for t in range(seq):
            idx[s * seq + t] = rng.choice(num_e, size=k, replace=False, p=w)
    return idx


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--samples-per-rank", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of a sample's expert preference")
    ap.add_argument("--affinity", type=float, default=0.95,
                    help="node_affine routing: the share of a sample's expert choices on its home node's experts")
    ap.add_argument("--inter-gbps", type=float, default=0.4)
    ap.add_argument("--intra-gbps", type=float, default=8.0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "placement")
    args = ap.parse_args(argv)
    command = "python bench/bench_placement.py " + " ".join(sys.argv[1:] if argv is None else argv)

    ranks = args.nodes * args.ranks_per_node
    num_s = ranks * args.samples_per_rank
    topo = Topology(levels=(Level("node", args.nodes, 2e-5, 8 / (args.inter_gbps * 1e9)),
                            Level("local", args.ranks_per_node, 5e-6, 8 / (args.intra_gbps * 1e9))))
    expert_rank = np.arange(args.experts) * ranks // args.experts
    sample = np.repeat(np.arange(num_s), args.seq)
    rank_S = np.repeat(np.arange(ranks), args.samples_per_rank)
    token_bytes = 2 * args.hidden  # bf16 hidden vector
    sample_bytes = args.seq * token_bytes  # its residual stream moves with it
    rows = []
    for kind in ("node_affine", "zipf", "uniform"):
        for k in (2, 4, 8):
            rng = np.random.default_rng(k)
            idx = routing(kind, num_s, args.seq, args.experts, k, args.zipf, args.affinity,
                          expert_rank // args.ranks_per_node, rng)
            traffic = traffic_from_routing(idx, sample, num_s, expert_rank, ranks, args.ranks_per_node, dedup=True)
            p = place_samples(traffic, rank_S, topo, token_bytes, sample_bytes)
            rows.append(dict(routing=kind, k=k, inter_before=p.before.inter_total / token_bytes,
                             inter_after=p.after.inter_total / token_bytes,
                             inter_ratio=p.after.inter_total / max(p.before.inter_total, 1e-9),
                             max_ratio=p.after.inter_max / max(p.before.inter_max, 1e-9),
                             time_ratio=p.time_after_s / p.time_before_s, pays=p.pays, moved=p.moved,
                             solve_ms=p.solve_s * 1e3))
    head = ["routing", "K", "inter-node units before", "after", "after / before", "slowest rank after / before",
            "a2a time after / before", "moving pays", "samples moved", "solve ms"]
    lines = ["# Sample placement (NetMoE), predicted by cost/netmoe.py", "", f"Command: `{command}`", "",
             f"{args.nodes} nodes x {args.ranks_per_node} ranks, {num_s} samples of {args.seq} tokens, "
             f"{args.experts} experts, hidden {args.hidden} (bf16), {args.inter_gbps} / {args.intra_gbps} Gbit/s "
             f"between / inside nodes; HD-d deduplicated units (one per token and destination node); a "
             f"sample's residual stream ({sample_bytes} bytes) moves with it. Model predictions, no runtime "
             "counts.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['routing']} | {r['k']} | {r['inter_before']:.0f} | {r['inter_after']:.0f} | "
                     f"{r['inter_ratio']:.2f} | {r['max_ratio']:.2f} | {r['time_ratio']:.2f} | {r['pays']} | "
                     f"{r['moved']} | {r['solve_ms']:.1f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

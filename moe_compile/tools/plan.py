"""Plan expert parallelism for a cluster without running anything: ``moe-plan``.

    moe-plan --model mixtral --topology cost/topologies/dgx_h100_2node.toml --nodes 64 --tokens 8192
    python -m moe_compile.tools.plan --model path/to/config.json --topology cluster.toml --tokens 4096

``--model``: a transformers model type (its default config: ``AutoConfig.for_model``; no
download) or a ``config.json`` file (a model's own, or one you write for your model). Its MoE
layer shape (experts E, top-k K, hidden H, expert FFN F, MoE layer count) is read from the config.
``--topology``: a topology TOML (``cost/topologies/`` or ``moe-calibrate``'s); ``--nodes`` scales
its first (slowest) level to that many members, the way a cluster grows. ``--tokens``: tokens per
rank per step.

Prints, for the MoE layer shape (every MoE layer of these models has the same one), the strategy
the planner would run (``passes/plan.py``'s choice over ``lowering/strategies``) and every
candidate's predicted forward time, marking the executable ones, and for the all-to-all
candidates the bytes one rank sends over each level's links in dispatch (HierMoE Eq. 2-5, on
uniform random routing, the busiest destination setting the pace, with the routing slots'
metadata). Nothing here needs torch.distributed or the model's weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import sympy as sp
from rich.console import Console
from rich.table import Table

from moe_compile.cost import hiermoe
from moe_compile.cost.planner import Plan, plan, uniform_routing
from moe_compile.cost.routing import hd_statistics
from moe_compile.cost.topology import Level, Topology
from moe_compile.cost.workload import SLOT_BYTES, Workload
from moe_compile.lowering.strategies import executable

# config attribute names, first found wins (transformers MoE families name them differently)
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token")
_FFN = ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size", "ffn_dim")
_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


@dataclass(frozen=True)
class MoEShape:
    name: str
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_size: int
    num_layers: int  # MoE layers (0 when the config does not say)


def _first(config: dict[str, Any], names: Sequence[str], what: str, source: str) -> int:
    for n in names:
        value = config.get(n)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise ValueError(f"{source}: no {what} in the config (looked for {', '.join(names)}); is it an MoE model?")


def shape_from_config(config: dict[str, Any], source: str) -> MoEShape:
    """The MoE layer shape of a transformers config (as a dict)."""
    layers = int(config.get("num_hidden_layers") or 0)
    dense_first = int(config.get("first_k_dense_replace") or 0)
    step = int(config.get("decoder_sparse_step") or 1)
    return MoEShape(name=str(config.get("model_type") or source),
                    num_experts=_first(config, _EXPERTS, "expert count", source),
                    top_k=_first(config, _TOP_K, "top-k", source),
                    hidden_size=_first(config, ("hidden_size", "d_model"), "hidden size", source),
                    ffn_size=_first(config, _FFN, "expert FFN size", source),
                    num_layers=max(layers - dense_first, 0) // max(step, 1))


def load_shape(model: str) -> MoEShape:
    """``--model``: a config.json path, or a transformers model type."""
    path = Path(model)
    if path.suffix == ".json" or path.is_file():
        return shape_from_config(json.loads(path.read_text()), str(path))
    try:
        from transformers import AutoConfig
    except ImportError as e:
        raise ValueError(f"--model {model!r}: a model type needs transformers installed (pip install "
                         "transformers), or pass a config.json") from e
    try:
        config = AutoConfig.for_model(model)
    except ValueError as e:
        raise ValueError(f"--model {model!r} is neither a file nor a transformers model type ({e})") from e
    return shape_from_config(config.to_dict(), model)


def scale_nodes(topology: Topology, nodes: int) -> Topology:
    """``topology`` with its first (slowest) level grown or shrunk to ``nodes`` members."""
    if nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {nodes}")
    first = topology.levels[0]
    levels = (Level(first.name, nodes, first.alpha_s, first.beta_s_per_byte), *topology.levels[1:])
    return replace(topology, levels=levels, name=f"{topology.name} ({first.name} x{nodes})")


def phase_bytes(topology: Topology, work: Workload, candidate: str, stats: Any) -> dict[str, float]:
    """Bytes one rank sends in a dispatch of an all-to-all candidate, per level's links (the
    model's n of Eq. 2-5: phases over a level's link, padded to the busiest destination); for an
    expert gather ``gather{j}``, its tokens' Inter-level-1..j phases plus the expert weights the
    hierarchical all-gather sends over each level from j on (s_l - 1 peers, the pieces gathered
    so far: HybridEP Eq. 4 per level); for ``model0``, its tokens' hierarchical all-gather (with
    their routing slots) and the outputs' reduce-scatter, which sends the same rows per level."""
    if candidate == "model0":
        out = {lv.name: 0.0 for lv in topology.levels}
        rows = float(work.num_tokens)  # rows of one position, then of the positions gathered so far
        for lv in topology.levels:
            out[lv.name] += (lv.size - 1) * rows * (2 * work.token_bytes + work.top_k * work.slot_bytes)
            rows *= lv.size
        return out
    gather = candidate.startswith("gather")
    dedup = candidate.startswith("hd") or gather
    named = {"flat_a2a": 1, "hier_a2a": 2}
    d = (int(candidate[6:]) + 1 if gather else int(candidate[2:]) if dedup else named[candidate]
         if candidate in named else int(candidate[4:-4]))
    subs = hiermoe.symbol_values(topology, work)
    row = hiermoe.dedup_row_bytes if dedup else hiermoe.copy_row_bytes
    inter = hiermoe.p_inter_max_tokens if dedup else hiermoe.c_inter_max_copies
    intra = hiermoe.p_intra_max_tokens if dedup else hiermoe.c_intra_max_copies
    values = dict(zip(hiermoe.stat_symbols(len(topology.levels)), stats.values(), strict=True)) if dedup else \
        dict(zip(hiermoe.copy_symbols(len(topology.levels)), stats.copy_values(), strict=True))
    out = {lv.name: 0.0 for lv in topology.levels}
    for i in range(1, d):  # Inter-level-i crosses level i's links
        n = hiermoe.n_inter_bytes(i, inter(i), row)
        out[topology.levels[i - 1].name] += float(sp.sympify(n).subs(subs).subs(values))
    if gather:
        piece = work.num_experts / topology.world_size * work.expert_bytes
        for lv in topology.levels[d - 1:]:
            out[lv.name] += (lv.size - 1) * piece
            piece *= lv.size
        return out
    n = hiermoe.n_intra_bytes(d - 1, intra(d - 1), row)  # Intra-level-(d-1): at the slowest link it crosses
    out[topology.levels[d - 1].name] += float(sp.sympify(n).subs(subs).subs(values))
    return out


def plan_table(shape: MoEShape, topology: Topology, tokens: int, dtype_bytes: int) -> tuple[Plan, Table]:
    """The plan and the table ``main`` prints."""
    work = Workload(num_tokens=tokens, hidden_size=shape.hidden_size, ffn_size=shape.ffn_size,
                    num_experts=shape.num_experts, top_k=shape.top_k, dtype_bytes=dtype_bytes, slot_bytes=SLOT_BYTES)
    if shape.num_experts % topology.world_size:
        raise ValueError(f"{shape.num_experts} experts do not split evenly over {topology.world_size} ranks: expert "
                         "parallelism places E/G experts on every rank; choose --nodes so that the ranks divide "
                         f"{shape.num_experts}")
    runnable = executable(len(topology.levels), None, None)
    decided = plan(topology, work, None, implemented=tuple(runnable))
    stats = hd_statistics(uniform_routing(work), work.num_experts, topology.sizes, copies=True)
    table = Table(title=f"{shape.name}: E={shape.num_experts} K={shape.top_k} H={shape.hidden_size} "
                        f"F={shape.ffn_size}, {tokens} tokens per rank, {topology.world_size} ranks "
                        f"({', '.join(f'{lv.name} x{lv.size}' for lv in topology.levels)})")
    table.add_column("candidate")
    table.add_column("runs here")
    table.add_column("predicted ms", justify="right")
    for lv in topology.levels:
        table.add_column(f"{lv.name} MiB/rank", justify="right")
    for name, t in sorted(decided.predicted.items(), key=lambda kv: kv[1]):
        how = ""
        if name in runnable:
            strategy, settings = runnable[name]
            how = f"{strategy.name}" + (", every token on every rank" if settings.model_centric else
                                         ", d* per step" if settings.dimension is None else
                                         f", domain level {settings.domain}" if settings.domain is not None else "")
        sent = phase_bytes(topology, work, name, stats) if name in runnable else {}
        mark = " <- chosen" if name == decided.strategy else ""
        table.add_row(name + mark, how or "predicted only", f"{t * 1e3:.3g}",
                      *(f"{sent[lv.name] / 2**20:.3g}" if sent else "-" for lv in topology.levels))
    return decided, table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a transformers model type (e.g. mixtral) or a config.json")
    p.add_argument("--topology", required=True, help="topology TOML file")
    p.add_argument("--nodes", type=int, default=None, help="scale the topology's first level to this many members")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank per step (default 4096)")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES), help="activation dtype (default bf16)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    err = Console(stderr=True)
    try:
        shape = load_shape(args.model)
        topology = Topology.load(args.topology)
        if args.nodes is not None:
            topology = scale_nodes(topology, args.nodes)
        if args.tokens < 1:
            raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
        decided, table = plan_table(shape, topology, args.tokens, _DTYPES[args.dtype])
    except (ValueError, OSError) as e:
        err.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        return 2
    console = Console() if Console().is_terminal else Console(width=140)
    console.print(table)
    layers = f"{shape.num_layers} MoE layers, each: " if shape.num_layers else ""
    console.print(f"{layers}{decided.strategy} (predicted {decided.predicted[decided.strategy] * 1e3:.3g} ms per "
                  f"layer forward; topology {topology.name or args.topology})", markup=False, highlight=False)
    for note in decided.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()

"""Expert swap during training: HierD-ES against SmartMoE-style balancing and no swap, side by side.

    python bench/bench_swap.py            # 8 local gloo ranks; writes bench/results/swap.{md,json,png}
    python bench/bench_swap.py --quick    # 6 steps of a smaller model; prints only (unless --out)
    python bench/bench_swap.py --topology cluster.toml --steps 50 --out /tmp/swap
    moe-cluster run --config bench/clusters/two_node_two_socket.toml -- python bench/bench_swap.py \
        --out bench/results/swap_cluster
    python bench/bench_swap.py --payback 0 --out bench/results/swap_payback0   # swap on any predicted gain
    python bench/bench_swap.py --report bench/results/swap.json   # rewrite swap.md / swap.png from the JSON

The script starts its own ranks like bench/bench_hier_a2a.py (forked after the imports, env RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT, one torch thread each, gloo over localhost; mesh
node=2,socket=2,gpu=2 for 8 ranks); under torchrun it is the rank torchrun made, the mesh --mesh or
else moe-cluster's MOE_CLUSTER_MESH. Rank 0 alone prints and writes.

What runs, per data distribution (``uniform``: token ids uniform over the vocabulary; ``zipf``:
Zipf(ZIPF_EXPONENT) over a permutation of the vocabulary that differs per node, so each node's
frequent tokens, and hence its hot experts, differ): the tiny LM (moe_compile.samples.tiny_lm,
``grouped_gemm`` MoE layers) with experts sharded by ``moe_compile.shard_experts``, compiled with
options {"mesh", "topology", "expert_swap", "inner_compiler": "aot_eager"} and trained with Adam and
DDP-style gradient averaging, in three variants built from the same weights and fed the same batches:

    HD-d* no swap   d* per layer and step (HierMoE Eq. 6), placement contiguous, no swapper.step()
    HierD-ES        swapper.step() after every optimizer step, policy "hierd" (HierMoE Section IV)
    Smart           swapper.step() after every optimizer step, policy "smart" (raw-token balancing,
                    the paper's HD2-MoE-Smart baseline)

The variants alternate every step (order rotated by one per step, so drift hits all alike). A swap
never changes what the model computes, so the three must see the same losses: the run stops with
the losses if they differ by more than --loss-rtol (relative) on any rank at any step.

Per step and variant: the predicted HD-d time of every layer (``EPLayer.last_times_s[d - 1]``, the
forward's gathered statistics under the placement of that step: one dispatch all-to-all), the
payload bytes per mesh level the layers sent in the step (``EPLayer.last_step_bytes()``: dispatch
and combine, forward and backward), the measured dispatch + combine wall seconds
(``EPLayer.step_comm_s``, both directions), the training step's wall time (forward, backward,
gradient averaging, Adam step, zero_grad; after a barrier), and for the swapping variants the
swapper's ``decision_s`` / ``migration_s`` (``ExpertSwapper.history``, after a barrier), its
``settle_s`` (overlap mode: the wait for a swap's outcome at the next forward) and swaps. Where
the swap time goes is measured from outside by wrapping moe_compile.swap's swapper, policy and transfer
internals in timers at run time (nothing in moe_compile is edited): the swapper's exchanges of
all ranks (posting and waiting), Q (the cost model's swap matrix, or Smart's), the predicted
times of a chosen swap, the two ranks' row exchange (p2p) and the commit.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from bench_hier_a2a import CLUSTER_ALPHA_S, CLUSTER_GBPS, calibrate_local, emulated_cluster_info
from machine import cpu_name, fork_ranks, resolve_ranks
from swap_report import BASE, DISTRIBUTIONS, PART_NAMES, VARIANTS, ZIPF_EXPONENT, write_report
from torch import Tensor, nn

import moe_compile
from moe_compile.cost import hiermoe as cost_hiermoe
from moe_compile.cost.routing import hd_statistics
from moe_compile.cost.topology import Topology
from moe_compile.samples.tiny_lm import TinyLMConfig, TinyMoELM
from moe_compile.swap import policy as swap_policy
from moe_compile.swap import swapper as swap
from moe_compile.swap import transfer as swap_transfer
from moe_compile.swap.options import DEFAULT_HYSTERESIS, DEFAULT_PAYBACK

# Shape legend: B batch, S sequence, V vocabulary.


# ---- timing moe_compile.swap's parts from outside -------------------------------------------------

PARTS: dict[str, float] = {}


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PARTS[name] = PARTS.get(name, 0.0) + time.perf_counter() - t0
    return wrapper


def instrument_swap() -> None:
    """Wrap the functions ``ExpertSwapper.step`` calls in timers (run time only; the wrapped
    functions are called as before). Each part sums into PARTS while a step runs."""
    swap_transfer.Message.__init__ = _timed("exchange_s", swap_transfer.Message.__init__)  # type: ignore[method-assign]
    swap_transfer.Message.wait = _timed("exchange_s", swap_transfer.Message.wait)  # type: ignore[method-assign]
    swap_policy.smart_matrix = _timed("q_s", swap_policy.smart_matrix)  # type: ignore[assignment]
    cost_hiermoe.HDCostModel.swap_matrices = _timed("q_s", cost_hiermoe.HDCostModel.swap_matrices)  # type: ignore[method-assign]
    swap_policy.decide_layer = _timed("decide_layer_s", swap_policy.decide_layer)  # type: ignore[assignment]
    swap_policy.predicted = _timed("predicted_s", swap_policy.predicted)  # type: ignore[assignment]
    swap_transfer.migrate = _timed("migrate_s", swap_transfer.migrate)  # type: ignore[assignment]
    swap_transfer.commit = _timed("commit_s", swap_transfer.commit)  # type: ignore[assignment]


# ---- data and model -------------------------------------------------------------------------------


def make_batches(kind: str, args: argparse.Namespace, rank: int, node: int) -> list[Tensor]:
    """[steps + 1] x [B, S + 1] token ids of this rank (the first batch is the warm-up's)."""
    if kind == "uniform":
        probs_V = torch.ones(args.vocab)
    else:  # Zipf over a permutation of the vocabulary that is the same on a node, different across nodes
        order_V = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(7000 + node))
        probs_V = torch.empty(args.vocab)
        probs_V[order_V] = torch.arange(1, args.vocab + 1, dtype=torch.float32) ** -ZIPF_EXPONENT
    gen = torch.Generator().manual_seed(9000 + rank)
    count = (args.steps + 1) * args.batch * (args.seq + 1)
    ids = torch.multinomial(probs_V, count, replacement=True, generator=gen)
    return list(ids.view(args.steps + 1, args.batch, args.seq + 1))


def build_model(args: argparse.Namespace) -> TinyMoELM:
    torch.manual_seed(0)  # the same weights on every rank and in every variant
    return TinyMoELM(TinyLMConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                                  num_heads=args.heads, num_experts=args.experts, top_k=args.top_k,
                                  ffn_size=args.ffn, moe_kind="grouped_gemm", max_seq_len=args.seq))


class Runner:
    """One variant: its model copy (sharded), the compiled module, Adam and the swapper."""

    def __init__(self, name: str, policy: str | None, base: nn.Module, mesh: Any, topology: Topology,
                 args: argparse.Namespace, first_BS: Tensor) -> None:
        self.name, self.policy = name, policy
        self.model = copy.deepcopy(base)
        self.shards = moe_compile.shard_experts(self.model, mesh, first_BS[:, :-1], first_BS[:, 1:])
        # No swap: no expert_swap option. Besides being what a user without swap compiles, it keeps
        # the three variants' options distinct: Dynamo reuses one compiled graph for two instances of
        # the same model class compiled with equal options, and the second would then run on the
        # first's expert-parallel layers and shards (checked after the warm-up).
        # expert_gather False: the token all-to-alls, whose experts a swap moves (a gathering layer
        # does not swap)
        self.options = {"mesh": mesh, "topology": topology, "inner_compiler": "aot_eager", "expert_gather": False}
        if policy is not None:
            self.options["expert_swap"] = {"every": 1, "policy": policy, "overlap": args.overlap,
                                           "threshold": args.threshold, "payback": args.payback,
                                           "hysteresis": args.hysteresis}
        self.module: Any = None
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        self.swapper: swap.ExpertSwapper | None = None

    def compile(self) -> None:
        self.module = torch.compile(self.model, backend="hiermoe", options=self.options)
        self.swapper = moe_compile.expert_swapper(self.module, self.opt)

    def layers(self) -> list[Any]:
        assert self.swapper is not None
        return self.swapper.layers()

    def train_step(self, ids_BS: Tensor, world: int) -> float:
        """The issue's loop: forward, backward, (gradient averaging,) optimizer step, zero_grad;
        swapper.step() comes after it, so a swap moves weights and optimizer state, no gradients."""
        loss = self.module(ids_BS[:, :-1], ids_BS[:, 1:])
        loss.backward()
        average_gradients(self.model, self.shards, world)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


def average_gradients(model: nn.Module, shards: Any, world: int) -> None:
    """DDP-style: one all-reduce of every replicated gradient, / world; expert shards (their owner
    already holds the sum over every rank's tokens) only / world."""
    shared: list[Tensor] = []
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if shards.owns(p):
            p.grad.div_(world)
        else:
            shared.append(p.grad)
    flat = torch._utils._flatten_dense_tensors(shared)
    dist.all_reduce(flat)
    flat.div_(world)
    for g, avg in zip(shared, torch._utils._unflatten_dense_tensors(flat, shared)):
        g.copy_(avg)


# ---- one distribution on one rank -----------------------------------------------------------------


def run_distribution(kind: str, args: argparse.Namespace, mesh: Any, topology: Topology) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    load_start = os.getloadavg()[0]
    node = mesh.get_coordinate()[0]
    batches = make_batches(kind, args, rank, node)
    base = build_model(args)
    # shard every copy before compiling any: shard_experts resets Dynamo, dropping earlier compiles
    runners = [Runner(name, policy, base, mesh, topology, args, batches[0]) for name, policy in VARIANTS]
    for r in runners:
        r.compile()

    # Step 1: warm-up (compiles forward and backward); its gradients are dropped, nothing steps.
    for r in runners:
        loss = r.module(batches[0][:, :-1], batches[0][:, 1:])
        loss.backward()
        r.opt.zero_grad(set_to_none=True)
    ids = [[lay.layer_id for lay in r.layers()] for r in runners]
    if any(len(i) != args.layers for i in ids) or len({x for i in ids for x in i}) != args.layers * len(runners):
        raise RuntimeError(f"expected {args.layers} expert-parallel layers of its own per variant, got layer ids "
                           f"{ids}: the variants must not share compiled graphs")

    # Step 2: training, the variants alternating every step.
    names = mesh.mesh_dim_names
    records: dict[str, list[dict[str, Any]]] = {r.name: [] for r in runners}
    routing_diffs = 0
    routing_log: dict[str, list[list[Any]]] = {r.name: [] for r in runners}  # [step][layer] this rank's [T, K]
    timings: dict[str, list[swap.StepTiming]] = {r.name: [] for r in runners}
    for step in range(1, args.steps + 1):
        ids_BS = batches[step]
        order = runners[step % len(runners):] + runners[: step % len(runners)]
        topk: dict[str, list[Tensor]] = {}
        for r in order:
            placement = [lay.placement() for lay in r.layers()]  # what this step's forward routes by
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            loss = r.train_step(ids_BS, world)
            step_s, step_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
            lays = r.layers()
            topk[r.name] = [lay.last_topk.clone() for lay in lays]
            routing_log[r.name].append([t.to(torch.int16).numpy() for t in topk[r.name]])
            rec: dict[str, Any] = {
                "step": step, "loss": loss, "step_s": step_s, "step_cpu_s": step_cpu_s,
                "layers": [lay.name for lay in lays],
                "placement": placement,
                "d": [lay.last_dimension for lay in lays],
                "pred_s": [lay.last_times_s[lay.last_dimension - 1] for lay in lays],
                "times_s": [list(lay.last_times_s) for lay in lays],
                "bytes": {n: sum(lay.last_step_bytes()[n] for lay in lays) for n in names},
                "fwd_dispatch_bytes": {n: sum(b for lay in lays for (lv, ph, dr), b in lay.step_bytes.items()
                                              if names[lv] == n and (ph, dr) == ("dispatch", "forward"))
                                       for n in names},
                "comm_s": sum(sum(lay.step_comm_s.values()) for lay in lays),
            }
            if r.policy is not None:
                assert r.swapper is not None
                dist.barrier()  # the swap's time alone, not the wait for ranks still in their step
                PARTS.clear()
                t1 = time.perf_counter()
                made = r.swapper.step()
                wall_s = time.perf_counter() - t1
                timing = r.swapper.history[-1]
                assert timing.step == r.swapper.calls
                timings[r.name].append(timing)  # settle_s grows at the variant's next forward
                rec.update(decision_s=timing.decision_s, migration_s=timing.migration_s, swap_wall_s=wall_s,
                           cpu_s=timing.cpu_s,
                           swaps=[{"layer": s.layer, "experts": list(s.experts), "ranks": list(s.ranks),
                                   "dimension": s.dimension, "objective_before": s.objective_before,
                                   "objective_after": s.objective_after,
                                   "predicted_before_s": s.predicted_before_s,
                                   "predicted_after_s": s.predicted_after_s, "moved_bytes": s.moved_bytes,
                                   "predicted_migration_s": s.predicted_migration_s}
                                  for s in made],
                           parts={p: PARTS.get(p, 0.0) for p in PART_NAMES})
            records[r.name].append(rec)
        ref = topk[BASE]
        routing_diffs += sum(not torch.equal(a, b) for name in topk if name != BASE
                             for a, b in zip(topk[name], ref))
        if rank == 0 and (step % 10 == 0 or step == args.steps):
            print(f"  {kind} step {step}/{args.steps}: " + "  ".join(
                f"{r.name} {records[r.name][-1]['step_s'] * 1e3:.0f} ms" for r in runners), flush=True)

    for r in runners:  # overlap mode: nothing left in flight (undecided rounds are dropped)
        if r.swapper is not None:
            r.swapper.flush()
        for rec, timing in zip([x for x in records[r.name] if "decision_s" in x], timings[r.name], strict=True):
            rec["settle_s"] = timing.settle_s

    # Step 3: the losses must agree (a swap never changes what the model computes).
    worst = 0.0
    for r in runners[1:]:
        for a, b in zip(records[r.name], records[BASE]):
            worst = max(worst, abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-12))
    worst_t = torch.tensor([worst, float(routing_diffs)], dtype=torch.float64)
    dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"records": records, "placement": {r.name: [lay.placement() for lay in r.layers()]
                                                                         for r in runners}})
    routings: list[Any] = [None] * world
    dist.all_gather_object(routings, routing_log)
    exact = exact_predictions(routings, runners, records, args.overlap) if rank == 0 else None
    if float(worst_t[0]) > args.loss_rtol:
        if rank == 0:
            for r in runners:
                print(r.name, [round(x["loss"], 6) for x in records[r.name]], file=sys.stderr)
        raise RuntimeError(f"{kind}: the variants' losses differ by {float(worst_t[0]):.2e} (relative) on some rank, "
                           f"more than --loss-rtol {args.loss_rtol}: a swap changed what the model computes")
    return {"distribution": kind, "max_loss_rel_diff": float(worst_t[0]), "exact": exact,
            "loadavg_1m": [load_start, os.getloadavg()[0]],
            "routing_diffs_max_rank": int(worst_t[1]), "ranks": gathered}


# ---- aggregation (rank 0) -------------------------------------------------------------------------


def exact_predictions(routings: list[Any], runners: list[Runner], records: dict[str, list[dict[str, Any]]],
                      overlap: bool = False) -> dict[str, Any]:
    """Per variant, step and layer: the HD-d time (plain max, d the one used) from every rank's
    routing together (``hd_statistics`` with each token's source rank: what HierD-ES's Q and its
    SwapRecord.predicted_*_s use), under the step's placement; and the largest relative difference
    between a swap's predicted_before_s and this (same routing, same placement)."""
    comm = runners[0].layers()[0].comm
    sizes = tuple(comm.sizes)
    assert list(comm.ranks) == list(range(len(routings))), "mesh position != global rank"
    out: dict[str, Any] = {}
    for r in runners:
        lays = r.layers()
        per_step, balance, worst = [], [], 0.0
        for i, rec in enumerate(records[r.name]):
            row, bal = [], []
            for j, lay in enumerate(lays):
                parts = [routings[g][r.name][i][j].astype(np.int64) for g in range(len(routings))]
                # (token, expert) pairs each rank's experts compute: the busiest over the mean
                load_G = np.bincount(np.asarray(rec["placement"][j])[np.concatenate(parts).ravel()],
                                     minlength=len(routings))
                bal.append(float(load_G.max() / load_G.mean()))
                token_rank = np.concatenate([np.full(len(p), g) for g, p in enumerate(parts)])
                stats = hd_statistics(np.concatenate(parts), lay.num_experts, sizes,
                                      placement=np.asarray(rec["placement"][j]), token_rank=token_rank)
                row.append(float(lay.cost.times_s(stats)[rec["d"][j] - 1]))
            per_step.append(row)
            balance.append(bal)
            for s in rec.get("swaps", []):
                j = rec["layers"].index(s["layer"])
                if overlap:  # decided on step i-2's routing, under the placement step i ran with
                    parts = [routings[g][r.name][i - 2][j].astype(np.int64) for g in range(len(routings))]
                    token_rank = np.concatenate([np.full(len(p), g) for g, p in enumerate(parts)])
                    stats = hd_statistics(np.concatenate(parts), lays[j].num_experts, sizes,
                                          placement=np.asarray(rec["placement"][j]), token_rank=token_rank)
                    want = float(lays[j].cost.times_s(stats)[s["dimension"] - 1])
                else:
                    want = row[j]
                worst = max(worst, abs(s["predicted_before_s"] - want) / want)
        out[r.name] = {"pred_s": per_step, "rank_load_max_over_mean": balance,
                       "swap_predicted_before_rel_diff": worst if r.policy else None}
    # how skewed the routing is (the same in every variant): per step and layer, the busiest expert's
    # (token, expert) count over the mean, over all tokens and within each node's tokens
    nodes = sizes[0]
    skew: list[list[dict[str, Any]]] = []
    for i in range(len(records[runners[0].name])):
        skew_row: list[dict[str, Any]] = []
        for j, lay in enumerate(runners[0].layers()):
            parts = [routings[g][runners[0].name][i][j].astype(np.int64) for g in range(len(routings))]
            per_node = [np.bincount(np.concatenate(parts[n * len(parts) // nodes:(n + 1) * len(parts) // nodes])
                                    .ravel(), minlength=lay.num_experts) for n in range(nodes)]
            total = np.sum(per_node, axis=0)
            skew_row.append({"all": float(total.max() / total.mean()),
                             "per_node": [float(c.max() / c.mean()) for c in per_node],
                             "hot_experts_per_node": [np.argsort(-c)[:4].tolist() for c in per_node]})
        skew.append(skew_row)
    out["routing_skew"] = skew
    return out



def aggregate(res: dict[str, Any], names: tuple[str, ...]) -> dict[str, list[dict[str, Any]]]:
    """Per variant, per step: figures over ranks (max / sum), from every rank's records."""
    ranks = [g["records"] for g in res["ranks"]]
    out: dict[str, list[dict[str, Any]]] = {}
    for name, _ in VARIANTS:
        steps = []
        for i, r0 in enumerate(ranks[0][name]):
            per = [rr[name][i] for rr in ranks]
            exact = res["exact"][name]["pred_s"][i]
            balance = res["exact"][name]["rank_load_max_over_mean"][i]
            row: dict[str, Any] = {
                "step": r0["step"], "loss_rank0": r0["loss"], "d": r0["d"], "pred_s": sum(r0["pred_s"]),
                "pred_s_per_layer": r0["pred_s"], "exact_pred_s": sum(exact), "exact_pred_s_per_layer": exact,
                "placement": r0["placement"], "rank_load_max_over_mean": max(balance),
                "per_rank": {"loss": [p["loss"] for p in per], "step_s": [p["step_s"] for p in per],
                             "comm_s": [p["comm_s"] for p in per], "bytes": [p["bytes"] for p in per],
                             "fwd_dispatch_bytes": [p["fwd_dispatch_bytes"] for p in per]},
                "step_s": max(p["step_s"] for p in per), "comm_s": max(p["comm_s"] for p in per),
                "bytes_max": {n: max(p["bytes"][n] for p in per) for n in names},
                "bytes_sum": {n: sum(p["bytes"][n] for p in per) for n in names},
                "fwd_dispatch_bytes_sum": {n: sum(p["fwd_dispatch_bytes"][n] for p in per) for n in names},
            }
            if "decision_s" in r0:
                row["decision_s"] = max(p["decision_s"] for p in per)
                row["migration_s"] = max(p["migration_s"] for p in per)
                row["settle_s"] = max(p["settle_s"] for p in per)
                row["swap_s"] = max(p["decision_s"] + p["migration_s"] + p["settle_s"] for p in per)
                row["swap_wall_s"] = max(p["swap_wall_s"] for p in per)
                row["overhead"] = row["swap_s"] / row["step_s"]
                row["cpu_s"] = max(p["cpu_s"] for p in per)
                row["cpu_overhead"] = row["cpu_s"] / row["step_s"]
                # each rank's swapper CPU over its own training-step CPU: the overhead a rank with a
                # core of its own would see if its step were CPU-bound (older results lack it)
                if all("step_cpu_s" in p for p in per):
                    row["cpu_share"] = max(p["cpu_s"] / p["step_cpu_s"] for p in per)
                row["swaps"] = r0["swaps"]
                row["per_rank"].update({k: [p[k] for p in per] for k in ("decision_s", "migration_s", "settle_s",
                                                                          "swap_wall_s", "parts")})
                row["per_rank"]["moved_bytes"] = [sum(s["moved_bytes"] for s in p["swaps"]) for p in per]
                row["moved_bytes_sum"] = sum(s["moved_bytes"] for p in per for s in p["swaps"])
                row["parts_max"] = {k: max(p["parts"][k] for p in per) for k in PART_NAMES}
                row["rest_max"] = max(p["decision_s"] + p["migration_s"] - sum(p["parts"][k] for k in (
                    "exchange_s", "decide_layer_s", "migrate_s", "commit_s")) for p in per)
            steps.append(row)
        out[name] = steps
    return out


# ---- report (rank 0) ------------------------------------------------------------------------------


def machine_info(loadavg: float) -> dict[str, Any]:
    return {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "torch_threads_per_rank": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "loadavg_1m_at_start": loadavg,
            "loadavg_1m_at_end": os.getloadavg()[0], "emulated_cluster": emulated_cluster_info()}


# ---- one rank -------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64  # one entry per compiled variant of the same forward
    loadavg = float(os.environ.get("SWAP_BENCH_LOADAVG", os.getloadavg()[0]))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", args.mesh_sizes, mesh_dim_names=args.mesh_names)
    say = print if rank == 0 else (lambda *a, **k: None)
    instrument_swap()
    start = time.perf_counter()
    fit_info: list[dict[str, Any]] = []
    if args.topology_file == "stated":
        links = {n: {"alpha_s": CLUSTER_ALPHA_S, "bandwidth_gbps": CLUSTER_GBPS.get(n, 10.0)} for n in args.mesh_names}
        topology = Topology.from_mesh(mesh, links, name="emulated cluster (stated)")
        source = "bench/clusters/two_node_two_socket.toml's stated figures, not measured"
    elif args.topology_file:
        topology, source = Topology.load(args.topology_file), f"from `{args.topology_file}`"
    else:
        fitted, fit_info = calibrate_local(mesh, args.mesh_names, args.mesh_sizes, args.quick)
        if fitted is not None:
            topology, source = fitted, f"{fitted.name}; fit r2 " + ", ".join(
                f"{f['level']} {f['r2']:.3f}" for f in fit_info)
        else:  # too noisy to fit: the emulated cluster's stated figures, said so in the report
            links = {n: {"alpha_s": CLUSTER_ALPHA_S, "bandwidth_gbps": CLUSTER_GBPS.get(n, 10.0)}
                     for n in args.mesh_names}
            topology = Topology.from_mesh(mesh, links, name="emulated cluster (stated)")
            source = "the fit at start had no positive beta; bench/clusters/two_node_two_socket.toml's stated figures"
    say(f"[{time.perf_counter() - start:6.1f} s] topology ({source}): " + ", ".join(
        f"{lv.name} alpha {lv.alpha_s * 1e6:.0f} us, {lv.bandwidth_gbps:.3g} Gbit/s" for lv in topology.levels),
        flush=True)
    results = []
    for kind in args.distributions:
        res = run_distribution(kind, args, mesh, topology)
        say(f"[{time.perf_counter() - start:6.1f} s] {kind} done (max loss difference {res['max_loss_rel_diff']:.1e})",
            flush=True)
        if rank == 0:
            res["steps"] = aggregate(res, args.mesh_names)
            res["final_placement"] = res.pop("ranks")[0]["placement"]  # every number is in res["steps"] now
            results.append(res)
    if rank == 0:
        topo = topology.to_dict()
        topo["source"] = source
        payload = {
            "command": " ".join(["python bench/bench_swap.py", *args.argv]), "machine": machine_info(loadavg),
            "world": dist.get_world_size(), "mesh": dict(zip(args.mesh_names, args.mesh_sizes)),
            "topology": topo, "calibration": fit_info, "steps": args.steps, "window": args.window, "lr": args.lr,
            "loss_rtol": args.loss_rtol, "overlap": args.overlap, "threshold": args.threshold, "payback": args.payback,
            "hysteresis": args.hysteresis,
            "zipf_exponent": ZIPF_EXPONENT, "wall_s": time.perf_counter() - start,
            "model": {k: getattr(args, k) for k in ("layers", "hidden", "ffn", "heads", "experts", "top_k", "vocab",
                                                    "batch", "seq")},
            "distributions": results,
        }
        write_report(payload, None if args.out is None else Path(args.out))
    dist.barrier()
    dist.destroy_process_group()


# ---- launcher -------------------------------------------------------------------------------------


def launch(args: argparse.Namespace) -> int:
    """Fork ``args.world`` local ranks running ``worker`` (bench/machine.py's fork_ranks)."""
    return fork_ranks(args.world, worker, args, args.timeout, "swapbench", "SWAP_BENCH_LOADAVG")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="6 steps of a smaller model; writes nothing unless --out")
    p.add_argument("--world", type=int, default=None, help="ranks to start (default 8; under torchrun its WORLD_SIZE)")
    p.add_argument("--mesh", default=None, help="levels slowest first, NAME=SIZE,... (default node=2,socket=2,gpu=2; "
                                                "under moe-cluster its MOE_CLUSTER_MESH)")
    p.add_argument("--topology", dest="topology_file", default=None, metavar="TOML",
                   help="topology file for the cost model, or 'stated': bench_hier_a2a's figures for the emulated "
                        "cluster (node 0.4, socket 2, gpu 10 Gbit/s, alpha 20 us); default: the ranks' links "
                        "fitted at start")
    p.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS))
    p.add_argument("--steps", type=int, default=None, help="training steps (default 50; 6 quick)")
    p.add_argument("--window", type=int, default=None,
                   help="the last steps summarized apart, after swaps settled (default steps // 2)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=None, help="default 128 (64 quick)")
    p.add_argument("--ffn", type=int, default=None, help="default 256 (128 quick)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=None, help="sequences per rank and step (default 4; 2 quick)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 64; 32 quick)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--loss-rtol", type=float, default=1e-4, help="largest relative loss difference between variants")
    p.add_argument("--out", default=None, help="results path without suffix (default bench/results/swap; with "
                                               "--quick nothing is written unless given)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the forked ranks are killed")
    p.add_argument("--pg-timeout", type=float, default=900.0, help="process group timeout, seconds")
    p.add_argument("--threshold", type=float, default=0.0,
                   help="expert_swap threshold: swap only when the objective drops by more than this fraction")
    p.add_argument("--payback", type=float, default=DEFAULT_PAYBACK,
                   help="expert_swap payback: swap only when the predicted a2a time saved over this many steps "
                        f"exceeds the predicted time to move the two experts (default {DEFAULT_PAYBACK:g}, the "
                        "library's; 0: off, swap on any predicted gain)")
    p.add_argument("--hysteresis", type=int, default=DEFAULT_HYSTERESIS,
                   help="expert_swap hysteresis: a pair swapped is not swapped again for this many calls "
                        f"(default {DEFAULT_HYSTERESIS}, the library's; 0: off, as in the results committed before "
                        "it existed)")
    p.add_argument("--overlap", action="store_true",
                   help="swappers in overlap mode (collectives in flight across steps; default results path "
                        "bench/results/swap_overlap)")
    p.add_argument("--report", default=None, metavar="JSON", help="only rewrite the .md and .png from a results JSON")
    args = p.parse_args(argv)
    args.argv = argv
    args.steps = args.steps or (6 if args.quick else 50)
    args.window = min(args.window or max(1, args.steps // 2), args.steps)
    args.hidden = args.hidden or (64 if args.quick else 128)
    args.ffn = args.ffn or (128 if args.quick else 256)
    args.batch = args.batch or (2 if args.quick else 4)
    args.seq = args.seq or (32 if args.quick else 64)
    if args.out is None and not args.quick:
        args.out = str(Path(__file__).parent / "results" / ("swap_overlap" if args.overlap else "swap"))
    resolve_ranks(p, args, None if args.topology_file == "stated" else args.topology_file)
    if args.experts % args.world:
        p.error(f"--experts {args.experts} must be divisible by the {args.world} ranks")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.report:
        payload = json.loads(Path(args.report).read_text())
        write_report(payload, Path(args.report).with_suffix(""))
        return 0
    if "RANK" in os.environ:  # started by torchrun or moe-cluster: be that rank
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())

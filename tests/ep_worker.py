"""One rank of the expert-parallel tests (launched by tests/dist_utils.py; gloo on CPU).

Each case writes this rank's measurements to $HIERMOE_TEST_OUT/rank<r>.json; the test process
asserts on them. References are computed here on the same rank: the single-process expert op
(``hiermoe::experts``, itself checked against eager elsewhere) or the eager model.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import json
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import moe_compile
from moe_compile.backend import collect_reports
from moe_compile.cost.routing import hd_statistics
from moe_compile.cost.topology import Topology
from moe_compile.ep import runtime, setup
from moe_compile.lowering.ep_stages import staged_experts
from moe_compile.samples.tiny_lm import TinyLMConfig, TinyMoELM

LEVELS = ("node", "socket", "gpu")
PARAMS: dict[str, Any] = json.loads(os.environ.get("HIERMOE_TEST_PARAMS", "{}"))


# Adam's eps where compiled and eager training are compared weight by weight: with the default
# 1e-8, an entry whose gradient is near eps turns a 1e-7 summation-order difference into an update
# difference of order lr (g / (|g| + eps) jumps between 0 and 1), so the comparison measured the
# optimizer's conditioning, not the rewrite. 1e-4 keeps Adam's behaviour on every gradient above it.
ADAM_EPS = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) if b.numel() else 0.0


def make_mesh(shape: list[int]) -> Any:
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=LEVELS[-len(shape):])


def routing(kind: str, T: int, K: int, E: int, rank: int) -> torch.Tensor:  # noqa: N803
    gen = torch.Generator().manual_seed(1000 + rank)
    if kind == "one_expert":  # every token of every rank picks expert 0 first (K > 1: then others)
        rest = torch.stack([torch.randperm(E - 1, generator=gen)[: K - 1] + 1 for _ in range(T)]) if K > 1 else None
        first = torch.zeros(T, 1, dtype=torch.long)
        return first if rest is None else torch.cat([first, rest], 1)
    if kind == "empty_rank" and rank == 1:  # rank 1 has no tokens at all
        return torch.zeros(0, K, dtype=torch.long)
    if kind == "local_only":  # every token stays on its own rank: nothing crosses a link
        per = E // dist.get_world_size()
        return torch.stack([torch.randperm(per, generator=gen)[:K] + rank * per for _ in range(T)])
    return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])


def expected_bytes(idx: np.ndarray, E: int, shape: list[int], me: int, d: int, dedup: bool,  # noqa: N803
                   row_bytes: int) -> dict[int, int]:
    """Payload bytes this rank must send per level in forward dispatch, computed from the routing
    alone: every level for the flat all-to-all (d = 1), the slowest level for d > 1 (the dedup
    lower bound: distinct (token, destination node) pairs)."""
    G = math.prod(shape)  # noqa: N806
    dest = idx // (E // G)  # [T, K] rank of each slot
    coords = np.array(np.unravel_index(np.arange(G), shape)).T  # [G, D]
    mine = coords[me]
    out: dict[int, int] = {}
    if d == 1:
        diff = coords[dest] != mine  # [T, K, D]
        first = np.where(diff.any(-1), diff.argmax(-1), -1)
        for lv in range(len(shape)):
            if dedup:
                pairs = {(t, int(q)) for t, k in zip(*np.nonzero(first == lv), strict=True) for q in [dest[t, k]]}
                out[lv] = len(pairs) * row_bytes
            else:
                out[lv] = int((first == lv).sum()) * row_bytes
        return out
    node = coords[dest][..., 0]
    away = node != mine[0]
    if dedup:
        out[0] = len({(t, int(node[t, k])) for t, k in zip(*np.nonzero(away), strict=True)}) * row_bytes
    else:
        out[0] = int(away.sum()) * row_bytes
    return out


def case_op_matrix() -> dict[str, Any]:
    """Every d and both dedup modes on several routings: outputs and all gradients against the
    single-process op; traffic against the routing-derived counts. ``dtype``: the tokens' and
    expert weights' (the routing weights stay float32, as under torch.autocast)."""
    shape, E, K, H, F, T = (PARAMS[k] for k in ("shape", "E", "K", "H", "F", "T"))  # noqa: N806
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = make_mesh(shape)
    dtype = getattr(torch, PARAMS.get("dtype", "float32"))
    torch.manual_seed(0)  # same weights on every rank
    full = [None if w is None else w.to(dtype) for w in (
        torch.randn(E, F, H), torch.randn(E, F, H), torch.randn(E, H, F), torch.randn(E, F), None, torch.randn(E, H))]
    records = []
    for kind in PARAMS["routings"]:
        k = E if kind == "k_eq_e" else min(K, E // world) if kind == "local_only" else K
        t = 1 if kind == "t1" else T
        idx = routing(kind, t, k, E, rank)
        gen = torch.Generator().manual_seed(2000 + rank)
        x = torch.randn(idx.shape[0], H, generator=gen).to(dtype)
        tw = torch.rand(idx.shape[0], k, generator=gen)
        g = torch.randn(idx.shape[0], H, generator=gen)
        ref_w = [None if w is None else w.clone().requires_grad_() for w in full]
        xr, twr = x.clone().requires_grad_(), tw.clone().requires_grad_()
        y_ref = torch.ops.hiermoe.experts(xr, idx, twr, *ref_w, "silu")
        grads_ref = torch.autograd.grad(y_ref, [xr, twr, *(w for w in ref_w if w is not None)], g)
        for dedup, d, mode in itertools.product((True, False), range(1, len(shape) + 1), ("stages", "resend")):
            if mode == "resend" and (not dedup or d != len(shape)):  # the fused op on the deepest route only
                continue
            lay = setup.build_layer(name=f"{kind}-{dedup}-{d}", mesh=mesh, topology=None, dimension=d,
                                    dedup=dedup, num_experts=E, top_k=k, hidden_size=H, ffn_size=F,
                                    gated=True, dtype=dtype, device=torch.device("cpu"))
            first, n = lay.local_experts[0], len(lay.local_experts)
            ws = [None if w is None else w.clone().requires_grad_() for w in full]
            by_expert = d % 2 == 1  # both row modes: every expert's rows, or only the local slots
            local = [None if w is None else w if by_expert else w.narrow(0, first, n) for w in ws]
            xe, twe = x.clone().requires_grad_(), tw.clone().requires_grad_()
            runtime.reset_counters()
            if mode == "resend":
                y, dim = torch.ops.hiermoe.ep_experts(xe, idx, twe, *local, "silu", lay.layer_id, by_expert)
                used = int(dim[0])
            else:
                y = staged_experts(xe, idx, twe, local, "silu", lay.layer_id, by_expert, k if dedup else 1)
                used = lay.last_dimension
            grads = torch.autograd.grad(y, [xe, twe, *(w for w in ws if w is not None)], g)
            errs = {"y": rel_err(y.float(), y_ref.float()), "x": rel_err(grads[0].float(), grads_ref[0].float()),
                    "topk_weights": rel_err(grads[1], grads_ref[1])}
            for i, (a, b) in enumerate(zip(grads[2:], grads_ref[2:], strict=True)):
                a, b = a.clone(), b.clone()
                dist.all_reduce(a)  # expert grads live on their owner: compare the sums over ranks
                dist.all_reduce(b)
                errs[f"w{i}"] = rel_err(a.float(), b.float())
            c = runtime.counters()
            row_bytes = H * x.element_size()
            stats = hd_statistics(idx, E, shape)
            p_inter1 = stats.p_inter[0] if len(shape) > 1 else None
            p_flat = stats.p_intra[0]
            records.append({
                "kind": kind, "dedup": dedup, "d": d, "mode": mode, "used": used, "errs": errs,
                "dtypes": [str(t.dtype).removeprefix("torch.") for t in (y, y_ref, grads[0], grads[1])],
                "sent": {lv: {ph: {dr: c[name][ph][dr]["payload_bytes"] for dr in ("forward", "backward")}
                              for ph in ("dispatch", "combine")} for lv, name in enumerate(mesh.mesh_dim_names)},
                "meta": sum(c[name][ph][dr]["meta_bytes"] for name in mesh.mesh_dim_names
                            for ph in ("dispatch", "combine") for dr in ("forward", "backward")),
                "expected": expected_bytes(idx.numpy(), E, shape, rank, d, dedup, row_bytes),
                # HierMoE Eq. 4 and Eq. 2 from this rank's p statistics, without the max padding
                # (sum over destinations that are not this rank's own) and with it (n_a2a)
                "eq4_sum": None if p_inter1 is None else
                int(p_inter1.sum() - p_inter1[mesh.get_coordinate()[0]]) * row_bytes,
                "eq4_n": None if p_inter1 is None else int(shape[0] * p_inter1.max()) * row_bytes,
                "eq2_sum": int(p_flat.sum() - p_flat[rank]) * row_bytes,
                "eq2_n": int(world * p_flat.max()) * row_bytes,
            })
    return {"records": records}


def tiny(kind: str, E: int, seed: int = 0) -> TinyMoELM:  # noqa: N803
    torch.manual_seed(seed)
    return TinyMoELM(TinyLMConfig(moe_kind=kind, num_experts=E))


def average_grads(model: torch.nn.Module, shard_report: Any) -> None:
    """What DDP does: average every gradient over ranks; an expert shard's gradient already sums
    every rank's tokens (its owner is the only holder), so it is only divided."""
    world = dist.get_world_size()
    for p in model.parameters():
        if shard_report is not None and shard_report.owns(p):
            if p.grad is not None:
                p.grad /= world
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= world


def compile_options(mesh: Any) -> dict[str, Any]:
    opts: dict[str, Any] = {"mesh": mesh, "inner_compiler": PARAMS.get("inner_compiler", "aot_eager")}
    for key in ("dimension", "dedup", "topology", "ep_backward", "kernels", "pipeline"):
        if key in PARAMS:
            opts[key] = PARAMS[key]
    if opts.get("dimension") is None:  # these cases test the token all-to-alls (gather_worker.py the gathers),
        opts["expert_gather"] = PARAMS.get("expert_gather", False)  # on experts every rank holds (not sharded):
        opts["replicated_experts"] = False  # else the planner runs them replicated, nothing sent (plan_worker.case_probe)
    return opts


def summed_grad_err(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    """Largest relative error over the parameters between the compiled model's gradients and the
    eager reference's, each summed over the ranks (an expert module this rank does not hold has
    no gradient here: zeros)."""
    errs = []
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        a = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        b = q.grad.clone()
        dist.all_reduce(a)
        dist.all_reduce(b)
        errs.append(rel_err(a, b))
    return max(errs)


def case_compile() -> dict[str, Any]:
    """Compiled tiny LM over the mesh against the eager model, forward and backward, per rank."""
    rank = dist.get_rank()
    mesh = make_mesh(PARAMS["shape"])
    out: dict[str, Any] = {}
    for kind in PARAMS["kinds"]:
        torch._dynamo.reset()
        model = tiny(kind, PARAMS.get("E", 8))
        ref = copy.deepcopy(model)
        compiled = torch.compile(model, backend="hiermoe", options=compile_options(mesh))
        gen = torch.Generator().manual_seed(10 + rank)
        ids = torch.randint(0, 32, (2, 8), generator=gen)
        with collect_reports() as graphs:
            runtime.reset_counters()
            loss, loss_ref = compiled(ids, ids), ref(ids, ids)
            loss.backward()
            loss_ref.backward()
        c = runtime.counters()
        # payload and metadata bytes this rank sent, per (phase, direction), over every level
        sent = {f"{ph} {dr} {kind}": sum(c[lv][ph][dr][f"{kind}_bytes"] for lv in c)
                for ph in ("dispatch", "combine") for dr in ("forward", "backward") for kind in ("payload", "meta")}
        ops = sum(lay.num_steps > 0 for lay in runtime.layers())
        code = "\n".join(gr.after for gr in graphs)
        out[kind] = {"loss": float(loss), "loss_ref": float(loss_ref), "grad_err": summed_grad_err(model, ref),
                     "layers_run": ops,
                     "sent": sent, "stage_ops": code.count("hiermoe.ep_dispatch"),
                     "triton_stages": code.count("triton = True"),
                     "fused_ops": code.count("hiermoe.ep_experts"),
                     "saved_bytes": [lay.saved_bytes for lay in runtime.layers()][-2:],
                     "d": [lay.last_dimension for lay in runtime.layers()][-2:],
                     "times": [lay.last_times_s for lay in runtime.layers()][-2:]}
    return out


@contextmanager
def counting(module: Any, name: str) -> Iterator[list[int]]:
    """Counts the calls of ``module.name`` inside the block (the real function still runs)."""
    real, calls = getattr(module, name), [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield calls
    finally:
        setattr(module, name, real)


def _between(code: str, start: str, wait: str, what: str) -> int:
    """Lines calling ``what`` between the first line with ``start`` and the next with ``wait``."""
    lines = code.splitlines()
    i = next((k for k, line in enumerate(lines) if start in line), None)
    if i is None:
        return -1
    j = next(k for k in range(i + 1, len(lines)) if wait in lines[k])
    return sum(what in line for line in lines[i + 1: j])


def case_overlap() -> dict[str, Any]:
    """The tiny LM with DeepSeek-V3 layers (a shared expert beside the routed ones) compiled with
    overlap on and off: every stage split into start and wait, the shared expert's matmuls between
    the dispatch's start and wait (forward) and the combine backward's (backward), in the graph and
    in the code Inductor generates, and the same loss and gradients as eager."""
    from torch._inductor.utils import run_and_get_code

    from moe_compile.ep import worker

    rank = dist.get_rank()
    mesh = make_mesh(PARAMS["shape"])
    gen = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(0, 32, (2, 8), generator=gen)
    out: dict[str, Any] = {}
    for overlap in (True, False):
        torch._dynamo.reset()
        model = tiny("deepseek_v3", 8)
        ref = copy.deepcopy(model)
        options = {**compile_options(mesh), "overlap": overlap}
        if not overlap:  # nothing to find in Inductor's code: the cheaper compiler checks the values
            options["inner_compiler"] = "aot_eager"
        compiled = torch.compile(model, backend="hiermoe", options=options)

        def step(compiled: Any = compiled) -> torch.Tensor:
            loss = compiled(ids, ids)
            loss.backward()
            return loss

        with collect_reports() as graphs:
            loss, inductor_code = run_and_get_code(step)
        loss_ref = ref(ids, ids)
        loss_ref.backward()
        sched = [s for g in graphs for s in g.scheduled]
        res: dict[str, Any] = {"loss": float(loss), "loss_ref": float(loss_ref),
                               "grad_err": summed_grad_err(model, ref),
                               "stages": [[n, m] for n, m, _ in sched], "in_flight": worker.in_flight()}
        if sched:
            fw, bw = sched[0][2], sched[-1][2]
            res["fw_between"] = _between(fw, "ep_dispatch_start", "ep_dispatch_wait", "aten.mm")
            res["bw_between"] = _between(bw, "ep_combine_backward_start", "ep_combine_backward_wait", "aten.mm")
        if inductor_code:
            code = "\n".join(inductor_code)
            if os.environ.get("HIERMOE_SHOW_CODE") and rank == 0 and overlap:
                Path("/tmp/r/inductor_code.py").write_text(code)
            res["inductor_fw_between"] = _between(code, "ep_dispatch_start", "ep_dispatch_wait", "mm(")
            res["inductor_bw_between"] = _between(code, "ep_combine_backward_start", "ep_combine_backward_wait", "mm(")
        out[str(overlap)] = res
    return out


def case_pipeline() -> dict[str, Any]:
    """The tiny LM (grouped GEMM layers) with each layer's tokens in n chunks (options pipeline =
    n), on 16 tokens per rank and on 3 (so with n = 5 two chunks are empty on every rank), and
    with pipeline "auto" and "tune", on a topology where the experts' compute and the transfers
    are alike.
    Per case: loss and summed gradients against eager, the dispatch stages in the graph, the
    plan explain shows, what is left in flight, the throwaway graphs autotune compiled."""
    from moe_compile.ep import worker
    from moe_compile.passes import autotune

    autotune.TUNE_ROUNDS = 2  # CI time: what is asserted is the rule and the agreement, not which n wins
    rank = dist.get_rank()
    mesh = make_mesh(PARAMS["shape"])
    links = {n: {"alpha_s": 1e-6, "bandwidth_gbps": 0.001} for n in mesh.mesh_dim_names}
    balanced = Topology.from_mesh(mesh, links, flops_per_s=2e7)  # tens of ms each: chunks pay in the model
    out: dict[str, Any] = {}
    cases = [("n5 empty chunks", 5, (1, 3), None), ("auto", "auto", (2, 8), balanced),
             ("tune", "tune", (2, 8), balanced)]
    for label, chunks, shape, topology in cases:
        torch._dynamo.reset()
        before = len(runtime.layers())
        model = tiny("grouped_gemm", 8)
        ref = copy.deepcopy(model)
        options = {**compile_options(mesh), "pipeline": chunks}
        if topology is not None:
            options["topology"] = topology
        compiled = torch.compile(model, backend="hiermoe", options=options)
        gen = torch.Generator().manual_seed(10 + rank)
        ids = torch.randint(0, 32, shape, generator=gen)
        with collect_reports() as graphs, counting(autotune, "_compiled") as compiles:
            loss = compiled(ids, ids)
            loss.backward()
        loss_ref = ref(ids, ids)
        loss_ref.backward()
        code = "\n".join(gr.after for gr in graphs)
        out[label] = {"loss": float(loss), "loss_ref": float(loss_ref), "grad_err": summed_grad_err(model, ref),
                      "dispatches": code.count("hiermoe.ep_dispatch.default"), "begins": code.count("hiermoe.ep_begin"),
                      "plans": [r.plan for g in graphs for r in g.regions],
                      "pipelines": [r.pipeline for g in graphs for r in g.regions],
                      "scheduled": [[n, m] for g in graphs for n, m, _ in g.scheduled],
                      "in_flight": worker.in_flight(), "new_layers": len(runtime.layers()) - before,
                      "tune_compiles": compiles[0]}
    return out


def case_train() -> dict[str, Any]:
    """A few AdamW steps: compiled expert-parallel model (gradients averaged over ranks, as DDP
    does) against the eager model wrapped in DistributedDataParallel."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = make_mesh(PARAMS["shape"])
    kind, steps = PARAMS["kind"], PARAMS["steps"]
    model = tiny(kind, PARAMS.get("E", 8))
    eager = DDP(copy.deepcopy(model))
    options = compile_options(mesh)
    if "topology_gbps" in PARAMS:
        from moe_compile.cost.topology import Topology

        links = {n: {"alpha_s": 2e-5, "bandwidth_gbps": g}
                 for n, g in zip(mesh.mesh_dim_names, PARAMS["topology_gbps"], strict=True)}
        options["topology"] = Topology.from_mesh(mesh, links)
    compiled = torch.compile(model, backend="hiermoe", options=options)
    def run(module: Any, params: Any, average: bool) -> list[float]:
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
        gen = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(steps):
            ids = torch.randint(0, 32, (2, 8 + 1), generator=gen)
            loss = module(ids[:, :-1], ids[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if average:  # what DDP does to the eager model's gradients
                for p in params:
                    if p.grad is None:  # experts held by other ranks: this rank's share is zero
                        p.grad = torch.zeros_like(p)
                    dist.all_reduce(p.grad)
                    p.grad /= world
            opt.step()
            losses.append(float(loss))
        return losses

    losses_eager = run(eager, list(eager.parameters()), average=False)
    losses = run(compiled, list(model.parameters()), average=True)
    return {"eager": losses_eager, "compiled": losses}


def topology_for(mesh: Any, node_gbps: float, inner_gbps: float) -> Any:
    from moe_compile.cost.topology import Topology

    names = mesh.mesh_dim_names
    links = {n: {"alpha_s": 2e-5, "bandwidth_gbps": node_gbps if i == 0 else inner_gbps} for i, n in enumerate(names)}
    return Topology.from_mesh(mesh, links, flops_per_s=1e12)


def case_explain() -> dict[str, Any]:
    """explain under torchrun: the d each layer used, every d's prediction, and the bytes sent,
    on a topology whose inter-node link is slow and on one with equal links; and the slow one
    again with the runtime told that the mesh is too large to gather statistics (each rank's
    own, max-reduced)."""
    from moe_compile.cost.hiermoe import dimension_rule

    mesh = make_mesh(PARAMS["shape"])
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for label, node_gbps in (("slow_node", 0.1), ("flat", 100.0), ("slow_node_max_reduced", 0.1)):
        runtime.GATHER_MAX = 0 if label.endswith("max_reduced") else 2**17
        model = tiny("grouped_gemm", 8)
        model.config.top_k = 4
        gen = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, 32, (4, 16), generator=gen)
        runtime.reset_counters()
        report = moe_compile.explain(model, ids, ids, options={
            "mesh": mesh, "topology": topology_for(mesh, node_gbps, 100.0), "inner_compiler": "aot_eager",
            "tune_dimension": 3, "expert_gather": False, "model_centric": False, "replicated_experts": False,
            "dedup": True})  # HD-d with d* per step; reaches the layers; explain's one forward is not measured
        c = runtime.counters()
        sent = {lv: sum(c[lv][ph]["forward"]["payload_bytes"] for ph in ("dispatch", "combine")) for lv in c}
        layers = []
        rounds = [lay.tuner.rounds for lay in runtime.layers()][-len(report.regions):]
        for r in report.regions:
            p = r.parallel
            times = list(p["predicted_s"].values())
            layers.append({"d": p["dimension"], "rule": dimension_rule(times), "times": times,
                           "statistics": p["statistics"],
                           "bytes": p["bytes_per_level"], "local": p["local_experts"]})
        out[label] = {"layers": layers, "counters": sent, "text": str(report), "tune_rounds": rounds}
    return out


def case_lag() -> dict[str, Any]:
    """d* from the previous forward's statistics: two forwards with different routings; the
    second decides from the first's gathered statistics (its own are exchanged off the critical
    path and read afterwards), or from its own with ``lag_statistics = False``."""
    from moe_compile.cost.routing import gathered_statistics, source_table
    from moe_compile.lowering.ep_stages import staged_experts

    shape = PARAMS["shape"]
    mesh = make_mesh(shape)
    rank = dist.get_rank()
    E, K, H, F, T = 8, 2, 6, 5, 12  # noqa: N806
    topo = topology_for(mesh, 0.1, 100.0)
    torch.manual_seed(0)
    weights = [torch.randn(E, F, H), torch.randn(E, F, H), torch.randn(E, H, F), None, None, None]
    out: dict[str, Any] = {}
    for lag in (True, False):
        lay = setup.build_layer(name=f"lag-{lag}", mesh=mesh, topology=topo, dimension=None, dedup=True,
                                num_experts=E, top_k=K, hidden_size=H, ffn_size=F, gated=True, dtype=torch.float32,
                                device=torch.device("cpu"))
        lay.lag_statistics = lag
        routings = [routing("random", T, K, E, rank + 10 * step) for step in range(2)]
        placement = lay.expert_pos_E.numpy()
        # what each step's statistics are, from every rank's routing (the same seeds on every rank)
        every = [[routing("random", T, K, E, r + 10 * step) for r in range(dist.get_world_size())] for step in range(2)]
        expected = []
        for step in range(2):
            tables = np.stack([source_table(t, E, tuple(shape), placement=placement) for t in every[step]])
            stats = gathered_statistics(tables, tuple(shape), copies=False)
            expected.append([float(t) for t in lay.cost.times_from_values(stats.values())])
        times = []
        for idx in routings:
            x = torch.randn(T, H)
            staged_experts(x, idx, torch.rand(T, K), weights, "silu", lay.layer_id, True, K)
            times.append(list(lay.last_times_s))
        got = lay.last_stats  # the second forward's, collected now
        want = np.stack([source_table(t, E, tuple(shape), placement=placement) for t in every[1]])
        same = bool(np.array_equal(lay.last_tables, want))
        out[str(lag)] = {"times": times, "expected": expected, "last_is_second": same,
                         "last_values": got.values(), "d": lay.last_dimension}
    return out


def case_tune() -> dict[str, Any]:
    """d per step with measurements (moe_compile.ep.tuning): forwards and backwards of a staged
    layer; what each step chose, the model's and the corrected times it decided on, and the
    offsets measured, on every rank."""
    from moe_compile.ep.tuning import DimensionTuner
    from moe_compile.lowering.ep_stages import staged_experts

    shape = PARAMS["shape"]
    mesh = make_mesh(shape)
    rank = dist.get_rank()
    E, K, H, F, T = 8, 2, 16, 8, 24  # noqa: N806
    lay = setup.build_layer(name="tune", mesh=mesh, topology=topology_for(mesh, 1.0, 10.0), dimension=None,
                            dedup=True, num_experts=E, top_k=K, hidden_size=H, ffn_size=F, gated=True,
                            dtype=torch.float32, device=torch.device("cpu"))
    lay.tuner = DimensionTuner(2)
    torch.manual_seed(0)
    weights = [torch.randn(E, F, H), torch.randn(E, F, H), torch.randn(E, H, F), None, None, None]
    steps = []
    eval_d = None
    for step in range(8):
        x = torch.randn(T, H, requires_grad=True)
        y = staged_experts(x, routing("random", T, K, E, rank + 10 * step), torch.rand(T, K), weights, "silu",
                           lay.layer_id, True, K)
        y.sum().backward()
        steps.append({"d": lay.last_dimension, "times": list(lay.last_times_s), "tuned": list(lay.last_tuned_s)})
        if step == 1:  # an evaluation between two exploring steps: a forward with no backward
            with torch.no_grad():
                staged_experts(x, routing("random", T, K, E, rank + 99), torch.rand(T, K), weights, "silu",
                               lay.layer_id, True, K)
            eval_d = lay.last_dimension
    return {"steps": steps, "offsets": {str(d): o for d, o in lay.tuner.offsets_s.items()},
            "tried": {str(d): n for d, n in lay.tuner.tried.items()}, "eval_d": eval_d}


def case_errors() -> dict[str, Any]:
    """Setup errors raise ValueError at compile time, before any step collective, on every rank."""
    from torch.distributed.device_mesh import DeviceMesh

    from moe_compile.cost.topology import Level, Topology

    mesh = make_mesh(PARAMS["shape"])
    msgs: dict[str, str] = {}

    def catch(name: str, fn: Any) -> None:
        try:
            fn()
            msgs[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the test asserts the type and message
            msgs[name] = f"{type(getattr(e, 'inner_exception', e)).__name__}: {e}"

    ids = torch.randint(0, 32, (2, 8))

    def run_compiled(model: Any, options: dict[str, Any]) -> None:
        torch._dynamo.reset()
        torch.compile(model, backend="hiermoe", options={"inner_compiler": "aot_eager", **options})(ids, ids)

    catch("indivisible", lambda: run_compiled(tiny("grouped_gemm", 6), {"mesh": mesh, "dimension": 1}))
    bad_topo = Topology(levels=tuple(Level(n, s, 1e-5, 1e-9) for n, s in
                                     zip(("rack", "gpu"), PARAMS["shape"], strict=True)))
    catch("level_names", lambda: run_compiled(tiny("grouped_gemm", 8), {"mesh": mesh, "topology": bad_topo}))
    sub = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("gpu",))
    catch("world_size", lambda: run_compiled(tiny("grouped_gemm", 8), {"mesh": sub, "dimension": 1}))
    catch("dimension", lambda: run_compiled(tiny("grouped_gemm", 8), {"mesh": mesh, "dimension": 5}))
    catch("device", lambda: setup.build_layer(
        name="l", mesh=mesh, topology=None, dimension=1, dedup=True, num_experts=8, top_k=2, hidden_size=4,
        ffn_size=4, gated=True, dtype=torch.float32, device=torch.device("meta")))
    # after all that, the world still works: one collective
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"messages": msgs, "world_ok": float(t) == dist.get_world_size()}


def main(cases: dict[str, Any] | None = None) -> None:
    """Run case ``argv[1]`` from ``cases`` (a sibling worker's globals; default this module's)."""
    case = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(PARAMS.get("pg_timeout_s", 60))))
    result = (cases or globals())[f"case_{case}"]()
    Path(os.environ["HIERMOE_TEST_OUT"], f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    assert moe_compile is not None
    main()

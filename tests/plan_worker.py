"""One rank of the planning tests (launched by tests/dist_utils.py with worker="plan_worker.py";
gloo on CPU): what the planner decides over a mesh and that its decision is what runs, from
``{"mesh": mesh}`` alone (probed links; experts on every rank run replicated) to the token
all-to-alls, gathers and model-centric layers chosen per topology. The shared rank helpers are
``ep_worker``'s.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from ep_worker import PARAMS, counting, main, make_mesh, rel_err, summed_grad_err, tiny  # noqa: E402

import moe_compile  # noqa: E402
from moe_compile import pipeline  # noqa: E402
from moe_compile.backend import collect_reports  # noqa: E402
from moe_compile.cost.topology import Topology  # noqa: E402
from moe_compile.ep import runtime  # noqa: E402
from moe_compile.passes import plan as plan_mod  # noqa: E402
from moe_compile.samples import SAMPLES  # noqa: E402
from moe_compile.tools import calibrate  # noqa: E402


def case_probe() -> dict[str, Any]:
    """``{"mesh": mesh}`` alone on a model whose experts every rank holds: the first compile probes
    the links, and the layers run replicated (each rank its own tokens, nothing sent). With
    ``replicated_experts`` False they run expert-parallel: the model trains as eager does, d* is
    chosen per step from the probed topology, and explain says it was probed."""
    mesh = make_mesh(PARAMS["shape"])
    rank = dist.get_rank()
    model = tiny("grouped_gemm", 8)
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 32, (2, 8), generator=gen)
    loss_ref = ref(ids, ids)
    loss_ref.backward()
    alone = {"mesh": mesh, "inner_compiler": "aot_eager"}
    t0 = time.perf_counter()
    rep_report = moe_compile.explain(model, ids, ids, options=alone)
    explain_s = time.perf_counter() - t0
    rep = copy.deepcopy(model)
    with collect_reports() as graphs:
        runtime.reset_counters()
        loss_rep = torch.compile(rep, backend="hiermoe", options=alone)(ids, ids)
        loss_rep.backward()
    c = runtime.counters()
    replicated = {"plans": [r.plan for r in rep_report.regions], "ep_layers": [r.ep_layer for r in rep_report.regions],
                  "sent": sum(v for lv in c.values() for ph in lv.values() for dr in ph.values() for v in dr.values()),
                  "experts_ops": sum(g.after.count("= torch.ops.hiermoe.experts") for g in graphs),
                  "stage_ops": sum(g.after.count("hiermoe.ep_") for g in graphs),
                  "text": str(rep_report), "loss": float(loss_rep), "grad_err": summed_grad_err(rep, ref)}
    # 6 experts do not split over 4 ranks: no expert-parallel candidate, but replicated runs
    torch._dynamo.reset()
    odd = tiny("grouped_gemm", 6)
    odd_ref = copy.deepcopy(odd)
    with collect_reports() as graphs:
        loss_odd = torch.compile(odd, backend="hiermoe", options=alone)(ids, ids)
        loss_odd.backward()
    loss_odd_ref = odd_ref(ids, ids)
    loss_odd_ref.backward()
    replicated["odd"] = {"plans": [r.plan for g in graphs for r in g.regions], "loss": float(loss_odd),
                         "loss_ref": float(loss_odd_ref), "grad_err": summed_grad_err(odd, odd_ref)}
    torch._dynamo.reset()
    options = {**alone, "replicated_experts": False}
    report = moe_compile.explain(model, ids, ids, options=options)
    compiled = torch.compile(model, backend="hiermoe", options=options)
    loss = compiled(ids, ids)
    loss.backward()
    topology = sorted({g.topology for g in (*rep_report.graphs, *report.graphs)} - {""})
    return {"text": str(report), "topology": topology, "explain_s": explain_s,
            "predicted": [r.parallel["predicted_s"] for r in report.regions],
            "plans": [r.plan for r in report.regions], "gathers": [r.parallel["gather"] for r in report.regions],
            "loss": float(loss), "loss_ref": float(loss_ref), "grad_err": summed_grad_err(model, ref),
            "replicated": replicated,
            "expert_rates": [(t.expert_flops_per_s, t.expert_row_bytes_per_s) for t in calibrate._probed.values()]}


def case_plan() -> dict[str, Any]:
    """The planner's choice decides what runs: one MoE layer (grouped GEMM sample, E=8, K=2, 64
    tokens per rank) at two hidden sizes, each on a topology whose inter-node link is slow and
    on one with equal links; and at H=64 on a slow device (1 GFLOP/s, the expert compute worth
    more than the links) with routing as drawn and with every token's experts among rank 0's
    (its first feature large, which the router weighs toward experts 0 and 1). Returns per case
    the plan explain shows, the runtime layer's settings, and the output's and token gradient's
    error against the layer run eagerly."""
    mesh = make_mesh(PARAMS["shape"])
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for hidden, label, node_gbps, gather, flops, skew in (
            (4, "equal", 100.0, False, 1e12, False), (64, "slow_node", 0.1, False, 1e12, False),
            (64, "equal", 100.0, False, 1e12, False), (64, "slow_node gather", 0.1, "auto", 1e12, False),
            (64, "slow_device", 100.0, False, 1e9, False), (64, "slow_device skewed", 100.0, False, 1e9, True)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        layer = SAMPLES["grouped_gemm"].make(hidden_size=hidden, ffn_size=8, num_experts=8, top_k=2)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(4, 16, hidden, generator=gen)  # 64 tokens
        if skew:
            with torch.no_grad():
                layer.router.weight[:, 0] = torch.tensor([8.0, 8.0, -8.0, -8.0, -8.0, -8.0, -8.0, -8.0])
            x[..., 0] = 4.0
        links = {n: {"alpha_s": 2e-5, "bandwidth_gbps": node_gbps if i == 0 else 100.0}
                 for i, n in enumerate(mesh.mesh_dim_names)}
        options = {"mesh": mesh, "topology": Topology.from_mesh(mesh, links, flops_per_s=flops),
                   "inner_compiler": "aot_eager", "expert_gather": gather,
                   "replicated_experts": False}  # the layer is on every rank: else it runs replicated
        report = moe_compile.explain(layer, x, options=options)
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        compiled = torch.compile(layer, backend="hiermoe", options=options)
        g = torch.randn(x.shape, generator=gen)
        with counting(pipeline, "plan_layer") as n_agree, counting(plan_mod, "plan_layer") as n_pass:
            yc = compiled(xc)
        ye = layer(xe)
        (gc,) = torch.autograd.grad(yc, xc, g)
        (ge,) = torch.autograd.grad(ye, xe, g)
        (region,) = report.regions
        lay = runtime.layer(region.ep_layer)
        out[f"{hidden} {label}"] = {
            "plan": region.plan, "executable": region.executable, "predicted": region.predicted_s,
            "notes": region.plan_notes, "dedup": lay.dedup, "dimension": lay.dimension, "text": str(report),
            "plans_made": n_agree[0] + n_pass[0],
            "err": max(rel_err(yc.detach(), ye.detach()), rel_err(gc, ge))}
    return out


def case_calibrate_retime() -> dict[str, Any]:
    """``tools.calibrate.retime_flat_levels`` on a 2-rank level "gpu": the level's all-to-all
    measured for real, then its times replaced by ones that fall with the message size (what noise
    on a busy machine gives). With ``--retries 0`` the flat fit stays; with 1 the level is timed
    again (real times replace the planted ones, the other entries are the same objects) and a
    note says so."""
    import argparse

    from moe_compile.tools.calibrate import Measurement, measure, plan_measurements, retime_flat_levels

    mesh = make_mesh(PARAMS["shape"])
    names = ("gpu",)
    args = argparse.Namespace(min_bytes=4096, max_bytes=1 << 18, steps=3, reps=3, warmup=1, retries=0)
    plan = plan_measurements(names, (2,), 2, args)
    dev = torch.device("cpu")
    measured = measure(mesh, plan, dev, args.reps, args.warmup, lambda what: None, "recv-first")
    i = next(j for j, (coll, group, *_) in enumerate(plan) if (coll, group) == ("all_to_all", "gpu"))
    planted = Measurement("all_to_all", "gpu", 2, measured[i].sizes_bytes, (3.0, 2.0, 1.0))
    out: dict[str, Any] = {}
    for retries in (0, 1):
        ms, notes = list(measured), []
        ms[i] = planted
        fits = retime_flat_levels(mesh, plan, ms, names, dev, argparse.Namespace(**{**vars(args), "retries": retries}),
                                  "recv-first", notes.append)
        out[str(retries)] = {
            "beta": fits[i].beta_s_per_byte, "times": list(ms[i].times_s), "sizes_same": ms[i].sizes_bytes ==
            planted.sizes_bytes, "others_same": all(ms[j] is measured[j] for j in range(len(ms)) if j != i),
            "notes": notes}
    return out


if __name__ == "__main__":
    assert moe_compile is not None
    main(globals())

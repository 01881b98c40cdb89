"""One rank of the expert-gather tests (launched by tests/dist_utils.py with worker="gather_worker.py"):
layers that all-gather their experts inside a mesh block (``lowering.strategies.gather``) against
the eager model. Cases write this rank's results to $HIERMOE_TEST_OUT/rank<r>.json;
tests/test_expert_gather.py asserts on them."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from ep_worker import PARAMS, main, make_mesh, summed_grad_err, tiny, topology_for  # noqa: E402
from hf_models import build, input_ids  # noqa: E402
from shard_worker import train_against_ddp  # noqa: E402

import moe_compile  # noqa: E402
from moe_compile.backend import collect_reports  # noqa: E402
from moe_compile.ep import runtime  # noqa: E402
from moe_compile.samples.tiny_lm import TinyLMConfig, TinyMoELM  # noqa: E402


def _sent(kind: str) -> dict[str, dict[str, int]]:
    """Payload bytes this rank sent per level and phase (forward and backward together)."""
    c = runtime.counters()
    return {lv: {ph: sum(c[lv][ph][dr][f"{kind}_bytes"] for dr in ("forward", "backward"))
                 for ph in ("dispatch", "combine", "gather")} for lv in c}


def _meshes() -> tuple[Any, Any]:
    """The mesh of PARAMS["shape"], and the same shape with the ranks in another order (mesh
    positions != ranks: a domain's rows follow its mesh positions, whatever the ranks' numbers)."""
    from torch.distributed.device_mesh import DeviceMesh

    standard = make_mesh(PARAMS["shape"])
    permuted = DeviceMesh("cpu", torch.arange(dist.get_world_size()).reshape(PARAMS["shape"][::-1]).t(),
                          mesh_dim_names=standard.mesh_dim_names)
    return standard, permuted


def _compiled_step(kind: str, mesh: Any, options: dict[str, Any], inductor: bool) -> tuple[Any, Any, dict[str, Any]]:
    """The tiny LM of ``kind`` compiled over ``mesh`` with ``options`` (Inductor or aot_eager), one
    forward + backward beside eager: (the compiled model, its input ids, the loss and the eager
    loss, the gradients summed over the ranks against eager's, this step's bytes per level, the
    plans, and the rewritten graphs' code)."""
    torch._dynamo.reset()
    model = tiny(kind, 8)
    ref = copy.deepcopy(model)
    opts = {"mesh": mesh, "topology": topology_for(mesh, 1.0, 10.0), **options,
            "inner_compiler": "inductor" if inductor else "aot_eager"}
    compiled = torch.compile(model, backend="hiermoe", options=opts)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(10 + dist.get_rank()))
    with collect_reports() as graphs:
        runtime.reset_counters()
        loss, loss_ref = compiled(ids, ids), ref(ids, ids)
        loss.backward()
        loss_ref.backward()
    return compiled, ids, {"loss": float(loss), "loss_ref": float(loss_ref), "grad_err": summed_grad_err(model, ref),
                           "sent": _sent("payload"), "plans": [r.plan for g in graphs for r in g.regions],
                           "code": "\n".join(g.after for g in graphs)}


def case_gather() -> dict[str, Any]:
    """Compiled tiny LM with every layer gathering its experts over the blocks of mesh level j
    (0: the whole mesh; 1: each node), per (kind, j) of ``cases`` (``permuted_kind`` on
    a mesh whose positions hold the ranks in another order, ``inductor_case`` ([kind, j]) compiled by Inductor,
    the others by aot_eager): loss and gradients summed over the ranks against eager; the bytes
    each level carried; the plans."""
    standard, permuted = _meshes()
    out: dict[str, Any] = {}
    for kind, level in PARAMS["cases"]:
        mesh = permuted if kind == PARAMS.get("permuted_kind") else standard
        _, _, r = _compiled_step(kind, mesh, {"expert_gather": mesh.mesh_dim_names[level]},
                                 [kind, level] == PARAMS.get("inductor_case"))
        code = r.pop("code")
        out[f"{kind} {level}"] = {**r, "gathers": code.count("hiermoe.ep_gather.default"),
                                  "dispatches": code.count("hiermoe.ep_dispatch"),
                                  "gathered_bytes": [lay.gathered_bytes for lay in runtime.layers()][-2:]}
    return out


def case_gather_shard() -> dict[str, Any]:
    """Sharded experts (shard_experts) gathered for each layer, trained with AdamW against eager
    DDP of the unsharded model: losses and, after training, each rank's shard against the eager
    model's rows of its experts (the gradients reduce-scattered back to their owners)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    mesh = make_mesh(PARAMS["shape"])
    out: dict[str, Any] = {}
    for level in PARAMS["levels"]:
        torch._dynamo.reset()
        model = tiny(PARAMS["kind"], 8)
        eager = DDP(copy.deepcopy(model))
        ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(rank))
        shard_report = moe_compile.shard_experts(model, mesh, ids[:, :-1], ids[:, 1:])
        opts = {"mesh": mesh, "topology": topology_for(mesh, 1.0, 10.0), "expert_gather": mesh.mesh_dim_names[level],
                "inner_compiler": "aot_eager"}
        compiled = torch.compile(model, backend="hiermoe", options=opts)
        losses, weight_err, _ = train_against_ddp(model, compiled, eager, shard_report, PARAMS["steps"])
        out[str(level)] = {"losses": losses, "weight_err": weight_err,
                           "local_bytes": shard_report.local_bytes, "full_bytes": shard_report.full_bytes}
    return out


def case_prefetch() -> dict[str, Any]:
    """The scheduled forward graph of a 3-layer data-centric model for each gather_prefetch: the
    order of the gathers' starts and waits and the layers' expert ops; loss and gradients against
    eager; what explain says about where the gathers start and how long the forward waited."""
    rank = dist.get_rank()
    mesh = make_mesh(PARAMS["shape"])
    out: dict[str, Any] = {}
    # (prefetch, gather_keep_bytes): one layer's 144 KiB of gathered experts kept, the others regathered
    for ahead, keep in [*((a, None) for a in PARAMS["prefetch"]), (1, 147456), ("auto", 147456)]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TinyMoELM(TinyLMConfig(moe_kind="grouped_gemm", num_experts=8, num_layers=3))
        ref = copy.deepcopy(model)
        opts = {"mesh": mesh, "topology": topology_for(mesh, 1.0, 10.0), "expert_gather": mesh.mesh_dim_names[0],
                "gather_prefetch": ahead, "gather_keep_bytes": keep, "inner_compiler": "aot_eager"}
        compiled = torch.compile(model, backend="hiermoe", options=opts)
        ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(rank))
        with collect_reports() as graphs:
            loss, loss_ref = compiled(ids, ids), ref(ids, ids)
            loss.backward()
            loss_ref.backward()
        forward = graphs[0].scheduled[0][2]
        events = []
        for line in forward.splitlines():
            for what in ("ep_gather_start", "ep_gather_wait", "hiermoe.experts.default"):
                if f"torch.ops.hiermoe.{what.removeprefix('hiermoe.')}" in line or (
                        what.startswith("ep_") and f"hiermoe.{what}.default" in line):
                    events.append(what.removeprefix("hiermoe.").removesuffix(".default"))
        backward = graphs[0].scheduled[1][2]
        out[str(ahead) if keep is None else f"{ahead} keep {keep}"] = {
            "loss": float(loss), "loss_ref": float(loss_ref), "grad_err": summed_grad_err(model, ref),
            "events": events, "starts": graphs[0].gather_starts,
            "backward_gathers": backward.count("hiermoe.ep_gather_start.default"),
            "backward_scatters": sum(backward.count(f"hiermoe.ep_gather_backward{v}.default(")
                                     for v in ("", "_start")),
            "regathered": [lay.regathered for lay in runtime.layers()][-3:]}
    # HF Mixtral with its key/value cache on: AOTAutograd reads the cache's empty tensors as
    # constants inside each layer, which the next layer's gather must pass to start early
    torch._dynamo.reset()
    model = build("mixtral", num_hidden_layers=3, use_cache=True)
    ref = copy.deepcopy(model)
    opts = {"mesh": mesh, "topology": topology_for(mesh, 1.0, 10.0), "expert_gather": mesh.mesh_dim_names[0],
            "gather_prefetch": 1, "inner_compiler": "aot_eager"}
    compiled = torch.compile(model, backend="hiermoe", options=opts)
    ids = input_ids(seed=rank)
    with collect_reports() as graphs:
        loss, loss_ref = compiled(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
        loss.backward()
        loss_ref.backward()
    out["hf_mixtral"] = {"loss": float(loss), "loss_ref": float(loss_ref), "grad_err": summed_grad_err(model, ref),
                         "starts": graphs[0].gather_starts,
                         "constants": graphs[0].scheduled[0][2].count("self._tensor_constant")}
    return out


def case_compress() -> dict[str, Any]:
    """HybridEP's SR compression of the gathered experts (gather_compress), the tiny LM trained
    with AdamW over the whole mesh (gather0), unsharded experts averaged by hand: per ratio
    (None = exact) the losses of each step and the expert bytes the forward sent across nodes."""
    from ep_worker import ADAM_EPS, average_grads

    rank = dist.get_rank()
    mesh = make_mesh(PARAMS["shape"])
    out: dict[str, Any] = {}
    for ratio in PARAMS["ratios"]:
        torch._dynamo.reset()
        model = tiny("grouped_gemm", 8)
        opts = {"mesh": mesh, "topology": topology_for(mesh, 1.0, 10.0), "expert_gather": mesh.mesh_dim_names[0],
                "gather_compress": ratio, "inner_compiler": "aot_eager"}
        compiled = torch.compile(model, backend="hiermoe", options=opts)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=ADAM_EPS)
        gen = torch.Generator().manual_seed(100 + rank)
        losses, node_bytes = [], []
        for _ in range(PARAMS["steps"]):
            batch = torch.randint(0, 32, (2, 9), generator=gen)
            runtime.reset_counters()
            loss = compiled(batch[:, :-1], batch[:, 1:])
            c = runtime.counters()
            node_bytes.append(c[mesh.mesh_dim_names[0]]["gather"]["forward"]["payload_bytes"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            average_grads(model, None)
            opt.step()
            losses.append(float(loss))
        out[str(ratio)] = {"losses": losses, "node_bytes": node_bytes}
    return out


def case_model() -> dict[str, Any]:
    """Compiled tiny LM with every layer model-centric (options model_centric "always"), per kind of
    ``kinds`` (``permuted_kind`` on a mesh whose positions hold the ranks in another order,
    ``inductor_kind`` compiled by Inductor, the others by aot_eager): loss and gradients summed over
    the ranks against eager, the token bytes each level carried, the plans; then the same model
    given a batch of another length on one rank only: the error every rank raises."""
    rank = dist.get_rank()
    standard, permuted = _meshes()
    out: dict[str, Any] = {}
    for kind in PARAMS["kinds"]:
        mesh = permuted if kind == PARAMS.get("permuted_kind") else standard
        compiled, ids, r = _compiled_step(kind, mesh, {"model_centric": "always"}, kind == PARAMS.get("inductor_kind"))
        code = r.pop("code")
        out[kind] = {**r, "token_gathers": code.count("hiermoe.ep_model_tokens.default"),
                     "dispatches": code.count("hiermoe.ep_dispatch"), "weight_gathers": code.count("hiermoe.ep_gather")}
        if kind == PARAMS["kinds"][0]:  # one rank brings 7 tokens per sample, the others 8
            short = ids[:, :7] if rank == 1 else ids
            try:
                compiled(short, short)
                out["uneven"] = None
            except Exception as e:  # noqa: BLE001 (the test reads the message)
                out["uneven"] = str(e)
    # experts sharded by shard_experts: "always" cannot run (each rank holds a quarter of the experts)
    torch._dynamo.reset()
    model = tiny("grouped_gemm", 8)
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(rank))
    moe_compile.shard_experts(model, standard, ids[:, :-1], ids[:, 1:])
    opts = {"mesh": standard, "topology": topology_for(standard, 1.0, 10.0), "model_centric": "always",
            "inner_compiler": "aot_eager"}
    try:
        torch.compile(model, backend="hiermoe", options=opts)(ids[:, :-1], ids[:, 1:])
        out["sharded"] = None
    except Exception as e:  # noqa: BLE001 (the test reads the message)
        out["sharded"] = str(e)
    return out


if __name__ == "__main__":
    assert moe_compile is not None
    main(globals())

"""One rank of the expert-parallel tests on Hugging Face models and with activation checkpointing
(launched by tests/dist_utils.py with worker="hf_worker.py"; gloo on CPU): transformers models
from small configs, and the checkpointed layers, compiled over the mesh against the eager model.
Cases write this rank's results to $HIERMOE_TEST_OUT/rank<r>.json; tests/test_expert_parallel.py
asserts on them."""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from ep_worker import PARAMS, main, make_mesh, rel_err, summed_grad_err  # noqa: E402

import moe_compile  # noqa: E402
from moe_compile.backend import collect_reports  # noqa: E402
from moe_compile.ep import runtime  # noqa: E402


def case_llama4() -> dict[str, Any]:
    """transformers' Llama-4 (its routing weights scale the experts' input) with K = PARAMS["k"],
    compiled over the mesh with the token all-to-alls: loss and gradients summed over the ranks
    against eager, the rewritten layers' layouts and plans, the layers that ran."""
    return _hf_over_mesh(build_args=("llama4_text", None), k=PARAMS["k"])


def case_checkpointed() -> dict[str, Any]:
    """transformers' Mixtral trained with activation checkpointing (``activation_checkpointing_enable``,
    PARAMS["reentrant"]), compiled over the mesh with the token all-to-alls, against the eager
    model checkpointed alike; and the bytes its steps send against the same model's without
    checkpointing (a backward that recomputed the exchanges would send them twice)."""
    plain = _hf_over_mesh(build_args=("mixtral", "grouped_mm"), k=2)
    checkpointed = _hf_over_mesh(build_args=("mixtral", "grouped_mm"), k=2, checkpointing=PARAMS["reentrant"])
    # sharded experts, with selective checkpointing (a context_fn): the exchanges stay outside it
    sharded = _hf_over_mesh(build_args=("mixtral", "grouped_mm"), k=2, checkpointing="selective", shard=True)
    return {"plain": plain, "checkpointed": checkpointed, "sharded": sharded}


def case_experts_checkpointed() -> dict[str, Any]:
    """A grouped-GEMM MoE layer whose experts alone are checkpointed (compile_utils.ExpertsCheckpointed,
    the router outside), compiled over the mesh with the token all-to-alls: without checkpointing
    ("none"), plain ("plain"), selective with a policy that recomputes everything ("recompute") and
    one that saves the grouped matmuls ("save"). Per variant: loss and gradients summed over the
    ranks against the eager model checkpointed alike, the bytes kept for backward and sent, the
    layouts explain shows."""
    from compile_utils import SAVE_GROUPED, ExpertsCheckpointed, kept_for_backward, selective_policy

    from moe_compile.samples import SAMPLES
    from moe_compile.samples.grouped_gemm import GroupedGemmMoE

    rank = dist.get_rank()
    mesh = make_mesh(PARAMS["shape"])
    kwargs = SAMPLES["grouped_gemm"].kwargs
    out = {}
    for variant in ("none", "plain", "recompute", "save"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        context_fn = {"recompute": selective_policy([], ()), "save": selective_policy([], SAVE_GROUPED)}.get(variant)
        model = GroupedGemmMoE(**kwargs) if variant == "none" else ExpertsCheckpointed(context_fn, **kwargs)
        ref = copy.deepcopy(model)
        x = torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(1 + rank))
        compiled = torch.compile(model, backend="hiermoe", options={
            "mesh": mesh, "inner_compiler": "aot_eager", "expert_gather": False, "replicated_experts": False,
            "model_centric": False})
        with collect_reports() as graphs:
            compiled(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
        runtime.reset_counters()
        with kept_for_backward(model) as kept:
            loss = compiled(x).square().mean()
        loss.backward()
        loss_ref = ref(x).square().mean()
        loss_ref.backward()
        c = runtime.counters()
        out[variant] = {
            "loss": float(loss), "loss_ref": float(loss_ref), "grad_err": summed_grad_err(model, ref),
            "kept": sum(kept), "layouts": [r.layout for g in graphs for r in g.regions],
            "plans": [r.plan for g in graphs for r in g.regions],
            "sent": {f"{ph} {dr}": sum(c[lv][ph][dr]["payload_bytes"] for lv in c)
                     for ph in ("dispatch", "combine") for dr in ("forward", "backward")}}
    return out


def _hf_over_mesh(build_args: tuple[str, str | None], k: int, checkpointing: bool | str | None = None,
                  shard: bool = False) -> dict[str, Any]:
    """``checkpointing`` None: none; "selective": non-reentrant with a context_fn whose policy
    recomputes everything and records the ops it is asked about ("policy_ops"); else activation
    checkpointing with that ``use_reentrant``. ``shard``: the experts sharded over the mesh first
    (moe_compile.shard_experts); then "grad_err" compares each shard's gradient with the eager
    model's rows of it summed over the ranks, and the other gradients summed over the ranks."""
    from compile_utils import kept_for_backward
    from hf_models import build, input_ids
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    rank = dist.get_rank()
    mesh = make_mesh(PARAMS["shape"])
    torch._dynamo.reset()
    model = build(*build_args, num_experts_per_tok=k)
    model.train()
    policy_ops: set[str] = set()
    recording = [False]  # the compiled model's ops only (the eager reference shares the policy)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if recording[0]:
            policy_ops.add(str(op))
        return CheckpointPolicy.PREFER_RECOMPUTE

    if checkpointing == "selective":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, policy)})
    elif checkpointing is not None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": checkpointing})
    ref = copy.deepcopy(model)
    ids = input_ids(seed=rank)
    report = moe_compile.shard_experts(model, mesh, input_ids=ids, labels=ids) if shard else None
    compiled = torch.compile(model, backend="hiermoe", options={"mesh": mesh, "inner_compiler": "aot_eager",
                                                                 "expert_gather": False, "replicated_experts": False})
    with collect_reports() as graphs:
        recording[0] = True  # AOTAutograd asks the policy as it traces the checkpoints
        compiled(input_ids=ids, labels=ids).loss.backward()  # compiles (verification saves tensors too)
        recording[0] = False
    model.zero_grad(set_to_none=True)
    runtime.reset_counters()
    with kept_for_backward(model) as kept:
        loss = compiled(input_ids=ids, labels=ids).loss
    loss_ref = ref(input_ids=ids, labels=ids).loss
    loss.backward()
    loss_ref.backward()
    c = runtime.counters()
    sent = {f"{ph} {dr}": sum(c[lv][ph][dr]["payload_bytes"] for lv in c)
            for ph in ("dispatch", "combine") for dr in ("forward", "backward")}
    return {"loss": float(loss), "loss_ref": float(loss_ref),
            "grad_err": summed_grad_err(model, ref) if report is None else _sharded_grad_err(model, ref, report),
            "layouts": [r.layout for g in graphs for r in g.regions], "plans": [r.plan for g in graphs for r in g.regions],
            "layers_run": sum(lay.num_steps > 0 for lay in runtime.layers()), "sent": sent, "kept": sum(kept),
            "inlined": sum(g.counters.get("inline_checkpoint", {}).get("inlined", 0) for g in graphs),
            "policy_ops": sorted(policy_ops)}


def _sharded_grad_err(model: torch.nn.Module, ref: torch.nn.Module, report: Any) -> float:
    """Largest relative error between a sharded model's gradients and the eager reference's, each
    summed over the ranks: a shard's gradient (its owner's alone) against the reference's rows of
    it; every other parameter's summed like the reference's."""
    shards = {id(s.local): s for s in report.shards if s.local is not None}
    ref_params = dict(ref.named_parameters())
    errs = []
    for name, p in model.named_parameters():
        s = shards.get(id(p))
        if s is not None:
            want = ref_params[s.name].grad.clone()
            dist.all_reduce(want)
            errs.append(rel_err(p.grad, want[s.first:s.first + s.num_local]))
            continue
        if name not in ref_params:  # another rank's expert module: no gradient here
            continue
        a, b = p.grad.clone(), ref_params[name].grad.clone()
        dist.all_reduce(a)
        dist.all_reduce(b)
        errs.append(rel_err(a, b))
    return max(errs)


if __name__ == "__main__":
    assert moe_compile is not None
    main(globals())

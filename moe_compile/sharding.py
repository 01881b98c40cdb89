"""``shard_experts``: each rank keeps only its own experts' weights (see ``moe_compile.ep.shard``
for what it records and how the compiled model reads the shards).

It finds the model's MoE layers with the backend's own finder (``explain``: a compile on the
example inputs, nothing rewritten in the model), so it belongs to the entry, beside ``explain``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch._dynamo
from torch import nn

from moe_compile.ep.setup import check_mesh, mesh_comm
from moe_compile.ep.shard import Shard, ShardReport, lookup, register
from moe_compile.explain import explain


def shard_experts(model: nn.Module, mesh: Any, *example_inputs: object, **example_kwargs: object) -> ShardReport:
    """Shard the expert weights of ``model`` over ``mesh`` (see the module docstring)."""
    check_mesh(mesh, None)
    if any(lookup(b) is not None for b in model.buffers()):
        raise ValueError("this model's experts are already sharded; shard_experts runs once per model")
    report = explain(model, *example_inputs, options={"inner_compiler": "eager"}, **example_kwargs)
    torch._dynamo.reset()  # the next compile must trace the sharded model
    comm = mesh_comm(mesh)
    world = comm.world
    shards: list[Shard] = []
    owned: list[nn.Parameter] = []
    full = local = 0
    for region in report.regions:
        num_experts = region.num_experts
        if num_experts % world:
            raise ValueError(f"layer {region.name}: {num_experts} experts do not split evenly over {world} ranks; "
                             f"use a mesh whose size divides {num_experts}")
        per = num_experts // world
        first = comm.position * per
        for family in region.expert_params:
            for i, path in enumerate(family):
                module, attr = _resolve(model, path)
                param = module._parameters.get(attr)
                if not isinstance(param, nn.Parameter):
                    raise ValueError(f"layer {region.name}: {path} is not a parameter of the model; "
                                     "shard_experts shards expert parameters only")
                full += param.numel() * param.element_size()
                placeholder = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
                if len(family) == 1:  # stacked [E, ...]
                    kept = nn.Parameter(param.detach()[first:first + per].clone(), requires_grad=param.requires_grad)
                    module.register_parameter(f"{attr}_shard", kept)
                    local += kept.numel() * kept.element_size()
                    owned.append(kept)
                    shard = Shard(path, placeholder, kept, first, per, num_experts)
                elif first <= i < first + per:  # this rank's expert module: keep it as it is
                    local += param.numel() * param.element_size()
                    owned.append(param)
                    continue
                else:
                    shard = Shard(path, placeholder, None, first, per, num_experts)
                del module._parameters[attr]
                module.register_buffer(attr, placeholder, persistent=False)
                register(shard, module, attr)
                shards.append(shard)
    if not shards:
        raise ValueError("shard_experts found no expert parameters to shard (see moe_compile.explain(model, ...) "
                         "for the layers found and why others were left alone)")
    assert local <= full and math.isfinite(full)
    return ShardReport(tuple(shards), full, local, tuple(owned))


def _resolve(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    *mods, attr = path.split(".")
    module = model
    for m in mods:
        module = getattr(module, m)
    return module, attr


def prepare_ddp(model: nn.Module, report: ShardReport) -> list[str]:
    """Make a model whose experts ``shard_experts`` split over the ranks safe to wrap in
    DistributedDataParallel (or in a trainer that wraps it: transformers' Trainer, accelerate).
    Call it before wrapping. Each rank holds different experts at the same places of
    ``model.parameters()``, and the expert-parallel backward leaves on each owner the sum of every
    rank's tokens, so DDP must not all-reduce the shards: their names go into DDP's ignore list, and
    a gradient hook divides each shard's gradient by the world size, as DDP divides the rest (hooks
    on the incoming gradient, so gradient accumulation stays right); the buffers that mark the
    shards are rank-local and ignored too. Returns the ignored names.
    Compile the model itself before wrapping (``model.compile(backend="hiermoe", ...)``, then DDP,
    as with a Trainer). A model larger than one DDP bucket (25 MiB by default) also wants
    ``torch._dynamo.config.optimize_ddp = False``: Dynamo otherwise splits the graph at the bucket
    boundaries, and a layer cut in two cannot be found whole (tested here: one bucket, both
    settings)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    world = dist.get_world_size()
    names = [n for n, p in model.named_parameters() if report.owns(p)]
    # and the buffers that mark the shards (rank-local; DDP would broadcast rank 0's)
    names += [n for n, b in model.named_buffers() if lookup(b) is not None]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    for p in model.parameters():
        if report.owns(p) and not getattr(p, "_hiermoe_ddp_hook", False):
            p.register_hook(lambda g: g / world)
            p._hiermoe_ddp_hook = True  # type: ignore[attr-defined]
    return names

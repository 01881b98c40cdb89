"""``shard_experts``: each rank keeps only its own experts' weights (see ``moe_compile.ep.shard``
for what it records and how the compiled model reads the shards).

It finds the model's MoE layers with the backend's own finder (``explain``: a compile on the
example inputs, nothing rewritten in the model), so it belongs to the entry, beside ``explain``.

And what training a sharded model needs beyond the compiled step, where anything that reads "the
model's" weights or gradients on one rank would see only its own experts: ``prepare_ddp``
(DistributedDataParallel must not average the shards), ``clip_grad_norm_`` (the whole model's
norm), ``full_state_dict`` / ``full_optim_state_dict`` (checkpoints of the unsharded model) and
their loading (a ``load_state_dict`` pre-hook per sharded weight, ``load_full_optim_state_dict``).
``moe_compile.trainer.ShardedExperts`` does the clipping and checkpoints for transformers' Trainer.

A rank's own ``optimizer.state_dict()`` holds its own experts' state only; loaded on another rank
it would train that rank's experts on the wrong moments, with nothing to see (the shapes agree).
So every optimizer over expert shards says in each saved param group which experts its rows are
(``ROWS_KEY``, as ``_save_rows`` does for the weights), and the first step after a load compares
them with the experts each rank holds, on every rank at once (``_check_rows``): reordered rows
(an expert swap since) are put in the slots' order, another rank's state stops every rank before
anything is updated.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch._dynamo
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.nn.utils import clip_grads_with_norm_, get_total_norm
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from moe_compile.ep import runtime
from moe_compile.ep.setup import check_mesh, mesh_comm
from moe_compile.ep.shard import ExpertParam, Shard, ShardReport, lookup, register
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
    params: list[ExpertParam] = []
    rows: list[tuple[nn.Parameter, Shard | str]] = []  # each expert parameter kept here, and whose rows it holds
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
                stacked = len(family) == 1
                params.append(ExpertParam(path, None if stacked else i, num_experts, tuple(param.shape), param.dtype))
                placeholder = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
                if stacked:  # [E, ...]
                    kept = nn.Parameter(param.detach()[first:first + per].clone(), requires_grad=param.requires_grad)
                    module.register_parameter(f"{attr}_shard", kept)
                    local += kept.numel() * kept.element_size()
                    owned.append(kept)
                    shard = Shard(path, placeholder, kept, first, per, num_experts)
                    rows.append((kept, shard))
                elif first <= i < first + per:  # this rank's expert module: keep it as it is
                    local += param.numel() * param.element_size()
                    owned.append(param)
                    rows.append((param, path))
                    continue
                else:
                    shard = Shard(path, placeholder, None, first, per, num_experts)
                del module._parameters[attr]
                module.register_buffer(attr, placeholder, persistent=False)
                register(shard, module, attr)
                module._register_load_state_dict_pre_hook(functools.partial(_load_rows, shard, attr), with_module=True)
                if shard.local is not None:  # the rows' experts go with them (_save_rows)
                    module._register_state_dict_hook(functools.partial(_save_rows, shard, attr))
                shards.append(shard)
    if not shards:
        raise ValueError("shard_experts found no expert parameters to shard (see moe_compile.explain(model, ...) "
                         "for the layers found and why others were left alone)")
    assert local <= full and math.isfinite(full)
    sharded = ShardReport(tuple(shards), full, local, tuple(owned), tuple(params), comm)
    global _ROWS_HOOK
    for param, what in rows:
        _EXPERT_ROWS[param] = (sharded, what)
    if _ROWS_HOOK is None:
        _ROWS_HOOK = register_optimizer_step_pre_hook(_check_rows)
    return sharded


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
    as with a Trainer). Importing moe_compile sets ``torch._dynamo.config.optimize_ddp = False``:
    Dynamo otherwise splits the graph of a DDP model at its gradient buckets (25 MiB by default),
    and a layer cut in two cannot be found whole (tests/test_ddp_graph.py)."""
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


def clip_grad_norm_(model: nn.Module, report: ShardReport, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model whose experts ``shard_experts`` split: the
    norm of the whole model's gradient, as the unsharded model's, and every gradient scaled by
    ``max_norm / norm`` where that is below 1. Returns the norm (before clipping).

    ``clip_grad_norm_(model.parameters(), ...)`` on a sharded model is wrong: each rank sees only its
    own experts' gradients, so each computes another norm and scales its replicated (dense)
    gradients by another factor, and the ranks' copies of the dense weights drift apart. Here the
    dense part is each rank's own (the same on every rank once averaged, as DDP does), the experts'
    part is summed over the mesh (an all-reduce of each rank's shards' ``|g|^p``; the max for the
    inf-norm). Collective: call it on every rank after the gradients are averaged (DDP, or
    ``prepare_ddp``'s division of the shards' gradients), before ``optimizer.step()``."""
    comm = _comm(report)
    grads = [(p, p.grad) for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    device = grads[0][1].device
    dense = [g for p, g in grads if not report.owns(p)]
    experts = [g for p, g in grads if report.owns(p)]
    order = float(norm_type)
    zero = torch.zeros((), device=device)
    dense_norm = get_total_norm(dense, order).to(device) if dense else zero
    expert_norm = get_total_norm(experts, order).to(device) if experts else zero.clone()
    if math.isinf(order):
        dist.all_reduce(expert_norm, op=dist.ReduceOp.MAX, group=comm.intra[0].group)
        total = torch.maximum(dense_norm, expert_norm)
    else:
        powered = expert_norm.double() ** order
        dist.all_reduce(powered, group=comm.intra[0].group)
        total = ((dense_norm.double() ** order + powered) ** (1.0 / order)).to(dense_norm.dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({float(total)}); "
                           "set error_if_nonfinite=False to clip anyway")
    clip_grads_with_norm_([p for p, _ in grads], max_norm, total)
    return total


def _layer_of(shard: Shard, settle: bool | None = True) -> runtime.EPLayer | None:
    """The runtime layer whose rows a stacked shard holds (None before its first compile: the
    contiguous placement). ``settle``: put in force a swap still waiting for its outcome (an
    exchange with the other ranks); False: a pending swap raises (its rows and the table may
    not agree yet); None: the rows as they are now (a pending swap of this rank's has moved them
    and their optimizer state alike)."""
    for lay in runtime.layers():
        if any(shard.local is q for q in lay.slot_params):
            if settle:
                lay.settle()
            elif settle is not None and lay.settle_hook is not None:
                raise RuntimeError(f"layer {lay.name}: an expert swap is waiting for its outcome; call the swapper's "
                                   "flush() on every rank before taking the state dict")
            return lay
    return None


def _placement(shard: Shard, world: int) -> tuple[list[int], list[int]]:
    """(mesh position, local slot) of every logical expert of a stacked shard's layer: the layer's
    placement table where an expert swap may have moved its rows (``runtime.EPLayer``), else the
    contiguous one ``shard_experts`` cut (expert e at position e // (E/G), slot e % (E/G))."""
    lay = _layer_of(shard)
    if lay is not None:
        return [int(p) for p in lay.expert_pos_E.tolist()], [int(s) for s in lay.expert_slot_E.tolist()]
    per = shard.num_experts // world
    return [e // per for e in range(shard.num_experts)], [e % per for e in range(shard.num_experts)]


def _local_experts(shard: Shard, settle: bool | None = True) -> list[int]:
    """The logical experts of this rank's shard rows, in row order (after any expert swap)."""
    lay = _layer_of(shard, settle)
    return list(lay.local_experts) if lay is not None else list(range(shard.first, shard.first + shard.num_local))


EXPERTS_SUFFIX = "_shard_experts"  # state dict key beside a shard: the logical expert of each of its rows


def _save_rows(shard: Shard, attr: str, module: nn.Module, state_dict: dict[str, Any], prefix: str,
               local_metadata: Any) -> None:
    """``state_dict`` hook of a module holding a stacked shard: beside ``<attr>_shard`` its rows'
    logical experts (``<attr>_shard_experts``), so that a per-rank state dict says whose rows it
    holds and in which order (``_load_rows`` checks them). Not collective: a state dict taken on
    one rank only (a trainer's writer) must not wait for the others."""
    state_dict[prefix + attr + EXPERTS_SUFFIX] = torch.tensor(_local_experts(shard, settle=False), dtype=torch.long)


def _stacked_shards(report: ShardReport) -> dict[str, Shard]:
    """The stacked weights' shards by name (the only shards with rows here: an expert module this
    rank holds keeps its parameter and has no shard record)."""
    return {sh.name: sh for sh in report.shards if sh.local is not None}


def full_state_dict(model: nn.Module, report: ShardReport, *, rank0_only: bool = False) -> dict[str, Tensor]:
    """The state dict of the model ``shard_experts`` sharded, as the unsharded model has it: the
    same keys (``gate_up_proj``, not the rank's ``gate_up_proj_shard``; every expert module's
    weights), each expert weight whole, its experts in logical order wherever expert swaps moved
    their rows. What a checkpoint should hold: it loads into the unsharded model
    (``load_state_dict``, ``from_pretrained``) and back into a sharded one (each rank keeps its
    rows, see ``shard_experts``).

    Collective over the mesh: every rank calls it at the same point (between steps). Each expert
    weight is gathered from the ranks that hold it: an all-gather of the stacked shards, a
    broadcast from the owner of an expert module (``rank0_only``: a gather to the mesh's first
    rank, and the other ranks get an empty dict, as torch's FSDP does; less memory there)."""
    comm = _comm(report)
    flat = comm.intra[0]  # the whole mesh, its group ranks in flat.peer_pos order
    root = flat.peer_pos.index(0)
    keep = not rank0_only or comm.position == 0
    state = model.state_dict() if keep else {}
    stacked = _stacked_shards(report)
    for param in report.params:
        if param.index is None:
            full = _gather_stacked(stacked[param.name], param, comm, rank0_only, root)
            state.pop(f"{param.name}_shard", None)
            state.pop(param.name + EXPERTS_SUFFIX, None)
        else:
            full = _broadcast_module(model, param, comm, rank0_only)
        if keep:
            assert full is not None
            state[param.name] = full
    return state


def _gather_stacked(shard: Shard, param: ExpertParam, comm: Any, rank0_only: bool, root: int,
                    value: Tensor | None = None) -> Tensor | None:
    """The [E, ...] tensor whose rows every rank holds as ``value`` (default: the shard itself; an
    optimizer state shaped like it), its experts in logical order."""
    flat = comm.intra[0]
    assert shard.local is not None
    local = (shard.local if value is None else value).detach()
    parts = [torch.empty_like(local) for _ in flat.peer_pos]
    if rank0_only:
        dist.gather(local, parts if comm.position == 0 else None, dst=dist.get_global_rank(flat.group, root),
                    group=flat.group)
        if comm.position != 0:
            return None
    else:
        dist.all_gather(parts, local, group=flat.group)
    by_pos = {pos: parts[i] for i, pos in enumerate(flat.peer_pos)}
    where, slot = _placement(shard, comm.world)
    return torch.stack([by_pos[where[e]][slot[e]] for e in range(param.num_experts)])


def _broadcast_module(model: nn.Module, param: ExpertParam, comm: Any, rank0_only: bool) -> Tensor | None:
    """Expert ``param.index``'s module weight, from the rank that holds it (modules never move:
    ``shard_experts`` keeps them in place and an expert swap refuses them)."""
    module, attr = _resolve(model, param.name)
    held = module._parameters.get(attr)
    if comm.position == _owner(param, comm):
        assert held is not None, f"{param.name}: this rank should hold expert {param.index}'s module"
        value = held.detach().clone()
    else:
        value = torch.empty(param.shape, dtype=param.dtype, device=_device(module, attr))
    payload = [value]
    return payload[0] if _from_owner(payload, _owner(param, comm), comm, rank0_only) else None


def _owner(param: ExpertParam, comm: Any) -> int:
    """The mesh position that holds expert module ``param.index`` (the contiguous placement)."""
    assert param.index is not None
    return param.index // (param.num_experts // comm.world)


def _from_owner(payload: list[Any], owner: int, comm: Any, rank0_only: bool) -> bool:
    """Hand ``payload[0]`` from mesh position ``owner`` to every rank (``rank0_only``: to the first
    only, point to point): a tensor each receiver allocated like it, or any picklable object.
    Returns whether this rank now holds it."""
    flat = comm.intra[0]
    group, tensor = flat.group, isinstance(payload[0], Tensor)
    src = dist.get_global_rank(group, flat.peer_pos.index(owner))
    if not rank0_only:
        if tensor:
            dist.broadcast(payload[0], src=src, group=group)
        else:
            dist.broadcast_object_list(payload, src=src, group=group)
        return True
    if owner != 0 and comm.position in (owner, 0):
        dst = dist.get_global_rank(group, flat.peer_pos.index(0))
        if comm.position == owner and tensor:
            dist.send(payload[0], dst=dst, group=group)
        elif comm.position == owner:
            dist.send_object_list(payload, dst=dst, group=group)
        elif tensor:
            dist.recv(payload[0], src=src, group=group)
        else:
            dist.recv_object_list(payload, src=src, group=group)
    return comm.position == 0


def _load_rows(shard: Shard, attr: str, module: nn.Module, state_dict: dict[str, Any], prefix: str,
               *args: Any) -> None:
    """``load_state_dict`` pre-hook of a module whose expert weight ``attr`` is sharded: a full
    weight in the state dict (a checkpoint of the unsharded model, or ``full_state_dict``'s)
    becomes this rank's rows, in the order of its slots now (after any expert swap); another
    rank's expert module's weight is dropped (that rank loads it). A per-rank state dict
    (``<attr>_shard`` rows) loads by the experts it says its rows hold (``<attr>_shard_experts``,
    ``_save_rows``): reordered into the rank's slots, an error if they are another rank's; one
    without that entry (saved before it existed) loads as it is."""
    key = prefix + attr
    saved = state_dict.pop(key + EXPERTS_SUFFIX, None)
    if saved is not None and shard.local is not None and key + "_shard" in state_dict:
        state_dict[key + "_shard"] = _own_rows(key, state_dict[key + "_shard"], saved, _local_experts(shard))
    if key not in state_dict:
        return
    value = state_dict.pop(key)
    if shard.local is None:  # another rank's expert module
        return
    if prefix + attr + "_shard" in state_dict:
        raise ValueError(f"{key}: the state dict holds both the whole weight and this rank's shard "
                         f"({key}_shard); give one of them")
    if tuple(value.shape) != tuple(shard.placeholder.shape):
        raise ValueError(f"{key}: the state dict's weight has shape {tuple(value.shape)}, the model's experts "
                         f"{tuple(shard.placeholder.shape)}")
    rows = torch.as_tensor(_local_experts(shard), device=value.device)
    state_dict[key + "_shard"] = value.index_select(0, rows)


def _own_rows(key: str, rows: Tensor, saved: Tensor, held: list[int]) -> Tensor:
    """A per-rank state dict's shard ``rows`` of the experts ``saved`` (its ``_shard_experts``),
    in the order of the experts this rank holds now (``held``): reordered where swaps moved them;
    an error where they are another rank's experts (a trainer that saved its first rank's state
    dict for every rank)."""
    ids = [int(e) for e in saved.tolist()]
    if sorted(ids) != sorted(held):
        raise ValueError(f"{key}_shard: the state dict holds the rows of experts {ids}, but this rank holds experts "
                         f"{held}: it is another rank's shard; save the whole weights with "
                         "moe_compile.full_state_dict (or moe_compile.trainer.ShardedExperts with a Trainer)")
    if ids == held:
        return rows
    return rows.index_select(0, torch.as_tensor([ids.index(e) for e in held], device=rows.device))


def full_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, report: ShardReport, *,
                          rank0_only: bool = False) -> dict[str, Any]:
    """The optimizer state of the model ``shard_experts`` sharded, as the optimizer of the
    unsharded model has it, keyed by parameter name (``torch.distributed.checkpoint.state_dict``'s
    format: ``set_optimizer_state_dict(unsharded_model, optimizer, it)`` loads it): each expert
    weight's per-element state (Adam's ``exp_avg``, ``exp_avg_sq``, momentum) whole, its experts in
    logical order; its scalar state (Adam's ``step``) as it is, which must be the same on every
    rank (as an expert swap requires). Collective over the mesh, like ``full_state_dict``
    (``rank0_only``: the others get an empty dict)."""
    comm = _comm(report)
    flat = comm.intra[0]
    root = flat.peer_pos.index(0)
    keep = not rank0_only or comm.position == 0
    osd: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer))
    state: dict[str, Any] = dict(osd["state"])
    # the unsharded optimizer's groups: no rank's rows (ROWS_KEY)
    groups: list[dict[str, Any]] = [{k: v for k, v in g.items() if k != ROWS_KEY} | {"params": list(g["params"])}
                                    for g in osd["param_groups"]]
    stacked = _stacked_shards(report)
    for param in report.params:
        if param.index is None:
            shard = stacked[param.name]
            entry = state.pop(f"{param.name}_shard", {})
            names = sorted(entry)
            every: list[Any] = [None] * comm.world
            dist.all_gather_object(every, (names, [_scalar(entry[k]) for k in names]), group=flat.group)
            if any(e != every[0] for e in every):
                raise ValueError(f"{param.name}: the optimizer's state of its shards differs in kind or in its "
                                 f"scalars between the ranks ({sorted(set(map(repr, every)))}); a full optimizer "
                                 "state needs one value per weight: take it after a step in which every rank's "
                                 "experts got a gradient")
            full_entry = {k: _gather_stacked(shard, param, comm, rank0_only, root, entry[k])
                          if _rows(entry[k], shard) else entry[k] for k in names}
            _rename(groups, f"{param.name}_shard", param.name)
        else:
            full_entry, group = _broadcast_entry(model, param, comm, state, groups, rank0_only)
            if keep and group is not None and not any(param.name in g["params"] for g in groups):
                groups[group]["params"].append(param.name)
        if keep and full_entry:
            state[param.name] = full_entry
    return {"state": state, "param_groups": groups} if keep else {}


def load_full_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, report: ShardReport,
                               optim_state_dict: dict[str, Any]) -> None:
    """Load an optimizer state of the unsharded model (``full_optim_state_dict``'s, or
    ``get_optimizer_state_dict`` of the unsharded model) into the optimizer of the sharded one:
    each rank keeps its experts' rows, in the order of its slots now (after any expert swap), and
    the state of its own expert modules. Collective only where the optimizer has not stepped
    yet: torch then creates its state with one step on zero gradients, and the first step of an
    optimizer over expert shards compares its rows on every rank (``_check_rows``)."""
    state: dict[str, Any] = dict(optim_state_dict["state"])
    groups: list[dict[str, Any]] = [dict(g, params=list(g["params"])) for g in optim_state_dict["param_groups"]]
    stacked = _stacked_shards(report)
    held = {n for n, _ in model.named_parameters()}
    for param in report.params:
        if param.index is None:
            shard = stacked[param.name]
            entry = state.pop(param.name, None)
            if entry is not None:
                rows = torch.as_tensor(_local_experts(shard))
                state[f"{param.name}_shard"] = {
                    k: v.index_select(0, rows.to(v.device)) if isinstance(v, Tensor) and tuple(v.shape) == param.shape
                    else v for k, v in entry.items()}
            _rename(groups, param.name, f"{param.name}_shard")
        elif param.name not in held:  # another rank's expert module: that rank loads it
            state.pop(param.name, None)
            for g in groups:
                if param.name in g["params"]:
                    g["params"].remove(param.name)
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups})
    # torch merges the loaded groups into the optimizer's: rows a per-rank state loaded before said
    # it held (a Trainer loads its first rank's, then ShardedExperts this) are not what it holds now
    for g in optimizer.param_groups:
        g.pop(ROWS_KEY, None)


def _device(module: nn.Module, attr: str) -> torch.device:
    """Where an expert module's weight lives: the parameter on its owner, the placeholder elsewhere."""
    held = module._parameters.get(attr)
    if held is not None:
        return held.device
    placeholder = module._buffers.get(attr)
    assert placeholder is not None, f"{attr}: neither a parameter nor a shard placeholder of {type(module).__name__}"
    return placeholder.device


def _comm(report: ShardReport) -> Any:
    if report.comm is None:
        raise ValueError("this ShardReport does not say which mesh the experts were sharded over; pass the one "
                         "moe_compile.shard_experts returned")
    return report.comm


def _scalar(v: Any) -> Any:
    """A state value every rank must hold alike (not the rows): compared across the ranks."""
    if isinstance(v, Tensor):
        return ("tensor", tuple(v.shape), v.item() if v.numel() == 1 else None)
    return v


def _rows(v: Any, shard: Shard) -> bool:
    """Whether an optimizer state value has the shard's rows (one per local slot, shaped like it)."""
    return isinstance(v, Tensor) and shard.local is not None and tuple(v.shape) == tuple(shard.local.shape)


def _rename(groups: list[dict[str, Any]], old: str, new: str) -> None:
    for g in groups:
        g["params"] = [new if n == old else n for n in g["params"]]


def _broadcast_entry(model: nn.Module, param: ExpertParam, comm: Any, state: dict[str, Any],
                     groups: list[dict[str, Any]], rank0_only: bool) -> tuple[dict[str, Any], int | None]:
    """Expert module ``param``'s optimizer state and param group index, from the rank that holds it
    (to the first rank only where ``rank0_only``)."""
    payload: list[Any] = [None]
    if comm.position == _owner(param, comm):
        entry = {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in state.get(param.name, {}).items()}
        group = next((i for i, g in enumerate(groups) if param.name in g["params"]), None)
        payload = [(entry, group)]
    if not _from_owner(payload, _owner(param, comm), comm, rank0_only):
        return {}, None
    entry, group = payload[0]
    device = _device(*_resolve(model, param.name))
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in entry.items()}, group


# ---- whose rows an optimizer's state holds --------------------------------------------------------

ROWS_KEY = "hiermoe_expert_rows"  # in a saved param group: [index in the group, weight, its rows' experts]
_EXPERT_ROWS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # expert parameter -> (ShardReport, Shard | name)
_ROWS_HOOK: Any = None  # the global optimizer step pre-hook (_check_rows), registered once


def _rows_of(param: Tensor) -> tuple[str, list[int]]:
    """(the unsharded weight's name, the logical experts of its rows here, in row order) of an
    expert parameter: a stacked shard's rows (after any expert swap), an expert module's weight
    (its own name says which expert; no rows)."""
    what = _EXPERT_ROWS[param][1]
    if isinstance(what, Shard):
        return what.name, _local_experts(what, settle=None)
    return what, []


def _tag_rows(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` post-hook: each saved param group says whose rows its expert parameters'
    state is (not collective: a trainer's writer takes it on one rank)."""
    for group, saved in zip(optimizer.param_groups, state_dict["param_groups"], strict=True):
        rows = [[i, *_rows_of(p)] for i, p in enumerate(group["params"]) if p in _EXPERT_ROWS]
        if rows:
            saved[ROWS_KEY] = rows
        else:
            saved.pop(ROWS_KEY, None)
    return state_dict


def _loaded(optimizer: torch.optim.Optimizer) -> None:
    """``load_state_dict`` post-hook: check the loaded rows at the next step."""
    optimizer._hiermoe_rows_checked = False  # type: ignore[attr-defined]


def _check_rows(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook (``register_optimizer_step_pre_hook``), at the first step of
    an optimizer over expert shards and the first after each ``load_state_dict``: the rows each
    loaded param group says its state holds (``ROWS_KEY``) against the experts this rank holds.
    The same experts in another order (an expert swap since it was saved): the state's rows are
    put in this rank's order. Other experts (another rank's state: a trainer that saved its first
    rank's optimizer state for every rank): every rank raises, before the step updates anything.
    Collective over the mesh then: every rank steps its optimizer at the same points, as the
    expert-parallel training it is part of does. A group without ``ROWS_KEY`` (saved before
    the first step, or the unsharded optimizer's, ``load_full_optim_state_dict``) is trusted."""
    if getattr(optimizer, "_hiermoe_rows_checked", False):
        return
    found = [(g, i, p) for g in optimizer.param_groups for i, p in enumerate(g["params"]) if p in _EXPERT_ROWS]
    optimizer._hiermoe_rows_checked = True  # type: ignore[attr-defined]
    if not found:
        return
    if not getattr(optimizer, "_hiermoe_rows_hooked", False):
        optimizer.register_state_dict_post_hook(_tag_rows)
        optimizer.register_load_state_dict_post_hook(_loaded)
        optimizer._hiermoe_rows_hooked = True  # type: ignore[attr-defined]
    problems: list[str] = []
    reorders: list[tuple[Tensor, list[int]]] = []
    for group, i, p in found:
        saved = {int(r[0]): (r[1], [int(e) for e in r[2]]) for r in group.get(ROWS_KEY, ())}
        if i not in saved:
            continue
        name, held = _rows_of(p)
        saved_name, saved_experts = saved[i]
        if saved_name != name or sorted(saved_experts) != sorted(held):
            what = f"experts {saved_experts}" if saved_experts else "that expert"
            problems.append(f"{name}{f' (experts {held})' if held else ''} got the state of {saved_name}'s {what}")
        elif saved_experts != held:
            reorders.append((p, [saved_experts.index(e) for e in held]))
    report = _EXPERT_ROWS[found[0][2]][0]
    verdicts: list[Any] = [problems]
    if report.comm is not None:
        verdicts = [None] * report.comm.world
        dist.all_gather_object(verdicts, problems, group=report.comm.intra[0].group)
    bad = {pos: v for pos, v in enumerate(verdicts) if v}
    if bad:
        optimizer._hiermoe_rows_checked = False  # type: ignore[attr-defined]  # until a right state is loaded
        first = next(iter(bad))
        raise RuntimeError(
            f"the optimizer state loaded on mesh position(s) {sorted(bad)} is not those ranks' own: at position "
            f"{first}, {'; '.join(bad[first][:3])}. A sharded model's optimizer.state_dict() holds the experts of "
            "the rank that took it (transformers' Trainer without moe_compile.trainer.ShardedExperts saves its "
            "first rank's for every rank). Load each rank's own, or save with moe_compile.full_optim_state_dict "
            "and load with moe_compile.load_full_optim_state_dict (ShardedExperts does both for a Trainer). "
            "The step was refused: no weight has changed")
    for p, order in reorders:  # new tensors: the loaded ones are the caller's state dict's own
        state = optimizer.state.get(p, {})
        for k, v in state.items():
            if isinstance(v, Tensor) and v.shape == p.shape:
                state[k] = v.index_select(0, torch.as_tensor(order, device=v.device))
    for group in optimizer.param_groups:  # checked: the rows are this rank's now (_tag_rows says so again)
        group.pop(ROWS_KEY, None)

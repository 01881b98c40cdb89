"""Expert shards: which placeholder stands for which rank's rows (the records the expert-parallel
pass and the runtime read); ``moe_compile.sharding.shard_experts`` makes them.

Expert sharding: each rank keeps only its own experts' weights.

``shard_experts(model, mesh, *example_inputs)`` finds the model's MoE layers with the backend's
own finder (a compile on the example inputs, nothing rewritten in the model), then for every
expert weight family:

- stacked ``[E, ...]`` parameter ``p``: the rank's experts become a new parameter ``p_shard``
  (``[E/G, ...]``, a copy of the rows this rank owns under the contiguous placement), and ``p``
  becomes a non-persistent buffer that is a stride-0 expansion of one element: it keeps the
  shape Dynamo and the finder see, and costs no memory;
- experts kept as E modules: the other ranks' modules get such placeholders for their weights;
  this rank's modules keep theirs.

Then the model must run compiled with ``options={"mesh": mesh, ...}``: the expert-parallel
pass reads ``p_shard`` (a parameter of the compiled graph, so autograd and the optimizer see it)
instead of ``p``; nothing copies expert weights in a step. Call it before creating the optimizer
(the optimizer must hold the ``_shard`` parameters). The model run eagerly after sharding would
compute with zero placeholder weights, so ``shard_experts`` refuses to shard a model twice and the
pass refuses a placeholder it does not know. A placeholder is known by its tensor, or by the module
buffer it was registered as: ``Module.to`` / ``_apply`` (transformers' Trainer moves the model to
its device when it is built) gives the buffer a new tensor, which is still the shard's.

Gradients: an owned expert parameter's gradient (``ShardReport.owns``) is the sum over every
rank's tokens routed to those experts; DDP-style averaging divides it by the world size without
an all-reduce (no other rank has a share, and with experts kept as E modules the ranks' parameter
lists no longer line up).

Checkpoints: ``state_dict()`` holds each rank's ``_shard`` rows (in its slots' order, which an
expert swap changes) and only its own expert modules. ``sharding.full_state_dict`` gathers the
unsharded model's state dict (every expert whole, in logical order); ``load_state_dict`` of such a
full state dict into a sharded model keeps each rank's rows (a pre-hook per sharded weight).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Shard:
    name: str  # module path of the original parameter
    placeholder: Tensor
    local: nn.Parameter | None  # None for a non-local expert module's weight
    first: int
    num_local: int
    num_experts: int


@dataclass(frozen=True)
class ExpertParam:
    """One expert weight of the unsharded model, the same list in the same order on every rank
    (what ``sharding.full_state_dict`` gathers): a stacked ``[E, ...]`` tensor (``index`` None) or
    expert ``index``'s own module's."""

    name: str  # its state_dict key in the unsharded model
    index: int | None
    num_experts: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ShardReport:
    """Per-rank expert memory after sharding."""

    shards: tuple[Shard, ...]
    full_bytes: int  # every expert weight of the model
    local_bytes: int  # what this rank holds
    owned: tuple[nn.Parameter, ...] = ()  # every expert parameter this rank holds (shards, local modules)
    params: tuple[ExpertParam, ...] = ()  # every expert weight of the unsharded model
    comm: Any = None  # moe_compile.ep.comm.MeshComm of the mesh the experts were sharded over

    def owns(self, p: object) -> bool:
        """Whether ``p`` is an expert parameter of this rank: its gradient already sums every
        rank's tokens, so DDP-style averaging divides it by the world size and must not all-reduce
        it (other ranks hold other experts at the same position of ``model.parameters()``)."""
        return any(p is q for q in self.owned)

    def __str__(self) -> str:
        return (f"expert weights on this rank: {self.local_bytes / 2**20:.2f} MiB of {self.full_bytes / 2**20:.2f} MiB "
                f"({len(self.shards)} tensors sharded)")


_BY_ID: dict[int, Shard] = {}
# where each shard's placeholder lives: (the module, its buffer name), to find the placeholder again
# after the module's buffers were replaced by new tensors (Module.to / _apply: transformers' Trainer
# moves the model to its device when it is built, which gives every buffer a new tensor object)
_HOMES: list[tuple[Shard, weakref.ref[nn.Module], str]] = []
_SHAPES: set[tuple[int, ...]] = set()  # the placeholders' shapes: any other tensor is no shard's, at once


def register(shard: Shard, module: nn.Module, attr: str) -> None:
    """Make ``lookup(shard.placeholder)`` find ``shard``, and ``lookup`` of whatever tensor
    ``module``'s buffer ``attr`` holds later."""
    _BY_ID[id(shard.placeholder)] = shard
    _HOMES.append((shard, weakref.ref(module), attr))
    _SHAPES.add(tuple(shard.placeholder.shape))


def lookup(t: object) -> Shard | None:
    """The shard a placeholder tensor stands for (None for any other value): the tensor
    ``shard_experts`` registered, or the one its module's buffer holds now."""
    if not isinstance(t, Tensor) or tuple(t.shape) not in _SHAPES:
        return None
    s = _BY_ID.get(id(t))
    if s is not None and s.placeholder is t:
        return s
    for shard, module_ref, attr in _HOMES:
        module = module_ref()
        if module is not None and module._buffers.get(attr) is t:
            return shard
    return None


def looks_like_placeholder(t: object) -> bool:
    """Whether ``t`` has the form of a ``shard_experts`` placeholder (more than one element, every
    stride 0: one value expanded to a weight's shape), which no real expert weight has."""
    return isinstance(t, Tensor) and t.numel() > 1 and all(st == 0 for st in t.stride())


def verification_value(t: object, seed: int) -> object:
    """Random full-shape weights for a placeholder, so that verification compares the layer's two
    forms on weights that tell the experts apart (the placeholder is all zeros). Allocated at
    compile time only, then freed."""
    s = lookup(t)
    if s is None:
        return t
    assert isinstance(t, Tensor)
    gen = torch.Generator(device=t.device).manual_seed(seed)
    return torch.randn(t.shape, generator=gen, dtype=t.dtype, device=t.device)

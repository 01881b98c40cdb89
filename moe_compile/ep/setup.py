"""Expert-parallel setup: checking the mesh and topology, and building each layer's runtime state.

Everything here runs at compile time, before the first collective of a step, so a bad setup
fails with a message that says what to change instead of hanging in an all-to-all. The only
collectives are the ``dist.new_group`` calls of the first ``MeshComm`` for a mesh, made by every
rank in the same order (every rank compiles the same graph first).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from moe_compile.cost.hiermoe import HDCostModel
from moe_compile.cost.topology import Topology
from moe_compile.cost.workload import SLOT_BYTES, Workload
from moe_compile.ep import runtime
from moe_compile.ep.comm import MeshComm

_comms: dict[int, Any] = {}

NEED_TOPOLOGY = ("expert parallelism picks the all-to-all dimension d* from the cluster's alpha/beta: give "
                 "options['topology'] (a TOML file from moe-calibrate, or a Topology) or fix "
                 "options['dimension'] (1..number of mesh levels)")


def check_mesh(mesh: Any, topology: Topology | None) -> None:
    """Raise ValueError for a mesh that cannot run expert parallelism on this world."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"option 'mesh' must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; "
                         "build one with init_device_mesh(device, (nodes, gpus), mesh_dim_names=('node', 'gpu'))")
    if not dist.is_initialized():
        raise ValueError("option 'mesh' needs torch.distributed initialized (run under torchrun, or call "
                         "dist.init_process_group before building the mesh)")
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError("the mesh needs mesh_dim_names, one per level, slowest first, "
                         "e.g. init_device_mesh('cpu', (2, 4), mesh_dim_names=('node', 'gpu'))")
    world = dist.get_world_size()
    if mesh.mesh.numel() != world:
        raise ValueError(f"the mesh has {mesh.mesh.numel()} ranks {tuple(mesh.mesh.shape)} but the world size is "
                         f"{world}; expert parallelism needs a mesh over every rank (its shape's product must be "
                         f"the torchrun --nproc-per-node x --nnodes)")
    if topology is not None:
        if tuple(topology.level_names) != tuple(names):
            unknown = sorted(set(names) - set(topology.level_names))
            raise ValueError(f"the mesh levels {list(names)} do not match the topology's {list(topology.level_names)}"
                             + (f" (unknown level(s) {unknown})" if unknown else "")
                             + "; name the mesh dims as the topology's levels, slowest first")
        if tuple(topology.sizes) != tuple(int(s) for s in mesh.mesh.shape):
            raise ValueError(f"the mesh shape {tuple(mesh.mesh.shape)} differs from the topology's level sizes "
                             f"{tuple(topology.sizes)}; calibrate the topology on this mesh (moe-calibrate)")


def mesh_comm(mesh: Any) -> Any:
    key = id(mesh)
    if key not in _comms:
        _comms[key] = (mesh, MeshComm.build(mesh))  # keep the mesh alive so its id stays unique
    return _comms[key][1]


def build_layer(*, name: str, mesh: Any, topology: Topology | None, dimension: int | None, dedup: bool,
                num_experts: int, top_k: int, hidden_size: int, ffn_size: int, gated: bool,
                dtype: torch.dtype, device: torch.device, tensors: tuple[Any, ...] = (),
                domain: int | None = None, model_centric: bool = False) -> runtime.EPLayer:
    """The runtime state of one layer: contiguous placement (expert e on position e // (E/G),
    HierMoE Fig. 6), the local experts, and the lambdified HD-d model when d is chosen per step.

    ``tensors`` are the weight tensors the layer's graph reads: a recompile of the same model
    (the same tensors) gets the layer it had, with its current placement (expert swaps may have
    moved experts since), and this compile's settings. ``domain``: the mesh level whose blocks
    gather the layer's experts (``lowering.ep_gather``); its tokens then cross levels
    0..domain-1 (the layer's fixed dimension is that many inter-level hops). ``model_centric``:
    the layer runs model-centric (``lowering.ep_model``)."""
    world = math.prod(int(s) for s in mesh.mesh.shape)
    if num_experts % world:
        raise ValueError(f"layer {name}: {num_experts} experts do not split evenly over {world} ranks; "
                         f"use a mesh whose size divides {num_experts} (expert parallelism places E/G experts "
                         "on every rank)")
    if device.type != mesh.device_type:
        raise ValueError(f"layer {name}: the model runs on {device.type} but the mesh is on {mesh.device_type}; "
                         f"build the mesh with init_device_mesh({device.type!r}, ...)")
    num_levels = mesh.mesh.ndim
    if domain is not None:
        if not 0 <= domain < num_levels:
            raise ValueError(f"layer {name}: expert domain level {domain} outside the mesh's levels 0..{num_levels - 1}")
        dimension = domain
    elif dimension is not None and not 1 <= dimension <= num_levels:
        raise ValueError(f"option 'dimension' must be in 1..{num_levels} (the mesh has {num_levels} levels), "
                         f"got {dimension}")
    if dimension is None and topology is None:
        raise ValueError(NEED_TOPOLOGY)
    comm = mesh_comm(mesh)
    cost = None
    if topology is not None:
        work = Workload(num_tokens=1, hidden_size=hidden_size, ffn_size=ffn_size, num_experts=num_experts,
                        top_k=top_k, dtype_bytes=dtype.itemsize, gated=gated, slot_bytes=SLOT_BYTES)
        cost = HDCostModel(topology, work)
    old = runtime.find_layer(name, comm, tensors)
    if old is not None:
        old.settle()  # its version must be the one every rank agrees on
        if (old.num_experts, old.top_k) != (num_experts, top_k):
            raise ValueError(f"layer {name}: recompiled with {num_experts} experts top-{top_k} but its weights were "
                             f"compiled before as {old.num_experts} experts top-{old.top_k}")
        old_topology = old.cost.topology if old.cost is not None else None
        if ((old.dedup, old.dimension, old_topology, old.domain, old.model_centric)
                == (dedup, dimension, topology, domain, model_centric)):
            return old
        if old.version:
            raise ValueError(f"layer {name}: its experts were swapped under the expert-parallel options it was first "
                             "compiled with; compile it again with the same mesh, topology, dimension and dedup")
        blocker = ("two compiled graphs with different expert-parallel options read these weights; compile "
                   "the model once (one set of options) to swap its experts")
        old.swap_blocker = blocker
    else:
        blocker = None
    per_rank = num_experts // world
    expert_pos = torch.arange(num_experts, device=comm.device) // per_rank
    local = tuple(range(comm.position * per_rank, (comm.position + 1) * per_rank))
    return runtime.register_layer(tensors=tensors, name=name, num_experts=num_experts, top_k=top_k, comm=comm,
                                  expert_pos_E=expert_pos, local_experts=local, dedup=dedup, dimension=dimension,
                                  cost=cost, domain=domain, model_centric=model_centric, ffn_size=ffn_size,
                                  swap_blocker=blocker or _no_swap(domain, model_centric))


def _no_swap(domain: int | None, model_centric: bool) -> str | None:
    """Why a layer's experts need no swapping (None: they may), from how it runs."""
    if model_centric:
        return ("it runs model-centric: every rank computes every token on its columns of every expert, so "
                "where an expert lives does not matter")
    if domain is not None:
        return ("it gathers its experts (expert_gather): no token travels to them, so where they live does not "
                "matter")
    return None

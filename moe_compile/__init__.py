"""moe_compile: the ``hiermoe`` torch.compile backend for Mixture-of-Experts models.

``torch.compile(model, backend="hiermoe")`` finds the MoE layers of a model in its FX graph and
replaces each, after checking it numerically, by one dropless expert op.  Importing this package
registers the backend (an installed package also registers it through the
``torch_dynamo_backends`` entry point, so ``import moe_compile`` is optional), registers the
``hiermoe`` experts implementation with Hugging Face transformers when transformers is installed,
and turns on Dynamo's ``capture_dynamic_output_shape_ops`` and ``capture_scalar_outputs`` so
per-expert loops over ``torch.where(mask)``, and over token counts read into Python ints
(``counts.tolist()``, ``int(counts[e])``), trace as one graph instead of breaking at every expert
(``moe_compile.dynamo_fixes`` repairs what the flags would make fail to compile: a ``tolist()``
of a data-dependent length, a slice with data-dependent bounds of an empty dimension), and turns
off ``optimize_ddp`` so a model under DistributedDataParallel is not cut at its gradient buckets.
"""

from __future__ import annotations

import torch._dynamo

import moe_compile.lowering  # noqa: F401  (registers torch.ops.hiermoe.*)
from moe_compile import dynamo_fixes, hf
from moe_compile.backend import hiermoe_backend
from moe_compile.ep.runtime import counters, reset_counters
from moe_compile.ep.shard import ShardReport
from moe_compile.explain import explain
from moe_compile.options import Options, SwapOptions, parse_options
from moe_compile.report import RegionReport, Report, SkipReport
from moe_compile.sharding import (
    clip_grad_norm_,
    full_optim_state_dict,
    full_state_dict,
    load_full_optim_state_dict,
    prepare_ddp,
    shard_experts,
)
from moe_compile.swap.swapper import ExpertSwapper, SwapRecord, expert_swapper

__all__ = ["ExpertSwapper", "Options", "RegionReport", "Report", "ShardReport", "SkipReport", "SwapOptions",
           "SwapRecord", "clip_grad_norm_", "counters", "expert_swapper", "explain", "full_optim_state_dict",
           "full_state_dict", "hiermoe_backend", "load_full_optim_state_dict", "parse_options", "prepare_ddp",
           "reset_counters", "shard_experts"]

# Per-expert loops (`idx, pos = torch.where(mask[e])`) have data-dependent shapes; without this
# Dynamo breaks the graph at each expert and no layer can be seen whole.
torch._dynamo.config.capture_dynamic_output_shape_ops = True
# Loops that slice expert-sorted tokens by counts read into Python ints (Megatron's SequentialMLP:
# `torch.split(tokens, counts.tolist())`, `n = int(counts[e])`): the ints become unbacked sizes
# instead of a graph break at the read.
torch._dynamo.config.capture_scalar_outputs = True
dynamo_fixes.install()  # what the two flags above would otherwise make fail to compile
# A model under DistributedDataParallel: Dynamo's DDP optimizer cuts its graph at DDP's gradient
# buckets (25 MiB), so a layer whose experts outweigh a bucket reaches the backend in pieces and
# is never found whole. Compiled whole, DDP all-reduces the gradients after the compiled backward
# (the pieces would let it start during backward).
torch._dynamo.config.optimize_ddp = False


def _register_backend() -> None:
    from importlib.metadata import entry_points

    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    # When installed, the entry point registers the backend on first lookup; registering here
    # too would make that lookup fail with "duplicate name".
    installed = "hiermoe" in entry_points(group="torch_dynamo_backends").names
    if not installed and "hiermoe" not in _COMPILER_FNS:
        register_backend(hiermoe_backend, name="hiermoe")  # type: ignore[arg-type]


_register_backend()
hf.install()

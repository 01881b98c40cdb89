"""Choose how each expert op runs: the torch lowering (as aten ops the inner compiler sees
through, or opaque) or the HEXA-MoE Triton kernels (re-index
vector, ESMM forward, ESMM/ESTMM/ESS/ESFK backward; papers/hexa-moe.txt Sec. 4.2, App. A Alg. 1-4).

``hiermoe::experts`` and ``hiermoe::experts_triton`` take the same arguments and compute the same
function (``lowering/triton_experts.py``), so lowering one layer to the kernels is a change of the
call's target and nothing else. This module refers to the ops through ``torch.ops`` only (it must
not import Triton; see DESIGN.md, Layout).
"""

from __future__ import annotations

import torch
import torch.fx as fx

import moe_compile.lowering as lowering
from moe_compile.lowering.experts_ref import activation_error
from moe_compile.passes.graph_index import fake_tensor, tensor_meta

KERNEL_CHOICES = ("auto", "triton", "torch")


def _device_of(node: fx.Node) -> torch.device | None:
    """Device of the tensor ``node`` produces, from its recorded fake value, or (for nodes added by
    earlier passes, which carry none) from the nearest producer that has one."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop(0)
        if n in seen:
            continue
        seen.add(n)
        t = tensor_meta(n)
        if t is not None:
            return t.device
        todo.extend(n.all_input_nodes)
    return None


def lower_kernels_pass(gm: fx.GraphModule, kernels: str) -> dict[str, int]:
    """Retarget every ``hiermoe::experts`` call to ``hiermoe::experts_triton`` where ``kernels``
    resolves to Triton, and run every expert-parallel local stage (``hiermoe::ep_local_experts``)
    on the kernels there (its ``triton`` argument: one ESMM call over the dispatched rows and
    their slots, no per-slot copy of a row).

    Contract:
      needs       a graph whose expert ops are ``torch.ops.hiermoe.experts.default`` call nodes (what
                  canonicalize emits, or what a model calls itself) or ``ep_local_experts`` nodes
                  (what the expert-parallel pass emits), with fake values recorded on the op's
                  input x (the tokens) or on its producers (Dynamo's ``example_value`` or ``val``).
      guarantees  the graph computes the same function (same arguments, same semantics); each op is
                  counted once, under "triton" (retargeted), "composite" (the torch lowering as
                  ``hiermoe::experts_composite``, aten ops the inner compiler traces, fuses and
                  differentiates, where every matmul can be one grouped_mm) or "torch" (left as
                  the opaque ``hiermoe::experts``).
                  "auto" is Triton when x is on CUDA and the triton package is installed and the
                  kernels compute the op's activation (not an ``expr:`` one), else torch.
      refuses     (ValueError, before anything changes) an unknown ``kernels`` value, and
                  kernels="triton" when the kernels cannot run: triton missing, x on CPU without
                  TRITON_INTERPRET=1 in the environment from before triton was imported, or an
                  activation they do not compute (``lowering.experts_ref.activation_error``).

    Pseudo-code::

        ops = [n for n in graph if n.target in (experts, ep_local_experts)]   # Step 1
        for n in ops: choice[n] = resolve(kernels, device(n.x))              # Step 2 (may refuse)
        for n in ops with choice triton: experts -> experts_triton,          # Step 3
                                         ep_local_experts(..., triton=True)
        for n in ops with choice torch: experts -> experts_composite where grouped_mm takes them
        return {"triton": #retargeted, "composite": #traceable, "torch": #left}
    """
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {list(KERNEL_CHOICES)}, got {kernels!r}")
    # Step 1: the expert ops.
    local = torch.ops.hiermoe.ep_local_experts.default
    ops = [n for n in gm.graph.nodes
           if n.op == "call_function" and n.target in (torch.ops.hiermoe.experts.default, local)]
    # Step 2: resolve the option per op; refuse before changing anything.
    choices: dict[fx.Node, str] = {}
    for n in ops:
        x = n.args[0] if n.args else n.kwargs.get("x")
        device = _device_of(x) if isinstance(x, fx.Node) else None
        activation = n.args[9] if len(n.args) > 9 else n.kwargs.get("activation")
        unsupported = activation_error(activation) if isinstance(activation, str) else None
        if kernels == "torch" or (kernels == "auto" and unsupported is not None):
            choices[n] = "torch"
        elif kernels == "auto":
            on_gpu = device is not None and device.type == "cuda" and lowering.triton_kernels_error(device) is None
            choices[n] = "triton" if on_gpu else "torch"
        else:
            why = unsupported or (lowering.triton_kernels_error(device) if device is not None else None)
            if why is not None:
                raise ValueError(f"options kernels='triton' cannot lower {n.name}: {why}")
            choices[n] = "triton"
    # Step 3: retarget.
    counts = {"triton": 0, "torch": 0, "composite": 0}
    for n, choice in choices.items():
        if choice == "triton" and n.target is local:
            n.update_kwarg("triton", True)
        elif choice == "triton":
            n.target = torch.ops.hiermoe.experts_triton.default
        elif n.target is not local and _composite_ok(n):
            n.target = torch.ops.hiermoe.experts_composite.default
            choice = "composite"
        counts[choice] += 1
    if counts["triton"] or counts["composite"]:
        gm.recompile()
    return counts


def _composite_ok(n: fx.Node) -> bool:
    """Whether the expert op ``n`` can run as ``hiermoe::experts_composite`` (every matmul one
    grouped_mm, ``lowering.experts_composite.grouped_mm_ok``), judged on the fake values of its
    tokens and weights (``graph_index.fake_tensor``); False where one of them has none."""
    names = ("x", "topk_idx", "topk_weights", "w_up", "w_gate", "w_down")
    args = [n.args[i] if i < len(n.args) else n.kwargs.get(name) for i, name in enumerate(names)]
    x, w_up, w_gate, w_down = (fake_tensor(a) if isinstance(a, fx.Node) else None for a in
                               (args[0], args[3], args[4], args[5]))
    if x is None or w_up is None or w_down is None or (args[4] is not None and w_gate is None):
        return False
    return lowering.grouped_mm_ok(x, w_up, w_gate, w_down)

"""Choose how each expert op runs: the torch lowering (as aten ops the inner compiler sees
through, or opaque) or the HEXA-MoE Triton kernels (re-index
vector, ESMM forward, ESMM/ESTMM/ESS/ESFK backward; papers/hexa-moe.txt Sec. 4.2, App. A Alg. 1-4).

``hiermoe::experts`` and ``hiermoe::experts_triton`` take the same arguments and compute the same
function (``lowering/triton_experts.py``), so lowering one layer to the kernels is a change of the
call's target and nothing else. This module refers to the ops through ``torch.ops`` only (it must
not import Triton; see DESIGN.md, Layout).
"""

from __future__ import annotations

import operator
import os
from typing import cast

import torch
import torch.fx as fx

import moe_compile.lowering as lowering
from moe_compile.lowering import kernel_table
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
                  differentiates, where every matmul can be one grouped_mm; on CPU, an op whose
                  weights are stacks of E modules' weights (or gate and up the halves of one such
                  stack: per-module views) takes them as lists instead,
                  ``hiermoe::experts_composite_list``: no stacked copy, per-module gradients;
                  an op whose gate and up are the two views of one stored [E, 2F, H] tensor
                  takes that tensor, ``hiermoe::experts_composite_gate_up``: one matmul with 2F
                  columns for both, forward and backward, and their biases, where they are the
                  two views of one stored [E, 2F] tensor in the same order, as ``b_gate_up``) or
                  "torch" (left as the opaque ``hiermoe::experts``).
                  "auto" is Triton when x is on CUDA, the triton package is installed, the
                  kernels compute the op's activation (not an ``expr:`` one) and the measured
                  table (``lowering.kernel_table``: this device, the nearest shape, forward+backward
                  when the op is trained) has them faster than the torch lowering; else torch.
                  A trained op lowered to Triton takes the training form
                  ``experts_triton_keep(...)[0]`` (pre-activations kept for the backward) unless
                  HIERMOE_TRITON_KEEP=0.
      refuses     (ValueError, before anything changes) an unknown ``kernels`` value, and
                  kernels="triton" when the kernels cannot run: triton missing, x on CPU without
                  TRITON_INTERPRET=1 in the environment from before triton was imported, or an
                  activation they do not compute (``lowering.experts_ref.activation_error``).

    Pseudo-code::

        ops = [n for n in graph if n.target in (experts, ep_local_experts)]   # Step 1
        for n in ops: choice[n] = resolve(kernels, device(n.x))              # Step 2 (may refuse)
        for n in ops with choice triton: experts -> experts_triton,          # Step 3
                                         or experts_triton_keep(..., blk)[0] when trained,
                                         ep_local_experts(..., triton=True)
        for n in ops with choice torch: experts -> experts_composite_gate_up where gate, up are views
                                           of one stored tensor grouped_mm takes,
                                        -> experts_composite where grouped_mm takes every weight,
                                        -> experts_composite_list on CPU where weights are stacks
                                           of E module weights or gate and up halves of one
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
            choices[n] = _measured_choice(n, device) if on_gpu and device is not None else "torch"
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
        elif choice == "triton" and _keeps(n):
            _to_keep_form(gm, n)
        elif choice == "triton":
            n.target = torch.ops.hiermoe.experts_triton.default
        elif n.target is not local and _to_composite(gm, n):
            choice = "composite"
        counts[choice] += 1
    if counts["triton"] or counts["composite"]:
        gm.recompile()
    return counts


_NAMES = ("x", "topk_idx", "topk_weights", "w_up", "w_gate", "w_down", "b_up", "b_gate", "b_down", "activation")


def _arg(n: fx.Node, i: int) -> object:
    return n.args[i] if i < len(n.args) else n.kwargs.get(_NAMES[i])


def _fakes(n: fx.Node, *names: str) -> list[torch.Tensor | None]:
    out = []
    for name in names:
        a = _arg(n, _NAMES.index(name))
        out.append(fake_tensor(a) if isinstance(a, fx.Node) else None)
    return out


def _measured_choice(n: fx.Node, device: torch.device) -> str:
    """kernels="auto" on CUDA: what ``lowering.kernel_table`` measured faster for this layer's shape
    on this device, forward + backward where its inputs require grad, else forward; the torch
    lowering where a shape is unknown or the device was never measured."""
    x, idx, w_up = _fakes(n, "x", "topk_idx", "w_up")
    if x is None or idx is None or w_up is None:
        return "torch"
    num_t = x.shape[0] if isinstance(x.shape[0], int) else 8192  # a symbolic T: judge a large batch
    choice = kernel_table.choose(kernel_table.device_key(device), x.dtype, num_t, idx.shape[1], w_up.shape[0],
                                 x.shape[1], w_up.shape[1], training=_training(n))
    return choice.kernels


def _training(n: fx.Node) -> bool:
    """Whether a gradient can flow through expert op ``n``: a fake value of its tokens or weights
    requires grad (Dynamo records parameters' requires_grad on their example values)."""
    return any(t is not None and t.requires_grad
               for t in _fakes(n, "x", "topk_weights", "w_up", "w_gate", "w_down", "b_up", "b_gate", "b_down"))


def _keeps(n: fx.Node) -> bool:
    """Whether the Triton lowering of ``n`` takes its training form (``hiermoe::experts_triton_keep``:
    the forward stores up and gate for the backward instead of the backward recomputing them): when
    it is trained, unless HIERMOE_TRITON_KEEP=0 (read when the graph is compiled)."""
    mode = os.environ.get("HIERMOE_TRITON_KEEP", "1")
    if mode not in ("0", "1"):
        raise ValueError(f"HIERMOE_TRITON_KEEP must be 0 or 1, got {mode!r}")
    return mode == "1" and all(t is not None for t in _fakes(n, "x", "topk_idx", "w_up")) and _training(n)


def _to_keep_form(gm: fx.GraphModule, n: fx.Node) -> None:
    """Replace ``n`` by ``experts_triton_keep(..., blk)[0]`` (same value; the other outputs feed the
    backward through autograd)."""
    x, idx, w_up = _fakes(n, "x", "topk_idx", "w_up")
    assert x is not None and idx is not None and w_up is not None
    blk = lowering.triton_keep_blk(x, idx.shape[1], w_up.shape[0])
    args = tuple(cast(fx.node.Argument, _arg(n, i)) for i in range(len(_NAMES))) + (blk,)
    with gm.graph.inserting_after(n):
        keep = gm.graph.call_function(torch.ops.hiermoe.experts_triton_keep.default, args)
    with gm.graph.inserting_after(keep):
        y = gm.graph.call_function(operator.getitem, (keep, 0))
    y.meta.update(n.meta)
    n.replace_all_uses_with(y)
    gm.graph.erase_node(n)


def _to_list_form(gm: fx.GraphModule, n: fx.Node) -> bool:
    """On CPU, where every weight of composite op ``n`` is a ``torch.stack`` of E tensors (experts
    stored as E modules, ``passes/emit.py``), or gate and up are the two halves (``_half``) of one
    such stack (Megatron's ``linear_fc1``: gate and up rows in one [2F, H] weight per module), call
    ``experts_composite_list`` on the E tensors (each module's halves as views of its weight)
    instead: nothing is stacked (a copy of every expert weight in the forward, kept for the
    backward, and a stacked gradient) and each module's weight gets its own gradient
    (``lowering/grouped_mm.py``, ``grouped_linear``). Stays as it is elsewhere: on CUDA one
    grouped_mm beats E matmuls."""
    x = _arg(n, 0)
    device = _device_of(x) if isinstance(x, fx.Node) else None
    if device is None or device.type != "cpu":
        return False
    slots = [_NAMES.index(name) for name in ("w_up", "w_gate", "w_down")]
    given = [_arg(n, i) for i in slots]
    lists: list[list[fx.Node] | None] = []
    for g in given:
        half = _half(g)
        if g is None:
            lists.append(None)
        elif _is_stack(g):
            lists.append(list(cast(list[fx.Node], cast(fx.Node, g).args[0])))
        elif half is not None and _is_stack(half[0]):
            lists.append([_module_half(gm, cast(fx.Node, g), t, half[1]) for t in cast(list[fx.Node], half[0].args[0])])
        else:
            return False
    args = [_arg(n, i) for i in range(len(_NAMES))]
    for i, items in zip(slots, lists, strict=True):
        if items is not None:
            args[i] = items
    n.args, n.kwargs = tuple(cast(list[fx.node.Argument], args)), {}
    n.target = torch.ops.hiermoe.experts_composite_list.default
    for g in given:  # the views, then the stacks, that nothing reads any more
        if isinstance(g, fx.Node) and not g.users and not _is_stack(g):
            base = g.args[0]
            gm.graph.erase_node(g)
            g = base
        if isinstance(g, fx.Node) and not g.users:
            gm.graph.erase_node(g)
    return True


def _is_stack(node: object) -> bool:
    return (isinstance(node, fx.Node) and node.target is torch.stack and len(node.args) == 1 and not node.kwargs
            and isinstance(node.args[0], (list, tuple)))


def _module_half(gm: fx.GraphModule, view: fx.Node, weight: fx.Node, which: str) -> fx.Node:
    """The view of one module's [2F, H] ``weight`` that ``view`` (a ``_half`` of their stack) takes
    of every module: rows ``narrow(0, start, F)`` for a half, every other row for "even"/"odd"."""
    with gm.graph.inserting_before(view):
        if which in ("first", "second"):
            return gm.graph.call_function(torch.narrow, (weight, 0, view.args[2], view.args[3]))
        return gm.graph.call_function(operator.getitem, (weight, slice(1 if which == "odd" else 0, None, 2)))


def _half(node: object) -> tuple[fx.Node, str] | None:
    """(W, which) where ``node`` is one of the views ``passes/emit.py`` splits a stored [E, 2F, H]
    gate_up tensor W (or its [E, 2F] bias) into: ``narrow(W, 1, 0, F)`` ("first"),
    ``narrow(W, 1, F, F)`` ("second"), both with W.shape[1] == 2F, ``W[:, 0::2]`` ("even"),
    ``W[:, 1::2]`` ("odd")."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or not node.args:
        return None
    w = node.args[0]
    if not isinstance(w, fx.Node):
        return None
    if node.target is torch.narrow and len(node.args) == 4:
        start, length = node.args[2], node.args[3]
        fake = fake_tensor(w)
        if (fake is None or fake.dim() not in (2, 3) or node.args[1] not in (1, 1 - fake.dim())
                or not isinstance(length, int) or fake.shape[1] != 2 * length):
            return None
        return (w, "first") if start == 0 else (w, "second") if start == length else None
    if node.target is operator.getitem and len(node.args) == 2:
        index = node.args[1]
        if (isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None)
                and isinstance(index[1], slice) and index[1].step == 2 and index[1].stop is None
                and index[1].start in (None, 0, 1)):
            return w, "odd" if index[1].start == 1 else "even"
    return None


def _to_gate_up_form(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Where composite op ``n``'s gate and up are the two views of one stored [E, 2F, H] tensor
    (halves or even/odd rows, as ``passes/emit.py`` splits transformers' ``gate_up_proj``), call
    ``experts_composite_gate_up`` on that tensor: one grouped matmul with 2F columns for both
    projections, in the forward and for the backward's input and weight gradients, and the
    weight's gradient made whole by the matmul (no two halves summed into zeros)."""
    up, gate = _half(_arg(n, _NAMES.index("w_up"))), _half(_arg(n, _NAMES.index("w_gate")))
    if up is None or gate is None or up[0] is not gate[0]:
        return False
    order = {("first", "second"): "gate_first", ("second", "first"): "up_first",
             ("even", "odd"): "interleaved"}.get((gate[1], up[1]))
    x, w_down = _fakes(n, "x", "w_down")
    fused = fake_tensor(gate[0])
    if order is None or x is None or w_down is None or fused is None or not lowering.grouped_mm_ok(x, fused, None, w_down):
        return False
    args = [cast(fx.node.Argument, _arg(n, i)) for i in range(len(_NAMES))]
    views = [args[_NAMES.index("w_up")], args[_NAMES.index("w_gate")]]
    kwargs: dict[str, fx.node.Argument] = {}
    b_up, b_gate = _half(args[_NAMES.index("b_up")]), _half(args[_NAMES.index("b_gate")])
    if b_up is not None and b_gate is not None and b_up[0] is b_gate[0] and (b_gate[1], b_up[1]) == (gate[1], up[1]):
        # their biases are the two views of one [E, 2F] tensor in the same order: pass that
        kwargs["b_gate_up"] = b_gate[0]
        views += [args[_NAMES.index("b_up")], args[_NAMES.index("b_gate")]]
        args[_NAMES.index("b_up")] = args[_NAMES.index("b_gate")] = None
    n.args = (*args[:3], gate[0], order, *args[5:])
    n.kwargs = kwargs
    n.target = torch.ops.hiermoe.experts_composite_gate_up.default
    for v in views:
        if isinstance(v, fx.Node) and not v.users:
            gm.graph.erase_node(v)
    return True


def _to_composite(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Retarget ``n`` to the composite form that reads its weights as stored, if any applies: the
    list form (CPU, E modules), the gate_up form, else ``experts_composite``. The gate_up form
    judges the stored tensor, not its views: GPT-OSS's interleaved rows of a transposed
    [E, H, 2F] are views grouped_mm cannot take one by one."""
    ok = _composite_ok(n)
    if (ok and _to_list_form(gm, n)) or _to_gate_up_form(gm, n):
        return True
    if ok:
        n.target = torch.ops.hiermoe.experts_composite.default
    return ok


def _composite_ok(n: fx.Node) -> bool:
    """Whether the expert op ``n`` can run as ``hiermoe::experts_composite`` (every matmul one
    grouped_mm, ``lowering.experts_composite.grouped_mm_ok``), judged on the fake values of its
    tokens and weights (``graph_index.fake_tensor``); False where one of them has none."""
    x, w_up, w_gate, w_down = _fakes(n, "x", "w_up", "w_gate", "w_down")
    if x is None or w_up is None or w_down is None or (_arg(n, _NAMES.index("w_gate")) is not None and w_gate is None):
        return False
    return lowering.grouped_mm_ok(x, w_up, w_gate, w_down)

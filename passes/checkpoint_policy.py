"""checkpoint_policy: what a selective activation checkpoint's policy is asked about the expert op.

A selective checkpoint (``torch.utils.checkpoint`` with a ``context_fn`` from
``create_selective_checkpoint_contexts``) decides per op, when AOTAutograd traces its body, whether
backward recomputes the op's output or keeps it. Its policy is written for the ops the model runs;
after the rewrite the experts run the expert op's matmuls (``hiermoe.grouped_mm``, ...), which it
does not name. ``inline_checkpoint`` closes the checkpoint again around the rewritten layer and
asks through this module:

- ``written_matmuls``: the matmuls the layer was written with (the nodes the rewrite erased), as
  AOTAutograd names them to a policy (aten's for torch's matmuls; a library's own matmul op);
- ``asking_as_written``: the context_fn whose policy saves an expert-op matmul where it saves that
  op by name or any written matmul, so what it saved of the model's experts it saves of the op's;
- ``policy_saves``: the one question about an expert-parallel local stage (it stays outside the
  checkpoint): whether the policy saves the gate and up projections' grouped matmuls.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

_SAVING = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE, True)  # a policy's answers that keep the output

# the expert op's matmuls (its lowerings' forward ops)
_EXPERT_MATMULS = ("hiermoe.grouped_mm.default", "hiermoe.grouped_mm_rows.default", "hiermoe.grouped_linear.default",
                   "hiermoe.grouped_linear_gate_up.default")
# the ops whose outputs the local expert stage's kept pre-activations are: the gate and up
# projections' grouped matmuls as the expert op runs them on one process, and torch's, which
# transformers' grouped_mm experts run (what a policy written for the model names)
_GATE_UP_OPS = ("aten._grouped_mm.default", *_EXPERT_MATMULS)


def policy_saves(context_fn: Any, written: tuple[Any, ...] = ()) -> bool | str:
    """Whether the policy of a selective checkpoint's ``context_fn`` (None: it has none) saves the
    outputs of the gate and up projections' grouped matmuls (``_GATE_UP_OPS``, and ``written``: the
    matmuls the layer was written with, ``written_matmuls``; any of them MUST_SAVE or
    PREFER_SAVE), asked as AOTAutograd asks it (a fresh ``context_fn()``, its forward mode's ``policy_fn``, a context
    that is not a recompute), without arguments; or why it cannot be asked."""
    if context_fn is None:
        return "the checkpoint has no context_fn"
    try:
        forward_mode, _ = context_fn()
    except Exception as e:  # noqa: BLE001 (the user's function; the note names what it raised)
        return f"its context_fn raised {type(e).__name__}: {e}"
    policy = getattr(forward_mode, "policy_fn", None)
    if not callable(policy):
        return "its context_fn does not come from torch.utils.checkpoint.create_selective_checkpoint_contexts"
    ops = [op for name in _GATE_UP_OPS if (op := _op(name)) is not None] + [w for w in written if str(w) not in _GATE_UP_OPS]
    try:
        answers = [policy(SelectiveCheckpointContext(is_recompute=False), op) for op in ops]
    except Exception as e:  # noqa: BLE001 (a policy that reads the op's arguments)
        return f"its policy raised {type(e).__name__} when asked about {ops[0]} without arguments"
    return any(a in _SAVING for a in answers)


def _op(name: str) -> Any:
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op, None), overload, None)


# the ops AOTAutograd traces (and a selective checkpoint's policy is asked about) for the matmuls a
# layer may be written with in the Dynamo graph; matmul and linear become mm, addmm or bmm by shape
_MM = torch.ops.aten.mm.default
_ATEN_MATMULS: dict[Any, tuple[Any, ...]] = {
    torch._grouped_mm: (torch.ops.aten._grouped_mm.default,),
    torch.bmm: (torch.ops.aten.bmm.default,), "bmm": (torch.ops.aten.bmm.default,),
    torch.baddbmm: (torch.ops.aten.baddbmm.default,),
    torch.mm: (_MM,), "mm": (_MM,), torch.addmm: (torch.ops.aten.addmm.default,),
    torch.matmul: (_MM, torch.ops.aten.bmm.default), operator.matmul: (_MM, torch.ops.aten.bmm.default),
    "matmul": (_MM, torch.ops.aten.bmm.default), torch.einsum: (torch.ops.aten.bmm.default,),
    torch._C._nn.linear: (_MM, torch.ops.aten.addmm.default),
    torch.nn.functional.linear: (_MM, torch.ops.aten.addmm.default),
}


def written_matmuls(replaced: Iterable[fx.Node]) -> tuple[Any, ...]:
    """The matmul ops AOTAutograd would have asked a selective checkpoint's policy about for the
    ``replaced`` nodes (a rewritten layer's expert computation as the model wrote it), in a fixed
    order: aten's for torch's matmuls, and a library's own custom op where its name says it is a
    matmul (``mm``, ``matmul``, ``linear``: it stays one op under AOTAutograd)."""
    ops: dict[Any, None] = {}
    for n in replaced:
        if n.op not in ("call_function", "call_method"):
            continue
        target = n.target.default if isinstance(n.target, torch._ops.OpOverloadPacket) else n.target
        if isinstance(target, torch._ops.OpOverload) and target.namespace not in ("aten", "hiermoe") and any(
                w in target._opname for w in ("mm", "matmul", "linear")):
            ops[target] = None  # a library's matmul op (transformers' grouped_mm_fallback on CPU)
        for op in _ATEN_MATMULS.get(n.target, ()):
            ops[op] = None
    return tuple(sorted(ops, key=str))


def asking_as_written(context_fn: Any, written: tuple[Any, ...]) -> Any:
    """``context_fn`` whose policy, asked about one of the expert op's matmuls (``_EXPERT_MATMULS``),
    saves its output where it saves that op (named as such, with its arguments) or any of the
    matmuls the layer was written with (``written``, asked without arguments, as ``policy_saves``
    asks); else its answer for the op. A policy written for the model (torchtitan's saves
    ``aten.mm``, others name ``aten._grouped_mm``) so saves of the rewritten experts what it saved of
    the model's, and one naming the expert op's matmuls still saves them. Where the written matmuls
    cannot be asked about (the policy reads the op's arguments and raises), its answer for the op
    stands. A ``context_fn`` whose forward mode has no ``policy_fn`` (not torch's
    ``create_selective_checkpoint_contexts``) is returned as it is."""
    expert = {op for name in _EXPERT_MATMULS if (op := _op(name)) is not None}

    def wrapped() -> Any:
        modes = context_fn()
        forward = modes[0]
        policy = getattr(forward, "policy_fn", None)
        if not callable(policy):
            return modes

        def ask(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            answer = policy(ctx, op, *args, **kwargs)
            if op not in expert or answer in _SAVING:
                return answer
            try:
                written_answers = [policy(ctx, w) for w in written]
            except Exception:  # noqa: BLE001 (a policy that reads the arguments: its answer as traced)
                return answer
            return next((a for a in written_answers if a in _SAVING), answer)

        forward.policy_fn = ask
        return modes

    return wrapped


__all__ = ["asking_as_written", "policy_saves", "written_matmuls"]

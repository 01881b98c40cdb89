"""The ``hiermoe`` experts implementation for Hugging Face transformers.

After ``import moe_compile``, ``model.set_experts_implementation("hiermoe")`` (or
``from_pretrained(..., experts_implementation="hiermoe")``) makes every transformers experts
module (classes decorated with ``use_experts_implementation``) call ``hiermoe::experts``
directly, in eager mode and under torch.compile alike.  The stored weights are passed as views
(transposes, halves or interleaved rows of ``gate_up_proj``), so nothing is copied.

Registration is lazy: if transformers' MoE integration is already imported it happens at once,
otherwise a post-import hook performs it when transformers loads that module, so importing
moe_compile does not pay for importing transformers.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

import torch

_MOE_MODULE = "transformers.integrations.moe"

# activation module class name -> the op's activation
_ACTIVATIONS = {
    "SiLU": "silu", "SiLUActivation": "silu",
    "GELU": "gelu", "GELUActivation": "gelu",
    "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh",
    "GELUPytorchTanh": "gelu_tanh", "ReLU": "relu", "Sigmoid": "sigmoid",
}


def _activation(module: torch.nn.Module) -> str:
    act = getattr(module, "act_fn", None)
    name = type(act).__name__
    if name == "GELU" and getattr(act, "approximate", "none") == "tanh":
        return "gelu_tanh"
    if name == "GELUActivation" and getattr(act, "act", None) is not None:
        inner = act.act  # type: ignore[union-attr]
        if getattr(inner, "__name__", "") == "gelu" or inner is torch.nn.functional.gelu:
            return "gelu"
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"experts_implementation='hiermoe' does not support the activation {name} of "
            f"{type(module).__name__}; supported are {sorted(set(_ACTIVATIONS.values()))}. "
            "Use experts_implementation='grouped_mm' for this model.")
    return _ACTIVATIONS[name]


def hiermoe_experts_forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers ``ExpertsInterface`` entry: (hidden [T, H], top-k ids, top-k weights) -> [T, H]."""
    from transformers.integrations.moe import _default_apply_gate

    cls = type(self).__name__
    if getattr(self, "_is_expert_parallel", False):
        raise ValueError(f"experts_implementation='hiermoe' does not run under transformers' own expert "
                         f"parallelism ({cls}); shard with moe_compile instead or use 'grouped_mm'")
    if getattr(self, "has_post_expert_norm", False):
        raise ValueError(f"{cls} normalizes each expert's output; experts_implementation='hiermoe' does not "
                         "support that yet, use 'grouped_mm'")
    if getattr(type(self), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        raise ValueError(f"{cls} uses its own gating function ({type(self).__name__}._apply_gate, e.g. a "
                         "clamped SwiGLU); experts_implementation='hiermoe' supports act(gate) * up only, "
                         "use 'grouped_mm'")
    activation = _activation(self)
    transposed = bool(getattr(self, "is_transposed", False))

    def linear_layout(w: torch.Tensor) -> torch.Tensor:  # stored [E, in, out] -> [E, out, in]
        return w.transpose(1, 2) if transposed else w

    w_gate = b_gate = None
    b_up = b_down = None
    if getattr(self, "has_gate", True):
        w = linear_layout(self.gate_up_proj)
        b = self.gate_up_proj_bias if getattr(self, "has_bias", False) else None
        if getattr(self, "is_concatenated", True):
            ffn = w.shape[1] // 2
            w_gate, w_up = w[:, :ffn], w[:, ffn:]
            if b is not None:
                b_gate, b_up = b[:, :ffn], b[:, ffn:]
        else:
            w_gate, w_up = w[:, 0::2], w[:, 1::2]
            if b is not None:
                b_gate, b_up = b[:, 0::2], b[:, 1::2]
    else:
        w_up = linear_layout(self.up_proj)
        b_up = self.up_proj_bias if getattr(self, "has_bias", False) else None
    w_down = linear_layout(self.down_proj)
    if getattr(self, "has_bias", False):
        b_down = self.down_proj_bias
    y = torch.ops.hiermoe.experts(hidden_states, top_k_index, top_k_weights, w_up, w_gate, w_down,
                                  b_up, b_gate, b_down, activation)
    return y.to(hidden_states.dtype)


def _register(moe: Any) -> None:
    moe.ExpertsInterface.register("hiermoe", hiermoe_experts_forward)


class _RegisterOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Post-import hook: register once transformers' MoE integration module has been executed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _MOE_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return None
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)  # type: ignore[attr-defined]

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)  # type: ignore[attr-defined]
        _register(module)


def install() -> None:
    if _MOE_MODULE in sys.modules:
        _register(sys.modules[_MOE_MODULE])
    elif importlib.util.find_spec("transformers") is not None:
        if not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterOnImport())


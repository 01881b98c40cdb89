"""The sample registry: each entry builds one MoE layer and says what the detector should find in it.

Router labels (``SampleSpec.router``):
  "softmax"               softmax over E, top-k, the top-k probabilities are the weights
  "softmax+renorm"        softmax, top-k, weights divided by their sum (with capacity: over the kept choices)
  "topk+softmax"          top-k on the logits, softmax over the K chosen (equal to "softmax+renorm")
  "sigmoid"               sigmoid scores, top-k, scores are the weights
  "sigmoid+renorm"        sigmoid, top-k, weights divided by their sum
  "sigmoid+bias+grouped"  DeepSeek-V3: sigmoid, selection bias, group-limited top-k, renorm
  "...+argmax", "...+sort" the top-k written without torch.topk: K masked argmaxes, a sort's head
``route_scale`` multiplies the weights after the router rule (1.0 when there is none).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .deepseek_v3 import DeepseekV3MoE
from .dense_masked import DenseMaskedMoE
from .expert_loop import MixtralSparseMoeBlock
from .gathered_bmm import GatheredBmmMoE
from .gpt_oss import GptOssMoE
from .grouped_gemm import GroupedGemmMoE
from .normed_router import NormedRouterMoE
from .qwen3 import Qwen3MoeSparseMoeBlock
from .sequential_mlp import SequentialMLPMoE
from .sparsemixer import SparseMixerMoE
from .switch_einsum import SwitchEinsumMoE

# Arguments whose value IS the expected metadata of the same name.
_META_KEYS = ("hidden_size", "ffn_size", "num_experts", "top_k", "activation", "gated", "bias")


@dataclass(frozen=True)
class SampleSpec:
    """One registered MoE layer: how to build it and what a correct detector reports for it.

    ``kwargs`` are the constructor's defaults here; ``make(**overrides)`` builds with some replaced and
    ``expected(**overrides)`` gives the metadata of that same build. ``spec.top_k`` etc. read
    ``expected()`` of the default build.
    """

    name: str
    factory: Callable[..., nn.Module]
    kwargs: Mapping[str, Any]
    router: str | Callable[[Mapping[str, Any]], str]  # a label, or the label as a function of the args
    dispatch: str  # "grouped_mm", "gathered_bmm", "expert_loop", "dense", "einsum_capacity"
    weight_layout: str  # where the expert weights live, for humans reading a failing test
    drops: bool = False
    fixed: Mapping[str, Any] = field(default_factory=dict)  # metadata the constructor does not take

    def _merged(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        known = inspect.signature(self.factory).parameters
        unknown = set(overrides) - set(known)
        if unknown:
            raise ValueError(
                f"{self.name}: cannot override {sorted(unknown)}; the constructor takes {list(known)}"
            )
        return {**self.kwargs, **overrides}

    def make(self, **overrides: Any) -> nn.Module:
        return self.factory(**self._merged(overrides))

    def expected(self, **overrides: Any) -> dict[str, Any]:
        args = self._merged(overrides)
        meta = {k: args[k] for k in _META_KEYS if k in args}
        if "activation" in meta:
            meta["activation"] = EXPRESSIONS.get(meta["activation"], meta["activation"])
        meta.update(self.fixed)
        meta.update(
            router=self.router(args) if callable(self.router) else self.router,
            route_scale=float(args.get("route_scale", args.get("routed_scaling_factor", 1.0))),
            drops=self.drops,
            capacity_factor=args.get("capacity_factor"),
            shared_ffn_size=args["ffn_size"] * args.get("n_shared_experts", 0),
            dispatch=self.dispatch,
        )
        return meta

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_") or key in ("name", "kwargs", "fixed"):
            raise AttributeError(key)
        meta = self.expected()
        if key in meta:
            return meta[key]
        raise AttributeError(f"SampleSpec has no field or metadata {key!r}")


def _softmax_router(args: Mapping[str, Any]) -> str:
    return "softmax+renorm" if args["norm_topk_prob"] else "softmax"


def _bmm_router(args: Mapping[str, Any]) -> str:
    return str(args["router"])


def _capacity_router(args: Mapping[str, Any]) -> str:
    # Switch (top-1) keeps the raw probability; GShard renormalizes the kept choices.
    return "softmax" if args["top_k"] == 1 else "softmax+renorm"


def _normed_router(args: Mapping[str, Any]) -> str:
    return "softmax+renorm" if args["router"] == "norm" else "softmax"


def _grouped_router(args: Mapping[str, Any]) -> str:
    return args["score_func"] + ("+renorm" if args["norm_topk_prob"] else "")


_H, _F, _E = 32, 48, 8

# what the finder reads off the samples whose activation is an expression (lowering/activation.py)
GPT_OSS_ACTIVATION = ("expr:mul(add(clamp(u,-7.0,7.0),1.0),mul(clamp(g,None,7.0),"
                      "sigmoid(mul(clamp(g,None,7.0),1.702))))")
EXPRESSIONS = {"relu2": "expr:square(relu(u))"}


def _spec(
    name: str,
    factory: Callable[..., nn.Module],
    router: str | Callable[[Mapping[str, Any]], str],
    dispatch: str,
    layout: str,
    /,
    **kw: Any,
) -> SampleSpec:
    extra = {k: kw.pop(k) for k in ("drops", "fixed") if k in kw}
    kwargs = {"hidden_size": _H, "ffn_size": _F, "num_experts": _E, "top_k": 2, **kw}
    return SampleSpec(name, factory, kwargs, router, dispatch, layout, **extra)


SAMPLES: dict[str, SampleSpec] = {
    s.name: s
    for s in (
        _spec(
            "grouped_gemm",
            GroupedGemmMoE,
            _grouped_router,
            "grouped_mm",
            "gate_up_proj [E,2F,H] (gate first), down_proj [E,H,F]; torch.sort + inverse perm + view.sum",
            activation="silu",
            gated=True,
            bias=False,
            score_func="softmax",
            norm_topk_prob=True,
            style="hf",
        ),
        _spec(
            "grouped_gemm_sigmoid",
            GroupedGemmMoE,
            _grouped_router,
            "grouped_mm",
            "gate_up_proj [E,2F,H], down_proj [E,H,F] + biases; argsort + gather + scatter_add (torchtitan)",
            top_k=4,
            activation="gelu_tanh",
            gated=True,
            bias=True,
            score_func="sigmoid",
            norm_topk_prob=False,
            route_scale=2.0,
            style="titan",
        ),
        _spec(
            "gathered_bmm",
            GatheredBmmMoE,
            _bmm_router,
            "gathered_bmm",
            "gate_up_proj [E,2F,H] + bias [E,2F], down_proj [E,H,F] + bias [E,H]; w[expert_ids] + bmm",
            activation="gelu",
            gated=True,
            bias=True,
            router="topk+softmax",
        ),
        _spec(
            "gathered_bmm_plain",
            GatheredBmmMoE,
            _bmm_router,
            "gathered_bmm",
            "up_proj [E,F,H], down_proj [E,H,F]; w[expert_ids] + bmm",
            activation="gelu_tanh",
            gated=False,
            bias=False,
            router="softmax",
        ),
        _spec(
            "expert_loop",
            MixtralSparseMoeBlock,
            "softmax+renorm",
            "expert_loop",
            "ModuleList of w1/w3/w2 nn.Linear (Mixtral); torch.where per expert + index_add_",
            activation="silu",
            gated=True,
            bias=False,
        ),
        _spec(
            "dense_masked",
            DenseMaskedMoE,
            _softmax_router,
            "dense",
            "ModuleList of fc1/fc2 nn.Linear with bias; all experts on all tokens, dense [T,E] gate matrix",
            activation="gelu",
            gated=False,
            bias=True,
            norm_topk_prob=False,
        ),
        _spec(
            "switch_einsum",
            SwitchEinsumMoE,
            _capacity_router,
            "einsum_capacity",
            "wi [E,H,F] + bi [E,F], wo [E,F,H] + bo [E,H]; einsum dispatch/combine, capacity drops",
            top_k=1,
            activation="relu",
            gated=False,
            bias=True,
            capacity_factor=1.0,
            drops=True,
        ),
        _spec(
            "gshard_einsum",
            SwitchEinsumMoE,
            _capacity_router,
            "einsum_capacity",
            "wi [E,H,F] + bi [E,F], wo [E,F,H] + bo [E,H]; einsum dispatch/combine, capacity drops",
            top_k=2,
            activation="relu",
            gated=False,
            bias=True,
            capacity_factor=1.0,
            drops=True,
        ),
        _spec(
            "deepseek_v3",
            DeepseekV3MoE,
            "sigmoid+bias+grouped",
            "expert_loop",
            "experts.gate_up_proj [E,2F,H], experts.down_proj [E,H,F] in a range(E) loop; shared SwiGLU MLP",
            ffn_size=16,
            num_experts=16,
            top_k=4,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            n_shared_experts=1,
            activation="silu",
            fixed={"gated": True, "bias": False},
        ),
        _spec(
            "gpt_oss",
            GptOssMoE,
            "topk+softmax",
            "expert_loop",
            "gate_up_proj [E,H,2F] ([in, out], gate/up interleaved) + bias, down_proj [E,F,H] + bias; range(E) loop",
            fixed={"gated": True, "bias": True, "activation": GPT_OSS_ACTIVATION},
        ),
        _spec(
            "sparsemixer",
            SparseMixerMoE,
            "topk+softmax+argmax",
            "expert_loop",
            "w1/w3 [E,F,H], w2 [E,H,F]; top-k as K masked argmaxes (PhiMoE), range(E) loop",
            activation="silu",
            jitter_eps=0.5,  # wide enough that each weight is a softmax over several experts
            fixed={"gated": True, "bias": False},
        ),
        _spec(
            "normed_router",
            NormedRouterMoE,
            _normed_router,
            "expert_loop",
            "gate_up [E,2F,H], down [E,H,F]; the router's own norm + scale (or latent MLP) before the logits, "
            "per-expert weight scale; experts read their own normed tokens",
            activation="gelu_tanh",
            router="norm",
            extra_rows=0,
            fixed={"gated": True, "bias": False},
        ),
        _spec(
            "sequential_mlp",
            SequentialMLPMoE,
            "topk+softmax",
            "expert_loop",
            "ModuleList of linear_fc1 [2F,H] / linear_fc2 [H,F] (Megatron); rows cut by counts.tolist()",
            activation="silu",
            gated=True,
            style="split",
            fixed={"bias": False},
        ),
        _spec(
            "qwen3",
            Qwen3MoeSparseMoeBlock,
            _softmax_router,
            "expert_loop",
            "ModuleList of gate_proj/up_proj/down_proj nn.Linear (Qwen3); torch.where per expert, index_add_",
            top_k=4,
            activation="silu",
            norm_topk_prob=False,
            fixed={"gated": True, "bias": False},
        ),
    )
}


def example_input(spec: SampleSpec, batch: int = 2, seq: int = 8, **overrides: Any) -> torch.Tensor:
    """A random [batch, seq, hidden] input for ``spec`` (uses the global RNG: seed it for repeatability)."""
    hidden = spec.expected(**overrides)["hidden_size"]
    return torch.randn(batch, seq, hidden)

"""Sort + grouped-GEMM dispatch, as in HF transformers v5 ``grouped_mm_experts_forward`` and torchtitan.

Routed (token, expert) pairs are sorted by expert, counted per expert with ``torch.histc``, and the
counts' ``cumsum`` (int32) are the group offsets of ``torch._grouped_mm``. Expert weights are stacked
parameters in the transformers v5 layout: ``gate_up_proj`` [E, 2F, H] (gate rows first) and
``down_proj`` [E, H, F].

torch 2.13 on CPU: ``torch._grouped_mm`` runs fp32 in eager (when every row stride is a multiple of
16 bytes), but its meta function accepts only bf16, so Dynamo cannot trace it in fp32. Like
transformers, the layer then calls an opaque ``torch.library.custom_op`` fallback that loops over the
groups. So an fp32 graph holds ``moe_samples::grouped_mm_fallback`` and a bf16 graph holds
``aten._grouped_mm``.

Shape legend: T tokens, H hidden, F ffn, E experts, K top-k, S = T*K routed rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import check_top_k, get_activation, init_stacked_


@torch.library.custom_op("moe_samples::grouped_mm_fallback", mutates_args=())
def grouped_mm_fallback(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(S, in) rows sorted by group times weight (G, in, out) per group; offs are cumulative ends."""
    output = torch.zeros(input.size(0), weight.size(2), device=input.device, dtype=input.dtype)
    start = 0
    # One device->host sync for all groups; the op is opaque, so this never reaches Dynamo.
    for i, end in enumerate(offs.tolist()):
        if start == end:
            continue
        output[start:end] = torch.mm(input[start:end], weight[i])
        start = end
    return output


@grouped_mm_fallback.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    assert input.dim() == 2 and weight.dim() == 3 and offs.dim() == 1
    assert input.size(1) == weight.size(1) and offs.size(0) == weight.size(0)
    return input.new_empty(input.size(0), weight.size(2))


# A separate op for the backward keeps autograd (and AOT) from tracing into the group loop.
@torch.library.custom_op("moe_samples::grouped_mm_fallback_backward", mutates_args=())
def grouped_mm_fallback_backward(
    input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, grad_output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_input = torch.zeros_like(input, memory_format=torch.contiguous_format)
    grad_weight = torch.zeros_like(weight, memory_format=torch.contiguous_format)
    start = 0
    for i, end in enumerate(offs.tolist()):
        if start == end:
            continue
        grad_input[start:end] = torch.mm(grad_output[start:end], weight[i].T)
        grad_weight[i] = torch.mm(input[start:end].T, grad_output[start:end])
        start = end
    return grad_input, grad_weight


@grouped_mm_fallback_backward.register_fake
def _(
    input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, grad_output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty_like(input, memory_format=torch.contiguous_format),
        torch.empty_like(weight, memory_format=torch.contiguous_format),
    )


def _setup_context(ctx, inputs, output) -> None:
    input, weight, offs = inputs
    ctx.save_for_backward(input, weight)
    ctx.offs = offs


def _backward(ctx, grad_output: torch.Tensor):
    input, weight = ctx.saved_tensors
    grad_input, grad_weight = torch.ops.moe_samples.grouped_mm_fallback_backward(
        input, weight, ctx.offs, grad_output
    )
    return grad_input, grad_weight, None


grouped_mm_fallback.register_autograd(_backward, setup_context=_setup_context)


def _strides_16b_aligned(*tensors: torch.Tensor) -> bool:
    # The CPU kernel of torch._grouped_mm refuses non-unit strides that are not multiples of 16 bytes.
    return all(s * t.element_size() % 16 == 0 for t in tensors for s in t.stride() if s != 1)


def grouped_mm(
    x_SI: torch.Tensor, w_EIO: torch.Tensor, offs_E: torch.Tensor, impl: str = "auto"
) -> torch.Tensor:
    """Per-group ``x @ w[g]``: torch._grouped_mm where it works, else the custom-op fallback."""
    if impl == "torch":
        return torch._grouped_mm(x_SI, w_EIO, offs=offs_E)
    if impl == "auto":
        if w_EIO.dtype == torch.bfloat16:
            return torch._grouped_mm(x_SI.to(w_EIO.dtype), w_EIO, offs=offs_E)
        # Not under compile: the fp32 meta check would fail while tracing (see module docstring).
        if (
            not torch.compiler.is_compiling()
            and x_SI.device.type == "cpu"
            and _strides_16b_aligned(x_SI, w_EIO)
        ):
            return torch._grouped_mm(x_SI, w_EIO, offs=offs_E)
    return torch.ops.moe_samples.grouped_mm_fallback(x_SI.to(w_EIO.dtype), w_EIO, offs_E)


class GroupedGemmMoE(nn.Module):
    """Token-choice top-k MoE whose experts run as two grouped GEMMs over expert-sorted rows.

    ``style="hf"``: ``torch.sort`` of the flat expert ids, inverse permutation, ``view(T, K, H).sum(1)``
    (transformers v5). ``style="titan"``: stable ``argsort``, ``torch.gather`` of the rows, and a
    ``scatter_add`` combine (torchtitan). ``score_func`` "softmax" or "sigmoid"; ``norm_topk_prob``
    renormalizes the top-k scores; ``route_scale`` multiplies them afterwards.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        top_k: int,
        activation: str = "silu",
        gated: bool = True,
        bias: bool = False,
        score_func: str = "softmax",
        norm_topk_prob: bool = True,
        route_scale: float = 1.0,
        style: str = "hf",
        impl: str = "auto",
    ) -> None:
        super().__init__()
        check_top_k(num_experts, top_k)
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if style not in ("hf", "titan"):
            raise ValueError(f"style must be 'hf' or 'titan', got {style!r}")
        if impl not in ("auto", "torch", "fallback"):
            raise ValueError(f"impl must be 'auto', 'torch' or 'fallback', got {impl!r}")
        self.hidden_size, self.ffn_size = hidden_size, ffn_size
        self.num_experts, self.top_k = num_experts, top_k
        self.gated, self.has_bias = gated, bias
        self.score_func, self.norm_topk_prob, self.route_scale = score_func, norm_topk_prob, route_scale
        self.style, self.impl = style, impl
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        up_rows = 2 * ffn_size if gated else ffn_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, up_rows, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))
        init_stacked_(self.gate_up_proj, hidden_size)
        init_stacked_(self.down_proj, ffn_size)
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, up_rows))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
            init_stacked_(self.gate_up_proj_bias, hidden_size)
            init_stacked_(self.down_proj_bias, ffn_size)
        self.act_fn = get_activation(activation)

    def route(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits_TE = self.router(x_TH)
        if self.score_func == "softmax":
            scores_TE = F.softmax(logits_TE, dim=-1, dtype=torch.float32)
        else:
            scores_TE = torch.sigmoid(logits_TE.to(torch.float32))
        topk_w_TK, topk_idx_TK = torch.topk(scores_TE, k=self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_w_TK = topk_w_TK / (topk_w_TK.sum(dim=-1, keepdim=True) + 1e-20)
        topk_w_TK = topk_w_TK * self.route_scale
        return topk_w_TK.to(x_TH.dtype), topk_idx_TK

    def experts(self, x_SH: torch.Tensor, expert_ids_S: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        h_SF = grouped_mm(x_SH, self.gate_up_proj.transpose(-2, -1), offs_E, self.impl)
        if self.has_bias:
            h_SF = h_SF + self.gate_up_proj_bias[expert_ids_S]
        if self.gated:
            gate_SF, up_SF = h_SF.chunk(2, dim=-1)
            h_SF = self.act_fn(gate_SF) * up_SF
        else:
            h_SF = self.act_fn(h_SF)
        out_SH = grouped_mm(h_SF, self.down_proj.transpose(-2, -1), offs_E, self.impl)
        if self.has_bias:
            out_SH = out_SH + self.down_proj_bias[expert_ids_S]
        return out_SH

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        x_TH = x.reshape(-1, hidden)
        topk_w_TK, topk_idx_TK = self.route(x_TH)
        if self.style == "hf":
            out_TH = self._forward_hf(x_TH, topk_w_TK, topk_idx_TK)
        else:
            out_TH = self._forward_titan(x_TH, topk_w_TK, topk_idx_TK)
        return out_TH.reshape(batch, seq, hidden)

    def _offsets(self, sorted_ids_S: torch.Tensor) -> torch.Tensor:
        # histc, not bincount: fixed output size (no data-dependent shape); on CPU it needs floats.
        counts_E = torch.histc(sorted_ids_S.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        return torch.cumsum(counts_E, dim=0, dtype=torch.int32)

    def _forward_hf(
        self, x_TH: torch.Tensor, topk_w_TK: torch.Tensor, topk_idx_TK: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, hidden = x_TH.shape
        weights_S = topk_w_TK.reshape(-1)
        expert_ids_S = topk_idx_TK.reshape(-1)
        sorted_ids_S, perm_S = torch.sort(expert_ids_S)
        x_sorted_SH = x_TH[perm_S // self.top_k]
        weights_sorted_S = weights_S[perm_S]
        out_SH = self.experts(x_sorted_SH, sorted_ids_S, self._offsets(sorted_ids_S))
        out_SH = out_SH * weights_sorted_S.unsqueeze(-1)
        inv_perm_S = torch.empty_like(perm_S)
        inv_perm_S[perm_S] = torch.arange(perm_S.size(0), device=perm_S.device)
        out_SH = out_SH[inv_perm_S]
        return out_SH.view(num_tokens, self.top_k, hidden).sum(dim=1)

    def _forward_titan(
        self, x_TH: torch.Tensor, topk_w_TK: torch.Tensor, topk_idx_TK: torch.Tensor
    ) -> torch.Tensor:
        hidden = x_TH.size(-1)
        perm_S = torch.argsort(topk_idx_TK.view(-1), stable=True)
        sorted_ids_S = topk_idx_TK.view(-1)[perm_S]
        scores_sorted_S = topk_w_TK.view(-1)[perm_S]
        token_idx_S = perm_S // self.top_k
        gather_idx_SH = token_idx_S.reshape(-1, 1).expand(-1, hidden)
        routed_SH = torch.gather(x_TH, dim=0, index=gather_idx_SH)
        routed_SH = self.experts(routed_SH, sorted_ids_S, self._offsets(sorted_ids_S))
        routed_SH = (routed_SH.to(torch.float32) * scores_sorted_S.reshape(-1, 1)).to(x_TH.dtype)
        out_TH = torch.zeros_like(x_TH)
        return out_TH.scatter_add(dim=0, index=gather_idx_SH, src=routed_SH)

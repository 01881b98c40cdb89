"""A configurable MoE layer for the fuzz tests: the idioms, storages, routers, activations and
the modifications a model may add to its experts, chosen by a ``FuzzConfig``.

``EXTRAS_ON_EXPERTS`` are modifications the expert op does not compute (a scale, a clamp or
another nonlinearity after the down projection): a layer with one must be left as written,
with the op named in the reason.  ``EXTRAS_IN_ACTIVATION`` (a clamped gate or up as in GPT-OSS,
an offset, a second nonlinearity between the projections) the op computes as an ``expr:``
activation: such a layer must be rewritten, with that expression (``computed_by_op``).  The
others ("none", and a threshold on the routing weights, which the rewrite keeps as it is when it
reads the thresholded weights) may be rewritten.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IDIOMS = ("loop", "gathered", "dense")
BIAS_FORMS = ("add", "linear")
ACCUMULATES = ("in_place", "out_of_place", "setitem")
# "modules": E nn.Module experts with named projections (experts.3.up.weight); "sequential": each
# expert an nn.ModuleList of its projections (experts.3.0.weight), loop and dense idioms only
STORAGES = ("stacked", "stacked_t", "fused", "modules", "sequential")
# how the dense idiom reads each expert's weight: scattered into [T, E] gates, or masked out of the
# top-k values per expert, (w * (idx == e)).sum(-1)
DENSE_WEIGHTS = ("scatter", "masked_sum")
DISPATCHES = ("where", "one_hot", "sorted_counts")
# what the routing weights scale: each expert's output, sum_k w_k FFN_k(x), or its input,
# sum_k FFN_k(w_k x) (Llama-4); loop and gathered idioms (a dense layer runs every expert on every
# token, and FFN(0 * x) is not 0 with biases)
WEIGHTS_ON = ("output", "input")
# "sigmoid_bias": experts chosen on sigmoid scores plus a bias buffer, weights gathered from the
# unbiased scores and renormalized (DeepSeek-V3's e_score_correction_bias)
ROUTERS = ("softmax_renorm", "softmax", "topk_softmax", "sigmoid_renorm", "sigmoid_bias")
# how the K experts are picked from the router's scores: torch.topk; a descending sort cut at K;
# K rounds of argmax, each masking the one before (PhiMoE's sparsemixer)
SELECTIONS = ("topk", "sort", "argmax_rounds")
# "relu2": squared ReLU (Nemotron-H, Primer); "sigmoid_alpha": z * sigmoid(1.702 z) (GPT-OSS's
# gate): read off the graph as expressions (passes/activation_expr.py)
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2", "sigmoid_alpha")
EXTRAS_IN_ACTIVATION = ("clamp_gate", "clamp_up", "up_plus_one", "relu_after")
EXTRAS_ON_EXPERTS = ("scale_out", "tanh_out", "clamp_out")
EXTRAS = ("none", "weight_threshold", *EXTRAS_IN_ACTIVATION, *EXTRAS_ON_EXPERTS)
# the clamp limit: above every pre-activation of the compile batch (tokens of std COMPILE_STD)
LIMIT = 2.0
COMPILE_STD = 0.05
LARGE_STD = 30.0


def computed_by_op(cfg: FuzzConfig) -> bool:
    """Whether the expert op computes ``cfg.extra`` (as an ``expr:`` activation): the extras
    between the projections, except relu6 (``relu_after`` on a relu), which is not in the
    expressions' grammar."""
    return cfg.extra in EXTRAS_IN_ACTIVATION and not (cfg.extra == "relu_after" and cfg.activation == "relu")


def follows_the_sum(cfg: FuzzConfig) -> bool:
    """Whether ``cfg.extra`` on the experts (``EXTRAS_ON_EXPERTS``) follows the routed sum: the
    gathered idiom at K = 1 with the weights on the input sums one slot per token and weighs
    nothing after the experts, so the extra applies to each token's output, and the rewrite keeps
    it after the op (as whatever follows a layer)."""
    return cfg.extra in EXTRAS_ON_EXPERTS and cfg.idiom == "gathered" and cfg.top_k == 1 and cfg.weights_on == "input"


@dataclass(frozen=True)
class FuzzConfig:
    idiom: str
    storage: str
    router: str
    router_bias: bool
    route_scale: float
    activation: str
    gated: bool
    bias: bool
    extra: str
    num_experts: int
    top_k: int
    hidden: int
    ffn: int
    dtype: str = "float32"
    # how stacked experts add their biases in the loop and dense idioms: "add" to the product
    # (x @ w.t() + b, rounded twice in bf16) or "linear" inside it (F.linear(x, w, b), once, as
    # nn.Linear modules do); the op must round them as the layer does (ExpertLayout.bias_in_matmul)
    bias_form: str = "add"
    # how the loop and dense idioms sum the experts' outputs: "in_place" into one buffer
    # (out.index_add_(0, tok, v); dense: a stack summed), "out_of_place" a new tensor per expert
    # (out = out.index_add(0, tok, v), out = out + v), "setitem" by indexed assignment
    # (out[tok] += v, mistral-inference's MoeLayer; loop idiom only)
    accumulate: str = "in_place"
    dense_weights: str = "scatter"  # DENSE_WEIGHTS (dense idiom)
    # how the loop idiom finds each expert's tokens: torch.where(idx == e); torch.where on a one-hot
    # mask (transformers 4.x Mixtral); or slots sorted by expert, cut by counts read into Python
    # ints (Megatron's SequentialMLP: unbacked sizes)
    dispatch: str = "where"
    weights_on: str = "output"  # WEIGHTS_ON (loop and gathered idioms)
    selection: str = "topk"  # SELECTIONS
    # group-limited routing (DeepSeek-V3's n_group / topk_group): the experts in ``groups`` groups,
    # each scored by the sum of its best two, all but the best group's scores set to 0 before the
    # top-k (1: every expert eligible)
    groups: int = 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _act(name: str, z: torch.Tensor) -> torch.Tensor:
    if name == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if name == "relu2":
        return torch.square(F.relu(z))
    if name == "sigmoid_alpha":
        return z * torch.sigmoid(z * 1.702)
    return {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}[name](z)


class _Expert(nn.Module):
    def __init__(self, h: int, f: int, gated: bool, bias: bool) -> None:
        super().__init__()
        self.up = nn.Linear(h, f, bias=bias)
        self.gate = nn.Linear(h, f, bias=bias) if gated else None
        self.down = nn.Linear(f, h, bias=bias)


class FuzzMoE(nn.Module):
    def __init__(self, cfg: FuzzConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e, h, f = cfg.num_experts, cfg.hidden, cfg.ffn
        self.router = nn.Linear(h, e, bias=cfg.router_bias)
        if cfg.router == "sigmoid_bias":
            self.register_buffer("score_bias", torch.randn(e) * 0.1)
        if cfg.storage == "modules":
            self.experts = nn.ModuleList(_Expert(h, f, cfg.gated, cfg.bias) for _ in range(e))
            return
        if cfg.storage == "sequential":
            self.experts = nn.ModuleList(nn.ModuleList(
                [nn.Linear(h, f, bias=cfg.bias), *([nn.Linear(h, f, bias=cfg.bias)] if cfg.gated else []),
                 nn.Linear(f, h, bias=cfg.bias)]) for _ in range(e))
            return

        def stacked(rows: int, cols: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(e, rows, cols) / cols**0.5)

        gated_fused = cfg.gated and cfg.storage == "fused"
        self.w_up = stacked(h, 2 * f if gated_fused else f) if cfg.storage == "stacked_t" else \
            stacked(2 * f if gated_fused else f, h)
        self.w_gate = (stacked(h, f) if cfg.storage == "stacked_t" else stacked(f, h)) \
            if cfg.gated and not gated_fused else None
        self.w_down = stacked(f, h) if cfg.storage == "stacked_t" else stacked(h, f)
        width = 2 * f if gated_fused else f
        self.b_up = nn.Parameter(torch.randn(e, width) * 0.1) if cfg.bias else None
        self.b_gate = nn.Parameter(torch.randn(e, f) * 0.1) if cfg.bias and cfg.gated and not gated_fused else None
        self.b_down = nn.Parameter(torch.randn(e, h) * 0.1) if cfg.bias else None

    # one expert on its tokens (loop and dense idioms) ----------------------------------------

    def _proj(self, t: torch.Tensor, e: int, which: str) -> torch.Tensor:
        cfg = self.cfg
        if cfg.storage == "modules":
            return getattr(self.experts[e], which)(t)
        if cfg.storage == "sequential":
            return self.experts[e][{"up": 0, "gate": 1, "down": -1}[which]](t)
        w = getattr(self, f"w_{which}")[e]
        b = getattr(self, f"b_{which}")
        if b is not None and cfg.bias_form == "linear":
            return F.linear(t, w.t() if cfg.storage == "stacked_t" else w, b[e])
        y = t @ w if cfg.storage == "stacked_t" else t @ w.t()
        return y if b is None else y + b[e]

    def _ffn(self, t: torch.Tensor, e: int) -> torch.Tensor:
        cfg = self.cfg
        up = self._proj(t, e, "up")
        gate = None
        if cfg.gated:
            if cfg.storage == "fused":
                gate, up = up.chunk(2, dim=-1)
            else:
                gate = self._proj(t, e, "gate")
        return self._finish(gate, up, lambda a: self._proj(a, e, "down"))

    # every (token, slot) at once, over gathered weights (gathered idiom) -----------------------

    def _ffn_gathered(self, t_NH: torch.Tensor, ids_N: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg

        def proj(x: torch.Tensor, which: str) -> torch.Tensor:
            w = getattr(self, f"w_{which}")[ids_N]
            y = torch.bmm(x.unsqueeze(1), w).squeeze(1) if cfg.storage == "stacked_t" else \
                torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)
            b = getattr(self, f"b_{which}")
            return y if b is None else y + b[ids_N]

        up = proj(t_NH, "up")
        gate = None
        if cfg.gated:
            if cfg.storage == "fused":
                gate, up = up.chunk(2, dim=-1)
            else:
                gate = proj(t_NH, "gate")
        return self._finish(gate, up, lambda a: proj(a, "down"))

    def _finish(self, gate: torch.Tensor | None, up: torch.Tensor, down: Any) -> torch.Tensor:
        cfg = self.cfg
        if gate is not None:
            if cfg.extra == "clamp_gate":
                gate = gate.clamp(max=LIMIT)
            if cfg.extra == "clamp_up":
                up = up.clamp(min=-LIMIT, max=LIMIT)
            if cfg.extra == "up_plus_one":
                up = up + 1
            a = _act(cfg.activation, gate) * up
        else:
            if cfg.extra in ("clamp_gate", "clamp_up"):
                up = up.clamp(max=LIMIT)
            if cfg.extra == "up_plus_one":
                up = up + 1
            a = _act(cfg.activation, up)
        if cfg.extra == "relu_after":
            a = F.relu(a) if cfg.activation != "relu" else F.relu6(a)
        y = down(a)
        if cfg.extra == "scale_out":
            y = y * 1.5
        if cfg.extra == "tanh_out":
            y = torch.tanh(y)
        if cfg.extra == "clamp_out":
            y = y.clamp(max=LIMIT)
        return y

    def _dispatch(self, idx: torch.Tensor, w: torch.Tensor) -> Any:
        """Each expert, its tokens and their [n, 1] routing weights, as ``cfg.dispatch`` picks them."""
        cfg = self.cfg
        if cfg.dispatch == "sorted_counts":
            flat = idx.reshape(-1)
            order = flat.argsort(stable=True)
            # (torch.bincount's length depends on the data: its tolist() breaks the graph, and the
            # layer is left alone: tests/test_bad_input.py)
            counts = F.one_hot(flat, cfg.num_experts).sum(0).tolist()
            w_flat = w.reshape(-1)
            start = 0
            for e, count in enumerate(counts):
                slots = order[start:start + count]
                start += count
                yield e, slots // cfg.top_k, w_flat[slots, None]
            return
        mask = F.one_hot(idx, cfg.num_experts).permute(2, 1, 0) if cfg.dispatch == "one_hot" else None
        for e in range(cfg.num_experts):
            if mask is not None:
                k, tok = torch.where(mask[e])
            else:
                tok, k = torch.where(idx == e)
            yield e, tok, w[tok, k, None]

    def _select(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, ids) of the top K of the [T, E] scores ``s``, as ``cfg.selection`` and
        ``cfg.groups`` pick them."""
        cfg = self.cfg
        k = cfg.top_k
        if cfg.groups > 1:
            per = cfg.num_experts // cfg.groups
            group_scores = s.view(s.shape[0], cfg.groups, per).topk(2, dim=-1)[0].sum(dim=-1)
            best = group_scores.topk(1, dim=-1)[1]
            keep = torch.zeros_like(group_scores).scatter(1, best, 1.0)
            keep = keep.unsqueeze(-1).expand(-1, -1, per).flatten(1)  # (reshape(T, -1) fails at T = 0)
            s = s.masked_fill(~keep.bool(), 0.0)
        if cfg.selection == "sort":
            vals, order = s.sort(dim=-1, descending=True)
            return vals[:, :k], order[:, :k]
        if cfg.selection == "argmax_rounds":
            vals, ids, rest = [], [], s
            for _ in range(k):
                i = rest.argmax(dim=-1, keepdim=True)
                vals.append(s.gather(1, i))
                ids.append(i)
                rest = rest.scatter(1, i, float("-inf"))
            return torch.cat(vals, dim=-1), torch.cat(ids, dim=-1)
        vals, ids = torch.topk(s, k, dim=-1)
        return vals, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        h = x.reshape(-1, cfg.hidden)
        logits = self.router(h)
        if cfg.router == "topk_softmax":
            vals, idx = self._select(logits)
            w = F.softmax(vals, dim=-1, dtype=torch.float32)
        elif cfg.router == "sigmoid_bias":
            scores = torch.sigmoid(logits.float())
            idx = self._select(scores + self.score_bias)[1]
            w = scores.gather(1, idx)
            w = w / w.sum(dim=-1, keepdim=True)
        else:
            scores = torch.sigmoid(logits.float()) if cfg.router == "sigmoid_renorm" else \
                F.softmax(logits, dim=-1, dtype=torch.float32)
            w, idx = self._select(scores)
            if cfg.router != "softmax":
                w = w / w.sum(dim=-1, keepdim=True)
        w = w * cfg.route_scale
        if cfg.extra == "weight_threshold":
            w = w * (w > 0.05)
        w = w.to(h.dtype)
        if cfg.idiom == "loop":
            out = torch.zeros_like(h)
            for e, tok, w_e in self._dispatch(idx, w):
                v = self._ffn(h[tok] * w_e, e) if cfg.weights_on == "input" else self._ffn(h[tok], e) * w_e
                if cfg.accumulate == "out_of_place":
                    out = out.index_add(0, tok, v)
                elif cfg.accumulate == "setitem":
                    out[tok] += v
                else:
                    out.index_add_(0, tok, v)
        elif cfg.idiom == "gathered":
            ids_N = idx.reshape(-1)
            h_N = h.repeat_interleave(cfg.top_k, dim=0)
            if cfg.weights_on == "input":
                out = self._ffn_gathered(h_N * w.reshape(-1, 1), ids_N).view(-1, cfg.top_k, cfg.hidden).sum(dim=1)
            else:
                y_N = self._ffn_gathered(h_N, ids_N)
                out = (y_N.view(-1, cfg.top_k, cfg.hidden) * w.unsqueeze(-1)).sum(dim=1)
        else:
            if cfg.dense_weights == "masked_sum":
                def gate(e: int) -> torch.Tensor:
                    return (w * (idx == e)).sum(-1, keepdim=True)
            else:
                scattered = torch.zeros(h.shape[0], cfg.num_experts, dtype=w.dtype, device=h.device).scatter(1, idx, w)

                def gate(e: int) -> torch.Tensor:
                    return scattered[:, e, None]
            if cfg.accumulate == "out_of_place":
                out = torch.zeros_like(h)
                for e in range(cfg.num_experts):
                    out = out + self._ffn(h, e) * gate(e)
            else:
                gates = scattered if cfg.dense_weights == "scatter" else \
                    torch.cat([gate(e) for e in range(cfg.num_experts)], dim=1)
                ys = torch.stack([self._ffn(h, e) for e in range(cfg.num_experts)], dim=1)
                out = (ys * gates.unsqueeze(-1)).sum(dim=1)
        return out.reshape(x.shape)


def make(cfg: FuzzConfig, seed: int = 0) -> FuzzMoE:
    torch.manual_seed(seed)
    model = FuzzMoE(cfg)
    return model.to(getattr(torch, cfg.dtype))


def running_sum(bias_form: str) -> FuzzMoE:
    """A per-expert loop over stacked weights that sums out of place (``out = out.index_add(0, tok,
    v)``), its biases inside ``F.linear`` or added after the product (``bias_form``)."""
    return make(FuzzConfig(idiom="loop", storage="stacked", router="softmax_renorm", router_bias=False,
                           route_scale=1.0, activation="relu", gated=False, bias=True, extra="none", num_experts=4,
                           top_k=2, hidden=16, ffn=24, bias_form=bias_form, accumulate="out_of_place"))

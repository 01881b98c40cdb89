"""Typed records passed between the MoE passes (find -> decide -> rewrite).

Legend of shape letters used in names across passes/ and lowering/:
T tokens, H hidden size, F expert FFN size, E experts, K experts per token, C capacity slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from moe_compile.passes.graph_index import GraphIndex


@dataclass(frozen=True)
class WeightRole:
    """One expert tensor role (e.g. the up projection) as it is stored in the model.

    ``nodes`` holds either one stacked parameter node with a leading expert dim, or one node per
    expert (``nn.ModuleList`` storage) in expert order; ``stacked`` says which.
    """

    nodes: tuple[fx.Node, ...]
    stacked: bool
    names: tuple[str, ...]

    @property
    def first(self) -> fx.Node:
        return self.nodes[0]


@dataclass(frozen=True)
class ExpertLayout:
    """How the stored expert tensors map onto the expert op's canonical operands.

    Canonical operands: w_up [E, F, H], optional w_gate [E, F, H], w_down [E, H, F], biases
    [E, F] / [E, H].  ``*_transposed`` means the stored per-expert matrix is [in, out] rather than
    nn.Linear's [out, in].  ``fused_gate`` describes a single stored [E, 2F, H] gate_up tensor:
    "gate_first" (chunk(2) with the gate first), "up_first", or "interleaved" (gate at even rows).
    """

    up: WeightRole
    down: WeightRole
    gate: WeightRole | None = None
    fused_gate: str | None = None
    up_transposed: bool = False
    down_transposed: bool = False
    b_up: WeightRole | None = None
    b_gate: WeightRole | None = None
    b_down: WeightRole | None = None
    activation: str = "silu"
    ffn_size: int = 0
    # every bias is added inside its projection's matmul (``linear(x, w, b)``: the sum rounded once
    # to a 16-bit dtype), not to the rounded product after it (``x @ w + b``: rounded twice); the
    # op computes it the same way (``lowering.experts_ref.op_activation``)
    bias_in_matmul: bool = False
    # the graph nodes an ``expr:`` activation was read from (passes/activation_expr.py): account
    # counts them as the activation; not part of what the layout is (equality, signature)
    activation_nodes: frozenset[fx.Node] = field(default=frozenset(), compare=False, repr=False)

    @property
    def gated(self) -> bool:
        return self.gate is not None or self.fused_gate is not None

    def signature(self) -> str:
        """Everything the expert op's result depends on besides its inputs: which stored tensors
        play which role, how they are laid out, the activation.  Equal signatures compute equal
        experts (ranks compare them before expert parallelism, moe_compile.ep.agreement)."""
        roles = (("up", self.up), ("gate", self.gate), ("down", self.down), ("b_up", self.b_up),
                 ("b_gate", self.b_gate), ("b_down", self.b_down))
        names = " ".join(f"{k}={'|'.join(r.names)}" for k, r in roles if r is not None)
        return (f"{names} fused_gate={self.fused_gate} transposed={self.up_transposed},{self.down_transposed} "
                f"activation={self.activation} ffn={self.ffn_size} bias_in_matmul={self.bias_in_matmul}")

    def describe(self) -> str:
        gate = f", gate={self.fused_gate}" if self.fused_gate else (", gate=separate" if self.gate else "")
        bias = ", bias" if self.b_up is not None or self.b_down is not None else ""
        bias += " (in the matmul)" if bias and self.bias_in_matmul else ""
        store = "stacked" if self.up.stacked else "per-expert"
        return f"{store}{gate}{bias}"


@dataclass(frozen=True)
class RoutingWeights:
    """Where the [T, K] routing weights come from.

    kind "topk": ``node`` already is [T, K]; "dense": ``node`` is [T, E], gathered at the top-k
    indices; "combine": ``node`` is a [T, E, C] capacity combine tensor, summed over C first (a
    dropped token has an all-zero row there, so drops are kept exactly).

    ``scales`` "output": the layer weights each expert's output, y = sum_k w_k FFN_k(x) (what
    ``hiermoe::experts`` computes); "input": it weights each expert's input, y = sum_k FFN_k(w_k x)
    (Llama-4), which the rewrite emits as K rows per token, w_k x routed to expert k with weight 1.
    """

    node: fx.Node
    kind: str
    scales: str = "output"


@dataclass(frozen=True)
class OutputCandidate:
    """A node that may hold the routed output, with the region nodes it depends on."""

    node: fx.Node
    nodes: frozenset[fx.Node] = field(repr=False)


@dataclass(frozen=True)
class MoERegion:
    """One Mixture-of-Experts layer found in a graph, before it is rewritten."""

    name: str
    pattern: str
    router: str
    topk: fx.Node
    router_weight: fx.Node  # the router's [E, H] parameter: names the layer alike on every rank
    tokens: fx.Node
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_size: int
    num_tokens: int
    # what the expert op computes in (``expert_layout.compute_dtype``: the layer's matmuls' dtype,
    # torch.autocast's where the layer runs under it), e.g. "bfloat16"; the op's tokens and weights
    # are cast to it and its result back to the layer's output dtype
    dtype: str
    drops: bool
    # interpretations to verify, most likely first; canonicalize takes the first that verifies
    outputs: tuple[OutputCandidate, ...]
    layouts: tuple[ExpertLayout, ...]
    weights: tuple[RoutingWeights, ...]
    # set when the model already calls hiermoe::experts (transformers experts_implementation="hiermoe")
    existing_op: fx.Node | None = None
    # the [.., K] ids the experts read when the router masks the anchor's ids first (Zaya sends its
    # skip expert's slots to expert 0 with weight 0); None: the anchor's own
    ids: fx.Node | None = None
    # classes the router chooses among: E, or more where some are no expert (Zaya's skip class);
    # verification's synthetic routings draw ids from all of them
    num_scored: int = 0
    # the nodes whose results carry the selection besides ``topk`` (``routing_anchor.Anchor.sources``:
    # a sort whose values the weights are cut from, the argmaxes whose scores they gather): what
    # is computed from the routing decision descends from ``topk`` or from these
    selection: tuple[fx.Node, ...] = ()

    def routed(self, index: GraphIndex) -> set[fx.Node]:
        """The nodes computed from the routing decision (the ids, and the values chosen with them)."""
        return index.descendants([self.topk, *self.selection])


@dataclass(frozen=True)
class Skip:
    """A layer or graph left alone, with a reason a user can act on."""

    name: str
    reason: str
    graph: str = ""
    router_weight: fx.Node | None = None  # set when a router was found but its layer was not

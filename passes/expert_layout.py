"""Group a region's parameters into expert roles and list the layouts they are consistent with.

Experts are stored either stacked (one parameter with a leading expert dim, as in HF v5
``gate_up_proj [E, 2F, H]``) or as E modules (``experts.3.w1.weight``).  Roles are told apart by
data flow, not by names: the down projection is used last, the gate is the input projection whose
output reaches the activation, and a bias belongs to the projection its values meet first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from moe_compile.passes import op_kinds as ops
from moe_compile.passes.activation_expr import expression_activation
from moe_compile.passes.graph_index import GraphIndex, static_shape, tensor_meta
from moe_compile.passes.graph_params import ParamTable
from moe_compile.passes.regions import ExpertLayout, WeightRole

_NUM = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


@dataclass
class ExpertParams:
    weight_roles: list[WeightRole] = field(default_factory=list)
    bias_roles: list[WeightRole] = field(default_factory=list)
    foreign: list[fx.Node] = field(default_factory=list)
    complete: bool = True


def classify_params(params: ParamTable, state: list[fx.Node], num_experts: int,
                    family_keys: set[str]) -> ExpertParams:
    """Split parameter nodes into expert families (E modules), stacked tensors, and the rest.

    A family is a name pattern with one numeric component (``experts.#.w1.weight``) whose indices,
    over all parameters of the graph, are exactly 0..E-1; a layer index (``layers.#``) therefore
    never forms a family unless the model happens to have E layers, and 3-d tensors with a
    leading E are always stacked expert weights.  ``family_keys`` is ``valid_family_keys(params,
    num_experts)``, computed once per layer by the caller (it scans every parameter of the graph)."""
    out = ExpertParams()
    valid = family_keys
    families: dict[str, dict[int, fx.Node]] = {}
    for n in state:
        shape = static_shape(n) or ()
        if len(shape) == 3 and shape[0] == num_experts:
            continue
        fam = _member(params.path[n], num_experts, valid)
        if fam is not None:
            families.setdefault(fam[0], {})[fam[1]] = n
    grouped = {n for members in families.values() for n in members.values()}
    for _key, members in sorted(families.items()):
        if len(members) != num_experts:
            out.complete = False
        nodes = tuple(members[e] for e in sorted(members))
        role = WeightRole(nodes=nodes, stacked=False, names=tuple(params.path[n] for n in nodes))
        ndim = len(static_shape(nodes[0]) or ())
        (out.weight_roles if ndim == 2 else out.bias_roles).append(role)
    for n in state:
        if n in grouped:
            continue
        stacked_shape = static_shape(n)
        if stacked_shape and len(stacked_shape) in (2, 3) and stacked_shape[0] == num_experts:
            role = WeightRole(nodes=(n,), stacked=True, names=(params.path[n],))
            (out.weight_roles if len(stacked_shape) == 3 else out.bias_roles).append(role)
        else:
            out.foreign.append(n)
    return out


def valid_family_keys(params: ParamTable, num_experts: int) -> set[str]:
    indices: dict[str, set[int]] = {}
    for path in params.path.values():
        for key, e in _family_keys(path, num_experts):
            indices.setdefault(key, set()).add(e)
    return {k for k, idx in indices.items() if idx == set(range(num_experts))}


def in_family(path: str, num_experts: int, family_keys: set[str]) -> bool:
    """Whether ``path`` is a member of one of the E-expert families ``family_keys``."""
    return _member(path, num_experts, family_keys) is not None


def _member(path: str, num_experts: int, family_keys: set[str]) -> tuple[str, int] | None:
    """The family of ``family_keys`` that ``path`` belongs to and its expert index, or None: the
    last numeric component that names a whole family, so a layer index (``layers.0...``) is not
    taken for the expert index, nor a module's index inside each expert (``experts.3.0.weight``:
    each expert an ``nn.Sequential``, expert 3)."""
    return next(((key, e) for key, e in _family_keys(path, num_experts) if key in family_keys), None)


def _family_keys(path: str, num_experts: int) -> list[tuple[str, int]]:
    """``experts.3.w1.weight`` -> [(``experts.#.w1.weight``, 3)]: for each numeric component below
    ``num_experts``, last first, the name pattern with it replaced and its value."""
    return [(path[: m.start(1)] + "#" + path[m.end(1):], int(m.group(1)))
            for m in reversed(list(_NUM.finditer(path))) if int(m.group(1)) < num_experts]


@dataclass(frozen=True)
class Hypothesis:
    layout: ExpertLayout

    @property
    def ffn_size(self) -> int:
        return self.layout.ffn_size


def _matrix_shape(role: WeightRole) -> tuple[int, ...]:
    shape = static_shape(role.first) or ()
    return shape[1:] if role.stacked else shape


def layout_hypotheses(index: GraphIndex, nodes: set[fx.Node], experts: ExpertParams, hidden: int,
                      num_experts: int, token_root: fx.Node) -> tuple[list[Hypothesis], str]:
    """Layouts consistent with the tensor shapes, most likely first; or [] and the reason.  A
    layout whose experts compute an activation of several ops (``activation_expr``) comes first,
    with that expression as its activation."""
    uses = {r: _uses(r, nodes) for r in experts.weight_roles + experts.bias_roles}
    roles = sorted(experts.weight_roles, key=lambda r: min(index.pos[u] for u in uses[r]))
    if len(roles) not in (2, 3):
        return [], (f"experts have {len(roles)} weight matrices each; supported are 2 (up, down) "
                    "or 3 (gate, up, down)")
    act_nodes = [n for n in index.ordered(nodes) if ops.activation_of(n) is not None]
    # in program order: with two activations (an extra one the op cannot compute), the first
    # interpretation takes the one applied first and the reason names the other
    acts = list(dict.fromkeys(a for n in act_nodes if (a := ops.activation_of(n)) is not None))
    if not acts:
        acts = ["identity"]
    down = roles[-1]
    out: list[Hypothesis] = []
    for down_t in _orientations(_matrix_shape(down), hidden, out_is_hidden=True):
        ffn = _other_dim(_matrix_shape(down), hidden, down_t, out_is_hidden=True)
        for up_t in _orientations(_matrix_shape(roles[0]), hidden, out_is_hidden=False):
            f_in = _other_dim(_matrix_shape(roles[0]), hidden, up_t, out_is_hidden=False)
            for layout in _gatings(index, roles, act_nodes, f_in, ffn, uses):
                for act in acts:
                    out.append(Hypothesis(replace(layout, up_transposed=up_t, down_transposed=down_t,
                                                  activation=act, ffn_size=ffn)))
    if not out:
        shapes = ", ".join(str(_matrix_shape(r)) for r in roles)
        return [], f"expert matrices {shapes} do not form up/down projections of hidden size {hidden}"
    with_bias = []
    for h in out:
        biased = _assign_biases(index, nodes, h.layout, experts.bias_roles, uses, hidden)
        if biased is not None:
            with_bias.append(Hypothesis(biased))
    if not with_bias:
        return [], "expert biases do not match the projections they are added to"
    expressions, seen = [], set()
    for h in with_bias:
        key = replace(h.layout, activation="")
        if key in seen:
            continue
        seen.add(key)
        found = expression_activation(index, nodes, h.layout, token_root)
        if found is not None:
            expressions.append(Hypothesis(replace(h.layout, activation=found.activation,
                                                  activation_nodes=found.nodes)))
    return expressions + with_bias, ""


def _uses(role: WeightRole, nodes: set[fx.Node]) -> list[fx.Node]:
    return [u for n in role.nodes for u in n.users if u in nodes]


def _orientations(shape: tuple[int, ...], hidden: int, out_is_hidden: bool) -> list[bool]:
    """Possible ``transposed`` flags: nn.Linear layout is [out, in]."""
    if len(shape) != 2:
        return []
    linear_ok = shape[0] == hidden if out_is_hidden else shape[1] == hidden
    trans_ok = shape[1] == hidden if out_is_hidden else shape[0] == hidden
    return [t for t, ok in ((False, linear_ok), (True, trans_ok)) if ok]


def _other_dim(shape: tuple[int, ...], hidden: int, transposed: bool, out_is_hidden: bool) -> int:
    # linear layout [out, in]: the FFN dim is the "in" of down and the "out" of up
    if out_is_hidden:
        return shape[0] if transposed else shape[1]
    return shape[1] if transposed else shape[0]


def _gatings(index: GraphIndex, roles: list[WeightRole], act_nodes: list[fx.Node], f_in: int, ffn: int,
             uses: dict[WeightRole, list[fx.Node]]) -> list[ExpertLayout]:
    if len(roles) == 2:
        if f_in == ffn:
            return [ExpertLayout(up=roles[0], down=roles[1])]
        if f_in == 2 * ffn:
            return [ExpertLayout(up=roles[0], down=roles[1], fused_gate=order)
                    for order in ("gate_first", "up_first", "interleaved")]
        return []
    a, b, down = roles
    if _matrix_shape(a) != _matrix_shape(b) or f_in != ffn:
        return []
    before_act = index.ancestors(act_nodes) if act_nodes else set()
    a_gate = any(u in before_act for u in uses[a])
    b_gate = any(u in before_act for u in uses[b])
    if a_gate and not b_gate:
        return [ExpertLayout(up=b, gate=a, down=down)]
    if b_gate and not a_gate:
        return [ExpertLayout(up=a, gate=b, down=down)]
    return [ExpertLayout(up=b, gate=a, down=down), ExpertLayout(up=a, gate=b, down=down)]


def _assign_biases(index: GraphIndex, nodes: set[fx.Node], layout: ExpertLayout, biases: list[WeightRole],
                   uses: dict[WeightRole, list[fx.Node]], hidden: int) -> ExpertLayout | None:
    """Attach each bias to the projection whose output it meets first in program order, and say
    whether every bias meets its projection inside the matmul (``linear(x, w, b)``, ``addmm``:
    ``ExpertLayout.bias_in_matmul``) rather than in an add after it."""
    if not biases:
        return layout
    projections = [("up", layout.up), ("down", layout.down)] + ([("gate", layout.gate)] if layout.gate else [])
    reach = {name: index.descendants(uses[r]) & nodes for name, r in projections}
    first = {name: min(index.pos[u] for u in uses[r]) for name, r in projections}
    assigned: dict[str, WeightRole] = {}
    inside = True
    for b in biases:
        mine = index.descendants(uses[b]) & nodes
        meets = {name: min((n for n in mine & reach[name]), key=index.pos.__getitem__, default=None)
                 for name in reach}
        cands = [(index.pos[n], first[name], name, n) for name, n in meets.items() if n is not None]
        if not cands:
            return None
        # earliest meeting point; on a tie the most recently used projection owns the bias
        _, _, name, where = min(cands, key=lambda c: (c[0], -c[1]))
        bias = ops.matmul_bias(where)
        inside = inside and isinstance(bias, fx.Node) and (bias in mine or bias in b.nodes)
        if name in assigned:
            return None
        size = _matrix_shape(b)[0] if _matrix_shape(b) else 0
        want = {"down": hidden, "gate": layout.ffn_size,
                "up": 2 * layout.ffn_size if layout.fused_gate else layout.ffn_size}[name]
        if size != want:
            return None
        assigned[name] = b
    return replace(layout, b_up=assigned.get("up"), b_gate=assigned.get("gate"), b_down=assigned.get("down"),
                   bias_in_matmul=inside)


def compute_dtype(experts: ExpertParams, nodes: set[fx.Node]) -> torch.dtype | None:
    """The dtype the layer's own expert matmuls compute in, read off the graph: the output dtype
    of the first matmuls each expert weight reaches inside the region (``nodes``), through views,
    casts and indexing.  It is what the model ran, ``torch.autocast`` included (an ``mm``, ``bmm``,
    ``linear`` or ``einsum`` under bf16 autocast computes in bf16; ``torch._grouped_mm`` has no
    autocast rule and stays in its inputs' dtype), or a cast the layer writes itself
    (``F.linear(x.to(w.dtype), w)``).  None where no matmul is found or they disagree: the expert
    op then computes in the tokens' dtype, and verification decides."""
    found: set[torch.dtype] = set()
    for role in experts.weight_roles:
        frontier, seen = list(role.nodes), set(role.nodes)
        for _ in range(_MATMUL_DEPTH):
            nxt = []
            for n in frontier:
                for u in n.users:
                    if u in seen or u not in nodes:
                        continue
                    seen.add(u)
                    if ops.is_matmul(u):
                        meta = tensor_meta(u)
                        if meta is not None:
                            found.add(meta.dtype)
                    else:
                        nxt.append(u)
            frontier = nxt
    return found.pop() if len(found) == 1 else None


# how many ops (views, casts, an index) may stand between an expert weight and its matmul
_MATMUL_DEPTH = 6

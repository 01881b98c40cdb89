"""Every rank rewrites the same MoE layers the same way, or none does.

An expert-parallel layer is a collective: if one rank leaves a layer as written while the
others turn it into the expert-parallel stages, the others wait in all-to-alls that rank never
joins.  Each rank decides from sample values seeded alike (``passes/verify.py``), so ranks that
compile the same graph at the same shapes decide alike; but Dynamo specializes a graph to each
rank's own shapes (a rank whose first batch is empty compiles a graph of 0 tokens, on which the
finder may see less and verification can tell no interpretation apart).  So the first compile of
a layer settles it with one small exchange, before any expert-parallel collective:

    every rank sends, per MoE layer of the graph: the interpretation it verified (a key: what
    the experts compute, and where: which nodes hold the output and the routing weights), or
    why none, or (0 tokens) every interpretation it could use; and its expert-parallel settings
    agreed key <- the one every rank with tokens verified, if each rank with 0 tokens has it at
    a place one of them found it (the first such, in rank order); otherwise the layer stays as
    written on every rank,
    with the reason naming the rank; and what every rank plans the layer from, so that all reach
    the same plan (the runtime settings must be the same): the token count of the lowest rank
    with tokens, and the (token, expert) pairs per expert of every rank's batch, summed
    (``cost.planner``'s expert loads: the busiest rank's compute under expert parallelism)

The decision is kept per layer (its name and weight tensors): a later compile of the same layer
(a recompile for new shapes, which one rank may do alone) uses it without an exchange.  The
exchange runs on its own gloo group with the default group's timeout: a rank that never compiles
the graph makes the others raise, naming the layers, instead of hanging.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from moe_compile.ep import groups


@dataclass(frozen=True)
class Proposal:
    """One rank's decision for one layer of the graph it compiles."""

    anchor: str  # the router weight's parameter path: the same layer on every rank
    name: str
    key: str | None  # the interpretation verified on this rank's samples (None: none, or 0 tokens)
    reason: str  # key is None and not vacuous: why the layer is left alone here
    # the nodes the verified interpretation reads its output and routing weights from, named alike
    # on every rank (GraphIndex.anchor): what a rank with 0 tokens, which cannot tell, takes
    where: str = ""
    vacuous: bool = False  # 0 tokens: nothing was verified; ``candidates`` lists what could be used
    candidates: tuple[tuple[str, str], ...] = ()  # (key, where)
    tokens: int = 0  # this rank's token count in the layer
    load: tuple[int, ...] = ()  # (token, expert) pairs per expert of this rank's batch (): unknown


@dataclass(frozen=True)
class Agreed:
    key: str | None  # the interpretation every rank uses; None: the layer stays as written
    reason: str = ""
    where: str = ""  # where the ranks with tokens found it (ranks with 0 tokens take this)
    tokens: int = 0  # the token count every rank plans with (the lowest rank's with tokens)
    load: tuple[int, ...] | None = None  # pairs per expert, every rank's summed (None: a rank did not know)


_lock = threading.Lock()
_group: list[Any] = []
# (layer anchor, its weight tensors) -> what the ranks agreed; the tensors are compared by identity
_decided: list[tuple[str, tuple[Any, ...], Agreed]] = []


def _cached(name: str, identity: tuple[Any, ...]) -> Agreed | None:
    with _lock:
        for n, ident, agreed in _decided:
            if n == name and len(ident) == len(identity) and all(a is b for a, b in zip(ident, identity, strict=True)):
                return agreed
    return None


def agree(settings: str, proposals: Sequence[Proposal], identities: Sequence[tuple[Any, ...]]) -> list[Agreed]:
    """What every rank does with each proposed layer (same order as ``proposals``).

    ``settings`` are this rank's expert-parallel options as text; ranks that differ raise the same
    ValueError.  ``identities`` name each layer's weights (for the cache).  Collective over the
    world unless every layer was decided before."""
    cached = [_cached(p.anchor, ident) for p, ident in zip(proposals, identities, strict=True)]
    if all(c is not None for c in cached):
        return [_check_local(p, c) for p, c in zip(proposals, cached, strict=True)]  # type: ignore[arg-type]
    every = _exchange(settings, list(proposals))
    settings_by_rank = [s for s, _ in every]
    if len(set(settings_by_rank)) > 1:
        lines = "; ".join(f"rank {r}: {s}" for r, s in enumerate(settings_by_rank))
        raise ValueError(f"the ranks compiled this model with different expert-parallel options ({lines}); "
                         "pass the same options (mesh, topology, dimension, dedup, expert_swap) on every rank")
    out = []
    for p, ident, c in zip(proposals, identities, cached, strict=True):
        agreed = c if c is not None else _combine(p.name, [dict((q.anchor, q) for q in ps).get(p.anchor)
                                                          for _, ps in every])
        if c is None:
            with _lock:
                _decided.append((p.anchor, ident, agreed))
        out.append(_check_local(p, agreed))
    return out


def _combine(name: str, by_rank: list[Proposal | None]) -> Agreed:
    """The one decision every rank derives from all ranks' proposals for layer ``name``."""
    for r, p in enumerate(by_rank):
        if p is None:
            return Agreed(None, f"left alone on every rank: rank {r} has no MoE layer {name} in this graph (its "
                                "graph differs, e.g. a graph break only some ranks take)")
        if p.key is None and not p.vacuous:
            return Agreed(None, f"left alone on every rank because rank {r} leaves it alone: {p.reason}")
    verified = {p.key for p in by_rank if p is not None and not p.vacuous}
    if not verified:
        return Agreed(None, "left alone on every rank: every rank's batch had 0 tokens when it compiled, so "
                            "no rank could verify a rewrite of it")
    if len(verified) > 1:
        keys = "; ".join(f"rank {r}: {p.key}" for r, p in enumerate(by_rank) if p is not None and not p.vacuous)
        return Agreed(None, f"left alone on every rank: the ranks verified different interpretations ({keys})")
    (key,) = verified
    with_tokens = [p for p in by_rank if p is not None and not p.vacuous]
    first = with_tokens[0]
    # Ranks with tokens may have verified the same experts read at different places: at K = 1 a
    # rank of 1 token sees the per-slot product [1, 1, H] in its input's shape and verifies it
    # before the sum the others verified (equal values). Ranks with 0 tokens take the first place
    # some rank verified that each of them can form.
    vacuous = [(r, p) for r, p in enumerate(by_rank) if p is not None and p.vacuous]
    wheres = list(dict.fromkeys(p.where for p in with_tokens))
    where = next((w for w in wheres if all((key, w) in p.candidates for _, p in vacuous)), None)
    if where is None:
        r = next(r for r, p in vacuous if (key, wheres[0]) not in p.candidates)
        return Agreed(None, f"left alone on every rank: rank {r} (0 tokens in its batch) cannot form the "
                            f"interpretation the other ranks verified ({key}; {' or '.join(wheres)})")
    loads = [p.load for p in by_rank if p is not None]
    load = tuple(int(sum(col)) for col in zip(*loads, strict=True)) if all(loads) else None
    return Agreed(key, where=where, tokens=first.tokens, load=load)


def _check_local(p: Proposal, agreed: Agreed) -> Agreed:
    """This rank must be able to do what was agreed; if a recompile of its own cannot, the ranks
    would diverge, so it raises instead."""
    if agreed.key is None or agreed.key == p.key or (p.vacuous and (agreed.key, agreed.where) in p.candidates):
        return agreed
    mine = "0 tokens and no interpretation like it" if p.vacuous else (p.key and f"verified {p.key}") or p.reason
    raise RuntimeError(f"layer {p.name}: every rank agreed to rewrite it as {agreed.key} when it was first "
                       f"compiled, but this rank's recompile ({mine}) cannot; the ranks would run different "
                       "collectives. Please report this with the model.")


def _exchange(settings: str, proposals: list[Proposal]) -> list[tuple[str, list[Proposal]]]:
    return _all_gather((settings, proposals), "rewriting the MoE layers " + ", ".join(p.name for p in proposals))


def _all_gather(obj: Any, what: str) -> list[Any]:
    with _lock:
        if not _group:
            _group.append(groups.new_group(backend="gloo"))  # collective: every rank's first compile
        group = _group[0]
    every: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(every, obj, group=group)
    except RuntimeError as e:
        raise RuntimeError(
            f"the ranks could not agree on {what} (rank {dist.get_rank()}: "
            f"{type(e).__name__}: {e}); every rank must compile the same graphs at the same step, and gives up "
            f"after the process group timeout ({groups.default_timeout().total_seconds():g} s)") from e
    return every


_values: list[tuple[str, tuple[Any, ...], list[Any]]] = []


def every_rank(name: str, identity: tuple[Any, ...], mine: Any) -> list[Any]:
    """Every rank's ``mine`` for the decision ``name`` about the tensors ``identity`` (compared by
    identity), in rank order: exchanged by the first compile that asks (collective over the world),
    the same list for every later compile of this rank that asks again (a recompile one rank may
    do alone), so a rewrite that must match across ranks is decided once, from what all saw."""
    with _lock:
        for n, ident, every in _values:
            if n == name and len(ident) == len(identity) and all(a is b for a, b in zip(ident, identity, strict=True)):
                return every
    every = _all_gather(mine, name)
    with _lock:
        _values.append((name, identity, every))
    return every


__all__ = ["Agreed", "Proposal", "agree", "every_rank"]

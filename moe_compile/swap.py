"""Topology-aware expert swap during training (HierMoE Section IV, HierD-ES).

    model = torch.compile(model, backend="hiermoe",
                          options={"mesh": mesh, "topology": "cluster.toml", "expert_swap": {"every": 1}})
    swapper = moe_compile.expert_swapper(model, optimizer)
    for batch in data:
        loss = model(batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
        swapper.step()          # per layer: pick the best swap and apply it (collective)

What one ``step()`` does, every ``every``-th call, for every expert-parallel layer of the model
(every rank calls it, in the same order):

    routing  = all_gather(each rank's [T, K] expert ids of the layer's last forward)
    d        = the dimension the layer used (d*, HierMoE Eq. 6, or the fixed one)
    Q*       = Q_d, Eq. 8-9: predicted HD-d seconds after swapping experts r and c, from the
               duplicate-free counts of every phase after the swap, computed incrementally
               (Fig. 8's four cases, O(D*T*K*E); cost.routing.swap_statistics) with the max over
               destinations replaced by Eq. 11's smooth-max (gamma = 10) unless told otherwise
    (r*, c*) = argmin Q*[r, c]  (Eq. 10, Theorem 1)
    swap r*, c* if Q*[r*, c*] < (1 - threshold) * Q*[r*, r*]  (the diagonal is the placement as is)
               and the plain-max t_d (Eq. 3) after the swap is not above t_d before it (the
               smooth-max can improve while the busiest destination gets busier)

One rank per layer computes Q* (rank = layer index mod world size; they work in parallel) and a
sum all-reduce hands every rank every decision, so all ranks apply the same swaps. A deciding
step costs one all-gather of the routing (of all layers together), that all-reduce, and, when a
sharded layer swaps, two messages each way between the two ranks per swap and one all-reduce
for all swaps together (the agreement below). With
``policy="smart"`` the pair instead minimizes the largest raw (not deduplicated) token count
of any rank: the SmartMoE-style balancing that HierMoE's HD2-MoE-Smart baseline uses (Section
V-B), for comparison.

Applying a swap of expert a (rank A, local slot i) and expert b (rank B, slot j):

- weights sharded by ``moe_compile.shard_experts`` (rows are local slots): A and B exchange row
  i / row j of every shard parameter, of its gradient if it has one, and of every optimizer state
  tensor shaped like the parameter (Adam's exp_avg, exp_avg_sq; momentum buffers). Scalar state
  (Adam's step) is per parameter, not per expert: it must be equal on A and B (it is when both
  stepped alike) and stays. Both sides first exchange a description of what they will send and
  stop, both, with an error if the two do not match; rows are received into new buffers and
  written only after every transfer of the swap has completed, so an exception leaves the
  weights, gradients, optimizer state and placement as they were. A == B swaps the two rows in
  place.
- weights every rank holds whole (not sharded; DDP keeps them, their gradients after the
  all-reduce and their optimizer state equal on every rank): nothing moves but the placement.

Then every rank updates the layer's placement table (``runtime.EPLayer.move_experts``); the
compiled graphs read it at their next forward, so nothing recompiles, and the model computes the
same function (only the place of each expert changed).

Call ``step()`` after ``optimizer.step()``: the backward of a forward whose experts moved since
refuses to run (``hiermoe::ep_experts_backward`` checks the placement version).

Overlap mode (``SwapOptions.overlap``): the routing all-gather and the decision all-reduce run on
the swapper's own process group without ``step()`` waiting for them. Call n posts step n's
routing; call n+1 reads it, computes Q* and posts the decisions; call n+2 applies them (a
decision for a layer whose placement changed in between is dropped, on every rank alike). So a
decision uses the routing of two steps before, and only the migration (row exchange and
agreement) remains inside ``step()``. ``flush()`` waits for what is in flight.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_compile import runtime
from moe_compile.cost.hiermoe import best_swap
from moe_compile.cost.routing import _exclusion_table, hd_statistics

POLICIES = ("hierd", "smart")
KINDS = ("max", "smooth", "lse")


@dataclass(frozen=True)
class SwapOptions:
    """``options["expert_swap"]`` of the backend (or ``expert_swapper`` keywords).

    every: decide every n-th ``step()`` call (HierMoE swaps every iteration, Section V-E).
    threshold: swap only when the predicted time drops by more than this fraction (default 0:
        any strict improvement).
    kind: the max over destinations in Q: "smooth" (Eq. 11, default), "max" or "lse".
    gamma: the smooth-max exponent (default 10, the paper's).
    policy: "hierd" (HierD-ES, default) or "smart" (balance raw token counts, the baseline).
    overlap: hide the decision's collectives behind training (default False): ``step()`` posts
        the routing all-gather without waiting, the next ``step()`` computes Q* on it and posts
        the decision all-reduce the same way, and the one after applies the swaps. Decisions then
        use the routing of two steps before and ``step()`` returns the swaps decided one call
        earlier; migrations still run inside ``step()`` (see ``ExpertSwapper.flush``).
    """

    every: int = 1
    threshold: float = 0.0
    kind: str = "smooth"
    gamma: float = 10.0
    policy: str = "hierd"
    overlap: bool = False


def parse_swap_options(raw: object) -> SwapOptions | None:
    """``True`` or a dict -> SwapOptions; ``None``/``False`` -> None. Bad values raise ValueError."""
    if raw is None or raw is False:
        return None
    if raw is True:
        return SwapOptions()
    if isinstance(raw, SwapOptions):
        return raw
    if not isinstance(raw, Mapping):
        raise ValueError(f"option 'expert_swap' must be True or a dict like {{'every': 1}}, got {raw!r}")
    valid = [f for f in SwapOptions.__dataclass_fields__]
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise ValueError(f"unknown expert_swap setting(s) {unknown}; valid settings are {valid}")
    every = raw.get("every", 1)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"expert_swap 'every' must be a positive int (swap every n steps), got {every!r}")
    threshold = raw.get("threshold", 0.0)
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 <= threshold < 1:
        raise ValueError(f"expert_swap 'threshold' must be a fraction in [0, 1), got {threshold!r}")
    kind = raw.get("kind", "smooth")
    if kind not in KINDS:
        raise ValueError(f"expert_swap 'kind' must be one of {list(KINDS)}, got {kind!r}")
    gamma = raw.get("gamma", 10.0)
    if isinstance(gamma, bool) or not isinstance(gamma, int | float) or not gamma > 0:
        raise ValueError(f"expert_swap 'gamma' must be a positive number, got {gamma!r}")
    policy = raw.get("policy", "hierd")
    if policy not in POLICIES:
        raise ValueError(f"expert_swap 'policy' must be one of {list(POLICIES)}, got {policy!r}")
    overlap = raw.get("overlap", False)
    if not isinstance(overlap, bool):
        raise ValueError(f"expert_swap 'overlap' must be True or False, got {overlap!r}")
    return SwapOptions(every, float(threshold), str(kind), float(gamma), str(policy), overlap)


@dataclass(frozen=True)
class SwapRecord:
    """One swap, as every rank recorded it."""

    step: int  # the swapper's step() call that made it (1-based)
    layer: str
    experts: tuple[int, int]
    ranks: tuple[int, int]  # mesh positions the two experts were on before the swap
    dimension: int  # d whose time was minimized
    objective_before: float  # Q*[r, r] (policy "hierd": seconds; "smart": tokens of the busiest rank)
    objective_after: float  # Q*[r*, c*]
    predicted_before_s: float  # t_d (Eq. 3, plain max) on the decision's routing, before and after
    predicted_after_s: float
    moved_bytes: int  # bytes this rank sent to move the two experts (0 when they are not its own)


@dataclass
class StepTiming:
    """Wall seconds of one deciding ``step()`` on this rank."""

    step: int
    decision_s: float  # gathering the routing, computing Q*, agreeing on the decisions
    migration_s: float  # moving weights, gradients and optimizer state, updating the placement
    swaps: int


@dataclass
class ExpertSwapper:
    """Picks and applies expert swaps between training steps (see the module docstring).
    Build it with ``expert_swapper``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    calls: int = 0
    history: list[StepTiming] = field(default_factory=list)
    capacity: int = 0  # routing ids per rank the gather has room for (grown when a step needs more)
    # overlap mode: the routing all-gather and the decision all-reduce in flight, on their own group
    _gather: tuple[_Gather, list[runtime.EPLayer], list[SwapOptions]] | None = None
    _table: tuple[Any, Tensor, list[runtime.EPLayer], list[int]] | None = None
    _group: Any = None

    def layers(self) -> list[runtime.EPLayer]:
        """The expert-parallel layers of this model that have been compiled, in layer-id order."""
        mine = {id(t) for t in self.model.parameters()} | {id(t) for t in self.model.buffers()}
        return [lay for lay in runtime.layers() if lay.tensors and any(id(t) in mine for t in lay.tensors)]

    def options(self, lay: runtime.EPLayer) -> SwapOptions:
        base = lay.swap_options or SwapOptions()
        merged = {**base.__dict__, **self.overrides}
        opts = parse_swap_options(merged)
        assert opts is not None
        return opts

    def step(self) -> list[SwapRecord]:
        """Decide and apply this step's swaps (collective: every rank calls it). Returns the swaps
        made, also appended to each layer's ``swaps``."""
        self.calls += 1
        layers, opts = self._checked_layers()
        if opts[0].overlap:
            return self._step_overlapped(layers, opts)
        self.flush()  # a switch from overlap mode leaves nothing in flight
        if self.calls % opts[0].every:
            return []
        t0 = time.perf_counter()
        decisions = self._decide(layers, opts)
        t1 = time.perf_counter()
        records = self._apply([(lay, dec) for lay, dec in zip(layers, decisions, strict=True) if dec is not None])
        t2 = time.perf_counter()
        self.history.append(StepTiming(self.calls, t1 - t0, t2 - t1, len(records)))
        return records

    def flush(self) -> None:
        """Overlap mode: wait for the collectives still in flight and drop their decisions (call it
        on every rank before destroying the process group, or to stop swapping)."""
        for work in ([self._gather[0].work] if self._gather else []) + ([self._table[0]] if self._table else []):
            if work is not None:
                work.wait()
        self._gather = self._table = None

    def swap(self, layer: str | int, a: int, b: int) -> SwapRecord:
        """Swap experts ``a`` and ``b`` of ``layer`` (its name or runtime id) now, whatever the
        cost model says (collective: every rank calls it with the same arguments)."""
        lay = self._find(layer)
        if not (0 <= a < lay.num_experts and 0 <= b < lay.num_experts) or a == b:
            raise ValueError(f"layer {lay.name}: experts to swap must be two different ids in "
                             f"[0, {lay.num_experts}), got {a} and {b}")
        if lay.swap_blocker:
            raise ValueError(f"layer {lay.name}: cannot swap its experts: {lay.swap_blocker}")
        nan = float("nan")
        return self._apply([(lay, (a, b, lay.last_dimension or 0, nan, nan, nan, nan))])[0]

    # internals ------------------------------------------------------------------------------

    def _cpu_group(self) -> Any:
        """The gloo group the swapper's own collectives use (routing, decisions, agreement: small CPU
        tensors, also when the model's collectives run on NCCL; and in overlap mode kept apart from
        the model's). Made at the first use, which every rank reaches in the same call."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _find(self, layer: str | int) -> runtime.EPLayer:
        for lay in self.layers():
            if layer in (lay.name, lay.layer_id):
                return lay
        raise ValueError(f"no expert-parallel layer {layer!r} in this model; its layers are "
                         f"{[lay.name for lay in self.layers()]}")

    def _checked_layers(self) -> tuple[list[runtime.EPLayer], list[SwapOptions]]:
        """This model's layers and their options, checked before any collective (the same checks
        fail alike on every rank: they depend on the compiled graphs and the options, not on the
        data)."""
        layers = self.layers()
        if not layers:
            raise ValueError("expert swap found no expert-parallel layer of this model that has run: compile it "
                             "with options={'mesh': ..., 'topology': ..., 'expert_swap': {...}} and call "
                             "swapper.step() after a training step")
        all_opts = [self.options(lay) for lay in layers]
        if len({o.every for o in all_opts}) > 1:
            raise ValueError("expert swap: every layer of the model must use the same 'every'")
        for lay, opts in zip(layers, all_opts, strict=True):
            if lay.swap_blocker:
                raise ValueError(f"layer {lay.name}: cannot swap its experts: {lay.swap_blocker}")
            if lay.last_topk is None:
                raise ValueError(f"layer {lay.name} has not run a forward yet; call swapper.step() after a "
                                 "training step")
            if opts.policy == "hierd" and lay.cost is None:
                raise ValueError(f"layer {lay.name}: expert swap predicts HierD-AlltoAll times from the cluster's "
                                 "alpha/beta; compile with options['topology'] (a TOML from moe-calibrate)")
        return layers, all_opts

    def _decide(self, layers: list[runtime.EPLayer], opts: list[SwapOptions]) -> list[tuple[Any, ...] | None]:
        routings, self.capacity = _gather_routing([lay.last_topk for lay in layers], layers[0].comm, self.capacity,
                                                  self._cpu_group())
        table = self._table_rows(layers, opts, routings)
        dist.all_reduce(table, group=self._cpu_group())  # each row was filled by one rank: the sum is its decision
        return _decisions(table)

    def _table_rows(self, layers: list[runtime.EPLayer], opts: list[SwapOptions],
                    routings: list[tuple[np.ndarray, np.ndarray]]) -> Tensor:
        """This rank's rows of the decision table (one row per layer: swap?, a, b, d, objective
        before/after, predicted before/after; zeros in the rows other ranks decide)."""
        world, me = layers[0].comm.world, layers[0].comm.position
        table = torch.zeros(len(layers), 8, dtype=torch.float64)
        for i, lay in enumerate(layers):
            if i % world == me:
                table[i] = torch.tensor(self._decide_layer(lay, opts[i], *routings[i]), dtype=torch.float64)
        return table

    def _step_overlapped(self, layers: list[runtime.EPLayer], opts: list[SwapOptions]) -> list[SwapRecord]:
        """One call of overlap mode: (1) apply the decisions whose all-reduce the previous call
        posted, to layers whose placement has not changed since they were made (only an explicit
        ``swap()`` in between changes it); (2) compute Q* on the routing the previous call's all-gather
        brought and post the decision all-reduce; (3) on a deciding call, post the all-gather of
        this step's routing. Every rank makes the same calls in the same order on the swapper's
        own process group, so the model's collectives never wait on these."""
        t0 = time.perf_counter()
        records: list[SwapRecord] = []
        migration_s = 0.0
        if self._table is not None:
            work, table, lays, versions = self._table
            self._table = None
            work.wait()
            t1 = time.perf_counter()
            records = self._apply([(lay, dec) for lay, dec, v in zip(lays, _decisions(table), versions, strict=True)
                                   if dec is not None and lay.version == v])
            migration_s = time.perf_counter() - t1
        if self._gather is not None:
            (pending, lays, lay_opts), self._gather = self._gather, None
            routings, self.capacity = _read_routing(pending, lays[0].comm)
            if routings is not None:  # else the capacity grew: the next round has room
                table = self._table_rows(lays, lay_opts, routings)
                work = dist.all_reduce(table, group=self._cpu_group(), async_op=True)
                self._table = (work, table, lays, [lay.version for lay in lays])
        if self.calls % opts[0].every == 0:
            self._gather = (_post_routing([lay.last_topk for lay in layers], layers[0].comm, self.capacity,
                                          self._cpu_group(), async_op=True), layers, opts)
        self.history.append(StepTiming(self.calls, time.perf_counter() - t0 - migration_s, migration_s,
                                       len(records)))
        return records

    def _decide_layer(self, lay: runtime.EPLayer, opts: SwapOptions, topk: np.ndarray, token_rank: np.ndarray
                      ) -> list[float]:
        placement = lay.expert_pos_E.cpu().numpy().astype(np.int64)
        d = lay.last_dimension or lay.dimension or 1
        if opts.policy == "hierd":
            assert lay.cost is not None
            q, d = lay.cost.swap_matrix(topk, d=d, kind=opts.kind, gamma=opts.gamma,  # type: ignore[arg-type]
                                        placement=placement, token_rank=token_rank)
        else:
            q = smart_matrix(topk, lay.num_experts, placement, lay.comm.world)
        before = float(q[0, 0])
        a, b, after = best_swap(q)
        if not after < (1.0 - opts.threshold) * before or placement[a] == placement[b]:
            return [0.0] * 8
        swapped = placement.copy()
        swapped[[a, b]] = swapped[[b, a]]
        pred = [self._predicted(lay, topk, token_rank, p, d) for p in (placement, swapped)]
        if opts.policy == "hierd" and opts.kind != "max" and pred[1] > pred[0]:
            return [0.0] * 8  # the smooth objective improved but the time it stands for would not
        return [1.0, a, b, d, before, after, *pred]

    @staticmethod
    def _predicted(lay: runtime.EPLayer, topk: np.ndarray, token_rank: np.ndarray, placement: np.ndarray,
                   d: int) -> float:
        if lay.cost is None:
            return float("nan")
        stats = hd_statistics(topk, lay.num_experts, lay.comm.sizes, placement=placement, token_rank=token_rank)
        return float(lay.cost.times_s(stats)[d - 1])

    def _apply(self, swaps: Sequence[tuple[runtime.EPLayer, tuple[Any, ...]]]) -> list[SwapRecord]:
        """Apply swaps (one per layer at most): move the experts of sharded layers, agree in one
        all-reduce that every rank succeeded, then write the received rows and update the
        placements. On any rank's failure every rank raises and nothing of these swaps is
        written. A rank whose transfer failed still takes part in the later layers' transfers, so
        no peer waits for it."""
        moves: list[tuple[list[tuple[Tensor, Tensor]], int]] = []
        error: BaseException | None = None
        for lay, (a, b, *_) in swaps:
            if lay.slot_params:
                pa, pb = int(lay.expert_pos_E[a]), int(lay.expert_pos_E[b])
                try:
                    moves.append(_migrate(lay, a, b, pa, pb, self.optimizer))
                except Exception as e:  # reported to every rank below, then raised here
                    error = error or e
                    moves.append(([], 0))
            else:
                moves.append(([], 0))
        if any(lay.slot_params for lay, _ in swaps):
            ok = torch.tensor([0 if error else 1], dtype=torch.int64)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self._cpu_group())
            if error is not None:
                raise error
            if not int(ok):
                pairs = ", ".join(f"{lay.name}: {dec[0]}<->{dec[1]}" for lay, dec in swaps)
                raise RuntimeError(f"expert swap ({pairs}) failed on another rank (see its error); the placements "
                                   "and every expert weight stay as they were")
        records = []
        for (lay, (a, b, d, obj_before, obj_after, pred_before, pred_after)), (pending, moved) in zip(
                swaps, moves, strict=True):
            with torch.no_grad():
                _commit([dst for dst, _ in pending], [src for _, src in pending])
            pa, pb = int(lay.expert_pos_E[a]), int(lay.expert_pos_E[b])
            lay.move_experts(a, b)
            rec = SwapRecord(self.calls, lay.name, (a, b), (pa, pb), d, obj_before, obj_after, pred_before,
                             pred_after, moved)
            lay.swaps.append(rec)
            records.append(rec)
        return records


def expert_swapper(model: nn.Module, optimizer: torch.optim.Optimizer | None, **options: Any) -> ExpertSwapper:
    """An ``ExpertSwapper`` for a model compiled by hiermoe over a mesh. ``optimizer`` is the one
    whose state moves with the experts (``None`` only if it keeps none, e.g. plain SGD).
    ``options`` override the compile's ``expert_swap`` settings (see ``SwapOptions``)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"expert_swapper needs the model (an nn.Module, compiled or not), got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"expert_swapper's optimizer must be a torch.optim.Optimizer or None, got "
                         f"{type(optimizer).__name__}")
    parse_swap_options({**SwapOptions().__dict__, **options})  # validate now, not at the first step
    return ExpertSwapper(model, optimizer, dict(options))


def smart_matrix(topk: np.ndarray, num_experts: int, placement: np.ndarray, world: int) -> np.ndarray:
    """[E, E]: the largest raw token count (one per (token, expert) pair, no dedup) any rank
    receives after swapping experts r and c: SmartMoE-style load balancing. The diagonal is
    the placement as is."""
    load_E = np.bincount(topk.ravel(), minlength=num_experts).astype(np.float64)
    load_G = np.bincount(placement, weights=load_E, minlength=world)
    pa, pb = placement[:, None], placement[None, :]
    others = _exclusion_table(load_G, np.maximum)[pa, pb]  # -inf where no third rank is left
    delta = load_E[None, :] - load_E[:, None]  # [r, c]: what r's rank gains when r and c swap
    q = np.maximum(others, np.maximum(load_G[pa] + delta, load_G[pb] - delta))
    q[pa == pb] = load_G.max()
    return q


@dataclass
class _Gather:
    """An all-gather of every rank's routing, posted by ``_post_routing`` (``work`` None once done)."""

    work: Any
    gathered: list[Tensor]
    ks: list[int]  # K of each layer
    capacity: int


def _post_routing(topks: Sequence[Tensor], comm: Any, capacity: int, group: Any = None,
                  async_op: bool = False) -> _Gather:
    """Post one all-gather on ``group`` of [per-layer sizes | ids padded to ``capacity``] (the
    same on every rank); with ``async_op`` it is in flight when this returns."""
    num_layers = len(topks)
    flat = [t.detach().to("cpu", torch.int32).reshape(-1) for t in topks]
    sizes = [f.numel() for f in flat]
    buf = torch.zeros(num_layers + capacity, dtype=torch.int32)
    buf[:num_layers] = torch.tensor(sizes, dtype=torch.int32)
    if sum(sizes) <= capacity and flat:
        buf[num_layers: num_layers + sum(sizes)] = torch.cat(flat)
    gathered = [torch.empty_like(buf) for _ in range(comm.world)]
    work = dist.all_gather(gathered, buf, group=group, async_op=async_op)
    return _Gather(work, gathered, [t.shape[1] for t in topks], capacity)


def _read_routing(g: _Gather, comm: Any) -> tuple[list[tuple[np.ndarray, np.ndarray]] | None, int]:
    """Wait for ``g`` and unpack it: every rank's routing of each layer ([sum of T, K] expert ids,
    [sum of T] source mesh position), identical on every rank, and the capacity to use next; None
    (with twice the largest size as the capacity) when some rank's ids did not fit, which every
    rank sees alike in the sizes."""
    if g.work is not None:
        g.work.wait()
    num_layers = len(g.ks)
    longest = max(int(x[:num_layers].sum()) for x in g.gathered)
    if longest > g.capacity:
        return None, 2 * longest
    # dist.all_gather orders by global rank; mesh positions map to ranks through comm.ranks
    out = []
    offsets = [num_layers] * comm.world
    for i, k in enumerate(g.ks):
        parts, sources = [], []
        for pos in range(comm.world):
            x = g.gathered[comm.ranks[pos]]
            n = int(x[i])
            parts.append(x[offsets[pos]: offsets[pos] + n].numpy().reshape(-1, k))
            sources.append(np.full(n // k if k else 0, pos, dtype=np.int64))
            offsets[pos] += n
        out.append((np.concatenate(parts).astype(np.int64), np.concatenate(sources)))
    return out, g.capacity


def _gather_routing(topks: Sequence[Tensor], comm: Any, capacity: int, group: Any = None
                    ) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """Every rank's routing of each layer (see ``_read_routing``) and the capacity to use next
    time: one all-gather, and a second with room for twice the largest when some rank's ids did
    not fit. The first call passes capacity 0 and so always takes two."""
    for attempt in range(2):
        routings, capacity = _read_routing(_post_routing(topks, comm, capacity, group), comm)
        if routings is not None:
            return routings, capacity
        assert attempt == 0
    raise AssertionError("unreachable: the second gather has room for every rank's routing")


def _decisions(table: Tensor) -> list[tuple[Any, ...] | None]:
    """The summed decision table's rows as (a, b, d, objective before/after, predicted
    before/after), None where the layer does not swap."""
    return [(int(row[1]), int(row[2]), int(row[3]), *row[4:]) if row[0] > 0 else None for row in table.tolist()]


# migration --------------------------------------------------------------------------------------

def _pieces(lay: runtime.EPLayer, slot: int, optimizer: torch.optim.Optimizer | None
            ) -> tuple[list[Tensor], list[float], str | None]:
    """The row views that move with the expert in ``slot`` (weights, gradients, optimizer state
    shaped like the weight), the scalar optimizer state that must agree, and an error if this
    rank cannot move them."""
    rows: list[Tensor] = []
    scalars: list[float] = []
    for p in lay.slot_params:
        rows.append(p.data[slot])
        if p.grad is not None:
            rows.append(p.grad[slot])
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key in sorted(state):
            v = state[key]
            if isinstance(v, Tensor) and v.shape == p.shape:
                rows.append(v[slot])
            elif isinstance(v, Tensor) and v.numel() == 1:
                scalars.append(float(v))
            elif isinstance(v, int | float):
                scalars.append(float(v))
            elif v is not None:
                return [], [], (f"optimizer state {key!r} of an expert shard has shape "
                                f"{tuple(getattr(v, 'shape', ()))}, neither the parameter's {tuple(p.shape)} nor a "
                                "scalar; expert swap cannot move it with the expert")
    return rows, scalars, None


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.int8, torch.int16, torch.bool]


_SIGNATURE_LEN = 256  # float64 values: one fixed-size message, so no message announces its size


def _signature(rows: Sequence[Tensor], scalars: Sequence[float], error: str | None) -> tuple[Tensor, str | None]:
    """What a side will send, to check that both sides agree: [ok, #rows, #scalars,
    (dtype, numel) per row..., scalars..., zeros], float64, and the error (also one when there
    are too many pieces to describe)."""
    vals = [float(len(rows)), float(len(scalars))]
    for r in rows:
        vals += [float(_DTYPES.index(r.dtype)), float(r.numel())]
    vals += list(scalars)
    if len(vals) >= _SIGNATURE_LEN:
        error = error or f"an expert has {len(rows)} tensors to move, more than a swap describes ({_SIGNATURE_LEN})"
    out = torch.zeros(_SIGNATURE_LEN, dtype=torch.float64)
    if not error:
        out[0] = 1.0
        out[1: 1 + len(vals)] = torch.tensor(vals, dtype=torch.float64)
    return out, error


def _exchange(send: Tensor, peer: int, recv_like: Tensor) -> Tensor:
    recv = torch.empty_like(recv_like)
    for req in (dist.isend(send, peer), dist.irecv(recv, peer)):
        assert req is not None  # None only for a rank outside the group; the world holds every rank
        req.wait()
    return recv


def _migrate(lay: runtime.EPLayer, a: int, b: int, pa: int, pb: int, optimizer: torch.optim.Optimizer | None
             ) -> tuple[list[tuple[Tensor, Tensor]], int]:
    """Transfer experts a (on position pa) and b (on pb) of a sharded layer: returns the writes
    still to do, (this rank's row, its new content), and the bytes this rank sent. Writes
    nothing."""
    comm = lay.comm
    me = comm.position
    if me not in (pa, pb):
        return [], 0
    local = list(lay.local_experts)
    if pa == pb:  # both here: the two rows trade places
        rows_a, _, err = _pieces(lay, local.index(a), optimizer)
        rows_b, _, _ = _pieces(lay, local.index(b), optimizer)
        if err:
            raise ValueError(f"layer {lay.name}: {err}")
        return [*zip(rows_a, [r.clone() for r in rows_b], strict=True),
                *zip(rows_b, [r.clone() for r in rows_a], strict=True)], 0
    mine, theirs = (a, b) if me == pa else (b, a)
    peer = comm.ranks[pb if me == pa else pa]
    rows, scalars, err = _pieces(lay, local.index(mine), optimizer)
    sig, err = _signature(rows, scalars, err)
    peer_sig = _exchange(sig, peer, sig)
    if err or peer_sig[0] != 1:
        raise ValueError(f"layer {lay.name}: cannot swap experts {a} and {b}: "
                         + (err or f"rank {peer} could not pack expert {theirs} (see its error)"))
    if not torch.equal(sig, peer_sig):
        raise ValueError(f"layer {lay.name}: cannot swap experts {a} and {b}: rank {comm.ranks[me]} and rank {peer} "
                         "hold different things for them (gradients on one side only, different optimizer "
                         "state, or scalar optimizer state such as Adam's step that differs); step both alike")
    payload = torch.cat([r.detach().contiguous().view(-1).view(torch.uint8) for r in rows]) if rows else \
        torch.empty(0, dtype=torch.uint8)
    received = _exchange(payload, peer, payload)
    pending, offset = [], 0
    for r in rows:
        nbytes = r.numel() * r.element_size()
        pending.append((r, received[offset: offset + nbytes].clone().view(r.dtype).view(r.shape)))
        offset += nbytes
    return pending, int(payload.numel()) + int(sig.numel()) * 8


def _commit(dst: Sequence[Tensor], src: Sequence[Tensor]) -> None:
    """Write the rows (the last step of a swap: every rank has received what it needs)."""
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)

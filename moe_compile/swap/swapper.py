"""Topology-aware expert swap during training (HierMoE Section IV, HierD-ES).

    model = torch.compile(model, backend="hiermoe",
                          options={"mesh": mesh, "topology": "cluster.toml", "expert_swap": {"every": 1}})
    swapper = moe_compile.expert_swapper(model, optimizer)
    for batch in data:
        loss = model(batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
        swapper.step()          # per layer: pick the best swap and apply it (collective)

What one ``step()`` does, every ``every``-th call, for every expert-parallel layer of the model
(every rank calls it, in the same order):

    routing  = every rank's [T, K] expert ids of the layer's last forward (one exchange)
    d        = the dimension the layer used (d*, HierMoE Eq. 6, or the fixed one)
    Q*       = Q_d, Eq. 8-9: predicted HD-d seconds after swapping experts r and c, from the
               duplicate-free counts of every phase after the swap, computed incrementally
               (Fig. 8's four cases, O(D*T*K*E); cost.routing.swap_statistics) with the max over
               destinations replaced by Eq. 11's smooth-max (gamma = 10) unless told otherwise
    (r*, c*) = argmin Q*[r, c]  (Eq. 10, Theorem 1)
    swap r*, c* if Q*[r*, c*] < (1 - threshold) * Q*[r*, r*]  (the diagonal is the placement as is)
               and the plain-max t_d (Eq. 3) after the swap is not above t_d before it (the
               smooth-max can improve while the busiest destination gets busier; Q with the
               plain max comes from the same pass over the tokens)
               and, with ``payback`` n (default 10, 0: off), the t_d saved over n steps exceeds the predicted time to
               move the two experts (Q* is then not computed at all where no swap could pass:
               a swap between ranks A and B changes two destinations per phase, A's and B's
               groups, so t_d after it is at least t_d with every phase at its busiest other
               destination, ``HDCostModel.swap_floor_s``, against the migration between A and B)

With ``payback``, that last bound is first checked by every rank on what all ranks hold alike:
the statistics the layer's forward gathered from every rank's routing to choose d*
(``EPLayer.last_stats``, exact) and the payload sizes announced in the last exchange. Where no
swap could pass, the layer's routing is not sent at all; a call that has no routing, decision or
outcome to send exchanges nothing (every ``ANNOUNCE_EVERY`` calls one small exchange announces the
payload sizes again). So on a steady routing that no swap would repay, ``step()`` costs a few
arithmetic operations per layer and no communication.

Every decision is counted per layer by its outcome, a swap or why none
(``EPLayer.swap_decisions``, ``swap_policy.OUTCOMES``; ``explain`` shows them).

The decision itself (Q*, the rules above, the payback bounds, Smart's matrix) is
``moe_compile.swap.policy``; this module exchanges what it needs and moves the experts.

One rank per layer computes Q* (rank = layer index mod world size, fixed; they work in parallel)
and an exchange hands every rank every decision, so all ranks apply the same swaps. Every exchange
of the swapper is one ``all_to_all_single`` on its own gloo group in which each rank sends the
same small header to every rank and a layer's routing ids to that layer's decider alone
(``transfer.Message``): one round of direct sends, where gloo's all-reduce and all-gather take
several rounds between neighbours. A deciding step costs the routing exchange (all layers
together, with what each rank would send to move one expert of each layer), the decision
exchange and, when a sharded layer swaps, one message each way between the two ranks per swap
and one outcome exchange for all swaps together (below). With
``policy="smart"`` the pair instead minimizes the largest raw (not deduplicated) token count
of any rank: the SmartMoE-style balancing that HierMoE's HD2-MoE-Smart baseline uses (Section
V-B), for comparison.

Applying a swap of expert a (rank A, local slot i) and expert b (rank B, slot j):

- weights sharded by ``moe_compile.shard_experts`` (rows are local slots): A and B exchange row
  i / row j of every shard parameter, of its gradient if it has one, and of every optimizer state
  tensor shaped like the parameter (Adam's exp_avg, exp_avg_sq; momentum buffers). Scalar state
  (Adam's step) is per parameter, not per expert: it must be equal on A and B (it is when both
  stepped alike) and stays. Each side sends one message, [description of what it sends | rows],
  into a receive as large as the larger size the two announced in the routing exchange (a side
  that outgrew it sends the rows in a second round, which both sides see coming); both stop with
  an error if the descriptions differ. Each side then writes the rows it received and moves its
  placement, keeping its own rows: if the outcome exchange says the other side failed, it puts
  them and the placement back. A == B swaps the two rows in place.
- weights every rank holds whole (not sharded; DDP keeps them, their gradients after the
  all-reduce and their optimizer state equal on every rank): nothing moves but the placement,
  which every rank updates at once.

The other ranks learn the outcome from every rank's flag in one exchange and then update the
layer's placement table (``runtime.EPLayer.move_experts``). If a rank's part failed, that swap
is dropped everywhere (a side that wrote puts its rows back, every placement stays) and every
rank raises at the same point: inside ``step()`` / ``swap()``, or in overlap mode where the outcome is read. The
compiled graphs read the placement table at their next forward, so nothing recompiles, and the
model computes the same function (only the place of each expert changed).

Call ``step()`` after ``optimizer.step()``: the backward of a forward whose experts moved since
refuses to run (``hiermoe::ep_experts_backward`` checks the placement version).

Overlap mode (``SwapOptions.overlap``): ``step()`` waits for no exchange of all ranks. Call n
posts one message with step n's routing, the decisions computed on step n-1's routing and the
outcome of the swaps call n started (those decided by call n-1); call n+1 reads it. So a decision
uses the routing of two steps before (it is dropped, on every rank alike, when a swap of the
previous call failed or the layer's placement changed in between), only the two ranks of a swap
wait (for each other, while they move its rows), and the other ranks put a swap in force when
they read its outcome: at the next forward of its layer (``runtime.EPLayer.settle``), before the
placement is read, or at the next swapper call. ``step()`` returns the swaps it started.
``flush()`` waits for what is in flight.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_compile.ep import groups, runtime
from moe_compile.swap import policy, transfer
from moe_compile.swap.options import SwapOptions, parse_swap_options

# the most calls without an exchange (where no layer's routing needs one and no decision or outcome is
# due): then a header-only exchange announces every rank's payload_bytes again
ANNOUNCE_EVERY = 16


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
    # alpha-beta seconds to move the two experts' rows between their ranks (both ways at once),
    # from the cluster's levels and the sizes the two ranks announced (nan when not predicted)
    predicted_migration_s: float = float("nan")


@dataclass
class StepTiming:
    """Wall seconds of one deciding ``step()`` on this rank."""

    step: int
    decision_s: float  # the routing exchange, Q*, the decision exchange (overlap mode: posting and reading)
    migration_s: float  # moving weights, gradients and optimizer state, the outcome, the placement
    swaps: int
    # overlap mode: waiting for the outcome of this call's swaps after step() returned (at the next
    # forward of a layer whose experts moved on other ranks, or the next swapper call)
    settle_s: float = 0.0
    # CPU seconds of the calling thread inside step() (time.thread_time): the swapper's own work,
    # without the waits for other ranks or for the cores that decision_s/migration_s include
    cpu_s: float = 0.0


@dataclass
class _Pending:
    """A swap this rank is outside of: its placement moves once every rank reported success."""

    lay: runtime.EPLayer
    a: int
    b: int
    record: SwapRecord
    index: int  # its outcome's position in the message


@dataclass
class _Written:
    """A swap this rank is one side of and has written: undone if the other side failed."""

    lay: runtime.EPLayer
    a: int
    b: int
    record: SwapRecord
    index: int  # its outcome's position in the message
    undo: list[tuple[Tensor, Tensor]]  # this rank's rows as they were
    peer: int  # the other side's global rank


@dataclass
class _Outcome:
    """Swaps started on every rank, waiting for the message that carries every rank's outcome:
    this rank's pending placement moves, the swaps it wrote (undone where the other side
    failed), its own error (raised only once the outcome is read, so every rank raises at the
    same point), and the layers whose next forward reads it."""

    msg: transfer.Message
    pending: list[_Pending]
    written: list[_Written]
    error: BaseException | None
    layers: list[runtime.EPLayer]


@dataclass
class _Round:
    """Overlap mode: the message the last call posted (routing of ``route_layers``, decisions of
    ``table_layers``, valid while their placements keep ``versions``) and the outcome of its swaps."""

    msg: transfer.Message
    route_layers: list[runtime.EPLayer]
    route_opts: list[SwapOptions]
    table_layers: list[runtime.EPLayer]
    versions: list[int] | None  # None: no decisions in it
    payload_layers: list[runtime.EPLayer]  # whose payload_bytes it carries


@dataclass
class ExpertSwapper:
    """Picks and applies expert swaps between training steps (see the module docstring).
    Build it with ``expert_swapper``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    calls: int = 0
    history: list[StepTiming] = field(default_factory=list)
    capacity: int = 0  # routing ids per rank the exchange has room for (grown when a step needs more)
    _round: _Round | None = None  # overlap mode: the message in flight
    _outcome: _Outcome | None = None  # swaps started whose outcome this rank has not read yet
    _in_step: bool = False
    _group: Any = None
    _layers: tuple[int, list[runtime.EPLayer]] = (-1, [])  # (runtime layers seen, this model's)
    _options: dict[int, tuple[Any, SwapOptions]] = field(default_factory=dict)  # layer id -> (its swap_options, merged)
    _payload_sizes: dict[int, tuple[Any, int]] = field(default_factory=dict)  # layer id -> (what moves, bytes)
    _checked: tuple[Any, ...] = ()  # (layers seen, their options) that _checked_layers last found consistent
    # layer id -> every rank's payload_bytes from the last message read, and policy.migration_matrix of them
    _announced: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    _posted: int = -ANNOUNCE_EVERY  # the call that last posted a message (the same on every rank)

    def layers(self) -> list[runtime.EPLayer]:
        """The expert-parallel layers of this model that have been compiled, in layer-id order
        (looked up again when a compile registered new layers)."""
        every = runtime.layers()
        if self._layers[0] != len(every):
            mine = {id(t) for t in self.model.parameters()} | {id(t) for t in self.model.buffers()}
            self._layers = (len(every), [lay for lay in every
                                         if lay.tensors and any(id(t) in mine for t in lay.tensors)])
        return list(self._layers[1])

    def options(self, lay: runtime.EPLayer) -> SwapOptions:
        cached = self._options.get(lay.layer_id)
        if cached is None or cached[0] is not lay.swap_options:
            base = lay.swap_options or SwapOptions()
            opts = parse_swap_options({**base.__dict__, **self.overrides})
            assert opts is not None
            cached = self._options[lay.layer_id] = (lay.swap_options, opts)
        return cached[1]

    def step(self) -> list[SwapRecord]:
        """Decide and apply this step's swaps (collective: every rank calls it). Returns the swaps
        made (overlap mode: started; see the module docstring), also appended to each layer's
        ``swaps`` once in force."""
        self.calls += 1
        layers, opts = self._checked_layers()
        self._in_step = True
        try:
            if opts[0].overlap:
                return self._step_overlapped(layers, opts)
            self.flush()  # a switch from overlap mode leaves nothing in flight
            if self.calls % opts[0].every:
                return []
            t0, c0 = time.perf_counter(), time.thread_time()
            decisions, sizes = self._decide(layers, opts)
            t1 = time.perf_counter()
            records: list[SwapRecord] = []
            try:
                records = self._apply([(lay, dec) for lay, dec in zip(layers, decisions, strict=True)
                                       if dec is not None], sizes)
            finally:
                self.history.append(StepTiming(self.calls, t1 - t0, time.perf_counter() - t1, len(records),
                                               cpu_s=time.thread_time() - c0))
            return records
        finally:
            self._in_step = False

    def flush(self) -> None:
        """Wait for what is in flight: the outcome of swaps started (applied or, when a rank
        failed, raised here) and, in overlap mode, the exchange whose decisions are then dropped.
        Call it on every rank before destroying the process group, or to stop swapping."""
        rnd, self._round = self._round, None
        try:
            self._settle()
        finally:
            if rnd is not None:
                rnd.msg.wait()

    def swap(self, layer: str | int, a: int, b: int) -> SwapRecord:
        """Swap experts ``a`` and ``b`` of ``layer`` (its name or runtime id) now, whatever the
        cost model says (collective: every rank calls it with the same arguments)."""
        lay = self._find(layer)
        if not (0 <= a < lay.num_experts and 0 <= b < lay.num_experts) or a == b:
            raise ValueError(f"layer {lay.name}: experts to swap must be two different ids in "
                             f"[0, {lay.num_experts}), got {a} and {b}")
        if lay.swap_blocker:
            raise ValueError(f"layer {lay.name}: cannot swap its experts: {lay.swap_blocker}")
        self._settle()  # the placement this swap starts from is the one in force everywhere
        nan = float("nan")
        self._in_step = True
        try:
            return self._apply([(lay, (a, b, lay.last_dimension or 0, nan, nan, nan, nan, nan))], {})[0]
        finally:
            self._in_step = False

    # internals ------------------------------------------------------------------------------

    def _cpu_group(self) -> Any:
        """The gloo group the swapper's own exchanges use (routing, decisions, outcomes: small CPU
        tensors, also when the model's collectives run on NCCL; and in overlap mode kept apart
        from the model's). Made at the first use, which every rank reaches in the same call."""
        if self._group is None:
            self._group = groups.new_group(backend="gloo")
        return self._group

    def _post(self, world: int, **kw: Any) -> transfer.Message:
        return transfer.Message(self._cpu_group(), world, dist.get_rank(), **kw)

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
        key = (self._layers[0], tuple(all_opts))  # the same layers and options: checked before
        if key != self._checked:
            if len({o.every for o in all_opts}) > 1:
                raise ValueError("expert swap: every layer of the model must use the same 'every'")
            if len({o.overlap for o in all_opts}) > 1:
                raise ValueError("expert swap: every layer of the model must use the same 'overlap'")
            for lay, opts in zip(layers, all_opts, strict=True):
                lay.gather_experts = policy.payback_bounded(lay, opts)  # for policy.no_swap_repays
                if (opts.policy == "hierd" or (opts.payback and lay.slot_params)) and lay.cost is None:
                    why = "HierD-ES" if opts.policy == "hierd" else f"the payback rule (payback {opts.payback:g} steps)"
                    raise ValueError(f"layer {lay.name}: {why} predicts HierD-AlltoAll times from the "
                                     "cluster's alpha/beta; compile with options['topology'] (a TOML from "
                                     "moe-calibrate)" + ("" if opts.policy == "hierd" else
                                                        ", or turn the rule off with expert_swap 'payback': 0"))
            self._checked = key
        for lay in layers:  # these can change from one call to the next
            if lay.swap_blocker:
                raise ValueError(f"layer {lay.name}: cannot swap its experts: {lay.swap_blocker}")
            if lay.last_topk is None:
                raise ValueError(f"layer {lay.name} has not run a forward yet; call swapper.step() after a "
                                 "training step")
        return layers, all_opts

    def _decide(self, layers: list[runtime.EPLayer], opts: list[SwapOptions]
                ) -> tuple[list[tuple[Any, ...] | None], dict[int, np.ndarray]]:
        """Sync mode: exchange the routing and every rank's ``payload_bytes`` (a second time, with
        room for the largest routing, when some rank's did not fit; always on the first call),
        compute this rank's rows, exchange them. Returns the decisions and the sizes."""
        comm = layers[0].comm
        unneeded = self._unneeded(layers, opts, set())
        if all(unneeded) and self.calls - self._posted < ANNOUNCE_EVERY:
            return [None] * len(layers), {}
        topks, deciders = _routed(layers, unneeded) if not all(unneeded) else (None, [])
        for _ in range(2):
            msg = self._post(comm.world, topks=topks, deciders=deciders, capacity=self.capacity,
                             payload=self._payloads(layers))
            routings, self.capacity = msg.routing(comm)
            if routings is not None:
                sizes = self._announce(layers, msg)
                self._posted = self.calls
                if all(unneeded):  # an announcement only
                    return [None] * len(layers), sizes
                table = self._post(comm.world, table=self._table_rows(layers, opts, routings, sizes)).table()
                _count_outcomes(layers, table[:, 0])
                return _decisions(table), sizes
        raise AssertionError("unreachable: the second exchange has room for every rank's routing")

    def _unneeded(self, layers: Sequence[runtime.EPLayer], opts: Sequence[SwapOptions], moved: set[int]
                  ) -> list[bool]:
        """Per layer: True where no swap could pass the payback rule, so its routing of this step
        need not go to its decider. Decided on what every rank holds alike: the exact statistics
        of the layer's last forward (``EPLayer.last_stats``, gathered from every rank's routing)
        give t_d and a bound on it after a swap between each pair of ranks
        (``HDCostModel.swap_floor_from_statistics``), held against the migration between that
        pair at the ``payload_bytes`` last announced; where some pair passes, the tighter bound
        per pair of experts (``HDCostModel.swap_floor_experts``, from the per-expert counts the
        forward gathers once asked: ``EPLayer.gather_experts``) decides. False where any
        of that is missing or stale: no payback rule or nothing moves, no gathered statistics (a
        fixed dimension, a mesh too large to gather them), a placement other than the forward's
        (``moved``: ids of layers whose swap this call started), no sizes announced yet. Each True
        is this call's decision for its layer, counted as such (``policy.NO_PAYBACK``)."""
        out = []
        for lay, o in zip(layers, opts, strict=True):
            announced = self._announced.get(lay.layer_id)
            out.append(policy.payback_bounded(lay, o) and lay.last_stats is not None and announced is not None
                       and id(lay) not in moved
                       and np.array_equal(lay.last_stats_placement, lay.expert_pos_E.cpu().numpy())
                       and policy.no_swap_repays(lay, o, announced[1]))
            if out[-1]:
                policy.count(lay, policy.NO_PAYBACK)
        return out

    def _announce(self, layers: Sequence[runtime.EPLayer], msg: transfer.Message) -> dict[int, np.ndarray]:
        """Every rank's ``payload_bytes`` in ``msg`` (layer id -> sizes by global rank), kept for
        ``_unneeded`` with the migration time between every pair of ranks they give."""
        got = msg.payload()
        sizes = {lay.layer_id: got[:, i] for i, lay in enumerate(layers)}
        self._announced = {lay.layer_id: (sizes[lay.layer_id], policy.migration_matrix(lay, sizes[lay.layer_id]))
                           for lay in layers}
        return sizes

    def _payloads(self, layers: Sequence[runtime.EPLayer]) -> list[int]:
        """Every layer's ``payload_bytes``, recomputed when what moves with an expert may have
        changed: a gradient came or went, or the number of optimizer state entries did (a stale
        size would only cost ``migrate`` a second round, never a wrong transfer)."""
        out = []
        state = self.optimizer.state if self.optimizer is not None else {}
        for lay in layers:
            key = tuple((p.grad is None, len(state.get(p, ()))) for p in lay.slot_params)
            cached = self._payload_sizes.get(lay.layer_id)
            if cached is None or cached[0] != key:
                cached = self._payload_sizes[lay.layer_id] = (key, transfer.payload_bytes(lay, self.optimizer))
            out.append(cached[1])
        return out

    def _table_rows(self, layers: list[runtime.EPLayer], opts: list[SwapOptions],
                    routings: list[tuple[np.ndarray, np.ndarray] | None],
                    sizes: Mapping[int, np.ndarray], pending: Sequence[_Pending] = ()) -> np.ndarray:
        """This rank's rows of the decision table (one row per layer: swap?, a, b, d, objective
        before/after, predicted before/after; zeros in the rows other ranks decide: those whose
        routing it did not receive), on the placements with the ``pending`` moves in force (every
        rank's placement once the swaps started succeed; decisions are dropped where one fails)."""
        table = np.zeros((len(layers), transfer.TABLE_COLS))
        for i, lay in enumerate(layers):
            routing = routings[i]
            if routing is not None:
                table[i] = policy.decide_layer(lay, opts[i], _planned(lay, pending), *routing, sizes.get(lay.layer_id),
                                               self.calls)
        return table

    def _step_overlapped(self, layers: list[runtime.EPLayer], opts: list[SwapOptions]) -> list[SwapRecord]:
        """One call of overlap mode: (1) read the message the previous call posted; (2) start the
        swaps it decided, unless a swap of that call failed on some rank or a layer's placement
        changed since (only an explicit ``swap()`` in between changes it); (3) compute Q* on the
        routing it carried; (4) post one message with this step's routing (on a deciding call),
        those decisions and the outcome of the swaps started in (2). Ranks outside a swap's pair
        move its placement when that message arrives: at the next forward of the layer
        (``runtime.EPLayer.settle``) or the next call, whichever comes first."""
        t0, c0 = time.perf_counter(), time.thread_time()
        self._settle()
        comm, world = layers[0].comm, layers[0].comm.world
        records: list[SwapRecord] = []
        outcome: list[bool] = []
        pending: list[_Pending] = []
        error: BaseException | None = None
        swaps: list[tuple[runtime.EPLayer, tuple[Any, ...]]] = []
        migration_s = 0.0
        routings = None
        written: list[_Written] = []
        sizes: dict[int, np.ndarray] = {}
        rnd, self._round = self._round, None
        if rnd is not None:
            if rnd.versions is not None:
                ok, decided = all(rnd.msg.outcome()), rnd.msg.table()
                _count_outcomes(rnd.table_layers, decided[:, 0],
                                [ok and lay.version == v for lay, v in zip(rnd.table_layers, rnd.versions, strict=True)])
                if ok:
                    swaps = [(lay, dec) for lay, dec, v in zip(rnd.table_layers, _decisions(decided),
                                                               rnd.versions, strict=True)
                             if dec is not None and lay.version == v]
            if rnd.route_layers:  # None: the capacity grew, the next round has room
                routings, self.capacity = rnd.msg.routing(comm)
            sizes = self._announce(rnd.payload_layers, rnd.msg)
        deciding = self.calls % opts[0].every == 0
        # before _start moves placements on the two ranks of a swap: decided alike everywhere
        unneeded = self._unneeded(layers, opts, {id(lay) for lay, _ in swaps}) if deciding else []
        if swaps:
            t1 = time.perf_counter()
            records, outcome, pending, written, error = self._start(swaps, sizes)
            migration_s = time.perf_counter() - t1
        table, versions, table_layers = None, None, []
        if routings is not None and rnd is not None:  # decided on the placements after this call's swaps
            table_layers = rnd.route_layers
            table = self._table_rows(table_layers, rnd.route_opts, routings, sizes, pending)
            versions = [lay.version + sum(p.lay is lay for p in pending) for lay in table_layers]
        route = deciding and not all(unneeded)
        topks, deciders = _routed(layers, unneeded) if route else (None, [])
        if outcome or table is not None or route or self.calls - self._posted >= ANNOUNCE_EVERY:
            msg = self._post(world, outcome=outcome, table=table, topks=topks, deciders=deciders,
                             capacity=self.capacity, payload=self._payloads(layers), async_op=True)
            self._round = _Round(msg, layers if route else [], opts, table_layers, versions, layers)
            self._posted = self.calls
            if outcome:
                self._await(_Outcome(msg, pending, written, error, [lay for lay, _ in swaps if lay.slot_params]))
        self.history.append(StepTiming(self.calls, time.perf_counter() - t0 - migration_s, migration_s,
                                       len(records), cpu_s=time.thread_time() - c0))
        return records

    def _start(self, swaps: Sequence[tuple[runtime.EPLayer, tuple[Any, ...]]], sizes: Mapping[int, np.ndarray]
               ) -> tuple[list[SwapRecord], list[bool], list[_Pending], list[_Written], BaseException | None]:
        """Start swaps (one per layer at most), in order, on every rank: layers whose experts every
        rank holds move their placement now (nothing can fail); for sharded layers the two ranks
        holding the experts move the rows (``transfer.migrate``, one round trip into receives of
        the announced ``sizes``), write them and move their placement, keeping their own rows to
        put back if the outcome says the other side failed; every other rank keeps the swap
        pending until the outcome arrives. Returns the records, this rank's outcome per sharded
        swap (False where its transfer failed), the pending moves, the swaps written and its first
        error. A rank whose transfer failed still takes part in the later layers' transfers, so no
        peer waits for it."""
        records: list[SwapRecord] = []
        outcome: list[bool] = []
        pending: list[_Pending] = []
        written: list[_Written] = []
        error: BaseException | None = None
        for lay, (a, b, d, obj_before, obj_after, pred_before, pred_after, migration) in swaps:
            pa, pb = int(lay.expert_pos_E[a]), int(lay.expert_pos_E[b])
            rec = SwapRecord(self.calls, lay.name, (a, b), (pa, pb), d, obj_before, obj_after, pred_before,
                             pred_after, 0, migration)
            if not lay.slot_params:
                lay.move_experts(a, b)
                lay.swaps.append(rec)
                records.append(rec)
                continue
            if lay.comm.position not in (pa, pb):
                pending.append(_Pending(lay, a, b, rec, len(outcome)))
                outcome.append(True)
                records.append(rec)
                continue
            announced = sizes.get(lay.layer_id)
            bound = 0 if announced is None else int(max(announced[lay.comm.ranks[pa]], announced[lay.comm.ranks[pb]]))
            try:
                moved = transfer.migrate(lay, a, b, pa, pb, self.optimizer, bound)
            except Exception as e:  # the outcome tells every rank; raised here once the outcome is out
                error = error or e
                outcome.append(False)
                continue
            transfer.commit(moved.writes)
            lay.move_experts(a, b)
            rec = dataclasses.replace(rec, moved_bytes=moved.sent_bytes)
            peer = lay.comm.ranks[pb if lay.comm.position == pa else pa]
            written.append(_Written(lay, a, b, rec, len(outcome), moved.undo, peer))
            outcome.append(True)
            lay.swaps.append(rec)
            records.append(rec)
        return records, outcome, pending, written, error

    def _apply(self, swaps: Sequence[tuple[runtime.EPLayer, tuple[Any, ...]]], sizes: Mapping[int, np.ndarray]
               ) -> list[SwapRecord]:
        """Sync mode: start the swaps, exchange their outcome and put them in force everywhere or,
        where some rank failed, nowhere (then every rank raises here and nothing of that swap
        stays written)."""
        records, outcome, pending, written, error = self._start(swaps, sizes)
        if outcome:
            msg = self._post(swaps[0][0].comm.world, outcome=outcome)
            self._await(_Outcome(msg, pending, written, error, []))
            self._settle()
        elif error is not None:
            raise error
        return records

    def _await(self, out: _Outcome) -> None:
        """Leave ``out`` to be read by the next forward of its layers (the first of them reads it,
        on every rank alike: every rank hooks the same layers) or the next swapper call."""
        self._outcome = out
        for lay in out.layers:
            lay.settle_hook = self._settle

    def _settle(self) -> None:
        """Read the outcome of the swaps started and put the successful ones in force on the ranks
        outside their pairs (the placement update); then, if some rank failed its part of a swap
        (that swap is dropped: a side that wrote puts its own rows and placement back), raise on
        every rank: the failing side's own error, or a RuntimeError on the others."""
        out, self._outcome = self._outcome, None
        if out is None:
            return
        for lay in out.layers:
            lay.settle_hook = None
        t0 = time.perf_counter()
        ok = out.msg.outcome()
        if not self._in_step and self.history:  # waited outside step(): the call that started them pays
            self.history[-1].settle_s += time.perf_counter() - t0
        for p in out.pending:
            if ok[p.index]:
                p.lay.move_experts(p.a, p.b)
                p.lay.swaps.append(p.record)
        undone = [w for w in out.written if not ok[w.index]]
        for w in undone:
            transfer.commit(w.undo)
            w.lay.move_experts(w.a, w.b)
            w.lay.swaps.remove(w.record)
        if out.error is not None:
            raise out.error
        if undone:
            w = undone[0]
            raise RuntimeError(f"layer {w.lay.name}: rank {w.peer} failed to receive its side of the swap of experts "
                               f"{w.a} and {w.b} (see its error); this rank put its own rows back, so nothing of "
                               "the swap stays written and the placement is the one before")
        if not all(ok):
            raise RuntimeError(f"an expert swap started in swapper call {self.calls} failed on another rank (see "
                               "its error); the placements and every expert weight stay as they were")


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


def _deciders(comm: Any, num_layers: int) -> list[int]:
    """The global rank that computes each layer's Q* (and alone receives its routing): layer i
    on mesh position i mod world, fixed, so that a rank posting its routing knows where it goes."""
    return [comm.ranks[i % comm.world] for i in range(num_layers)]


def _routed(layers: Sequence[runtime.EPLayer], unneeded: Sequence[bool]) -> tuple[list[Tensor | None], list[int]]:
    """A routing message's ids and deciders: None and -1 (sent nowhere) for the ``unneeded``."""
    comm = layers[0].comm
    return ([None if skip else lay.last_topk for lay, skip in zip(layers, unneeded, strict=True)],
            [-1 if skip else r for r, skip in zip(_deciders(comm, len(layers)), unneeded, strict=True)])


def _planned(lay: runtime.EPLayer, pending: Sequence[_Pending]) -> np.ndarray:
    """The layer's placement with the ``pending`` moves in force."""
    placement = lay.expert_pos_E.cpu().numpy().astype(np.int64)
    for p in pending:
        if p.lay is lay:
            placement[[p.a, p.b]] = placement[[p.b, p.a]]
    return placement


def _count_outcomes(layers: Sequence[runtime.EPLayer], codes: np.ndarray, started: Sequence[bool] | None = None
                    ) -> None:
    """Count each layer's decision by outcome (``EPLayer.swap_decisions``) from the first entries
    of the decision table; a swap whose ``started`` is False (overlap mode) counts as dropped."""
    for i, (lay, code) in enumerate(zip(layers, codes, strict=True)):
        what = policy.outcome(code)
        if what == policy.SWAPPED and started is not None and not started[i]:
            what = policy.DROPPED
        if what is not None:
            policy.count(lay, what)


def _decisions(table: np.ndarray) -> list[tuple[Any, ...] | None]:
    """The summed decision table's rows as (a, b, d, objective before/after, predicted
    before/after, migration), None where the layer does not swap."""
    if not table[:, 0].any():
        return [None] * table.shape[0]
    return [(int(row[1]), int(row[2]), int(row[3]), *row[4:]) if row[0] > 0 else None for row in table.tolist()]

"""Runtime state of compiled expert-parallel layers: the layer table the ops reach by id, and the
per-rank traffic counters.

A compiled graph calls ``hiermoe::ep_experts(..., layer=i)``; ``layer(i)`` is the ``EPLayer``
holding what the op needs between steps without recompiling: the mesh's process groups, the
placement table (logical expert -> mesh position), the dispatch settings and the cost model that
picks d* per step, and what the last step chose and sent (read by ``explain``).

The placement is mutable: an expert swap (``moe_compile.swap``, HierMoE Section IV) changes it
between steps, and the compiled graphs route by it from the next forward on. A recompile of the
same model (same weight tensors) finds the layer it had and keeps its placement, so a graph
compiled after a swap reads the experts where they now are.

Counters (``counters()``, ``reset_counters()``) hold, for this rank, the bytes and messages sent
per mesh level, per phase (dispatch / combine of tokens, gather of expert weights) and direction (forward / backward), payload (token
rows) apart from metadata (split sizes, expert ids, weights).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moe_compile.cost.routing import expert_table, gathered_statistics, hd_statistics, source_table
from moe_compile.ep import shard
from moe_compile.ep.comm import MeshComm
from moe_compile.ep.tuning import DimensionTuner, StepClock

_lock = threading.Lock()
# the training step as this process's expert-parallel layers see it: what the d tuner measures;
# the stage ops mark each forward dispatch and the end of its backward
STEP_CLOCK = StepClock()

_PHASES = ("dispatch", "combine", "gather", "samples")  # gather: expert weights (lowering.ep_gather); samples: lowering.sample_exchange
_DIRECTIONS = ("forward", "backward")
# the most numbers (ranks^2 * (levels + 1)) choose_dimension gathers for exact statistics: 181
# ranks on 3 levels; 1 MiB of int64 per layer and step on every rank
GATHER_MAX = 2**17
_MEASURE_WIDTH = 2  # what each rank adds to its tables: _last_step_measured
_FIELDS = ("payload_bytes", "payload_messages", "meta_bytes", "meta_messages")

_counts: dict[tuple[int, str, str], list[int]] = {}
_level_names: list[tuple[str, ...]] = []  # names of the mesh levels seen (the last one wins)


def record_traffic(layer_id: int, level: int, phase: str, direction: str, *, payload_bytes: int,
                   payload_messages: int, meta_bytes: int, meta_messages: int) -> None:
    """Add one send of layer ``layer_id`` to another rank across 0-based mesh level ``level``."""
    with _lock:
        c = _counts.setdefault((level, phase, direction), [0, 0, 0, 0])
        c[0] += payload_bytes
        c[1] += payload_messages
        c[2] += meta_bytes
        c[3] += meta_messages
        if 0 <= layer_id < len(_layers):
            lay = _layers[layer_id]
            key = (level, phase, direction)
            # a gather may start a layer ahead, before the step's begin resets step_bytes
            step = lay.gather_step_bytes if phase == "gather" else lay.step_bytes
            step[key] = step.get(key, 0) + payload_bytes


def reset_counters() -> None:
    """Zero this rank's traffic counters."""
    with _lock:
        _counts.clear()


def counters() -> dict[str, dict[str, dict[str, dict[str, int]]]]:
    """This rank's traffic since the last ``reset_counters()``:
    ``{level name: {"dispatch"|"combine": {"forward"|"backward": {payload_bytes, payload_messages,
    meta_bytes, meta_messages}}}}``, every level of the mesh present (zeros where nothing was sent)."""
    names = _level_names[-1] if _level_names else ()
    with _lock:
        snapshot = {k: list(v) for k, v in _counts.items()}
    out: dict[str, dict[str, dict[str, dict[str, int]]]] = {}
    for level, name in enumerate(names):
        out[name] = {ph: {dr: dict(zip(_FIELDS, snapshot.get((level, ph, dr), [0, 0, 0, 0]), strict=True))
                          for dr in _DIRECTIONS} for ph in _PHASES}
    return out


@dataclass
class EPLayer:
    """One expert-parallel layer of a compiled graph (see module docstring)."""

    layer_id: int
    name: str
    num_experts: int
    top_k: int
    comm: MeshComm
    expert_pos_E: Any  # torch.Tensor [E] mesh position of each logical expert
    local_experts: tuple[int, ...]  # logical experts on this rank, in local slot order
    dedup: bool
    dimension: int | None  # fixed d, or None: d* per step from the cost model
    cost: Any = None  # cost.hiermoe.HDCostModel
    # what the last forward step chose and sent
    last_dimension: int | None = None
    last_times_s: list[float] = field(default_factory=list)  # the model's t_1..t_D (Eq. 1-5)
    # t_1..t_D corrected by the measured offsets (moe_compile.ep.tuning) the last step decided on
    last_tuned_s: list[float] = field(default_factory=list)
    # rounds 0 (the model alone) unless options['tune_dimension'] says (passes.expert_parallel)
    tuner: DimensionTuner = field(default_factory=lambda: DimensionTuner(0))
    step_bytes: dict[tuple[int, str, str], int] = field(default_factory=dict)  # payload, since the last forward
    # wall seconds this rank spent in dispatch + combine since the last forward, per direction
    step_comm_s: dict[str, float] = field(default_factory=dict)
    # the StepClock step of this layer's last forward (-1: none yet): what the d tuner measures
    _clock_step: int = -1
    num_steps: int = 0
    # bytes the staged ops keep from this rank's last forward to its backward: the dispatched rows
    # with their expert ids and weights, and the route (0 for the fused "resend" op, which keeps
    # only its inputs)
    saved_bytes: int = 0
    # identity of the layer across recompiles: the weight tensors its graphs read (graph inputs)
    tensors: tuple[Any, ...] = ()
    # why experts of this layer cannot be swapped (None: they can), e.g. a graph that stacks only
    # this rank's expert modules
    swap_blocker: str | None = None
    version: int = 0  # placement version: +1 per swap that moved an expert to another rank or slot
    swaps: list[Any] = field(default_factory=list)  # moe_compile.swap.swapper.SwapRecord, oldest first
    # the swapper's decisions on this layer so far, by outcome (swap_policy.OUTCOMES: a swap or
    # why none), the same on every rank
    swap_decisions: dict[str, int] = field(default_factory=dict)
    last_topk: Any = None  # this rank's [T, K] routing of the last forward (expert swap reads it)
    # the exact statistics of every rank's routing of the last forward (choose_dimension; None
    # with a fixed dimension or on a mesh too large to gather them) and the placement they are for
    _stats: Any = None  # cost.routing.HDStatistics (read through last_stats)
    _stats_placement: Any = None  # numpy [E]
    # set by the expert swapper when its payback bound wants them: every rank's routing.source_table
    # ([source, G, D+1]) and routing.expert_table ([source, D+1, E]) of the last forward, gathered
    gather_experts: bool = False
    # decide d from the previous forward's gathered statistics (exchanged off the critical path);
    # False: from this forward's (one blocking exchange per layer and step)
    lag_statistics: bool = True
    _tables: Any = None
    _experts: Any = None
    # the exchange of the last forward's tables still in flight: (work, received [world, n], sizes of
    # the parts, placement they were made for); its result decides the next forward's d
    _pending: Any = None
    # this rank's shard parameters (moe_compile.shard_experts) whose rows are its local slots: what
    # an expert swap moves; empty when every rank holds every expert
    slot_params: tuple[Any, ...] = ()
    swap_options: Any = None  # moe_compile.options.SwapOptions from options["expert_swap"]
    # set while swaps the swapper started on this layer wait for their outcome (every rank's
    # success): called before anything reads the placement (see settle)
    settle_hook: Any = None
    # expert gather (``lowering.ep_gather``; HybridEP's expert domains, HEXA-MoE's data-centric
    # mode): the mesh level j whose blocks (the ranks sharing coordinates 0..j-1, ``MeshComm.intra[j]``)
    # all-gather their experts, so that tokens cross only levels 0..j-1 (j = 0: the whole mesh,
    # no token moves); None: experts stay where they are (all-to-all expert parallelism)
    domain: int | None = None
    # model-centric execution (``lowering.ep_model``): every rank computes every token on its
    # columns of the experts' F (ffn_size); no token goes to an expert's owner
    model_centric: bool = False
    ffn_size: int = 0
    # bytes of expert weights this rank received in its last forward's gathers
    gathered_bytes: int = 0
    # payload bytes the last forward's gather (and its backward's reduce-scatter) sent, like
    # step_bytes, and the seconds the forward waited for its gather (not hidden by a prefetch)
    gather_step_bytes: dict[tuple[int, str, str], int] = field(default_factory=dict)
    gather_exposed_s: float = 0.0
    # its gathered weights are gathered again in backward instead of kept (options['gather_keep_bytes'])
    regathered: bool = False
    # its combine sends each token's result to its sample's new rank (``ep_combine_to``, sample
    # placement): the dispatch's first hop carries each row's origin (``hier_a2a.Route.origin_row``)
    carry_origin: bool = False
    # HybridEP's SR compression of the gathered experts (options['gather_compress']: the ratio;
    # None: off), the shared experts (one per weight tensor) and their all-reduce in flight
    compress_ratio: float | None = None
    shared: Any = None
    shared_pending: Any = None

    local_slot_E: Any = field(init=False)  # [E] local slot of each logical expert, -1 elsewhere
    expert_row_E: Any = field(init=False)  # [E] arange: rows of weights that hold every expert
    # [E] local slot of every expert on the rank that holds it (the same table on every rank)
    expert_slot_E: Any = field(init=False)

    def __post_init__(self) -> None:
        self.expert_row_E = torch.arange(self.num_experts, device=self.expert_pos_E.device)
        per = len(self.local_experts)
        self.expert_slot_E = torch.arange(self.num_experts, device=self.expert_pos_E.device) % max(per, 1)
        self._update_slots()

    def _update_slots(self) -> None:
        slot = torch.full((self.num_experts,), -1, dtype=torch.long, device=self.expert_pos_E.device)
        slot[list(self.local_experts)] = torch.arange(len(self.local_experts), device=slot.device)
        self.local_slot_E = slot

    def phases(self, d: int) -> list[Any]:
        """The all-to-alls a row crosses: HD-d's (``MeshComm.phases``), or with an expert domain at
        level j, Inter-level-1..j only (the row reaches the rank of its expert's domain block
        that shares this rank's coordinates j.., which holds the gathered expert)."""
        if self.domain is not None:
            return self.comm.inter[: self.domain]
        return self.comm.phases(d)

    def domain_positions(self) -> range:
        """The mesh positions of this rank's expert domain, ascending: the block of the mesh at
        level ``domain`` (the ranks sharing coordinates 0..domain-1) that holds this rank."""
        assert self.domain is not None, f"layer {self.name} gathers no experts"
        block = math.prod(self.comm.sizes[self.domain:])
        start = self.comm.position - self.comm.position % block
        return range(start, start + block)

    def weight_rows(self, by_expert: bool) -> Any:
        """[E] the row of each expert in the weights the local experts stage reads, -1 for an expert
        this rank does not hold: with an expert domain, its row in the domain's gathered weights
        (the block's mesh positions ascending, each one's local slots); else ``rows`` where held."""
        if self.domain is not None:  # the domain's positions ascending (lowering.ep_gather's order)
            block = self.domain_positions()
            peer_E = self.expert_pos_E - block.start
            inside = (peer_E >= 0) & (peer_E < len(block))
            return torch.where(inside, peer_E * len(self.local_experts) + self.expert_slot_E, -1)
        return torch.where(self.local_slot_E >= 0, self.rows(by_expert), -1)

    def rows(self, by_expert: bool) -> Any:
        """[E] the row of each expert in the weight tensors the op receives: its id when they hold
        every expert (replicated stacked weights), its local slot when they hold only this rank's
        (shards, stacks of the local expert modules)."""
        return self.expert_row_E if by_expert else self.local_slot_E

    def placement(self) -> list[int]:
        """The mesh position (rank) of every logical expert."""
        return [int(p) for p in self.expert_pos_E.tolist()]

    def settle(self) -> None:
        """Put in force the expert swaps still waiting for their outcome (or raise if a rank
        failed its part of one): the forward calls it before reading the placement."""
        hook = self.settle_hook
        if hook is not None:
            hook()

    def move_experts(self, a: int, b: int) -> None:
        """Record that experts ``a`` and ``b`` swapped places (ranks, and slots inside them); the
        caller has moved their weights. Every rank applies it to its copy of the table."""
        with _lock:
            pos = self.expert_pos_E
            pa, pb = int(pos[a]), int(pos[b])
            pos[a], pos[b] = pb, pa
            slot = self.expert_slot_E
            sa, sb = int(slot[a]), int(slot[b])
            slot[a], slot[b] = sb, sa
            local = list(self.local_experts)
            if a in local or b in local:
                ia = local.index(a) if a in local else None
                ib = local.index(b) if b in local else None
                if ia is not None:
                    local[ia] = b
                if ib is not None:
                    local[ib] = a
                self.local_experts = tuple(local)
                self._update_slots()
            self.version += 1

    @property
    def last_stats(self) -> Any:
        """The exact statistics of every rank's routing of the last forward (None with a fixed
        dimension or on a mesh too large to gather them); see ``choose_dimension``."""
        self.collect_statistics()
        return self._stats

    @property
    def last_stats_placement(self) -> Any:
        self.collect_statistics()
        return self._stats_placement

    @property
    def last_tables(self) -> Any:
        self.collect_statistics()
        return self._tables

    @property
    def last_experts(self) -> Any:
        self.collect_statistics()
        return self._experts

    def collect_statistics(self) -> None:
        """Wait for the last forward's statistics exchange (normally long finished) and keep what
        it gathered. Every rank calls it at the same points (the next forward, or the swapper's
        step), so every rank holds the same statistics."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        work, received, size, placement = pending
        work.wait()
        rows = received.numpy()[list(self.comm.ranks)]
        world, num_levels = self.comm.world, len(self.comm.sizes)
        tables = rows[:, :size].reshape(world, world, -1)
        self._stats = gathered_statistics(tables, self.comm.sizes, copies=not self.dedup)
        self._stats_placement, self._tables = placement, tables
        steps, micros = rows[:, size], rows[:, size + 1]
        if steps[0] >= 0 and (steps == steps[0]).all() and (micros >= 0).all():
            self.tuner.observe(int(steps[0]), float(micros.min()) * 1e-6)
        extra = size + _MEASURE_WIDTH
        self._experts = rows[:, extra:].reshape(world, num_levels + 1, -1) if rows.shape[1] > extra else None

    def _last_step_measured(self) -> list[int]:
        """[step index, microseconds] of this layer's last step, what
        ``tuning.DimensionTuner.observe`` takes: the span of the training step its last forward
        belonged to, per layer and transfer (``STEP_CLOCK``; moe_compile.ep.tuning for why).
        [-1, -1] before the first step and after a forward with no backward (evaluation)."""
        span = STEP_CLOCK.span_s(self._clock_step)
        if not self.num_steps or span is None:
            return [-1, -1]
        return [self.num_steps - 1, int(span * 1e6)]

    def choose_dimension(self, topk_idx_TK: Any) -> int:
        """d for this step: the fixed option, or HierMoE Eq. 6 / Alg. 1 from statistics every rank
        agrees on: every rank's ``routing.source_table`` (G*(D+1) counts), gathered, give the
        statistics of all ranks' tokens together, each at its source (``gathered_statistics``,
        the exact p of Eq. 7), kept in ``last_stats`` with the placement they were made for (and,
        where the expert swapper asked with ``gather_experts``, every rank's
        ``routing.expert_table`` too, for its payback bound).

        Off the critical path: the tables travel in an asynchronous all-to-all on the mesh's own
        statistics group (``MeshComm.stats_group``), started here and collected at the next
        forward, which decides from them; so a step's d comes from the previous step's routing
        of all ranks (routing changes slowly between steps), and only the first forward of a
        layer waits for its own. ``lag_statistics = False`` decides from this step's instead.
        On a mesh whose tables would exceed ``GATHER_MAX`` numbers, each rank's own p statistics
        (its tokens standing in for every source of a relay) max-reduced, this step:
        an upper estimate, and ``last_stats`` is None."""
        if self.dimension is not None:
            return self.dimension
        topk = topk_idx_TK.detach().cpu()
        placement = self.expert_pos_E.cpu().numpy()
        world, sizes = self.comm.world, self.comm.sizes
        width = world * (len(sizes) + 1) + _MEASURE_WIDTH + (len(sizes) + 1) * self.num_experts * self.gather_experts
        if world * width <= GATHER_MAX:
            self.collect_statistics()  # the previous forward's, every rank's
            decide_now = self._stats is None or not self.lag_statistics
            parts = [source_table(topk, self.num_experts, sizes, placement=placement).reshape(-1),
                     np.array(self._last_step_measured(), dtype=np.int64)]
            if self.gather_experts:
                parts.append(expert_table(topk, self.num_experts, sizes, placement=placement).reshape(-1))
            own = torch.from_numpy(np.concatenate(parts))
            received, work = exchange_with_all(own, dist.get_world_size(), self.comm.stats_group, async_op=True)
            self._pending = (work, received, parts[0].size, placement.copy())
            if decide_now:
                self.collect_statistics()
            stats = self._stats
            agreed = stats.values() if self.dedup else stats.copy_values()
            tuner = self.tuner
        else:
            mine = hd_statistics(topk, self.num_experts, sizes, placement=placement, copies=not self.dedup)
            vals = torch.tensor(mine.values() if self.dedup else mine.copy_values(), dtype=torch.float64,
                                device=self.comm.device)
            if dist.get_backend() == "gloo":
                agreed = exchange_with_all(vals, dist.get_world_size())[0].amax(0).tolist()
            else:
                dist.all_reduce(vals, op=dist.ReduceOp.MAX)
                agreed = vals.cpu().tolist()
            self._pending, self._stats, self._stats_placement, self._tables, self._experts = None, None, None, None, None
            tuner = DimensionTuner(0)  # no measurements travel here: the model alone
        times = self.cost.times_from_values(agreed, dedup=self.dedup)
        self.last_times_s = [float(t) for t in times]
        d = tuner.choose(self.last_times_s, self.num_steps, measure=self.num_steps > 0)
        self.last_tuned_s = tuner.corrected_s(self.last_times_s)
        return d

    def begin_step(self, d: int) -> None:
        """This layer's forward runs with d (after ``choose_dimension``, which read the last step)."""
        self._clock_step = STEP_CLOCK.forward(self.layer_id)
        with _lock:
            self.last_dimension = d
            self.saved_bytes = 0
            self.step_bytes = {}
            self.step_comm_s = {}
            self.num_steps += 1

    def add_saved_bytes(self, num_bytes: int) -> None:
        """Dispatched rows kept for backward (every chunk's, for a chunked layer)."""
        with _lock:
            self.saved_bytes += num_bytes

    def add_comm_time(self, direction: str, seconds: float) -> None:
        with _lock:
            self.step_comm_s[direction] = self.step_comm_s.get(direction, 0.0) + seconds

    def last_step_bytes(self, gather: bool = False, samples: bool = False, phase: str | None = None
                        ) -> dict[str, int]:
        """Payload bytes this rank sent per level in the last step (its forward and, once run, its
        backward): tokens, or with ``gather`` expert weights (and their gradients), or with
        ``samples`` the samples the sample exchanges after this layer moved; ``phase``: only
        those of that phase ("dispatch", "combine")."""
        names = self.comm.level_names
        out = {n: 0 for n in names}
        for (level, what, _), b in (self.gather_step_bytes if gather else self.step_bytes).items():
            if (gather or (what == "samples") == samples) and phase in (None, what):
                out[names[level]] += b
        return out


_layers: list[EPLayer] = []


def find_layer(name: str, comm: Any, tensors: tuple[Any, ...]) -> EPLayer | None:
    """The layer a previous compile built for the same weights (a recompile of the same model)."""
    if not tensors:
        return None
    with _lock:
        for lay in _layers:
            if lay.name == name and lay.comm is comm and len(lay.tensors) == len(tensors) \
                    and all(a is b for a, b in zip(lay.tensors, tensors, strict=True)):
                return lay
    return None


def register_layer(**kw: Any) -> EPLayer:
    with _lock:
        lay = EPLayer(layer_id=len(_layers), **kw)
        _layers.append(lay)
        names = tuple(lay.comm.level_names)
        if not _level_names or _level_names[-1] != names:
            _level_names.append(names)
    return lay


def layer(layer_id: int) -> EPLayer:
    return _layers[layer_id]


_remap = threading.local()


class remapped:
    """Within this context (one call of a compiled graph), ``resolve`` maps the layer ids baked
    into the graph to the layers of the weights the graph was called with."""

    def __init__(self, ids: dict[int, int]) -> None:
        self.ids = ids

    def __enter__(self) -> None:
        self.saved = getattr(_remap, "ids", None)
        _remap.ids = self.ids

    def __exit__(self, *exc: object) -> None:
        _remap.ids = self.saved


def resolve(layer_id: int) -> EPLayer:
    """The layer a graph's ``layer`` argument stands for in the current call (see ``remapped``)."""
    ids = getattr(_remap, "ids", None)
    return _layers[ids.get(layer_id, layer_id) if ids else layer_id]


def as_bytes(parts: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
    """[rows, n] uint8: each part reshaped to [rows, -1] and its bytes side by side (one message
    for tensors of any dtypes)."""
    return torch.cat([p.contiguous().reshape(rows, p.numel() // rows).view(torch.uint8) for p in parts], dim=1)


def from_bytes(packed: torch.Tensor, likes: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """The parts ``as_bytes`` packed, each [rows, *shape] of its dtype (``likes``: dtype and the
    shape of one row), each in storage of its own (an op's outputs may not alias)."""
    out: list[torch.Tensor] = []
    offset = 0
    for dtype, shape in likes:
        n = int(np.prod(shape)) * dtype.itemsize
        if n == 0:  # an empty part (its bytes cannot be viewed as its dtype)
            out.append(packed.new_empty((packed.shape[0], *shape), dtype=dtype))
            continue
        part = packed[:, offset:offset + n].clone(memory_format=torch.contiguous_format)
        out.append(part.view(dtype).reshape(packed.shape[0], *shape))
        offset += n
    return out


def exchange_with_all(send: Any, world: int, group: Any = None, async_op: bool = False) -> tuple[Any, Any]:
    """Every rank's ``send`` ([world, n], row = sender's global rank) and the collective's work
    (None unless ``async_op``), from one ``all_to_all_single`` of ``world`` copies: on gloo one
    round of direct sends, where ``all_reduce`` and ``all_gather`` run several rounds between
    neighbours, each waiting for a rank to be scheduled (8 ranks on 2 cores, idle, after a
    barrier: 3.4-4.5 ms against 15-24 ms for an all_reduce of 16 values)."""
    recv = torch.empty(world * send.numel(), dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(recv, send.repeat(world), group=group, async_op=async_op)
    return recv.view(world, -1), work


def gather_by_position(own: Any, comm: Any) -> Any:
    """Every rank's ``own`` (a 1-D CPU tensor, the same size on every rank) as numpy [mesh
    position of ``comm``, n]: on gloo one round of direct sends (``exchange_with_all``), else
    ``all_gather_into_tensor`` on the mesh's device."""
    world = dist.get_world_size()
    if dist.get_backend() == "gloo":
        every, _ = exchange_with_all(own, world)
    else:
        every = own.new_empty((world, own.numel()), device=comm.device)
        dist.all_gather_into_tensor(every, own.to(comm.device))
    return every.cpu().numpy()[list(comm.ranks)]


def layer_for(template: EPLayer, tensors: tuple[Any, ...]) -> EPLayer:
    """The layer of ``tensors`` (another model's weights run by ``template``'s graph): found, or
    made with ``template``'s settings and the contiguous placement (the one its shards, if any,
    were cut for)."""
    found = find_layer(template.name, template.comm, tensors)
    if found is not None:
        return found
    world, position = template.comm.world, template.comm.position
    per = template.num_experts // world
    slot_params = tuple(sh.local for t in tensors if (sh := shard.lookup(t)) is not None and sh.local is not None)
    return register_layer(
        name=template.name, num_experts=template.num_experts, top_k=template.top_k, comm=template.comm,
        expert_pos_E=torch.arange(template.num_experts, device=template.expert_pos_E.device) // per,
        local_experts=tuple(range(position * per, (position + 1) * per)), dedup=template.dedup,
        dimension=template.dimension, cost=template.cost, tensors=tensors, swap_blocker=template.swap_blocker,
        slot_params=slot_params, swap_options=template.swap_options, tuner=DimensionTuner(template.tuner.rounds),
        domain=template.domain)


def layers() -> list[EPLayer]:
    return list(_layers)


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """Runs of throwaway layers (a compile-time measurement, ``passes.autotune``) that leave no
    trace: their traffic is not counted, the step clock the d tuner reads (``STEP_CLOCK``) does not
    advance, and the layers registered inside are dropped afterwards."""
    global STEP_CLOCK
    clock = STEP_CLOCK
    with _lock:
        counts = {k: list(v) for k, v in _counts.items()}
        registered = len(_layers)
    STEP_CLOCK = StepClock()
    try:
        yield
    finally:
        STEP_CLOCK = clock
        with _lock:
            _counts.clear()
            _counts.update(counts)
            del _layers[registered:]

"""Options of the hiermoe backend: ``torch.compile(model, backend="hiermoe", options={...})``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from moe_compile.cost.topology import Topology
from moe_compile.ep.setup import check_mesh
from moe_compile.ep.tuning import TUNE_ROUNDS
from moe_compile.swap.options import SwapOptions, parse_swap_options

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
KERNELS = ("auto", "triton", "torch")
EP_BACKWARDS = ("stages", "resend")
# the pipeline's passes, in order (moe_compile.pipeline.PASSES runs them and checks this list)
PASS_NAMES = ("inline_checkpoint", "find_moe_regions", "canonicalize", "plan", "sample_placement", "expert_parallel", "lower_kernels")


@dataclass(frozen=True)
class Options:
    """Validated backend options.

    inner_compiler: what compiles the rewritten graph: "inductor" (default), "aot_eager", "eager".
    disable_passes: names of pipeline passes to skip (``PASS_NAMES``).
    verify: check every rewrite numerically against the original layer before applying it
        (default True; a rewrite that is not verified is marked so in the report).
    dump_dir: write the report and before/after graph code of every compile here (default: the
        HIERMOE_DUMP_DIR environment variable).
    topology: a ``moe_compile.cost.Topology`` or the path of a topology TOML file; the planner
        then predicts every strategy's time for each layer on that cluster (shown by explain).
    kernels: how the expert op runs: "triton" (the fused ESMM/ESS/ESTMM kernels; on CPU through
        the Triton interpreter, TRITON_INTERPRET=1), "torch" (the torch implementation) or "auto"
        (default: Triton on CUDA, torch on CPU).
    mesh: a ``DeviceMesh`` with named dims, slowest level first (e.g. ("node", "gpu")): every MoE
        layer runs expert-parallel over it (experts split contiguously over the ranks, tokens
        data-parallel, HierMoE HD-d all-to-all), or, where every rank holds every expert whole
        and the planner predicts it faster, replicated (see 'replicated_experts'). Needs
        torch.distributed initialized.
    dimension: with a mesh, fix the all-to-all dimension d (1 = flat, 2 = node then inside the
        node, ... up to the mesh levels); default None = d* per layer and step from the
        topology's cost model (HierMoE Eq. 6 / Alg. 1).
    dedup: with a mesh, True sends each token once per destination group (HierMoE's HD-d);
        False one copy per (token, expert), the Megatron/HF flat all-to-all (dimension 1) and
        Tutel's 2DH (dimension 2); None (default) lets the planner choose per layer (with a
        topology, given or probed; without one, True).
    ep_backward: with a mesh, how an expert-parallel layer's backward gets its tokens: "stages"
        (default: the staged ops keep the dispatched rows from forward, so backward moves the
        forward's payload, no more) or "resend" (keep only the inputs and dispatch [x | grad_y]
        again in backward: 1.5x the payload, less activation memory).
    overlap: with a mesh, split every expert-parallel all-to-all stage into start and wait and run
        the graph's independent work (a shared expert, ...) between them, forward and backward
        (default True; ``passes.overlap``, ``moe_compile.ep.worker``). False runs each stage
        start to end where it stands.
    pipeline: with a mesh, run each expert-parallel layer's tokens in n chunks whose dispatch,
        expert compute and combine overlap (MoNTA; ``cost.pipeline``): "auto" (default) = n per
        layer from the cost model on the topology (1 where chunking does not pay, or with no
        topology and a fixed dimension), "tune" = n per layer measured at compile time on the
        ranks (every candidate n up to 4 and the model's, timed forward + backward on a throwaway
        copy of the layer; ``passes.autotune``: seconds of compile time per distinct layer
        shape), an int n = that many chunks, False = 1. Needs overlap.
    tune_dimension: with a mesh and d chosen per step (no fixed 'dimension'), run every d the
        model finds close to the best this many steps early in training, measuring the step's
        span over the MoE layers (first forward to last backward), and from then on decide on
        the model's t_d corrected by what was measured (``moe_compile.ep.tuning``); default 3;
        0 = the model alone (HierMoE Eq. 6).
    tune_strategy: with a mesh and a topology, time at compile time, on the ranks, every
        strategy the planner predicts within 2x of its best (one per distinct runtime: the
        token all-to-alls, the expert gathers, model-centric), forward + backward on a throwaway
        copy of each layer shape, and run the fastest (``passes.autotune``); default False (the
        planner's prediction alone). Seconds of compile time per distinct layer shape. A layer
        the planner runs replicated is not timed, nor is replicated timed against the others
        (it sends nothing and builds no runtime layer).
    expert_swap: with a mesh, True or a dict of ``SwapOptions`` settings (every,
        threshold, kind, gamma, policy): the settings ``moe_compile.expert_swapper`` uses, and
        experts kept as E modules are stacked whole so that they can be swapped (HierD-ES,
        HierMoE Section IV).
    expert_gather: with a mesh, whether the planner may move experts instead of tokens
        (``lowering.strategies.gather``: the ranks of a mesh block all-gather their experts,
        tokens cross only the levels above it; HybridEP, HEXA-MoE's data-centric mode):
        "auto" (default) = weighed against the all-to-alls per layer, False = never, a mesh
        level's name = every layer gathers inside the blocks that span that level and those
        below it (the slowest level's name: the whole mesh, no token moves; on ("node", "gpu"),
        "gpu": each node). Not with a fixed 'dimension' (that fixes a token all-to-all) nor
        with 'expert_swap' (with it, "auto" weighs the all-to-alls only).
    model_centric: with a mesh, whether a layer may run model-centric
        (``lowering.strategies.model``, HEXA-MoE's model-centric mode: the tokens of every rank
        all-gathered, each rank computing them on its columns of every expert's FFN, the partial
        outputs reduce-scattered): "auto" (default) = weighed against the other candidates per
        layer, False = never, "always" = every layer. It needs every expert whole on every rank,
        so a model sharded by ``shard_experts`` never runs it ("always" is then an error), nor
        does one compiled with 'expert_swap'.
    replicated_experts: with a mesh, whether a layer whose experts every rank holds whole (the
        model not sharded by ``moe_compile.shard_experts``, no 'expert_swap', no
        'sample_placement') may run replicated (``lowering.strategies.replicated``): every rank
        runs its own tokens through its own copy of every expert and nothing is sent, as eager
        DDP does; the expert gradients are then each rank's own tokens', summed by the
        all-reduce every replicated parameter needs (DDP's). "auto" (default) = weighed against
        the other candidates per layer (it sends nothing, so it wins unless reading every
        expert's weights costs more than the communication), False = never (every layer runs
        expert-parallel even though each rank holds every expert). Shard the experts
        (``shard_experts``) to save their memory: then the layer runs expert-parallel.
    gather_prefetch: with a mesh, how many layers ahead a layer's expert gather may start
        (``passes.overlap``): it runs during the layers before it, and the weights of this
        many further layers are in memory at once (0 = where the layer starts). "auto"
        (default): a layer that keeps its gathered weights for backward (``gather_keep_bytes``)
        at the graph's start, after the gathers before it (the forward's peak does not rise:
        those weights are held at its end anyway), one gathered again in backward 1 ahead.
    gather_keep_bytes: with a mesh, the most bytes of gathered expert weights a rank keeps from
        forward to backward (the last layers first); the other layers free theirs after their
        forward and gather them again in backward (default None: keep all; 0: keep none).
    gather_compress: with a mesh, HybridEP's SR compression of the gathered experts, LOSSY (off
        by default): a ratio r >= 1; each expert travels as the top n/r entries of its residual
        against the layer's shared expert (the mean of all experts, all-reduced in backward),
        values and int32 indices, and is rebuilt as shared + residual. A rank's own experts stay
        exact; gradients pass the compression unchanged (straight through) to their owners.
    sample_placement: with a mesh of two levels (nodes, ranks in a node), NetMoE's dynamic
        sample placement (``passes.sample_placement``; off by default): after each MoE layer
        but a graph's last, the samples may move (with every per-sample value the graph still
        reads) to ranks whose node holds the experts their tokens chose, decided per step from
        the layer's routing by NetMoE's two-stage assignment where the model says the next
        layer's all-to-alls save more than the move costs; they return home before anything
        that mixes samples (a loss) and before the graph's outputs, so results equal eager.
        Needs the same number of samples (>= 2) on every rank and a topology (given or probed).
    """

    inner_compiler: str = "inductor"
    disable_passes: tuple[str, ...] = ()
    verify: bool = True
    dump_dir: str | None = field(default_factory=lambda: os.environ.get("HIERMOE_DUMP_DIR") or None)
    topology: Topology | None = None
    kernels: str = "auto"
    mesh: Any = None
    dimension: int | None = None
    dedup: bool | None = None
    ep_backward: str = "stages"
    overlap: bool = True
    pipeline: str | int = "auto"
    tune_dimension: int = TUNE_ROUNDS
    tune_strategy: bool = False
    expert_swap: SwapOptions | None = None
    expert_gather: str | bool | int = "auto"
    gather_prefetch: int | Literal["auto"] = "auto"
    gather_keep_bytes: int | None = None
    gather_compress: float | None = None
    sample_placement: bool = False
    model_centric: str | bool = "auto"
    replicated_experts: str | bool = "auto"


def parse_options(raw: Mapping[str, object] | None) -> Options:
    """Validate user options; unknown names or bad values raise ValueError saying what to change."""
    if raw is None:
        return Options()
    if not isinstance(raw, Mapping):
        raise ValueError(f"hiermoe options must be a dict, got {type(raw).__name__}")
    valid = [f.name for f in fields(Options)]
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise ValueError(f"unknown hiermoe option(s) {unknown}; valid options are {valid}")
    kw: dict[str, object] = dict(raw)
    if "inner_compiler" in kw and kw["inner_compiler"] not in INNER_COMPILERS:
        raise ValueError(f"option 'inner_compiler' must be one of {list(INNER_COMPILERS)}, "
                         f"got {kw['inner_compiler']!r}")
    if "disable_passes" in kw:
        passes = kw["disable_passes"]
        if isinstance(passes, str) or not isinstance(passes, list | tuple | set | frozenset):
            raise ValueError(f"option 'disable_passes' must be a list of pass names from {list(PASS_NAMES)}, "
                             f"got {passes!r}")
        bad = sorted(set(passes) - set(PASS_NAMES))
        if bad:
            raise ValueError(f"option 'disable_passes' names unknown pass(es) {bad}; passes are {list(PASS_NAMES)}")
        kw["disable_passes"] = tuple(passes)
    if "verify" in kw and not isinstance(kw["verify"], bool):
        raise ValueError(f"option 'verify' must be True or False, got {kw['verify']!r}")
    if "dump_dir" in kw and kw["dump_dir"] is not None and not isinstance(kw["dump_dir"], str | os.PathLike):
        raise ValueError(f"option 'dump_dir' must be a directory path or None, got {kw['dump_dir']!r}")
    if "kernels" in kw and kw["kernels"] not in KERNELS:
        raise ValueError(f"option 'kernels' must be one of {list(KERNELS)}, got {kw['kernels']!r}")
    topo = kw.get("topology")
    if isinstance(topo, str | os.PathLike):
        if not os.path.exists(topo):
            raise ValueError(f"option 'topology': no such file {os.fspath(topo)!r}")
        kw["topology"] = Topology.load(os.fspath(topo))
    elif topo is not None and not isinstance(topo, Topology):
        raise ValueError(f"option 'topology' must be a moe_compile.cost.Topology or a TOML file path, got {topo!r}")
    dim = kw.get("dimension")
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 1):
        raise ValueError(f"option 'dimension' must be a positive int (1..number of mesh levels) or None, got {dim!r}")
    if "dedup" in kw and kw["dedup"] is not None and not isinstance(kw["dedup"], bool):
        raise ValueError(f"option 'dedup' must be True, False or None (the planner's choice), got {kw['dedup']!r}")
    if "ep_backward" in kw and kw["ep_backward"] not in EP_BACKWARDS:
        raise ValueError(f"option 'ep_backward' must be one of {list(EP_BACKWARDS)}, got {kw['ep_backward']!r}")
    if "overlap" in kw and not isinstance(kw["overlap"], bool):
        raise ValueError(f"option 'overlap' must be True or False, got {kw['overlap']!r}")
    if "pipeline" in kw:
        pipe = kw["pipeline"]
        if pipe is False:
            kw["pipeline"] = 1
        elif pipe not in ("auto", "tune") and (isinstance(pipe, bool) or not isinstance(pipe, int) or pipe < 1):
            raise ValueError(f"option 'pipeline' must be 'auto', 'tune', a chunk count n >= 1 or False, got {pipe!r}")
        if kw["pipeline"] not in ("auto", "tune", 1) and kw.get("overlap") is False:
            raise ValueError("option 'pipeline' overlaps the chunks' stages, which needs overlap=True; "
                             "leave 'overlap' out or set 'pipeline': False")
    if "tune_dimension" in kw:
        rounds = kw["tune_dimension"]
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"option 'tune_dimension' must be an int >= 0 (measurements of each close d; 0 = the "
                             f"cost model alone), got {rounds!r}")
    if "tune_strategy" in kw and not isinstance(kw["tune_strategy"], bool):
        raise ValueError(f"option 'tune_strategy' must be True or False, got {kw['tune_strategy']!r}")
    if "expert_gather" in kw:
        # a level's name, not its index: torch.compile compares option dicts with ==, and False == 0
        gather = kw["expert_gather"]
        names = tuple(getattr(kw.get("mesh"), "mesh_dim_names", None) or ())
        if gather is not False and gather != "auto":
            if not isinstance(gather, str) or (names and gather not in names):
                raise ValueError(f"option 'expert_gather' must be 'auto', False or the name of a mesh level (the "
                                 f"slowest level the gather spans: {list(names) or 'the mesh dim names'}), "
                                 f"got {gather!r}")
            if dim is not None:
                raise ValueError(f"option 'expert_gather' = {gather!r} gathers experts, option 'dimension' fixes a "
                                 "token all-to-all: give one of them")
            if names:
                kw["expert_gather"] = names.index(gather)
    if "model_centric" in kw:
        mc = kw["model_centric"]
        if mc is not False and mc not in ("auto", "always"):
            raise ValueError(f"option 'model_centric' must be 'auto', False or 'always', got {mc!r}")
        if mc == "always" and (dim is not None or kw.get("expert_gather", "auto") not in ("auto", False)):
            raise ValueError("option 'model_centric' = 'always' runs every layer model-centric; options 'dimension' "
                             "and 'expert_gather' (a level) fix another way: give one of them")
    if "replicated_experts" in kw and kw["replicated_experts"] not in ("auto", False):
        raise ValueError(f"option 'replicated_experts' must be 'auto' or False, got {kw['replicated_experts']!r}")
    if "gather_keep_bytes" in kw:
        keep = kw["gather_keep_bytes"]
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
            raise ValueError(f"option 'gather_keep_bytes' must be None (keep every layer's gathered weights) or an "
                             f"int >= 0 (bytes per rank), got {keep!r}")
    if "gather_compress" in kw:
        ratio = kw["gather_compress"]
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, int | float) or ratio < 1):
            raise ValueError(f"option 'gather_compress' must be None (off) or a compression ratio >= 1 (HybridEP's SR "
                             f"compression, lossy), got {ratio!r}")
    if "gather_prefetch" in kw:
        ahead = kw["gather_prefetch"]
        if ahead != "auto" and (isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0):
            raise ValueError(f"option 'gather_prefetch' must be 'auto' or an int >= 0 (layers ahead), got {ahead!r}")
    if "sample_placement" in kw and not isinstance(kw["sample_placement"], bool):
        raise ValueError(f"option 'sample_placement' must be True or False, got {kw['sample_placement']!r}")
    if kw.get("mesh") is None and (dim is not None or kw.get("dedup") is not None or "ep_backward" in kw
                                   or "overlap" in kw or "pipeline" in kw or "tune_dimension" in kw
                                   or "tune_strategy" in kw
                                   or "expert_gather" in kw or "gather_prefetch" in kw or "gather_keep_bytes" in kw
                                   or "gather_compress" in kw or kw.get("sample_placement")
                                   or "model_centric" in kw or "replicated_experts" in kw):
        raise ValueError("options 'dimension', 'dedup', 'ep_backward', 'overlap', 'pipeline', 'tune_dimension', "
                         "'tune_strategy', 'expert_gather', 'gather_prefetch', 'gather_keep_bytes', 'gather_compress', "
                         "'model_centric', 'replicated_experts' and 'sample_placement' set how "
                         "expert-parallel layers communicate; they need options['mesh'] (a DeviceMesh)")
    if "expert_swap" in kw:
        kw["expert_swap"] = parse_swap_options(kw["expert_swap"])
        if kw["expert_swap"] is not None and kw.get("mesh") is None:
            raise ValueError("option 'expert_swap' moves experts between the ranks of options['mesh']; give a mesh "
                             "(expert parallelism) or leave expert_swap out")
    if kw.get("expert_swap") is not None and kw.get("expert_gather", "auto") not in ("auto", False):
        raise ValueError("option 'expert_swap' moves the experts that tokens travel to, option 'expert_gather' "
                         "gathers every expert instead: give one of them")
    if kw.get("mesh") is not None:
        check_mesh(kw["mesh"], kw.get("topology"))  # type: ignore[arg-type]
    dump_dir = kw.get("dump_dir")
    if isinstance(dump_dir, os.PathLike):
        kw["dump_dir"] = os.fspath(dump_dir)
    return Options(**kw)  # type: ignore[arg-type]

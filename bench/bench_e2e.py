"""End-to-end training step on the emulated cluster: hiermoe's expert parallelism against the flat
all-to-all, Hugging Face transformers' own expert parallelism and eager DDP, side by side in one run.

    python bench/bench_e2e.py            # as root: bench/clusters/two_node.toml's cluster, calibrated at
                                         # start; writes bench/results/e2e.{md,json,png} (6-9 min, 2 cores)
    python bench/bench_e2e.py --quick    # one small configuration, 3 reps; prints only (~2 min)
    moe-cluster run --config bench/clusters/two_node.toml -- python bench/bench_e2e.py --topology c.toml
    torchrun --nproc-per-node 4 bench/bench_e2e.py --mesh node=2,gpu=2 --quick   # no root: loopback only
    python bench/bench_e2e.py --report bench/results/e2e.json   # rewrite e2e.md / e2e.png from the JSON

Started without torchrun, the script is the driver: it builds the emulated cluster of ``--cluster``
(``moe_compile.tools.cluster``: a network namespace per node, tc-shaped links) and runs itself there, one
torchrun per node. Under torchrun (``RANK`` set) it is one rank: the world is torchrun's, the mesh
``--mesh`` or else moe-cluster's ``MOE_CLUSTER_MESH``; rank 0 alone prints and writes.

Models (fp32; weights identical on every rank and variant at start; each rank its own batches, the
same for every variant at the same step):
  tiny_lm     moe_compile.samples.tiny_lm.TinyMoELM with grouped_gemm MoE layers
  hf_mixtral  transformers MixtralForCausalLM from a small random config, experts "grouped_mm"

Variants; one training step is zero_grad, forward + loss, backward, gradient averaging, AdamW step:
  hiermoe d*   torch.compile(backend="hiermoe", options={"mesh", "topology"}): the planner's choice per
               layer (HD-d with d* per layer and step, or an expert gather), the staged ops
               (backward sends the forward's payload)
  hiermoe d* resend  the same with options["ep_backward"] = "resend": the fused op, whose backward
               dispatches [x | grad_y] again (1.5x the payload; the layout before the staged ops)
  hiermoe HDd  the same with options["dimension"] = d, for every d of the mesh, slowest level first
  flat A2A     options {"dimension": 1, "dedup": False}: one copy per (token, expert), as Megatron and HF
  hiermoe a2a only   options {"expert_gather": False}: the planner's choice among the token all-to-alls
  hiermoe gatherj    options {"expert_gather": name of level j}: each mesh block at level j all-gathers
               its ranks' experts (j = 0: the whole mesh, HEXA's data-centric mode), tokens cross the levels
               above; gradients reduce-scattered to the owners; "no prefetch" with gather_prefetch 0,
               "regather" with gather_keep_bytes 0 (gathered again in backward, none kept),
               "prefetchn" with gather_prefetch n (a gather may start n layers ahead; the default "auto" starts
               every kept layer's at the step's start)
  HF EP        transformers' own, as its docs set it up: DistributedConfig(fsdp_size=G, ep_size=G,
               ep_implementation="all_to_all") applied by ``maybe_distribute_model`` (AllToAllEP for
               the experts, FSDP2 for the rest; EP needs fsdp_size * tp_size to be a multiple of ep_size)
  HF EP+DDP    transformers' ``apply_expert_parallelism`` with the model's ep plan (AllToAllEP) and no
               FSDP2: the dense gradients averaged as for every variant below
  eager DDP    the eager model with all experts on every rank, every gradient all-reduced
The hiermoe variants keep only their own experts (``moe_compile.shard_experts``, ``--no-shard`` to
keep all: then "hiermoe d*" runs what the planner picks for experts on every rank, replicated with
nothing sent in the layer, and the other variants set replicated_experts False) and compile with ``--inner-compiler`` (default aot_eager: the comparison is of the MoE
rewrite and its communication, not of Inductor's code generation for the rest).

Gradient averaging (all but HF EP, whose FSDP2 does its own): the gradients of every parameter all
ranks hold, flattened into one buffer, one all-reduce, divided by the world size; expert parameters
a rank holds alone (shard_experts' shards, transformers' DTensor shards) already sum every rank's
tokens and are only divided. Nothing overlaps with backward.

Check: every variant's first step runs on the same batch as eager DDP's; its loss must equal eager
DDP's within ``--loss-rtol`` (relative, default 1e-4) on every rank, else the run stops with the
losses. Every hiermoe variant must have rewritten every MoE layer.

Time: ``--warmup`` untimed steps per variant (the first compiles and is the check), one untimed
step for the bytes (``moe_compile.counters()``: token payload per mesh level, dispatch + combine,
forward + backward, summed over ranks) and the memory (what the rank holds between steps:
parameters and AdamW state, sharded experts at their shard; the step's peak above that:
``cluster_bench.step_peak_bytes``, every thread's allocations; the highest rank), then ``--reps``
repetitions; each times one step of every
variant, in an order rotated by one per repetition, each after a barrier; a step's time is its
slowest rank's. Reported: median, min and max; speedups are median ratios. d*: the d each layer of
``hiermoe d*`` used in each timed step (and the cost model's predicted times), against the
measured-fastest fixed d (e2e_report.py also counts this over bench/results/hier_a2a*.json).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

import moe_compile
from moe_compile.backend import collect_reports
from moe_compile.cost.topology import Topology
from moe_compile.ep import runtime
from moe_compile.tools import calibrate

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cluster_bench import step_peak_bytes  # noqa: E402

DEFAULT_CLUSTER = HERE / "clusters" / "two_node.toml"
MODELS = ("tiny_lm", "hf_mixtral")


def shown(path: str | Path) -> str:
    """``path`` as the report names it: relative to the repository root when inside it."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(HERE.parent)) if resolved.is_relative_to(HERE.parent) else str(path)


HF_KINDS = ("hf_ep", "hf_ep_ddp")  # transformers' expert parallelism: may fail, is recorded


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "hiermoe", "hf_ep", "hf_ep_ddp", "eager"
    options: tuple[tuple[str, Any], ...] = ()  # hiermoe options beyond mesh / topology / inner compiler


def variants(num_levels: int, model: str) -> list[Variant]:
    # replicated_experts False: with --no-shard every rank holds every expert and the planner would run
    # the layers replicated (nothing sent); "hiermoe d*" keeps the planner's whole choice
    no_rep = ("replicated_experts", False)
    out = [Variant("hiermoe d*", "hiermoe"), Variant("hiermoe d* resend", "hiermoe", (("ep_backward", "resend"), no_rep)),
           Variant("hiermoe d* tune", "hiermoe", (("pipeline", "tune"), no_rep))]
    out += [Variant(f"hiermoe HD{d}", "hiermoe", (("dimension", d),)) for d in range(num_levels, 0, -1)]
    out += [Variant(f"hiermoe HD{d} serial", "hiermoe", (("dimension", d), ("pipeline", False)))
            for d in range(num_levels, 0, -1)]
    out += [Variant(f"hiermoe HD{d} inline", "hiermoe", (("dimension", d), ("pipeline", False), ("overlap", False)))
            for d in range(num_levels, 0, -1)]
    out.append(Variant("flat A2A", "hiermoe", (("dimension", 1), ("dedup", False))))
    out.append(Variant("hiermoe a2a only", "hiermoe", (("expert_gather", False), no_rep)))
    out += [Variant(f"hiermoe gather{j}", "hiermoe", (("expert_gather", j),)) for j in range(num_levels)]
    out += [Variant(f"hiermoe gather{j} no prefetch", "hiermoe", (("expert_gather", j), ("gather_prefetch", 0)))
            for j in range(num_levels)]
    out += [Variant(f"hiermoe gather{j} regather", "hiermoe", (("expert_gather", j), ("gather_keep_bytes", 0)))
            for j in range(num_levels)]
    out += [Variant(f"hiermoe gather{j} prefetch{n}", "hiermoe", (("expert_gather", j), ("gather_prefetch", n)))
            for j in range(num_levels) for n in (1, 2)]
    if model == "hf_mixtral":
        out += [Variant("HF EP", "hf_ep"), Variant("HF EP+DDP", "hf_ep_ddp")]
    return out + [Variant("eager DDP", "eager")]


@dataclass
class Runner:
    """One variant, ready to step."""

    variant: Variant
    module: Callable[..., Any]
    model: nn.Module
    owned: Callable[[object], bool] = lambda p: False  # expert params this rank alone holds
    averages: bool = True  # False: the variant reduces its own gradients (FSDP2)
    opt: torch.optim.Optimizer | None = None
    ep_layers: list[int] = field(default_factory=list)  # runtime.EPLayer ids of its compiled layers
    plans: list[str] = field(default_factory=list)  # the candidate each layer runs (explain's plan)


# ---- models -------------------------------------------------------------------------------------


def build_model(kind: str, args: argparse.Namespace, top_k: int) -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    if kind == "tiny_lm":
        from moe_compile.samples.tiny_lm import TinyLMConfig, TinyMoELM

        return TinyMoELM(TinyLMConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                                      num_heads=4, num_experts=args.experts, top_k=top_k, ffn_size=args.ffn,
                                      moe_kind="grouped_gemm", max_seq_len=args.seq))
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                           num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                           num_local_experts=args.experts, num_experts_per_tok=top_k,
                           max_position_embeddings=max(args.seq, 128))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = MixtralForCausalLM(config)
    hf.set_experts_implementation("grouped_mm")
    return cast(nn.Module, hf)


def loss_of(kind: str, module: Callable[..., Any], ids_BS: Tensor) -> Tensor:
    """Mean next-token cross-entropy of a [batch, seq + 1] batch (seq tokens per sample)."""
    if kind == "tiny_lm":
        return cast(Tensor, module(ids_BS[:, :-1], ids_BS[:, 1:]))
    ids = ids_BS[:, :-1]
    return cast(Tensor, module(input_ids=ids, labels=ids).loss)  # transformers shifts the labels itself


def example_inputs(kind: str, ids_BS: Tensor) -> tuple[Tensor, ...]:
    return (ids_BS[:, :-1], ids_BS[:, 1:]) if kind == "tiny_lm" else (ids_BS[:, :-1],)


# ---- variants -----------------------------------------------------------------------------------


def prepare(v: Variant, base: nn.Module, model_kind: str, mesh: Any, topology: Topology,
            args: argparse.Namespace, first_BS: Tensor) -> Runner:
    """The variant's own copy of ``base``, distributed as the variant does it. hiermoe variants are
    only sharded here, not compiled: shard_experts resets Dynamo, which would drop earlier compiles."""
    model = copy.deepcopy(base)
    if v.kind == "hiermoe":
        owned: Callable[[object], bool] = lambda p: False  # noqa: E731
        if args.shard:
            owned = moe_compile.shard_experts(model, mesh, *example_inputs(model_kind, first_BS)).owns
        options = {"mesh": mesh, "topology": topology, "inner_compiler": args.inner_compiler, **dict(v.options)}
        if isinstance(options.get("expert_gather"), int) and options["expert_gather"] is not False:
            options["expert_gather"] = mesh.mesh_dim_names[options["expert_gather"]]  # the option takes names
        return Runner(v, torch.compile(model, backend="hiermoe", options=options), model, owned)
    if v.kind == "hf_ep":
        from transformers.distributed.configuration_utils import DistributedConfig

        world = dist.get_world_size()
        cls = type(model)
        config, _, meshes = cls.prepare_distribute_model(  # type: ignore[attr-defined]
            DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation="all_to_all"))
        model = cls.maybe_distribute_model(model, config, meshes)  # type: ignore[attr-defined]
        return Runner(v, model, model, averages=False)
    if v.kind == "hf_ep_ddp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor
        from transformers.distributed.configuration_utils import DistributedConfig
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        world = dist.get_world_size()
        ep_tp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "tp"))  # tp of 1: each rank its batch
        # the model's resolved ep plan, as maybe_distribute_model computes it (layer numbers filled in)
        _, ep_plan, _ = model._resolve_parallel_plans(  # type: ignore[operator]
            DistributedConfig(fsdp_size=world, ep_size=world))
        apply_expert_parallelism(model, ep_tp["ep"], ep_tp["tp"], ep_plan, ep_implementation="all_to_all")
        return Runner(v, model, model, owned=lambda p: isinstance(p, DTensor))
    return Runner(v, model, model)


def average_gradients(r: Runner, world: int) -> int:
    """DDP-style averaging (module docstring); returns the bytes this rank all-reduced."""
    if not r.averages:
        return 0
    shared: list[Tensor] = []
    for p in r.model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:  # experts no token of this rank reached, or another rank's
            p.grad = torch.zeros_like(p)
        if r.owned(p):  # already the sum over every rank's tokens
            p.grad.div_(world)
        else:
            shared.append(p.grad)
    if not shared:
        return 0
    flat = torch._utils._flatten_dense_tensors(shared)
    dist.all_reduce(flat)
    flat.div_(world)
    for g, avg in zip(shared, torch._utils._unflatten_dense_tensors(flat, shared)):
        g.copy_(avg)
    return flat.numel() * flat.element_size()


def held_bytes(r: Runner) -> int:
    """The bytes of the tensors the variant's rank holds between steps: its parameters (a DTensor's
    local shard; shard_experts' other ranks' experts hold no storage) and the optimizer's state."""
    tensors = [*r.model.parameters()]
    if r.opt is not None:
        tensors += [t for st in r.opt.state.values() for t in st.values() if isinstance(t, Tensor)]
    storages: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def train_step(r: Runner, model_kind: str, ids_BS: Tensor, world: int) -> tuple[float, int]:
    """(loss, gradient bytes all-reduced by this rank)."""
    assert r.opt is not None
    r.opt.zero_grad(set_to_none=True)
    loss = loss_of(model_kind, r.module, ids_BS)
    loss.backward()
    grad_bytes = average_gradients(r, world)
    r.opt.step()
    return float(loss.detach()), grad_bytes


def agree(ok: bool) -> bool:
    """True when every rank says ok (one all-reduce)."""
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def failure_text(e: BaseException) -> str:
    """The error and where it was raised: the innermost frame, and the innermost transformers frame."""
    frames = traceback.extract_tb(e.__traceback__)
    where = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} ({f.name})" for f in frames[-1:]]
    hf = [f for f in frames if "transformers" in f.filename]
    if hf and hf[-1] is not frames[-1]:
        where.append(f"{hf[-1].filename.split('site-packages/')[-1]}:{hf[-1].lineno} ({hf[-1].name})")
    return f"{type(e).__name__}: {str(e)[:500]} at " + " via ".join(where)


# ---- one configuration --------------------------------------------------------------------------


def bench_config(model_kind: str, top_k: int, args: argparse.Namespace, mesh: Any, topology: Topology
                 ) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    names = tuple(mesh.mesh_dim_names)
    torch._dynamo.reset()
    base = build_model(model_kind, args, top_k)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(4)]
    wanted = [v for v in variants(len(names), model_kind)
              if v.name in args.variants or v.kind == "eager" or not (args.variants or v.name.endswith((" serial", " inline", " tune")))]
    # eager DDP first: its first-step loss is the reference of the check
    wanted = wanted[-1:] + wanted[:-1]
    failed: dict[str, str] = {}

    # Step 1: every variant's model (sharding compiles and resets Dynamo, so all of it before any compile).
    runners: list[Runner] = []
    for v in wanted:
        try:
            r: Runner | None = prepare(v, base, model_kind, mesh, topology, args, batches[0])
            err = ""
        except Exception as e:  # noqa: BLE001 - only transformers' EP may fail here; recorded, not hidden
            if v.kind not in HF_KINDS:
                raise
            r, err = None, failure_text(e)
        if not agree(r is not None):
            failed[v.name] = err or "failed on another rank"
            continue
        assert r is not None
        r.opt = torch.optim.AdamW(r.model.parameters(), lr=args.lr, weight_decay=0.0)
        runners.append(r)

    # Step 2: the first step of each (compiles hiermoe) on the same batch: losses must agree.
    first_loss: dict[str, float] = {}
    rewritten: dict[str, int] = {}
    compile_s: dict[str, float] = {}
    for r in list(runners):
        t0 = time.perf_counter()
        try:
            with collect_reports() as graphs:
                first_loss[r.variant.name], _ = train_step(r, model_kind, batches[0], world)
            err = ""
        except Exception as e:  # noqa: BLE001 - as above
            if r.variant.kind not in HF_KINDS:
                raise
            err = failure_text(e)
        if not agree(not err):
            failed[r.variant.name] = err or "failed on another rank"
            runners.remove(r)
            continue
        compile_s[r.variant.name] = time.perf_counter() - t0
        if r.variant.kind == "hiermoe":
            regions = [reg for g in graphs for reg in g.regions]
            r.ep_layers = [reg.ep_layer for reg in regions if reg.ep_layer is not None]
            # every layer runs expert-parallel, or replicated (no runtime layer) where the planner chose so
            r.plans = [reg.plan.split()[0] for reg in regions if reg.ep_layer is not None or
                       reg.plan.startswith("replicated")]
            rewritten[r.variant.name] = len(r.plans)
            if len(r.plans) != args.layers:
                raise RuntimeError(f"{model_kind} K={top_k} {r.variant.name}: {len(r.plans)} of {args.layers} "
                                   "MoE layers run expert-parallel or replicated; see moe_compile.explain(...) for why")
    ref = first_loss["eager DDP"]
    rel = torch.tensor([abs(first_loss[r.variant.name] - ref) / abs(ref) for r in runners], dtype=torch.float64)
    dist.all_reduce(rel, op=dist.ReduceOp.MAX)
    bad = [f"{r.variant.name} (max rel err {float(e):.2e}; rank {rank}: {first_loss[r.variant.name]:.9g} vs "
           f"eager DDP {ref:.9g})" for r, e in zip(runners, rel) if float(e) > args.loss_rtol]
    if bad:
        raise RuntimeError(f"{model_kind} K={top_k}: first-step loss differs from eager DDP by more than "
                           f"{args.loss_rtol:g} (relative): " + "; ".join(bad))
    for _ in range(args.warmup - 1):
        for r in runners:
            train_step(r, model_kind, batches[1], world)

    # Step 3: bytes per mesh level of one untimed step (payload; metadata apart), summed over ranks.
    traffic = torch.zeros(len(runners), len(names) + 1, dtype=torch.int64)  # levels..., meta
    grad_bytes: list[int] = []  # all-reduced by each rank (the same on every rank)
    # what the expert-parallel layers keep from forward to backward on a rank (the dispatched rows,
    # the gathered expert weights not gathered again), the largest over the ranks
    kept = torch.zeros(len(runners), dtype=torch.int64)
    # memory per rank: held between steps, and the step's peak above what the rank held before it
    memory = torch.zeros(len(runners), 2, dtype=torch.int64)
    for i, r in enumerate(runners):
        runtime.reset_counters()
        memory[i, 0] = held_bytes(r)
        (_, grad_sent), memory[i, 1] = step_peak_bytes(functools.partial(train_step, r, model_kind, batches[2], world))
        grad_bytes.append(grad_sent)
        for j in r.ep_layers:
            lay = runtime.layer(j)
            kept[i] += lay.saved_bytes + (lay.gathered_bytes if lay.domain is not None and not lay.regathered else 0)
        c = runtime.counters()
        for lv, n in enumerate(names):
            if n in c:
                traffic[i, lv] = sum(d["payload_bytes"] for ph in c[n].values() for d in ph.values())
                traffic[i, -1] += sum(d["meta_bytes"] for ph in c[n].values() for d in ph.values())
    dist.all_reduce(traffic)
    dist.all_reduce(kept, op=dist.ReduceOp.MAX)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)

    # Step 4: interleaved timed repetitions; d* records the d of each of its layers in each step.
    times = torch.zeros(args.reps, len(runners), dtype=torch.float64)
    # per step, the seconds each variant's forward waited for its expert gathers (lowering.ep_gather)
    gather_wait = torch.zeros(args.reps, len(runners), dtype=torch.float64)
    # and per MoE layer (graph order), to tell the first layer's wait (nothing but the embedding to
    # hide behind) from the later layers'
    most_layers = max((len(r.ep_layers) for r in runners if r.variant.kind == "hiermoe"), default=0)
    gather_wait_layer = torch.zeros(args.reps, len(runners), most_layers, dtype=torch.float64)
    dstar_d: list[list[int]] = []
    dstar_pred: list[list[list[float]]] = []
    dstar_tuned: list[list[list[float]]] = []  # the model's times corrected by measurement (ep.tuning)
    dstar_offsets: list[dict[str, list[float]]] = []  # per layer, d: its measured offsets at the end
    order = list(range(len(runners)))
    for rep in range(args.reps):
        ids = batches[3 if rep % 2 else 2]
        for i in order[rep % len(order):] + order[: rep % len(order)]:
            r = runners[i]
            dist.barrier()
            t0 = time.perf_counter()
            train_step(r, model_kind, ids, world)
            times[rep, i] = time.perf_counter() - t0
            if r.variant.kind == "hiermoe":
                for li, j in enumerate(r.ep_layers):
                    if runtime.layer(j).domain is not None:
                        gather_wait_layer[rep, i, li] = runtime.layer(j).gather_exposed_s
                gather_wait[rep, i] = gather_wait_layer[rep, i].sum()
            if r.variant.name == "hiermoe d*":
                lays = [runtime.layer(j) for j in r.ep_layers]
                dstar_d.append([cast(int, lay.last_dimension) for lay in lays])
                dstar_pred.append([list(lay.last_times_s) for lay in lays])
                dstar_tuned.append([list(lay.last_tuned_s) for lay in lays])
                dstar_offsets = [{str(d): o for d, o in lay.tuner.offsets_s.items()} for lay in lays]
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(gather_wait, op=dist.ReduceOp.MAX)
    dist.all_reduce(gather_wait_layer, op=dist.ReduceOp.MAX)
    if rank != 0:
        return {}
    results = []
    for i, r in enumerate(runners):
        t = times[:, i].tolist()
        row = traffic[i].tolist()
        name = r.variant.name
        results.append({
            "variant": name, "kind": r.variant.kind, "options": dict(r.variant.options), "times_s": t,
            "median_s": statistics.median(t), "first_loss_rank0": first_loss[name],
            "first_loss_max_rel_err": float(rel[i]), "warmup_first_step_s": compile_s[name],
            "moe_layers_rewritten": rewritten.get(name),
            "payload_bytes_per_level": dict(zip(names, row[:len(names)])) if r.variant.kind == "hiermoe" else None,
            "meta_bytes": row[-1] if r.variant.kind == "hiermoe" else None,
            "grad_allreduce_bytes": grad_bytes[i] if r.averages else None,
            "gather_wait_s": gather_wait[:, i].tolist() if r.variant.kind == "hiermoe" else None,
            # [layer][rep]: each layer's wait, its slowest rank's
            "gather_wait_layer_s": (gather_wait_layer[:, i, :len(r.ep_layers)].T.tolist()
                                    if r.variant.kind == "hiermoe" else None),
            "plans": r.plans, "kept_bytes": int(kept[i]) if r.variant.kind == "hiermoe" else None,
            "held_bytes": int(memory[i, 0]), "step_peak_bytes": int(memory[i, 1]),
        })
    canonical = [v.name for v in variants(len(names), model_kind)]
    results.sort(key=lambda res: canonical.index(res["variant"]))
    return {"model": model_kind, "top_k": top_k, "results": results, "failed": failed,
            "loadavg_1m_at_end": os.getloadavg()[0],  # the machine's, our ranks included
            "dstar_d_per_step": dstar_d, "dstar_predicted_s_per_step": dstar_pred,
            "dstar_tuned_s_per_step": dstar_tuned, "dstar_offsets_s": dstar_offsets}


# ---- one rank -----------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64  # one entry per compiled variant of the same forward
    if int(os.environ["RANK"]) != 0 and os.environ.get("E2E_RANK_LOGS"):  # only rank 0 on the terminal
        fd = os.open(Path(os.environ["E2E_RANK_LOGS"], f"rank{os.environ['RANK']}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    loadavg = float(os.environ.get("E2E_LOADAVG", os.getloadavg()[0]))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", args.mesh_sizes, mesh_dim_names=args.mesh_names)
    say = print if rank == 0 else (lambda *a, **k: None)
    start = time.perf_counter()
    fit_info: list[dict[str, Any]] = []
    if args.topology_file:
        topology = Topology.load(args.topology_file)
    else:
        from bench_hier_a2a import calibrate_local

        fitted, fit_info = calibrate_local(mesh, args.mesh_names, args.mesh_sizes, quick=False)
        if fitted is None:
            raise RuntimeError("the calibration at start fitted no positive beta (too noisy); run "
                               "moe_compile.tools.calibrate on the cluster and pass its file with --topology")
        topology = fitted
        if rank == 0 and args.out is not None:  # the file to reuse with --topology, named in the report
            saved = Path(f"{args.out}_topology.toml")
            saved.parent.mkdir(parents=True, exist_ok=True)
            topology.save(saved)
            args.topology_saved = shown(saved)
    say(f"[{time.perf_counter() - start:6.1f} s] topology: " + ", ".join(
        f"{lv.name} alpha {lv.alpha_s * 1e6:.0f} us, {lv.bandwidth_gbps:.3g} Gbit/s" for lv in topology.levels),
        flush=True)
    configs = []
    for model_kind in args.models:
        for top_k in args.top_k:
            res = bench_config(model_kind, top_k, args, mesh, topology)
            gc.collect()
            if rank == 0:
                configs.append(res)
                say(f"[{time.perf_counter() - start:6.1f} s] {model_kind} K={top_k}: " + "  ".join(
                    f"{r['variant']} {r['median_s'] * 1e3:.0f} ms" for r in res["results"])
                    + "".join(f"  ({n} failed: {e})" for n, e in res["failed"].items()), flush=True)
    if rank == 0:
        from e2e_report import write_report

        payload = {"command": os.environ.get("E2E_COMMAND") or " ".join(["python bench/bench_e2e.py", *sys.argv[1:]]),
                   "machine": machine_info(loadavg), "mesh": dict(zip(args.mesh_names, args.mesh_sizes)),
                   "world": dist.get_world_size(), "cluster_file": os.environ.get("E2E_CLUSTER_FILE"),
                   "topology_file": args.topology_file, "topology_saved": getattr(args, "topology_saved", None),
                   "topology": topology.to_dict(), "calibration": fit_info,
                   "shape": {k: getattr(args, k) for k in ("hidden", "ffn", "experts", "layers", "vocab", "batch",
                                                           "seq")},
                   "tokens_per_rank": args.batch * args.seq, "reps": args.reps, "warmup": args.warmup,
                   "inner_compiler": args.inner_compiler, "shard": args.shard, "loss_rtol": args.loss_rtol,
                   "wall_s": time.perf_counter() - start, "configs": configs}
        write_report(payload, None if args.out is None else Path(args.out))
    dist.barrier()
    dist.destroy_process_group()


def machine_info(loadavg: float) -> dict[str, Any]:
    import platform

    import transformers
    from bench_hier_a2a import emulated_cluster_info
    from machine import cpu_name

    return {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "torch_threads_per_rank": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "loadavg_1m_at_start": loadavg, "date": datetime.date.today().isoformat(),
            "emulated_cluster": emulated_cluster_info()}


# ---- driver -------------------------------------------------------------------------------------


def drive(args: argparse.Namespace, argv: list[str]) -> int:
    """Build the emulated cluster and run this script on it (one torchrun per node)."""
    from moe_compile.tools import cluster

    spec = cluster.load_spec(args.cluster)
    logs = Path(tempfile.mkdtemp(prefix="e2e_ranks_"))
    env = {"E2E_LOADAVG": f"{os.getloadavg()[0]:.2f}", "E2E_RANK_LOGS": str(logs),
           "E2E_COMMAND": " ".join(["python bench/bench_e2e.py", *argv]), "E2E_CLUSTER_FILE": shown(args.cluster)}
    print(f"bench_e2e: {spec.describe()}; rank logs (ranks > 0) in {logs}", flush=True)
    try:
        code = cluster.run(spec, [sys.executable, str(Path(__file__).resolve()), *argv], timeout_s=args.timeout,
                           env=env)
    except cluster.ClusterError as e:
        print(f"bench_e2e: cannot build the emulated cluster ({e}); as root it can, or run under torchrun "
              "(see --help)", file=sys.stderr)
        return 2
    if not code:
        shutil.rmtree(logs, ignore_errors=True)
        return 0
    print(f"bench_e2e: the ranks exited with {code}" + (" (timed out)" if code == 124 else "")
          + f"; rank logs in {logs}", file=sys.stderr)
    for log in sorted(logs.glob("rank*.log")):
        print(f"--- {log.name} ---\n{log.read_text()[-3000:]}", file=sys.stderr)
    return code


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny_lm K=4 only, H=64, 2 x 32 tokens per rank, 3 reps; "
                                                        "prints only unless --out is given")
    p.add_argument("--cluster", type=Path, default=DEFAULT_CLUSTER,
                   help="driver: the cluster description to emulate (default bench/clusters/two_node.toml)")
    p.add_argument("--mesh", default=None, help="levels slowest first, NAME=SIZE,... (default: moe-cluster's "
                                               "MOE_CLUSTER_MESH)")
    p.add_argument("--topology", dest="topology_file", default=None, metavar="TOML",
                   help="topology file (moe_compile.tools.calibrate's, for this cluster) for hiermoe; default: fit "
                        "the cluster's links at start")
    p.add_argument("--models", default=None, help=f"comma-separated, from {MODELS} (default all; tiny_lm quick)")
    p.add_argument("--top-k", default=None, help="comma-separated top-k values (default 2,4; 4 quick)")
    p.add_argument("--variants", default=None,
                   help="comma-separated variant names to run (default all but the 'HD<d> serial' ones, the "
                        "unchunked layer, which run only when named; eager DDP always runs: its first-step loss is "
                        "the reference), e.g. 'hiermoe d*,hiermoe HD1,HF EP+DDP'")
    p.add_argument("--hidden", type=int, default=None, help="hidden size H (default 256; 64 quick)")
    p.add_argument("--ffn", type=int, default=None, help="expert FFN size F (default 256; 64 quick)")
    p.add_argument("--experts", type=int, default=8, help="experts E per layer (default 8)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers, each with an MoE layer (default 2)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank (default 4; 2 quick)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 128; 32 quick)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 9; 3 quick)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant before the bytes step, "
                                                         "the first of which compiles and is checked (default 2)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--loss-rtol", type=float, default=1e-4, help="first-step loss check, relative (default 1e-4)")
    p.add_argument("--inner-compiler", default="aot_eager", choices=("inductor", "aot_eager", "eager"))
    p.add_argument("--no-shard", dest="shard", action="store_false",
                   help="hiermoe variants keep every expert's weights (their gradients are then all-reduced too)")
    p.add_argument("--out", default=None, help="results path without suffix (default bench/results/e2e; with "
                                               "--quick nothing is written unless given)")
    p.add_argument("--timeout", type=float, default=1800.0, help="driver: seconds before the ranks are stopped")
    p.add_argument("--pg-timeout", type=float, default=600.0, help="process group timeout, seconds")
    p.add_argument("--report", default=None, metavar="JSON", help="only rewrite the .md and .png of an earlier "
                                                                  "run's JSON (beside it)")
    args = p.parse_args(argv)
    args.hidden = args.hidden or (64 if args.quick else 256)
    args.ffn = args.ffn or (64 if args.quick else 256)
    args.batch = args.batch or (2 if args.quick else 4)
    args.seq = args.seq or (32 if args.quick else 128)
    args.reps = args.reps or (3 if args.quick else 9)
    args.models = args.models or ("tiny_lm" if args.quick else ",".join(MODELS))
    args.top_k = args.top_k or ("4" if args.quick else "2,4")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if unknown := sorted(set(args.models) - set(MODELS)):
        p.error(f"--models: unknown {unknown}; choose from {MODELS}")
    args.top_k = [int(k) for k in str(args.top_k).split(",")]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else []
    known = {v.name for levels in range(1, 5) for v in variants(levels, "hf_mixtral")}
    if unknown_variants := sorted(set(args.variants) - known):
        p.error(f"--variants: unknown {unknown_variants}; choose from {sorted(known)}")
    if args.out is None and not args.quick:
        args.out = str(HERE / "results" / "e2e")
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the first step compiles and is the loss check)")
    if "RANK" in os.environ and not args.report:
        mesh = args.mesh or os.environ.get("MOE_CLUSTER_MESH")
        if mesh is None:
            p.error("under torchrun give --mesh NAME=SIZE,... (slowest level first) or run under moe-cluster")
        try:
            args.mesh_names, args.mesh_sizes = calibrate.parse_mesh(mesh)
            calibrate.check_world_size(args.mesh_names, args.mesh_sizes, int(os.environ["WORLD_SIZE"]))
        except ValueError as e:
            p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.report:
        from e2e_report import write_report

        write_report(json.loads(Path(args.report).read_text()), Path(args.report).with_suffix(""))
        return 0
    if "RANK" in os.environ:
        worker(args)
        return 0
    return drive(args, argv)


if __name__ == "__main__":
    sys.exit(main())

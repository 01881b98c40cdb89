"""Train the tiny MoE LM expert-parallel under torchrun.

    torchrun --nproc-per-node 4 -m moe_compile.samples.train_ep --mesh node=2,gpu=2 --dimension 2
    torchrun --nproc-per-node 8 -m moe_compile.samples.train_ep --mesh node=2,socket=2,gpu=2 \\
        --topology cluster.toml --shard

Each rank trains on its own batches (data parallel); every MoE layer runs expert-parallel over
the mesh (HierMoE HD-d all-to-all; d fixed by --dimension, or d* per step from --topology). With
--topology and without --shard every rank holds every expert, and the planner runs the layers
replicated (each rank its own tokens, nothing sent) unless --no-replicated.
Gradients are averaged over ranks as DDP would: the non-expert parameters by all-reduce, the
expert shards (``--shard``) by dividing by the world size (each owner already holds the sum).
Rank 0 prints the losses, the explain table of the first step, and its traffic per level.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import moe_compile
from moe_compile.samples.tiny_lm import TinyLMConfig, TinyMoELM


def parse_mesh(spec: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    try:
        pairs = [item.split("=") for item in spec.split(",")]
        return tuple(n for n, _ in pairs), tuple(int(s) for _, s in pairs)
    except ValueError:
        raise SystemExit(f"--mesh must look like node=2,gpu=4 (slowest level first), got {spec!r}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", required=True, help="level sizes, slowest first, e.g. node=2,gpu=4")
    ap.add_argument("--topology", help="topology TOML (moe-calibrate writes one): d* per step")
    ap.add_argument("--dimension", type=int, help="fix the all-to-all dimension instead (1..levels)")
    ap.add_argument("--no-dedup", action="store_true", help="one copy per (token, expert): the flat/2DH baselines")
    ap.add_argument("--shard", action="store_true", help="keep only this rank's experts (moe_compile.shard_experts)")
    ap.add_argument("--no-replicated", action="store_true",
                    help="run expert-parallel even where every rank holds every expert (replicated_experts False)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-kind", default="grouped_gemm", help="a sample layer from moe_compile.samples.SAMPLES")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--inner-compiler", default="aot_eager", choices=("inductor", "aot_eager", "eager"))
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    names, shape = parse_mesh(args.mesh)
    mesh = init_device_mesh(device, shape, mesh_dim_names=names)

    torch.manual_seed(0)  # the same initial weights on every rank
    config = TinyLMConfig(moe_kind=args.moe_kind, num_experts=args.experts, top_k=args.top_k)
    model = TinyMoELM(config).to(device)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data

    def batch() -> torch.Tensor:
        return torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=gen).to(device)

    report: moe_compile.ShardReport | None = None
    if args.shard:
        first = batch()
        report = moe_compile.shard_experts(model, mesh, first[:, :-1], first[:, 1:])
        if rank == 0:
            print(report)
    options: dict[str, Any] = {"mesh": mesh, "inner_compiler": args.inner_compiler, "dedup": not args.no_dedup}
    if args.topology:
        options["topology"] = args.topology
    if args.dimension:
        options["dimension"] = args.dimension
    if args.no_replicated:
        options["replicated_experts"] = False
    compiled = torch.compile(model, backend="hiermoe", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    moe_compile.reset_counters()
    for step in range(args.steps):
        ids = batch()
        if step == 0:  # every rank: the step runs collectives
            explained = moe_compile.explain(model, ids[:, :-1], ids[:, 1:], options=options)
            compiled = torch.compile(model, backend="hiermoe", options=options)
            if rank == 0:
                print(explained)
        loss = compiled(ids[:, :-1], ids[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():
            if report is not None and report.owns(p):  # the owner holds the sum over ranks
                assert p.grad is not None
                p.grad /= world
                continue
            if p.grad is None:  # experts this rank does not run
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        losses = loss.detach().reshape(1).clone()
        dist.all_reduce(losses)
        if rank == 0:
            print(f"step {step:3d}  mean loss over ranks {float(losses) / world:.4f}")
    if rank == 0:
        for level, phases in moe_compile.counters().items():
            sent = sum(d["payload_bytes"] for ph in phases.values() for d in ph.values())
            print(f"rank 0 sent over {level}: {sent / 2**20:.2f} MiB payload")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

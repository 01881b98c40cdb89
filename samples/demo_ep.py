"""The expert-parallel part of the demo: 4 local gloo ranks, ``{"mesh": mesh, "replicated_experts": False}``.

    python -m moe_compile.samples.demo_ep          (about 30 s on 2 CPU cores; no root, no network)

The ranks run on this machine (gloo over loopback, a free port), the mesh is node=2 x gpu=2. Each
rank holds the whole tiny MoE LM, so with the mesh alone the planner would run its layers
replicated (each rank its own tokens through its own experts, nothing sent); ``replicated_experts``
False makes them expert-parallel, as they are once ``moe_compile.shard_experts`` keeps only each
rank's experts. Each rank compiles it with that and the mesh: the first compile probes the links, the planner
predicts every all-to-all dimension per layer, and each step runs HierMoE's HD-d* (d chosen per
layer and step) as three graph stages. Rank 0 prints the explain report, the token payload one
training step sends per mesh level with HD-d* and with the flat all-to-all that Megatron and HF
use (one copy per (token, expert)), and the losses of a few training steps next to an eager
reference trained on the same batches (gradients averaged over ranks as DDP does).

On loopback the levels are equally fast, so the probe may well find HD1 best; on a cluster
whose inter-node link is slow (``moe-cluster``, bench/bench_e2e.py) d* moves to 2.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table
from torch.distributed.device_mesh import init_device_mesh

import moe_compile
from moe_compile.samples.tiny_lm import TinyLMConfig, TinyMoELM

WORLD = 4
MESH = (("node", "gpu"), (2, 2))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _average_grads(model: torch.nn.Module) -> None:
    """What DDP does: every gradient all-reduced and divided by the world size (experts a rank
    does not run contribute zeros)."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def _payload_per_level(model: torch.nn.Module, options: dict[str, Any], ids: torch.Tensor) -> dict[str, int]:
    """Token payload bytes one forward + backward sends per mesh level, summed over ranks."""
    compiled = torch.compile(copy.deepcopy(model), backend="hiermoe", options=options)
    moe_compile.reset_counters()
    compiled(ids[:, :-1], ids[:, 1:]).backward()
    out = {}
    for level, phases in moe_compile.counters().items():
        sent = torch.tensor([sum(d["payload_bytes"] for ph in phases.values() for d in ph.values())])
        dist.all_reduce(sent)
        out[level] = int(sent)
    return out


def _rank(rank: int, port: int, steps: int, width: int | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    console = Console(width=width)
    try:
        names, shape = MESH
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        torch.manual_seed(0)  # the same initial weights on every rank
        config = TinyLMConfig(moe_kind="grouped_gemm", num_experts=8, top_k=2)
        model = TinyMoELM(config)
        eager = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
        batches = [torch.randint(0, config.vocab_size, (4, 33), generator=gen) for _ in range(steps)]
        # every rank holds every expert: without replicated_experts False the layers run replicated
        options: dict[str, Any] = {"mesh": mesh, "inner_compiler": "aot_eager", "replicated_experts": False}

        report = moe_compile.explain(model, batches[0][:, :-1], batches[0][:, 1:], options=options)
        if rank == 0:
            print(report, flush=True)
        hd = _payload_per_level(model, {**options, "expert_gather": False}, batches[0])  # tokens, not experts
        flat = _payload_per_level(model, {**options, "dimension": 1, "dedup": False}, batches[0])
        if rank == 0:
            table = Table(title="token payload of one training step, all ranks (forward + backward)")
            for col in ("level", "HD-d* (MiB)", "flat all-to-all (MiB)", "HD-d* / flat"):
                table.add_column(col, justify="left" if col == "level" else "right")
            for level in hd:
                ratio = f"{hd[level] / flat[level]:.2f}" if flat[level] else "-"
                table.add_row(level, f"{hd[level] / 2**20:.3f}", f"{flat[level] / 2**20:.3f}", ratio)
            console.print(table)

        compiled = torch.compile(model, backend="hiermoe", options=options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.0)
        rows = []
        for ids in batches:
            losses = []
            for module, m, o in ((compiled, model, opt), (eager, eager, opt_e)):
                loss = module(ids[:, :-1], ids[:, 1:])
                o.zero_grad(set_to_none=True)
                loss.backward()
                _average_grads(m)
                o.step()
                mean = loss.detach().reshape(1).clone()
                dist.all_reduce(mean)
                losses.append(float(mean) / WORLD)
            rows.append(losses)
        if rank == 0:
            table = Table(title=f"training on {WORLD} ranks: mean loss over ranks, expert-parallel vs eager")
            for col in ("step", "hiermoe EP", "eager", "|diff|"):
                table.add_column(col, justify="right")
            for step, (lc, le) in enumerate(rows):
                table.add_row(str(step), f"{lc:.5f}", f"{le:.5f}", f"{abs(lc - le):.1e}")
            console.print(table)
    finally:
        dist.destroy_process_group()


def run(steps: int = 5, width: int | None = None) -> None:
    """Spawn the 4 ranks and wait for them (rank 0 prints)."""
    mp.start_processes(_rank, args=(_free_port(), steps, width), nprocs=WORLD, start_method="spawn")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    args = parser.parse_args(argv)
    run(args.steps, None if Console().is_terminal else 120)


if __name__ == "__main__":
    main()

"""The hiermoe demo: what the backend finds in two MoE models, that it computes what eager computes,
and that a compiled model trains like the eager one.

    python -m moe_compile.samples.demo            (about two minutes on 2 CPU cores; no downloads)

1. A Hugging Face ``MixtralForCausalLM`` built from a small random config (experts implementation
   "grouped_mm") and the tiny MoE LM of this package (per-expert loop layers): the ``explain`` report
   of each, then the largest difference between compiled and eager logits and parameter gradients.
2. The tiny LM trained a few steps eagerly and compiled with hiermoe from the same initial weights,
   the two loss columns side by side.
3. Expert parallelism (``demo_ep``): 4 local gloo ranks compile the tiny LM with ``{"mesh": mesh,
   "replicated_experts": False}`` (it is on every rank, where the planner would otherwise run it
   replicated); rank 0 prints the per-layer plan with predicted times, the token bytes per mesh
   level of HD-d* against the flat all-to-all, and a few training losses next to eager's.

The inner compiler is ``aot_eager`` to keep the demo fast; the default (Inductor) gives the same
rewritten graph, then generates kernels for it.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from typing import Any, cast

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

import moe_compile
from moe_compile.samples import demo_ep
from moe_compile.samples.tiny_lm import TinyLMConfig, TinyMoELM
from moe_compile.samples.train_tiny_lm import counting_batch, train

OPTIONS: dict[str, Any] = {"inner_compiler": "aot_eager"}

# Wide enough for the tables when stdout is a file or pipe (rich assumes 80 columns there).
console = Console(width=None if Console().is_terminal else 120)


def build_mixtral(seed: int) -> tuple[nn.Module, int]:
    """A 2-layer Mixtral from a small random config (no hub access); returns (model, vocab_size)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    model = MixtralForCausalLM(config)
    # "grouped_mm" and "batched_mm" are traced as one graph and rewritten; the "eager"
    # implementation loops over the hit experts with a data-dependent Python loop and graph-breaks.
    model.set_experts_implementation("grouped_mm")
    return model, config.vocab_size


def build_tiny_lm(seed: int) -> tuple[nn.Module, int]:
    torch.manual_seed(seed)
    config = TinyLMConfig(moe_kind="expert_loop")
    return TinyMoELM(config), config.vocab_size


def _hf_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(input_ids=ids, labels=labels)
    return out.logits, out.loss


def _lm_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(ids)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
    return logits, loss


def compare(name: str, model: nn.Module, vocab_size: int, run: Callable[..., tuple[torch.Tensor, torch.Tensor]],
            seed: int) -> dict[str, Any]:
    """explain() the model, then one forward+backward eager and compiled from identical weights."""
    gen = torch.Generator().manual_seed(seed)
    ids, labels = counting_batch(2, 32, vocab_size, gen)
    model.train()

    console.rule(f"[bold]{name}")
    report = moe_compile.explain(model, ids, options=OPTIONS)
    print(report)

    eager = copy.deepcopy(model)
    compiled_src = copy.deepcopy(model)
    compiled = cast(nn.Module, torch.compile(compiled_src, backend="hiermoe", options=OPTIONS))
    logits_e, loss_e = run(eager, ids, labels)
    loss_e.backward()
    logits_c, loss_c = run(compiled, ids, labels)
    loss_c.backward()

    grad_err = 0.0
    for (pname, p_e), p_c in zip(eager.named_parameters(), compiled_src.parameters()):
        if p_e.grad is None and p_c.grad is None:
            continue
        assert p_e.grad is not None and p_c.grad is not None, f"gradient missing on one side for {pname}"
        grad_err = max(grad_err, (p_e.grad - p_c.grad).abs().max().item())
    return {
        "model": name,
        "rewritten": len(report.regions),
        "left_alone": len(report.skipped),
        "graph_breaks": len(report.graph_breaks),
        "logits_err": (logits_e - logits_c).abs().max().item(),
        "loss_err": abs(loss_e.item() - loss_c.item()),
        "grad_err": grad_err,
    }


def side_by_side_training(steps: int, seed: int) -> tuple[list[float], list[float]]:
    model, vocab = build_tiny_lm(seed)
    eager = copy.deepcopy(model)
    compiled = cast(nn.Module, torch.compile(copy.deepcopy(model), backend="hiermoe", options=OPTIONS))
    # Same initial weights, same batches (train() seeds its own generator), same optimizer.
    losses_e = train(eager, steps, seed=seed, vocab_size=vocab)
    losses_c = train(compiled, steps, seed=seed, vocab_size=vocab)
    return losses_e, losses_c


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="training steps of the tiny LM")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-ep", action="store_true", help="skip the expert-parallel part (4 processes)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    console.print(f"moe_compile demo: torch {torch.__version__}, hiermoe options {OPTIONS}")

    rows = [
        compare("HF Mixtral (grouped_mm)", *build_mixtral(args.seed), _hf_loss, args.seed),
        compare("tiny LM (expert_loop)", *build_tiny_lm(args.seed), _lm_loss, args.seed),
    ]
    table = Table(title="compiled (hiermoe) vs eager, one forward + backward in fp32:\n"
                        "MoE layers rewritten, layers left alone, graph breaks, max abs difference")
    for col in ("model", "rewritten", "left alone", "breaks", "logits", "loss", "grads"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        table.add_row(r["model"], str(r["rewritten"]), str(r["left_alone"]), str(r["graph_breaks"]),
                      f"{r['logits_err']:.1e}", f"{r['loss_err']:.1e}", f"{r['grad_err']:.1e}")
    console.rule("[bold]summary")
    console.print(table)

    console.rule(f"[bold]training the tiny LM {args.steps} steps: eager vs hiermoe")
    losses_e, losses_c = side_by_side_training(args.steps, args.seed)
    train_table = Table(title="loss per step (AdamW lr 1e-2, counting task, same init and batches)")
    for col in ("step", "eager", "hiermoe", "|diff|"):
        train_table.add_column(col, justify="right")
    for step, (le, lc) in enumerate(zip(losses_e, losses_c)):
        train_table.add_row(str(step), f"{le:.4f}", f"{lc:.4f}", f"{abs(le - lc):.1e}")
    console.print(train_table)

    console.rule(f"[bold]expert parallelism: {demo_ep.WORLD} local gloo ranks, "
                 "options {'mesh': mesh, 'replicated_experts': False}")
    if args.no_ep:
        console.print("skipped (--no-ep)")
    else:
        demo_ep.run(steps=5, width=console.width)
    console.print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

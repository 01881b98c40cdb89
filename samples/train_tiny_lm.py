"""Train the tiny MoE LM on a synthetic, learnable task: continue a counting pattern.

Each sequence counts up modulo the vocabulary from a random start with a random stride of 1..3
(a pattern that repeats every vocab/gcd tokens). A bigram model gets the loss from log(vocab) down to
about log(3); attending to the previous token resolves the stride and takes it towards 0. Both stages
show within tens of steps, so a broken model or a broken compile is visible at once.

    python -m moe_compile.samples.train_tiny_lm --steps 50 --backend aot_eager --moe-kind grouped_gemm
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from .registry import SAMPLES
from .tiny_lm import TinyLMConfig, TinyMoELM


def counting_batch(
    batch: int, seq: int, vocab_size: int, generator: torch.Generator, max_stride: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), both [batch, seq]; labels are the inputs shifted left by one."""
    start = torch.randint(0, vocab_size, (batch, 1), generator=generator)
    stride = torch.randint(1, max_stride + 1, (batch, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab_size
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train(
    model: nn.Module,
    steps: int,
    lr: float = 1e-2,
    batch: int = 8,
    seq: int = 32,
    seed: int = 0,
    optimizer: str = "adamw",
    vocab_size: int | None = None,
    log: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``model`` (eager or compiled; ``model(input_ids, labels)`` returns the loss); return all losses.

    ``vocab_size`` defaults to ``model.config.vocab_size`` (pass it when ``model`` is a compiled wrapper
    whose config is not reachable).
    """
    if vocab_size is None:
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError("pass vocab_size: the model has no .config.vocab_size")
        vocab_size = int(config.vocab_size)
    if optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
    gen = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for step in range(steps):
        input_ids, labels = counting_batch(batch, seq, vocab_size, gen)
        loss = model(input_ids, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if log is not None:
            log(step, losses[-1])
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--backend", choices=("none", "hiermoe", "inductor", "aot_eager"), default="none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--moe-kind", choices=sorted(SAMPLES), default="expert_loop")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    config = TinyLMConfig(moe_kind=args.moe_kind, num_layers=args.layers, max_seq_len=max(64, args.seq))
    model: nn.Module = TinyMoELM(config)
    if args.backend != "none":
        # The expert loops select tokens with torch.where; without this flag Dynamo breaks the graph there.
        torch._dynamo.config.capture_dynamic_output_shape_ops = True
        model = cast(nn.Module, torch.compile(model, backend=args.backend))

    def log(step: int, loss: float) -> None:
        print(f"step {step:4d}  loss {loss:.4f}", flush=True)

    train(model, args.steps, args.lr, args.batch, args.seq, args.seed, args.optimizer, config.vocab_size, log)


if __name__ == "__main__":
    main()

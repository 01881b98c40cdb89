"""Bits shared by the sample MoE layers: activation lookup and expert-weight init.

The samples deliberately do NOT share their routing or dispatch code: each file is written the way
its source project writes it, so that the detector sees many shapes of the same computation.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS: tuple[str, ...] = ("silu", "gelu", "gelu_tanh", "relu", "relu2")


class ReLUSquared(nn.Module):
    """relu(x)^2 (Primer; transformers' ``ACT2FN["relu2"]``, NemotronH's experts)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(torch.relu(x))


def get_activation(name: str) -> nn.Module:
    """An activation module by name, like transformers' ``ACT2FN[name]``."""
    if name == "silu":
        return nn.SiLU()
    if name == "gelu":
        return nn.GELU()
    if name == "gelu_tanh":
        return nn.GELU(approximate="tanh")
    if name == "relu":
        return nn.ReLU()
    if name == "relu2":
        return ReLUSquared()
    raise ValueError(f"unknown activation {name!r}; use one of {ACTIVATIONS}")


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The functional form of an activation by name (for code that calls ``F.*`` directly)."""
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    if name == "gelu_tanh":
        return lambda t: F.gelu(t, approximate="tanh")
    if name == "relu":
        return F.relu
    if name == "relu2":
        return lambda t: torch.square(F.relu(t))
    raise ValueError(f"unknown activation {name!r}; use one of {ACTIVATIONS}")


def check_top_k(num_experts: int, top_k: int) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")


def init_stacked_(param: torch.Tensor, fan_in: int) -> None:
    """Init a stacked expert weight or bias the way ``nn.Linear`` inits one expert's weight.

    Keeps the stacked-parameter samples on the same output scale as the ModuleList samples, so one
    test tolerance (relative to the output scale) fits all of them.
    """
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        param.uniform_(-bound, bound)

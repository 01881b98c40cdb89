"""Settings of the expert swapper: ``options["expert_swap"]`` of the backend, or the keywords of
``moe_compile.expert_swapper`` (``SwapOptions``, checked by ``parse_swap_options``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

POLICIES = ("hierd", "smart")
# training steps in which a swap's predicted all-to-all saving must repay its predicted migration
# (SwapOptions.payback): what keeps the swapper under HierMoE's ~1 % of a step (Section V-E)
DEFAULT_PAYBACK = 10.0
DEFAULT_HYSTERESIS = 10
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
    overlap: hide the swapper's exchanges behind training (default False): ``step()`` posts one
        message (routing, decisions, outcome) without waiting, the next ``step()`` reads it and
        computes Q*, and the one after starts the swaps. Decisions then use the routing of two
        steps before; only a swap's two ranks move its rows inside ``step()``, the others put it
        in force at the layer's next forward (see the module docstring).
    payback: swap only when the predicted all-to-all time saved over this many training steps
        exceeds the predicted time to move the two experts (default ``DEFAULT_PAYBACK``, 10; 0
        turns the rule off and swaps on any predicted gain, as HierMoE Section IV does). Saved per
        step: ``moe_compile.swap.policy.A2A_PER_STEP`` times the drop of the plain-max t_d; moving: the alpha-beta time
        (``Level.time_s``) of the larger of the two ranks' announced ``payload_bytes`` at the
        slowest level between them. With routing that changes every step a swap's gain may not
        last, while its migration is paid at once (bench/README.md measures both). It applies to
        experts sharded by ``shard_experts`` (whole experts move no rows).
    hysteresis: a pair of experts swapped is not swapped again (back) for this many ``step()``
        calls (default ``DEFAULT_HYSTERESIS``, 10; 0 turns it off). Without it, routing that
        changes every step makes HierD-ES swap the same pair back and forth, each time paying
        the migration (``payback: 0``).
    """

    every: int = 1
    threshold: float = 0.0
    kind: str = "smooth"
    gamma: float = 10.0
    policy: str = "hierd"
    overlap: bool = False
    payback: float = DEFAULT_PAYBACK
    hysteresis: int = DEFAULT_HYSTERESIS


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
    payback = raw.get("payback", DEFAULT_PAYBACK)
    if isinstance(payback, bool) or not isinstance(payback, int | float) or not 0 <= payback < float("inf"):
        raise ValueError(f"expert_swap 'payback' must be a number of training steps >= 0 (0: off), got {payback!r}")
    hysteresis = raw.get("hysteresis", DEFAULT_HYSTERESIS)
    if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 0:
        raise ValueError(f"expert_swap 'hysteresis' must be a number of step() calls >= 0 (0: off), got {hysteresis!r}")
    return SwapOptions(every, float(threshold), str(kind), float(gamma), str(policy), overlap, float(payback),
                       hysteresis)

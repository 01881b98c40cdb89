"""Options of the hiermoe backend: ``torch.compile(model, backend="hiermoe", options={...})``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from moe_compile.cost.topology import Topology

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
KERNELS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class Options:
    """Validated backend options.

    inner_compiler: what compiles the rewritten graph: "inductor" (default), "aot_eager", "eager".
    disable_passes: names of pipeline passes to skip (see ``moe_compile.pipeline.PASS_NAMES``).
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
        data-parallel, HierMoE HD-d all-to-all). Needs torch.distributed initialized.
    dimension: with a mesh, fix the all-to-all dimension d (1 = flat, 2 = node then inside the
        node, ... up to the mesh levels); default None = d* per layer and step from the
        topology's cost model (HierMoE Eq. 6 / Alg. 1).
    dedup: with a mesh, send each token once per destination group (HierMoE, default True);
        False sends one copy per (token, expert), the Megatron/HF flat all-to-all (dimension 1)
        and Tutel's 2DH (dimension 2) baselines.
    expert_swap: with a mesh, True or a dict of ``SwapOptions`` settings (every,
        threshold, kind, gamma, policy): the settings ``moe_compile.expert_swapper`` uses, and
        experts kept as E modules are stacked whole so that they can be swapped (HierD-ES,
        HierMoE Section IV).
    """

    inner_compiler: str = "inductor"
    disable_passes: tuple[str, ...] = ()
    verify: bool = True
    dump_dir: str | None = field(default_factory=lambda: os.environ.get("HIERMOE_DUMP_DIR") or None)
    topology: Topology | None = None
    kernels: str = "auto"
    mesh: Any = None
    dimension: int | None = None
    dedup: bool = True
    expert_swap: SwapOptions | None = None


def parse_options(raw: Mapping[str, object] | None) -> Options:
    """Validate user options; unknown names or bad values raise ValueError saying what to change."""
    from moe_compile.pipeline import PASS_NAMES

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
    if "dedup" in kw and not isinstance(kw["dedup"], bool):
        raise ValueError(f"option 'dedup' must be True or False, got {kw['dedup']!r}")
    if kw.get("mesh") is None and (dim is not None or "dedup" in kw):
        raise ValueError("options 'dimension' and 'dedup' set how expert-parallel layers communicate; "
                         "they need options['mesh'] (a DeviceMesh)")
    if "expert_swap" in kw:
        kw["expert_swap"] = parse_swap_options(kw["expert_swap"])
        if kw["expert_swap"] is not None and kw.get("mesh") is None:
            raise ValueError("option 'expert_swap' moves experts between the ranks of options['mesh']; give a mesh "
                             "(expert parallelism) or leave expert_swap out")
    if kw.get("mesh") is not None:
        from moe_compile.parallel import check_mesh

        check_mesh(kw["mesh"], kw.get("topology"))  # type: ignore[arg-type]
    dump_dir = kw.get("dump_dir")
    if isinstance(dump_dir, os.PathLike):
        kw["dump_dir"] = os.fspath(dump_dir)
    return Options(**kw)  # type: ignore[arg-type]


# expert swap (moe_compile.swap) ---------------------------------------------------------------------

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
        step: ``moe_compile.swap_policy.A2A_PER_STEP`` times the drop of the plain-max t_d; moving: the alpha-beta time
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

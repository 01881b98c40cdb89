"""The transformers MoE zoo: which causal-LM families hiermoe rewrites, and why not the others.

    python -m moe_compile.zoo --out bench/results/zoo.md    # every family, both implementations
    python -m moe_compile.zoo --family gpt_oss --family phimoe

Every transformers causal-LM family whose default config has experts (``moe_families``) is built
from a small random config (``build_tiny``: hidden 32, 8 experts, top-2, vocab 64, and 2 layers
where the family's layers differ, else 1; nothing is downloaded), under each experts implementation it has (``grouped_mm`` and
``batched_mm``; the model's own code where it has no ``ExpertsInterface``), compiled with hiermoe
(aot_eager) and run forward and backward beside eager (``survey``). A row says how many MoE
layers the model has, how many hiermoe rewrote, whether compiled equals eager (the logits and
every parameter's gradient, relative error <= 1e-5 of each tensor's scale, as in the tests), and
for the layers left alone the reasons ``explain`` gives. ``tests/test_zoo.py`` checks every row.

    python -m moe_compile.zoo --autocast --out bench/results/zoo_autocast.md

runs every step under ``torch.autocast("cpu", bfloat16)``, as a mixed-precision trainer does: the
reference is then plain ``torch.compile`` with the same inner compiler under autocast (compiling
alone changes bf16 results), and a row is equal when the compiled model is nearer it than the
model in fp32 is (``gap``: the distance autocast itself makes); it also says which dtype each
rewritten layer computes in.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from moe_compile.explain import explain_run
from moe_compile.report import Report

IMPLEMENTATIONS = ("grouped_mm", "batched_mm")
OWN = "own"  # a family without transformers' ExpertsInterface runs its own experts code
RTOL = 1e-5  # as tests/compile_utils.py: rounding differences are ~1e-7, any real difference O(1)

# config fields that hold the expert count; a family has experts if its default config sets one
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

# the small config every family starts from: fields a family's config does not have are ignored
_SMALL: dict[str, Any] = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_local_experts=8,
    n_routed_experts=8, moe_num_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
    first_k_dense_replace=0, n_group=2, topk_group=1, shared_expert_intermediate_size=48, kv_lora_rank=16,
    q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, decoder_sparse_step=1,
    mlp_only_layers=[], num_shared_experts=1, n_shared_experts=1, use_cache=False, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, mlp_layer_types=["sparse", "sparse"],  # both layers MoE
)
# what a family needs besides _SMALL to build small (its own names for the same settings, a
# layer-type list to match 2 layers (cut to 1 where both are alike), sizes of its non-MoE parts)
_FAMILY: dict[str, dict[str, Any]] = {
    "aria_text": dict(moe_topk=2),
    "bailing_hybrid": dict(num_experts_per_token=2, num_expert_group=2, layer_group_size=2, linear_head_dim=8,
                           linear_num_heads=4),
    "dbrx": dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(moe_num_experts=8, moe_top_k=2, ffn_hidden_size=48)),
    "deepseek_v4": dict(mlp_layer_types=["hash_moe", "moe"]),  # one hash-routed layer, one top-k routed
    "doge": dict(is_moe=True, num_experts=16),
    "dots3_note_text": dict(use_sliding_window=False, use_dsa=False, per_layer_config={}, head_dim=16),
    "ernie4_5_moe": dict(moe_k=2, moe_layer_start_index=0),
    "gemma4_text": dict(enable_moe_block=True, top_k_experts=2, hidden_size_per_layer_input=0,
                        vocab_size_per_layer_input=64, global_head_dim=8, sliding_window=8, per_layer_config={}),
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8,
                             shared_intermediate_size=48),
    "hunyuan_v1_moe": dict(moe_topk=2),
    "jamba": dict(expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1,
                  mamba_dt_rank=4, mamba_d_state=4, use_mamba_kernels=False),
    "jetmoe": dict(kv_channels=8),
    "kimi_linear": dict(num_experts_per_token=2, linear_head_dim=8, linear_num_heads=4),
    "lfm2_moe": dict(num_dense_layers=0, layer_types=["full_attention", "conv"]),
    "longcat_flash": dict(num_layers=2, ffn_hidden_size=48, expert_ffn_hidden_size=48, moe_topk=2,
                          zero_expert_num=2),
    "zaya": dict(num_experts_per_tok=1),  # its config allows top-1 only
}


@dataclass
class ZooRow:
    """One family under one experts implementation."""

    family: str
    implementation: str  # "grouped_mm", "batched_mm", or OWN
    moe_layers: int = 0
    rewritten: int = 0
    equal: bool = False  # compiled == eager, forward and backward
    out_err: float = float("nan")
    grad_err: float = float("nan")
    reasons: list[str] = field(default_factory=list)  # why layers were left alone (distinct, as explain says)
    graph_breaks: list[str] = field(default_factory=list)
    error: str = ""  # the model could not be built or run (then nothing else is set)
    inner_compiler: str = "aot_eager"
    note: str = ""
    seconds: float = 0.0
    dtypes: list[str] = field(default_factory=list)  # what each rewritten layer computes in
    gap: float = float("nan")  # --autocast: the fp32 model's distance from the reference

    @property
    def complete(self) -> bool:
        """Every MoE layer rewritten and compiled equal to eager."""
        return not self.error and self.equal and self.moe_layers > 0 and self.rewritten == self.moe_layers


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")


def moe_families() -> list[str]:
    """transformers causal-LM model types whose default config has experts, one per model (a
    multimodal wrapper whose text config is itself listed is left out), sorted."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    _quiet()
    out = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            cfg = AutoConfig.for_model(model_type).to_dict()
        except Exception:  # noqa: BLE001 (a default config that does not validate: not buildable)
            continue
        text = cfg.get("text_config")
        if isinstance(text, dict) and text.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            continue  # the *_text family is the same model
        nested = [cfg] + [v for v in cfg.values() if isinstance(v, dict)]
        if any(f in c for c in nested for f in _EXPERT_FIELDS) or cfg.get("is_moe") \
                is not None or cfg.get("enable_moe_block") is not None:
            out.append(model_type)
    return out


_LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layers", "num_layers")


def build_tiny(family: str, implementation: str = "grouped_mm", seed: int = 0,
               layers: int | None = None) -> torch.nn.Module:
    """A small random ``family`` causal LM with ``implementation`` experts (OWN: leave the default).

    ``layers`` None: 2 where the family's two layers differ (a hybrid of attention and Mamba or
    linear attention, sliding and full attention, dense and MoE blocks, hash- and top-k-routed
    layers), else 1, since a second layer alike the first only repeats its trace (Dynamo's
    tracing is most of a family's time in the zoo test)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _quiet()
    fields = set(AutoConfig.for_model(family).to_dict())
    kwargs = {k: v for k, v in _SMALL.items() if k in fields}
    if "kv_lora_rank" in fields:  # multi-head latent attention: one kv head per query head
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    kwargs.update(_FAMILY.get(family, {}))
    cfg = AutoConfig.for_model(family, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    if layers is None and _layers_alike(model, cfg.to_dict(), 2):
        layers = 1
    if layers not in (None, 2):
        for name in _LAYER_COUNT_FIELDS:
            if name in kwargs or name in fields:
                kwargs[name] = layers
        # per-layer lists given for 2 layers (``mlp_layer_types``): their first ``layers`` entries
        kwargs = {k: v[:layers] if isinstance(v, list) and len(v) == 2 else v for k, v in kwargs.items()}
        cfg = AutoConfig.for_model(family, **kwargs)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    if implementation != OWN:
        model.set_experts_implementation(implementation)
    return model


def _layers_alike(model: torch.nn.Module, config: dict[str, Any], n: int) -> bool:
    """Whether the ``n`` layers of ``model`` are alike: every ``ModuleList`` of ``n`` entries
    (the decoder layers) holds modules printing alike (their classes, sizes, and submodules),
    and no config list of ``n`` entries (``layer_types``: a per-layer setting that can live in
    a plain attribute, such as sliding vs full attention) holds two different values."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    if not lists or any(len({repr(layer) for layer in ml}) > 1 for ml in lists):
        return False
    nested = [config] + [v for v in config.values() if isinstance(v, dict)]
    return not any(isinstance(v, list) and len(v) == n and len({repr(e) for e in v}) > 1
                   for c in nested for v in c.values())


def implementations(family: str) -> tuple[str, ...]:
    """The experts implementations a family's model takes: both stock ones, or OWN."""
    model = build_tiny(family, OWN)
    return IMPLEMENTATIONS if any(hasattr(m, "_is_expert_parallel") for m in model.modules()) else (OWN,)


def count_moe_layers(model: torch.nn.Module) -> int:
    """MoE layers of a model: transformers experts modules (``use_experts_implementation``), or
    for a family without them, the modules holding a ``*Experts`` module, or ``*MoE`` modules."""
    interface = [m for m in model.modules() if hasattr(m, "_is_expert_parallel")]
    if interface:
        return len(interface)
    holders = {name.rsplit(".", 1)[0] for name, m in model.named_modules()
               if type(m).__name__.endswith("Experts") and "shared" not in name}
    if holders:
        return len(holders)
    return sum(1 for m in model.modules() if re.search(r"Mo[Ee]$", type(m).__name__))


def input_ids(seed: int = 0, batch: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, _SMALL["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max(1, max |b|) (tests/compile_utils.py)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1.0)).item()


def _step(model: Any, ids: torch.Tensor, params: list[torch.nn.Parameter]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(1)  # the same random draws (sampled routing, dropout) in the compiled and the eager step
    logits = model(ids).logits
    cot = torch.randn(logits.shape, generator=torch.Generator().manual_seed(123), dtype=logits.dtype)
    grads = torch.autograd.grad(logits, params, cot, allow_unused=True, materialize_grads=True)
    return logits.detach(), list(grads)


def _aot_eager_error(model: torch.nn.Module, ids: torch.Tensor, params: list[torch.nn.Parameter]) -> str | None:
    """Why ``torch.compile(model, backend="aot_eager")`` itself fails a step, or None."""
    torch._dynamo.reset()
    try:
        _step(torch.compile(model, backend="aot_eager"), ids, params)
    except Exception as e:  # noqa: BLE001 (the reason is reported)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    return None


def survey(family: str, implementation: str, inner_compiler: str = "aot_eager", autocast: bool = False) -> ZooRow:
    """Build ``family`` small, compile it with hiermoe (``inner_compiler``), compare with eager.
    Where the model's step fails under plain ``aot_eager`` too (a torch issue, not hiermoe's),
    hiermoe runs with the ``eager`` inner compiler instead and the row says so. ``autocast``: every
    step under bf16 autocast against plain ``torch.compile`` under it (see the module docstring)."""
    row = ZooRow(family, implementation, inner_compiler=inner_compiler)
    start = time.perf_counter()
    try:
        model = build_tiny(family, implementation)
        row.moe_layers = count_moe_layers(model)
        ids = input_ids()
        params = [p for p in model.parameters() if p.requires_grad]
        fp32 = _step(model, ids, params) if autocast else None
        got: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

        def run(compiled: Any) -> None:
            got.append(_step(compiled, ids, params))

        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            try:
                report = explain_run(model, run, {"inner_compiler": inner_compiler})
            except Exception:
                if inner_compiler != "aot_eager":
                    raise
                why = _aot_eager_error(model, ids, params)
                if why is None:
                    raise
                row.inner_compiler, row.note = "eager", f"plain aot_eager fails too ({why})"
                got.clear()
                report = explain_run(model, run, {"inner_compiler": "eager"})
            if autocast:  # compiling alone changes bf16 results: the reference is plain torch.compile
                torch._dynamo.reset()
                want = _step(torch.compile(model, backend=row.inner_compiler), ids, params)
            else:
                want = _step(model, ids, params)
    except Exception as e:  # noqa: BLE001 (the row records it)
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        row.seconds = time.perf_counter() - start
        return row

    def dist(a: tuple[torch.Tensor, list[torch.Tensor]]) -> tuple[float, float]:
        return _rel_err(a[0], want[0]), max((_rel_err(x, y) for x, y in zip(a[1], want[1], strict=True)), default=0.0)

    row.out_err, row.grad_err = dist(got[0])
    bound = RTOL
    if fp32 is not None:  # autocast: within the fp32 model's own distance from the reference
        row.gap = max(dist(fp32))
        bound = max(row.gap, RTOL)
    row.equal = row.out_err <= bound and row.grad_err <= bound
    row.rewritten = len(report.regions)
    row.reasons = reasons(report) if row.rewritten < row.moe_layers else []
    row.graph_breaks = report.graph_breaks
    row.dtypes = [r.dtype for r in report.regions]
    row.seconds = time.perf_counter() - start
    return row


def reasons(report: Report) -> list[str]:
    """The distinct reasons layers were left alone: those of layers whose router was found, or
    where none was, what the graphs without one say, and the graph breaks."""
    layer = [s.reason for s in report.skipped if not re.fullmatch(r"graph \d+|<model>", s.name)]
    if layer:
        return list(dict.fromkeys(layer))
    graphs = list(dict.fromkeys(s.reason for s in report.skipped))
    return graphs + [f"graph break: {b}" for b in report.graph_breaks]


def markdown(rows: Sequence[ZooRow], command: str, autocast: bool = False) -> str:
    """The zoo table: one line per family, a column per implementation."""
    families = list(dict.fromkeys(r.family for r in rows))
    by = {(r.family, r.implementation): r for r in rows}
    impls = [i for i in (*IMPLEMENTATIONS, OWN) if any(r.implementation == i for r in rows)]
    complete = {i: sum(1 for r in rows if r.implementation == i and r.complete) for i in impls}
    total = {i: sum(1 for r in rows if r.implementation == i) for i in impls}
    what = ("run forward and backward beside eager. A cell: MoE layers rewritten / MoE layers, and whether the "
            f"compiled model equals eager (logits and every parameter gradient within {RTOL:g} of scale).")
    if autocast:
        what = ("run forward and backward under torch.autocast('cpu', bfloat16) beside plain torch.compile (the same "
                "inner compiler) under it. A cell: MoE layers rewritten / MoE layers, the dtype they compute in, the "
                "largest relative difference of the logits and every parameter gradient from plain torch.compile's, "
                "and whether that is within the model's own fp32-vs-autocast gap (the same distance for the fp32 "
                "model, shown in brackets).")
    lines = [
        "# transformers MoE zoo under hiermoe" + (" and bf16 autocast" if autocast else ""),
        "",
        f"Made by `{command}` (transformers {_version()}, torch {torch.__version__}).",
        "Each family built small (hidden 32, 8 experts, top-2; 2 layers where its layers differ, else 1), "
        f"compiled with hiermoe (aot_eager) and {what} `own`: the family has "
        "no transformers ExpertsInterface and runs its own experts code.",
        "",
        "Families with every MoE layer rewritten and equal: " + ", ".join(
            f"{complete[i]} of {total[i]} ({i})" for i in impls) + ".",
        "",
        "| family | " + " | ".join(impls) + " | reason (when a layer is left alone) |",
        "|---|" + "---|" * len(impls) + "---|",
    ]
    for fam in families:
        cells, why = [], []
        for i in impls:
            r = by.get((fam, i))
            if r is None:
                cells.append("")
            elif r.error:
                cells.append("error")
                why.append(f"{i}: {r.error}")
            else:
                mark = "*" if r.note else ""
                verdict = "equal" if r.equal else "DIFFERS"
                if autocast:
                    dt = "/".join(sorted(set(r.dtypes))).replace("bfloat16", "bf16").replace("float32", "fp32")
                    verdict = (f"{dt + ' ' if dt else ''}{max(r.out_err, r.grad_err):.1e} "
                               f"[{r.gap:.1e}] {'within' if r.equal else 'BEYOND'}")
                cells.append(f"{r.rewritten}/{r.moe_layers} {verdict}{mark}")
                why.extend(x for x in r.reasons if x not in why)
        lines.append(f"| {fam} | " + " | ".join(cells) + " | " + "<br>".join(_cell(w) for w in why[:3]) + " |")
    notes = sorted({f"{r.family} ({r.implementation}): {r.note}" for r in rows if r.note})
    if notes:
        lines += ["", "\\* compiled with the `eager` inner compiler: the model's step fails under `aot_eager` without "
                  "hiermoe too, a torch issue:", ""] + [f"- {_cell(n)}" for n in notes]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:800]


def _version() -> str:
    import transformers

    return str(transformers.__version__)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_compile.zoo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", action="append", help="only these model types (default: every MoE family)")
    ap.add_argument("--out", type=Path, help="write the markdown table here (and the rows as JSON beside it)")
    ap.add_argument("--autocast", action="store_true",
                    help="every step under torch.autocast('cpu', bfloat16), against plain torch.compile under it")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the models are tiny, more threads only synchronize)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    families = args.family or moe_families()
    rows = []
    for fam in families:
        try:
            impls = implementations(fam)
        except Exception as e:  # noqa: BLE001
            rows.append(ZooRow(fam, IMPLEMENTATIONS[0], error=f"{type(e).__name__}: {e}"[:300]))
            continue
        for impl in impls:
            row = survey(fam, impl, autocast=args.autocast)
            rows.append(row)
            status = row.error or f"{row.rewritten}/{row.moe_layers} {'equal' if row.equal else 'DIFFERS'}"
            print(f"{fam:24s} {impl:11s} {status}  ({row.seconds:.1f} s)", file=sys.stderr, flush=True)
    command = "python -m moe_compile.zoo" + "".join(f" --family {f}" for f in args.family or ()) + (
        f" --out {args.out}" if args.out else "") + (f" --threads {args.threads}" if args.threads != 1 else "") + (
        " --autocast" if args.autocast else "")
    text = markdown(rows, command, args.autocast)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

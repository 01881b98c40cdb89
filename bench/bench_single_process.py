"""Single-process forward+backward time and peak memory: hiermoe-compiled models vs eager, side by side.

    python bench/bench_single_process.py --threads 1  # full run, writes bench/results/single_process.{md,json}
    python bench/bench_single_process.py --quick      # small shapes, a few minutes (compiling), prints only

Cases (fp32 unless --dtype bfloat16, one training step = forward + loss + backward, no optimizer):
  every sample of moe_compile.samples' registry (grouped_gemm, expert_loop, dense_masked, gpt_oss,
                ...: one MoE layer each, input [B, S, H], a fixed random upstream gradient)
  hf_mixtral    transformers MixtralForCausalLM from a small random config, experts "grouped_mm"
  hf_qwen3_moe  transformers Qwen3MoeForCausalLM, the same way
  hf_olmoe      transformers OlmoeForCausalLM, the same way
  hf_llama4     transformers Llama4ForCausalLM (text), its own experts code: every expert on every
                token, the routing weights scaling the input (opt-in: --cases hf_llama4)

Variants: eager; hiermoe with inner compiler inductor; hiermoe with inner compiler aot_eager; and
plain torch.compile (inductor, no MoE rewrite) as a reference for what the rewrite itself adds.

Method: every variant gets its own deep copy of one model (identical weights) and sees the same
inputs. After warm-up (which includes compilation), each repetition times one step of every variant,
in a rotating order, so that drift of the machine hits all variants alike. Reported: median, min and
max over repetitions, and the ratio median(variant) / median(eager). Peak memory is measured in one
extra, untimed step per variant: on CUDA, torch.cuda.max_memory_allocated above the bytes allocated
before the step; on CPU, the peak of the running sum of the CPU allocator's allocation and free
events recorded by torch.profiler(profile_memory=True), i.e. the largest number of tensor bytes
allocated during the step that were live at one time (parameters and inputs excluded, gradients and
saved activations included).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch._dynamo
from machine import cpu_name
from rich.console import Console
from rich.table import Table
from torch import nn

import moe_compile
from moe_compile.backend import collect_reports
from moe_compile.samples import SAMPLES

VARIANTS = ("eager", "hiermoe+inductor", "hiermoe+aot_eager", "inductor")
HF = ("hf_mixtral", "hf_qwen3_moe", "hf_olmoe")
OPT_IN = ("hf_llama4",)  # not in the default run (bench/results/single_process.md)
CASES = (*SAMPLES, *HF, *OPT_IN)  # every sample, then the transformers models
# Wide enough for the results table when stdout is a file or pipe (rich assumes 80 columns there).
console = Console(width=None if Console().is_terminal else 170)


@dataclass
class Shape:
    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int
    seq: int
    dtype: str = "float32"  # of the parameters and activations (bfloat16: the GPU training setting)

    @property
    def batch(self) -> int:
        return max(1, self.tokens // self.seq)


@dataclass
class Result:
    case: str
    variant: str
    times_s: list[float] = field(default_factory=list)
    compile_s: float = float("nan")
    peak_bytes: int | None = None
    # the share of the profiled step (the peak's, CPU) spent in matmul kernels (MATMUL_OPS' self time)
    matmul_share: float | None = None
    rewritten: int | None = None  # MoE layers hiermoe rewrote (None: not a hiermoe variant)
    left_alone: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s) if self.times_s else float("nan")


# ---- models and one training step per case ---------------------------------------------------


# (config, model) class names in transformers
_HF_CASES = {"hf_mixtral": ("MixtralConfig", "MixtralForCausalLM"),
             "hf_qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
             "hf_olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
             "hf_llama4": ("Llama4TextConfig", "Llama4ForCausalLM")}


# --checkpointing selective: the outputs of these ops are saved for backward, everything else in a
# decoder layer recomputed (torchtitan's op-level selective checkpointing saves matmuls and
# attention the same way); the expert matmuls as each variant runs them
SAVED_OPS = frozenset({
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten._grouped_mm.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default", "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default", "transformers.grouped_mm_fallback.default",
    "hiermoe.grouped_mm.default", "hiermoe.grouped_mm_rows.default", "hiermoe.grouped_linear.default",
    "hiermoe.grouped_linear_gate_up.default",
})
CHECKPOINTING = ("full", "selective")


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if str(op) in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def build_case(case: str, shape: Shape, device: torch.device, checkpointing: str | None = None
               ) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """(model, step): ``step(m)`` runs forward and returns the scalar loss to backpropagate.
    ``checkpointing``: the transformers models with activation checkpointing on, transformers'
    ``activation_checkpointing_enable()``: "full" recomputes each decoder layer in backward,
    "selective" saves its matmuls' and attention's outputs (``SAVED_OPS``) and recomputes the rest."""
    torch.manual_seed(0)
    dtype = getattr(torch, shape.dtype)
    if case in SAMPLES:
        model = SAMPLES[case].make(hidden_size=shape.hidden, ffn_size=shape.ffn, num_experts=shape.experts,
                                   top_k=shape.top_k).to(device=device, dtype=dtype)
        x = torch.randn(shape.batch, shape.seq, shape.hidden, device=device, dtype=dtype, requires_grad=True)
        # A fixed random upstream gradient, as if the layer sat inside a model.
        grad_out = torch.randn(shape.batch, shape.seq, shape.hidden, device=device, dtype=dtype)

        def layer_step(m: nn.Module) -> torch.Tensor:
            x.grad = None
            return (m(x) * grad_out).sum()

        return model, layer_step
    if case in _HF_CASES:
        import transformers

        config_cls, model_cls = (getattr(transformers, n) for n in _HF_CASES[case])
        # every family's MoE fields: the experts' ffn is moe_intermediate_size where the config has one
        config = config_cls(
            vocab_size=1024, hidden_size=shape.hidden, intermediate_size=shape.ffn, moe_intermediate_size=shape.ffn,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_local_experts=shape.experts,
            num_experts=shape.experts, num_experts_per_tok=shape.top_k, max_position_embeddings=max(shape.seq, 128),
            intermediate_size_mlp=shape.ffn,  # Llama-4's shared expert
        )
        hf = model_cls(config)
        if case != "hf_llama4":  # Llama-4 has no ExpertsInterface
            hf.set_experts_implementation("grouped_mm")
        if checkpointing is not None:
            hf.train()
            kwargs: dict[str, Any] = {}
            if checkpointing == "selective":
                from torch.utils.checkpoint import create_selective_checkpoint_contexts

                kwargs = {"use_reentrant": False,
                          "context_fn": functools.partial(create_selective_checkpoint_contexts, _save_matmuls)}
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
        cast(nn.Module, hf).to(device=device, dtype=dtype)  # transformers' typed wrapper of .to confuses mypy
        ids = torch.randint(0, config.vocab_size, (shape.batch, shape.seq), device=device)

        def lm_step(m: nn.Module) -> torch.Tensor:
            return m(input_ids=ids, labels=ids).loss

        return hf, lm_step
    raise ValueError(f"unknown case {case!r}; use one of {CASES}")


def make_variant(model: nn.Module, variant: str) -> nn.Module:
    model = copy.deepcopy(model)
    if variant == "eager":
        return model
    if variant == "inductor":
        return cast(nn.Module, torch.compile(model))
    inner = variant.split("+", 1)[1]
    return cast(nn.Module, torch.compile(model, backend="hiermoe", options={"inner_compiler": inner}))


# ---- measurement -------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_step(model: nn.Module, step: Callable[[nn.Module], torch.Tensor]) -> None:
    for p in model.parameters():
        p.grad = None
    step(model).backward()


def timed_step(model: nn.Module, step: Callable[[nn.Module], torch.Tensor], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    run_step(model, step)
    sync(device)
    return time.perf_counter() - start


# matmul kernels: their self time is the step's matmul time (aten::matmul, linear etc. call them)
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::addbmm",
                        "aten::_grouped_mm"})


def profile_step(model: nn.Module, step: Callable[[nn.Module], torch.Tensor], device: torch.device
                 ) -> tuple[int, float | None]:
    """(peak bytes allocated during one step above what was allocated before it (see module
    docstring), the share of that step's wall time spent in matmul kernels: on CPU, the self time
    of ``MATMUL_OPS`` over the profiled step's duration; None on CUDA)."""
    for p in model.parameters():
        p.grad = None
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_step(model, step)
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base, None
    from torch._C._autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        start = time.perf_counter()
        step(model).backward()
        wall_us = (time.perf_counter() - start) * 1e6
    matmul_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMUL_OPS)
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, matmul_us / wall_us


def bench_case(case: str, shape: Shape, variants: list[str], reps: int, warmup: int,
               device: torch.device, checkpointing: str | None = None) -> list[Result]:
    torch._dynamo.reset()
    base, step = build_case(case, shape, device, checkpointing)
    results = {v: Result(case, v) for v in variants}
    models: dict[str, nn.Module] = {}
    for v in variants:
        res = results[v]
        try:
            with collect_reports() as graphs:
                models[v] = make_variant(base, v)
                start = time.perf_counter()
                for _ in range(warmup):
                    run_step(models[v], step)
                sync(device)
                res.compile_s = time.perf_counter() - start  # warm-up incl. compilation
            if v.startswith("hiermoe"):
                res.rewritten = sum(len(g.regions) for g in graphs)
                res.left_alone = [f"{s.name}: {s.reason}" for g in graphs for s in g.skipped
                                  if not s.reason.startswith("no MoE layer found")]
        except Exception as exc:  # a variant that cannot compile is reported, not fatal to the others
            res.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
            models.pop(v, None)
            console.print(f"[red]{case} / {v} failed: {res.error}")
        console.print(f"  {case:12s} {v:18s} warm-up {res.compile_s:6.1f} s"
                      + (f", {res.rewritten} MoE layer(s) rewritten" if res.rewritten is not None else ""))
    live = [v for v in variants if v in models]
    for rep in range(reps):
        order = live[rep % len(live):] + live[: rep % len(live)] if live else []
        for v in order:
            results[v].times_s.append(timed_step(models[v], step, device))
    for v in live:
        results[v].peak_bytes, results[v].matmul_share = profile_step(models[v], step, device)
    return [results[v] for v in variants]


# ---- output ------------------------------------------------------------------------------------


def machine_info(device: torch.device) -> dict[str, Any]:
    cpu = cpu_name()
    info: dict[str, Any] = {
        "cpu": cpu, "cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "platform": platform.platform(), "device": str(device),
        # Other processes on the machine disturb CPU timings; the load before the run says how busy it was.
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def rows(results: list[Result]) -> list[list[str]]:
    out = []
    eager = {r.case: r for r in results if r.variant == "eager"}
    inductor = {r.case: r for r in results if r.variant == "inductor" and not r.error}
    for r in results:
        e = eager.get(r.case)
        if r.error:
            out.append([r.case, r.variant, "failed", "", "", "", "", "", "", "", "", "", "", "", r.error])
            continue
        # hiermoe with Inductor inside against Inductor alone: what a user adding the backend sees
        i = inductor.get(r.case) if r.variant == "hiermoe+inductor" else None
        vs_inductor = ["-", "-", "-"] if i is None else [
            f"{r.median_s / i.median_s:.2f}",
            # the ratio with everything but hiermoe's matmuls taking no time: below it, no rewrite that
            # runs the same matmuls can go
            f"{r.matmul_share * r.median_s / i.median_s:.2f}" if r.matmul_share is not None else "-",
            f"{r.peak_bytes / i.peak_bytes:.2f}" if i.peak_bytes and r.peak_bytes is not None else "-"]
        ratio = f"{r.median_s / e.median_s:.2f}" if e and e.times_s else "-"
        ratio_min = f"{min(r.times_s) / min(e.times_s):.2f}" if e and e.times_s else "-"
        mem_ratio = (f"{r.peak_bytes / e.peak_bytes:.2f}" if e and e.peak_bytes and r.peak_bytes is not None
                     else "-")
        note = "" if r.rewritten is None else f"{r.rewritten} rewritten"
        if r.left_alone:
            note += f"; left alone: {'; '.join(r.left_alone)}"
        out.append([r.case, r.variant, _ms(r.median_s), f"{_ms(min(r.times_s))} / {_ms(max(r.times_s))}",
                    ratio, ratio_min, _mib(r.peak_bytes), mem_ratio,
                    "-" if r.matmul_share is None else f"{100 * r.matmul_share:.0f} %", *vs_inductor,
                    f"{r.compile_s:.1f}",
                    str(len(r.times_s)), note])
    return out


HEADERS = ["case", "variant", "median ms", "min / max ms", "time vs eager", "(mins)", "peak MiB", "mem vs eager",
           "matmul share", "time vs inductor", "matmuls alone vs inductor", "mem vs inductor", "warm-up s", "reps",
           "MoE layers"]


def write_results(out_dir: Path, results: list[Result], info: dict[str, Any], shape: Shape,
                  command: str, name: str = "single_process", checkpointing: str | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"command": command, "machine": info, "shape": asdict(shape), "checkpointing": checkpointing,
               "results": [{**asdict(r), "median_s": r.median_s} for r in results]}
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [
        "# Single-process benchmark: hiermoe vs eager (forward + backward)",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {info['cpu']}; {info['cpu_count']} CPUs ({info['affinity']} usable, "
        f"{info['torch_threads']} torch threads; 1-min load average {info['loadavg_1m_at_start']} at start); "
        f"device {info['device']}"
        + (f" ({info['gpu']})" if "gpu" in info else "")
        + f"; torch {info['torch']}; transformers {info.get('transformers', '-')}; Python {info['python']}",
        "",
        f"Shape: {shape.tokens} tokens (batch {shape.batch} x seq {shape.seq}), hidden {shape.hidden}, "
        f"ffn {shape.ffn}, {shape.experts} experts, top-{shape.top_k}, {shape.dtype}. hf_mixtral, hf_qwen3_moe and hf_olmoe "
        "are 2-layer MixtralForCausalLM, Qwen3MoeForCausalLM and OlmoeForCausalLM (vocab 1024, 4 heads) with "
        "experts implementation grouped_mm"
        + ("; hf_llama4 is a 2-layer Llama4ForCausalLM the same way, with its own experts code." if any(
            r.case == "hf_llama4" for r in results) else ".")
        + (" Activation checkpointing on (transformers' `activation_checkpointing_enable()`: every decoder "
           "layer recomputed in backward)." if checkpointing == "full" else "")
        + (" Selective activation checkpointing (`activation_checkpointing_enable()` with a `context_fn`): "
           "the outputs of each decoder layer's matmuls and attention saved for backward (the expert matmuls "
           "as each variant runs them: " + ", ".join(f"`{o}`" for o in sorted(SAVED_OPS)) + "), the rest "
           "recomputed." if checkpointing == "selective" else ""),
        "",
        "Time: one training step (forward, loss, backward); median and min/max over the repetitions, "
        "variants interleaved. Peak: tensor bytes live at once during one step above those before it "
        "(see bench/README.md for how). Ratios are variant / eager (below 1 is better): "
        "\"time vs eager\" of the medians, \"(mins)\" of the fastest repetitions; \"vs inductor\": "
        "hiermoe+inductor against backend=\"inductor\" (median time, peak). "
        "Matmul share: of the profiled step (the peak's, CPU), the time in matmul kernels (self time of "
        + ", ".join(f"`{o}`" for o in sorted(MATMUL_OPS)) + "). \"Matmuls alone vs inductor\": hiermoe's "
        "matmul time (its share of its median) over inductor's median, the ratio it would have if everything "
        "but its matmuls took no time; where both run the same matmuls, no rewrite goes below it. "
        "Warm-up includes compilation.",
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "|".join("---" for _ in HEADERS) + "|",
    ]
    for row in rows(results):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per variant (default 11; 3 quick)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (incl. compile)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per step (default 2048; 256 quick)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default 256; 64 quick)")
    parser.add_argument("--ffn", type=int, default=None, help="expert ffn size (default 512; 128 quick)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 512; 64 quick)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=[c for c in CASES if c not in OPT_IN])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's default, one per usable core)")
    parser.add_argument("--quick", action="store_true", help="small shapes and few reps: a smoke test")
    parser.add_argument("--checkpointing", nargs="?", const="full", choices=CHECKPOINTING, default=None,
                        help="the transformers models with activation checkpointing (activation_checkpointing_enable): "
                             "full (the default when given bare: each decoder layer recomputed) or selective (its "
                             "matmuls' and attention's outputs saved, the rest recomputed)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results directory (default bench/results; with --quick nothing is written "
                             "unless --out is given)")
    parser.add_argument("--name", default="single_process", help="results file stem (<out>/<name>.md and .json)")
    args = parser.parse_args(argv)

    quick = args.quick
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    shape = Shape(tokens=args.tokens or (256 if quick else 2048), hidden=args.hidden or (64 if quick else 256),
                  ffn=args.ffn or (128 if quick else 512), experts=args.experts, top_k=args.top_k,
                  seq=args.seq or (64 if quick else 512), dtype=args.dtype)
    if shape.tokens % shape.seq:
        raise ValueError(f"--tokens {shape.tokens} must be a multiple of --seq {shape.seq}")
    reps = args.reps or (3 if quick else 11)
    variants = ["eager"] + [v for v in args.variants if v != "eager"]  # ratios need eager
    device = torch.device(args.device)
    out_dir = args.out if args.out is not None else (None if quick else Path(__file__).parent / "results")
    # Several compiled copies of one module class, each a separate Dynamo cache entry.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    assert moe_compile.hiermoe_backend is not None  # importing moe_compile registered the backend

    info = machine_info(device)
    command = "python bench/bench_single_process.py " + " ".join(sys.argv[1:] if argv is None else argv)
    console.print(f"{info['cpu']}, {info['torch_threads']} threads, torch {info['torch']}, device {device}; "
                  f"{shape}; reps {reps}")
    results: list[Result] = []
    for case in args.cases:
        if args.checkpointing is not None and case not in _HF_CASES:
            raise ValueError(f"--checkpointing applies to the transformers models ({', '.join(_HF_CASES)}), not {case}")
        results.extend(bench_case(case, shape, variants, reps, args.warmup, device, args.checkpointing))

    table = Table(title=f"forward+backward, {shape.tokens} tokens, H={shape.hidden} F={shape.ffn} "
                        f"E={shape.experts} K={shape.top_k}, {device}")
    for h in HEADERS:
        table.add_column(h, justify="left" if h in ("case", "variant", "MoE layers") else "right",
                         overflow="fold")
    for row in rows(results):
        table.add_row(*row)
    console.print(table)
    if out_dir is not None:
        write_results(out_dir, results, info, shape, command.strip(), args.name, args.checkpointing)
        console.print(f"wrote {out_dir / (args.name + '.md')} and {out_dir / (args.name + '.json')}")


if __name__ == "__main__":
    main()

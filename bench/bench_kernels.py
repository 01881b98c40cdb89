"""Expert-op kernels side by side: the HEXA-MoE Triton kernels (hiermoe::experts_triton) vs the torch
lowering (hiermoe::experts), a plain autograd pipeline over torch._grouped_mm, and a padded bmm.

    python bench/bench_kernels.py                 # CUDA: the model shapes below, bf16, writes bench/results/kernels.*
    python bench/bench_kernels.py --models mixtral --tokens 1024 8192 --reps 20
    python bench/bench_kernels.py --cpu-check     # no GPU: tiny scaled shapes in the Triton interpreter,
                                                  # correctness and peak memory only (no timing)

Shapes (one MoE layer, gated SwiGLU experts, no biases, uniform random top-k routing):
  mixtral  H 4096, F 14336, E 8,   K 2      (Mixtral 8x7B)
  qwen3    H 2048, F 768,   E 128, K 8      (Qwen3-30B-A3B)
  deepseek H 7168, F 2048,  E 256, K 8      (DeepSeek-V3 routed experts)
over T in {128, 1024, 8192, 32768} tokens.

Implementations (same inputs, same weights):
  triton      torch.ops.hiermoe.experts_triton: re-index + 2 ESMM launches forward; backward = the
              hidden-grad launch (recomputes up/gate) + one ESFK launch (input gradient, biases) and
              the weight gradients as grouped GEMMs over the rows stored in the re-index order
  triton_keep the training form hiermoe::experts_triton_keep: the forward also stores up/gate (2 P F
              elements) and the backward's hidden launch reads them instead of recomputing them
  triton_estmm  triton with the weight gradients by the ESTMM range of ESFK (HIERMOE_TRITON_WGRAD=estmm)
  composite   torch.ops.hiermoe.experts_composite: the torch lowering as aten ops (what kernels="torch"
              runs under torch.compile), eager here
  torch       torch.ops.hiermoe.experts: sort, gather, F.grouped_mm per projection, index_add
  grouped_mm  the same pipeline written with torch._grouped_mm and differentiated by autograd
              (saves its activations instead of recomputing)
  padded_bmm  tokens scattered into an [E, C, H] buffer, C = the largest expert load (a host
              sync), torch.bmm per projection, autograd

Method (CUDA): per (shape, T, implementation), ``--warmup`` untimed calls (Triton compiles in the
first), then ``--reps`` calls each timed with a pair of CUDA events around it (no host sync inside
the timed region beyond what the implementation itself does); reported: median (and min) time,
TFLOP/s = model FLOPs / median, and the fraction of the device's dense bf16 peak. Model FLOPs count
only the useful expert matmuls: forward 2*T*K*H*F*3, forward+backward 3x that; recomputation,
padding and routing are not counted (they are the implementations' overheads). Peak memory: one
extra call after ``torch.cuda.reset_peak_memory_stats``: max_memory_allocated minus the bytes
allocated before the call (inputs, weights and .grad buffers excluded, returned gradients
included). An implementation that runs out of memory is reported as OOM, the others still run.

Method (--cpu-check): each shape scaled down (H, F / 64, E / 8, T in {16, 64}), fp32 and fp16; the
Triton op runs in the interpreter (TRITON_INTERPRET=1 is set by this script before torch/triton
are imported). Checked: forward and every gradient against the torch op (max |diff| / max(1, |ref|):
fp32 1e-5, fp16 6e-3). Measured: peak tensor bytes allocated during one forward and one
forward+backward call (torch.profiler's CPU allocator events, the same method as
bench_single_process.py): memory of the algorithms' buffers, not of the interpreter itself.
"""

from __future__ import annotations

import os
import sys

if "--cpu-check" in sys.argv:  # the interpreter must be on before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

import moe_compile.lowering as lowering  # noqa: E402
from moe_compile.lowering import experts_flops  # noqa: E402

MODELS: dict[str, tuple[int, int, int, int]] = {  # H, F, E, K
    "mixtral": (4096, 14336, 8, 2),
    "qwen3": (2048, 768, 128, 8),
    "deepseek": (7168, 2048, 256, 8),
}
TOKENS = (128, 1024, 8192, 32768)
IMPLS = ("triton", "triton_keep", "triton_estmm", "composite", "torch", "grouped_mm", "padded_bmm")
REF_IMPL = "grouped_mm"  # GPU rows: time ratio and max relative difference against this one
# Dense bf16 tensor-core peak (TFLOP/s, no sparsity) by device-name substring, from the vendors' data sheets.
BF16_PEAK_TFLOPS = {"H100 SXM": 989.4, "H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "H100": 756.0, "H200": 989.4,
                    "H800": 989.4, "A100": 312.0, "L40S": 362.1, "A10G": 70.0, "L4": 121.0, "RTX 4090": 165.2}

Args = list[Any]  # x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down


@dataclass
class Row:
    model: str
    tokens: int
    impl: str
    mode: str  # "fwd" or "fwd+bwd"
    times_ms: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    flops: int = 0
    error: str | None = None
    max_err: float | None = None  # --cpu-check: vs the torch op; GPU: vs REF_IMPL (output and every gradient)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else float("nan")


def make_args(num_t: int, hidden: int, ffn: int, num_e: int, top_k: int, dtype: torch.dtype, device: str,
              seed: int = 0) -> Args:
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape: int, scale: float) -> Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    scores = torch.rand(num_t, num_e, generator=g, device=device)
    top_w, top_i = scores.softmax(-1).topk(top_k, dim=-1)
    # routing weights in the model's dtype, as a bf16 model casts them (fp32 ones would make the
    # expert op's result fp32: experts_ref.out_dtype)
    return [rnd(num_t, hidden, scale=1.0), top_i, (top_w / top_w.sum(-1, keepdim=True)).to(dtype),
            rnd(num_e, ffn, hidden, scale=hidden**-0.5), rnd(num_e, ffn, hidden, scale=hidden**-0.5),
            rnd(num_e, hidden, ffn, scale=ffn**-0.5), None, None, None]


def _routing(topk_idx: Tensor, num_e: int) -> tuple[Tensor, Tensor, Tensor]:
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_e)
    return order, flat[order], counts


def grouped_mm_experts(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor,
                       w_down: Tensor, *_: Any) -> Tensor:
    """Sort-based MoE with torch._grouped_mm, differentiated by autograd (saves activations)."""
    num_k = topk_idx.shape[1]
    order, _expert, counts = _routing(topk_idx, w_up.shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    tok = order // num_k
    xs = x[tok]
    h = F.silu(torch._grouped_mm(xs, w_gate.mT, offs=offs)) * torch._grouped_mm(xs, w_up.mT, offs=offs)
    ys = torch._grouped_mm(h, w_down.mT, offs=offs)
    w = topk_weights.reshape(-1)[order].float()
    return x.new_zeros(x.shape, dtype=torch.float32).index_add(0, tok, ys.float() * w[:, None]).to(x.dtype)


def padded_bmm_experts(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor,
                       w_down: Tensor, *_: Any) -> Tensor:
    """Every expert padded to the largest load C: [E, C, H] buffer, torch.bmm, autograd."""
    num_k, num_e = topk_idx.shape[1], w_up.shape[0]
    order, expert, counts = _routing(topk_idx, num_e)
    cap = int(counts.max())  # host sync: the padded layout needs C
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(order.numel(), device=x.device) - starts[expert]
    tok = order // num_k
    buf = x.new_zeros(num_e, cap, x.shape[1]).index_put((expert, rank), x[tok])
    h = F.silu(torch.bmm(buf, w_gate.mT)) * torch.bmm(buf, w_up.mT)
    ys = torch.bmm(h, w_down.mT)[expert, rank]
    w = topk_weights.reshape(-1)[order].float()
    return x.new_zeros(x.shape, dtype=torch.float32).index_add(0, tok, ys.float() * w[:, None]).to(x.dtype)


def _triton_estmm(*a: Any) -> Tensor:
    """The Triton op with its weight gradients by the ESTMM kernel (HIERMOE_TRITON_WGRAD=estmm, read
    when the backward runs: set for the whole call)."""
    os.environ["HIERMOE_TRITON_WGRAD"] = "estmm"
    return torch.ops.hiermoe.experts_triton(*a, "silu")


def _triton_keep(*a: Any) -> Tensor:
    """The training form: the forward keeps up/gate for the backward (what lower_kernels emits when
    the op's inputs require grad)."""
    from moe_compile.lowering.triton_experts import keep_blk

    x, idx, *_ = a
    return torch.ops.hiermoe.experts_triton_keep(*a, "silu", keep_blk(x, idx.shape[1], a[3].shape[0]))[0]


def impl_fn(impl: str) -> Callable[..., Tensor]:
    os.environ.pop("HIERMOE_TRITON_WGRAD", None)
    if impl == "triton":
        return lambda *a: torch.ops.hiermoe.experts_triton(*a, "silu")
    if impl == "triton_estmm":
        return _triton_estmm
    if impl == "triton_keep":
        return _triton_keep
    if impl == "composite":
        return lambda *a: torch.ops.hiermoe.experts_composite(*a, "silu")
    if impl == "torch":
        return lambda *a: torch.ops.hiermoe.experts(*a, "silu")
    return {"grouped_mm": grouped_mm_experts, "padded_bmm": padded_bmm_experts}[impl]


def step(fn: Callable[..., Tensor], args: Args, grad: Tensor | None) -> None:
    """One forward, or forward + backward w.r.t. x, topk_weights and the three weights."""
    if grad is None:
        with torch.no_grad():
            fn(*args)
        return
    y = fn(*args)
    leaves = [a for a in args if isinstance(a, Tensor) and a.requires_grad]
    torch.autograd.grad(y, leaves, grad)


def leaves_for(args: Args, backward: bool) -> Args:
    return [a.detach().requires_grad_(backward) if isinstance(a, Tensor) and a.is_floating_point() else a
            for a in args]


def bench_gpu(model: str, num_t: int, impl: str, mode: str, reps: int, warmup: int, dtype: torch.dtype) -> Row:
    hidden, ffn, num_e, top_k = MODELS[model]
    row = Row(model, num_t, impl, mode, flops=experts_flops(num_t, top_k, hidden, ffn, True) * (3 if mode != "fwd" else 1))
    fn = impl_fn(impl)
    backward = mode != "fwd"
    try:
        args = leaves_for(make_args(num_t, hidden, ffn, num_e, top_k, dtype, "cuda"), backward)
        # seeded: every implementation's gradients are compared against REF_IMPL's for the same grad
        gen = torch.Generator(device="cuda").manual_seed(1)
        grad = torch.randn(num_t, hidden, device="cuda", generator=gen).to(dtype) if backward else None
        for _ in range(warmup):
            step(fn, args, grad)
        torch.cuda.synchronize()
        row.max_err = _check_against_ref(model, num_t, impl, fn, args, grad)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(fn, args, grad)
            end.record()
            end.synchronize()
            row.times_ms.append(start.elapsed_time(end))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(fn, args, grad)
        torch.cuda.synchronize()
        row.peak_bytes = torch.cuda.max_memory_allocated() - base
    except torch.cuda.OutOfMemoryError:
        row.error = "OOM"
    except Exception as exc:  # an implementation that cannot run is reported, the others go on
        row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
    finally:
        args = grad = None  # type: ignore[assignment]
        torch.cuda.empty_cache()
    return row


_REF_OUT: dict[tuple[str, int, bool], list[Tensor]] = {}


def _outputs(fn: Callable[..., Tensor], args: Args, grad: Tensor | None) -> list[Tensor]:
    if grad is None:
        with torch.no_grad():
            return [fn(*args)]
    y = fn(*args)
    leaves = [a for a in args if isinstance(a, Tensor) and a.requires_grad]
    return [y, *torch.autograd.grad(y, leaves, grad)]


def _rel_err_big(a: Tensor, b: Tensor, rows: int = 1 << 24) -> float:
    """rel_err in fp32 slices of the flattened tensors (a DeepSeek-shape weight gradient has 3.8e9
    elements: no double copy of it fits beside the model); ``b`` may live on the host."""
    a, b = a.reshape(-1), b.reshape(-1)
    diff = scale = 0.0
    for i in range(0, a.numel(), rows):
        x, y = a[i:i + rows].float(), b[i:i + rows].to(a.device).float()
        diff = max(diff, (x - y).abs().max().item())
        scale = max(scale, y.abs().max().item())
    return diff / max(1.0, scale)


def _check_against_ref(model: str, num_t: int, impl: str, fn: Callable[..., Tensor], args: Args,
                       grad: Tensor | None) -> float | None:
    """Max over the output and every gradient of |impl - REF_IMPL| / max(1, |REF_IMPL|) on the same
    inputs (make_args is seeded); the reference's outputs are kept from its own row, so REF_IMPL
    must come first among --impls for the others to be checked."""
    key = (model, num_t, grad is not None)
    got = _outputs(fn, args, grad)
    if impl == REF_IMPL:
        _REF_OUT.clear()  # one reference at a time, in host memory: DeepSeek's gradients are 22 GiB,
        _REF_OUT[key] = [t.cpu() for t in got]  # which beside its weights and another impl's filled an H100
        return 0.0
    want = _REF_OUT.get(key)
    if want is None:
        return None
    return max(_rel_err_big(a, b) for a, b in zip(got, want, strict=True))


def cpu_peak_bytes(fn: Callable[[], None]) -> int:
    from torch._C._autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    # The profiler's own bookkeeping keeps the last window's tensors in reference cycles; freed
    # inside the next window they would count against this call.
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
              if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def rel_err(a: Tensor, b: Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1.0)).item()


def cpu_check(models: list[str], tokens: list[int]) -> list[Row]:
    """Tiny scaled shapes in the interpreter: correctness of forward and every gradient vs the
    torch op, and peak memory of both ops."""
    rows = []
    tol = {torch.float32: 1e-5, torch.float16: 6e-3}
    for model in models:
        hidden, ffn, num_e, top_k = MODELS[model]
        h, f, e = max(16, hidden // 64), max(16, ffn // 64), max(top_k, num_e // 8)
        for num_t in tokens:
            for dtype in (torch.float32, torch.float16):
                base = make_args(num_t, h, f, e, top_k, dtype, "cpu")
                grad = torch.randn(num_t, h, generator=torch.Generator().manual_seed(1)).to(dtype)
                outs = {}
                for impl in ("triton", "torch"):
                    fn = impl_fn(impl)
                    args = leaves_for(base, True)
                    y = fn(*args)
                    leaves = [a for a in args if isinstance(a, Tensor) and a.requires_grad]
                    outs[impl] = [y, *torch.autograd.grad(y, leaves, grad)]
                    name = f"{model}/{str(dtype).removeprefix('torch.')}"
                    fwd = Row(name, num_t, impl, "fwd", peak_bytes=cpu_peak_bytes(
                        functools.partial(step, fn, leaves_for(base, False), None)))
                    both = Row(name, num_t, impl, "fwd+bwd", peak_bytes=cpu_peak_bytes(
                        functools.partial(step, fn, leaves_for(base, True), grad)))
                    rows += [fwd, both]
                err = max(rel_err(a, b) for a, b in zip(outs["triton"], outs["torch"], strict=True))
                for r in rows[-4:]:
                    r.max_err = err
                if err > tol[dtype]:
                    raise AssertionError(f"{model} T={num_t} {dtype}: triton vs torch op differ by {err:.2e}")
                kib = [(r.peak_bytes or 0) / 2**10 for r in (rows[-3], rows[-1])]
                print(f"{model:9s} H={h} F={f} E={e} K={top_k} T={num_t:3d} {dtype}: max rel. diff {err:.1e}, "
                      f"peak fwd+bwd triton {kib[0]:.0f} KiB vs torch {kib[1]:.0f} KiB")
    return rows


def machine_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "platform": platform.platform(), "device": device}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if device == "cuda":
        name = torch.cuda.get_device_name()
        info["gpu"] = name
        info["capability"] = list(torch.cuda.get_device_capability())
        info["bf16_peak_tflops"] = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)
    else:
        info["triton_interpret"] = os.environ.get("TRITON_INTERPRET")
    return info


def table(rows: list[Row], info: dict[str, Any], cpu: bool) -> list[str]:
    if cpu:
        head = ["shape/dtype", "T", "impl", "mode", "peak KiB", "vs torch", "max rel. diff vs torch"]
    else:
        head = ["model", "T", "impl", "mode", "median ms", "min ms", "TFLOP/s", "of bf16 peak", "peak MiB",
                f"time vs {REF_IMPL}", f"peak vs {REF_IMPL}", f"max rel. diff vs {REF_IMPL}", "note"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    ref = {(r.model, r.tokens, r.mode): r for r in rows if r.impl == "torch"}
    base = {(r.model, r.tokens, r.mode): r for r in rows if r.impl == REF_IMPL}
    peak = info.get("bf16_peak_tflops")
    for r in rows:
        if cpu:
            t = ref.get((r.model, r.tokens, r.mode))
            ratio = f"{r.peak_bytes / t.peak_bytes:.2f}" if t and t.peak_bytes and r.peak_bytes is not None else "-"
            out.append(f"| {r.model} | {r.tokens} | {r.impl} | {r.mode} | {(r.peak_bytes or 0) / 2**10:.1f} | {ratio} "
                       f"| {r.max_err:.1e} |")
            continue
        if r.error:
            out.append(f"| {r.model} | {r.tokens} | {r.impl} | {r.mode} | - | - | - | - | - | - | - | - | {r.error} |")
            continue
        tflops = r.flops / (r.median_ms * 1e-3) / 1e12
        frac = f"{tflops / peak:.0%}" if peak else "-"
        b = base.get((r.model, r.tokens, r.mode))
        t_ratio = f"{r.median_ms / b.median_ms:.2f}x" if b and not b.error else "-"
        m_ratio = f"{r.peak_bytes / b.peak_bytes:.2f}x" if b and b.peak_bytes and r.peak_bytes is not None else "-"
        err = f"{r.max_err:.1e}" if r.max_err is not None else "-"
        out.append(f"| {r.model} | {r.tokens} | {r.impl} | {r.mode} | {r.median_ms:.3f} | {min(r.times_ms):.3f} | "
                   f"{tflops:.1f} | {frac} | {(r.peak_bytes or 0) / 2**20:.1f} | {t_ratio} | {m_ratio} | {err} | |")
    return out


def write(out: Path, rows: list[Row], info: dict[str, Any], command: str, cpu: bool) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "machine": info, "rows": [{**asdict(r), "median_ms": r.median_ms} for r in rows]},
        indent=2, default=str) + "\n")
    title = "# Expert kernels: Triton (HEXA-MoE ESMM/ESFK) vs torch"
    where = (f"Device: {info.get('gpu', info['device'])}; torch {info['torch']}, triton {info.get('triton', '-')}, "
             f"Python {info['python']}.")
    if cpu:
        notes = [
            "Mode `--cpu-check` (no GPU in this run): tiny scaled shapes (H, F / 64, E / 8), the Triton op in the "
            "Triton interpreter. Correctness (forward and all gradients vs the torch op: fp32 <= 1e-5, fp16 <= 6e-3 "
            "of the scale) and peak tensor bytes of one call (torch.profiler CPU allocator events) only; "
            "interpreter times mean nothing and are not reported.",
            "",
            "GPU numbers (time, TFLOP/s, fraction of bf16 peak, CUDA peak memory) are in `kernels.md`, written by "
            "`python bench/bench_kernels.py` on a CUDA machine (all three shapes, T in 128/1024/8192/32768).",
        ]
    else:
        notes = [
            f"bf16, uniform random top-k routing, gated SwiGLU experts without biases. Dense bf16 peak used for the "
            f"fraction: {info.get('bf16_peak_tflops') or 'unknown (pass --peak-tflops)'} TFLOP/s. TFLOP/s count "
            "model FLOPs only (fwd 6*T*K*H*F, fwd+bwd 3x), so recompute and padding show up as lower TFLOP/s. "
            "Peak MiB: bytes allocated during one call above those before it.",
        ]
    lines = [title, "", f"Command: `{command}`", "", where, "", *notes, "", *table(rows, info, cpu)]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--tokens", nargs="+", type=int, default=None,
                        help=f"token counts (default {list(TOKENS)}; --cpu-check: 16 64)")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=[REF_IMPL, *(i for i in IMPLS if i != REF_IMPL)],
                        help=f"implementations, in this order ({REF_IMPL} first: the others are checked against it)")
    parser.add_argument("--modes", nargs="+", choices=("fwd", "fwd+bwd"), default=["fwd", "fwd+bwd"])
    parser.add_argument("--reps", type=int, default=20, help="timed calls per measurement (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first (Triton compiles in the first)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the GPU, if not known")
    parser.add_argument("--cpu-check", action="store_true",
                        help="no GPU: correctness and memory at tiny shapes in the Triton interpreter")
    parser.add_argument("--write-table", type=Path, default=None, metavar="RESULTS_JSON",
                        help="no run: write the kernels='auto' table (lowering/kernel_table.json) from a CUDA "
                             "results JSON of this script (triton_keep / triton vs composite)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results path without suffix (.md and .json are written; default "
                             "bench/results/kernels, or kernels_cpu_check with --cpu-check)")
    args = parser.parse_args(argv)
    command = "python bench/bench_kernels.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.out is None:
        args.out = Path(__file__).parent / "results" / ("kernels_cpu_check" if args.cpu_check else "kernels")

    if args.write_table is not None:
        from moe_compile.lowering import kernel_table

        results = {**json.loads(args.write_table.read_text()), "source": str(args.write_table)}
        old = json.loads(kernel_table.TABLE_PATH.read_text()) if kernel_table.TABLE_PATH.exists() else {}
        table = kernel_table.merged(old, results, MODELS)
        kernel_table.TABLE_PATH.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {kernel_table.TABLE_PATH}: {len(table['entries'])} entries, "
              f"{', '.join(s['device'] for s in table['sources'])}")
        return
    if not lowering.HAS_TRITON:
        raise SystemExit("the triton package is not installed: pip install 'triton>=3.3'")
    if args.cpu_check:
        info = machine_info("cpu")
        rows = cpu_check(args.models, args.tokens or [16, 64])
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --cpu-check for the interpreter check")
        info = machine_info("cuda")
        if args.peak_tflops:
            info["bf16_peak_tflops"] = args.peak_tflops
        rows = []
        for model in args.models:
            for num_t in args.tokens or TOKENS:
                for mode in args.modes:
                    for impl in args.impls:
                        r = bench_gpu(model, num_t, impl, mode, args.reps, args.warmup, torch.bfloat16)
                        rows.append(r)
                        print(f"{model:9s} T={num_t:6d} {mode:8s} {impl:10s} "
                              + (r.error or f"{r.median_ms:9.3f} ms  {r.flops / r.median_ms / 1e9:7.1f} TFLOP/s  "
                                            f"{(r.peak_bytes or 0) / 2**20:9.1f} MiB"), flush=True)
    write(args.out, rows, info, command.strip(), args.cpu_check)
    print("\n".join(table(rows, info, args.cpu_check)))
    print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()

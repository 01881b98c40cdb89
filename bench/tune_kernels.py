"""Launch-tile sweep for the HEXA-MoE Triton kernels on a CUDA device: which tiles, warps and stages
each kernel (``up``/``down`` forward ESMMs, ``hidden`` and ``esfk`` backward) should use, and which
re-index block size. The winners become ``lowering.triton_experts.HOPPER_TILES`` / ``GPU_BLK_MAX``.

    python bench/tune_kernels.py --models mixtral qwen3 --tokens 8192   # writes bench/results/tune_kernels.*

Method: bf16, the shapes of bench_kernels.py, uniform random top-k routing. Coordinate descent per
kernel, the other kernels held at 64-wide tiles (``SMALL_TILES``): first the (block_f, block_h)
tile pair at 8 warps / 3 stages (tiles past 128x128 at 2 stages too), then warps and stages for the
best pair. Each candidate: one untimed call (Triton compiles it), then ``--reps`` calls timed with
CUDA events, median kept. The forward kernels are timed through ``esmm_forward`` (both launches,
one of them varied), the backward ones through ``esfk_backward``. A candidate that does not compile or fit (shared memory, registers) is recorded
with its error. Last, the re-index block: blk in {64, 128} with the winning tiles, forward +
backward.

``--groups`` instead sweeps each kernel's program grouping (``Tiles.group``, ``triton_esmm.block_tile``:
how many consecutive re-index blocks take all their output tiles before the next; 0 = all blocks,
the order before groups) with the shipped tiles and block (``kernel_config``), the forward in its
training form (pre-activations kept) and the backward reading them, one kernel varied at a time;
then the whole forward + backward with every kernel at its best group, at the default and at 0.

``--breakdown`` instead runs the op as shipped (``torch.ops.hiermoe.experts_triton`` forward +
backward, the tiles of ``kernel_config``) under each top-k combine (atomic, slots) and backward form
(fused ESFK, or ESTMM/ESMM/ESS as three launches) and reports every kernel's CUDA time from
torch.profiler, summed over ``--reps`` calls after one untimed call.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import MODELS, make_args  # noqa: E402

from moe_compile.lowering.triton_esfk import esfk_backward  # noqa: E402
from moe_compile.lowering.triton_esmm import KernelConfig, Tiles, esmm_forward  # noqa: E402
from moe_compile.lowering.triton_experts import HOPPER_TILES, SMALL_TILES, keep_blk, kernel_config  # noqa: E402
from moe_compile.lowering.triton_reindex import Reindex, build_reindex  # noqa: E402

PAIRS = ((64, 64), (128, 64), (64, 128), (128, 128), (256, 64), (64, 256), (256, 128), (128, 256))
LAUNCH = ((4, 3), (8, 3), (8, 4), (4, 4), (8, 2), (4, 2))
KERNELS = KernelConfig.LAUNCHES
FORWARD = ("up", "down")
GROUPS = (0, 1, 2, 4, 8, 16, 32, 64)
# what kernel_config ships on Hopper for bf16 (its wgrad is "grouped" there; the template's default is estmm)
SHIPPED = dataclasses.replace(HOPPER_TILES, wgrad="grouped")


def timed(fn: Callable[[], Any], reps: int) -> float:
    fn()  # compile
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@dataclasses.dataclass
class Case:
    """One bench shape's bf16 inputs on the GPU (``make_args``: gated SwiGLU, no biases), its fp32
    routing weights and an upstream gradient; calls the launchers on them."""

    model: str
    num_t: int

    def __post_init__(self) -> None:
        _hidden, self.ffn, self.num_e, self.top_k = MODELS[self.model]
        self.x, self.idx, tw, self.w_up, self.w_gate, self.w_down, *_ = make_args(
            self.num_t, _hidden, self.ffn, self.num_e, self.top_k, torch.bfloat16, "cuda")
        self.tw_N = tw.reshape(-1).float().contiguous()
        self.g = torch.randn_like(self.x)

    def reindex(self, blk: int) -> Reindex:
        return build_reindex(self.idx, self.num_e, blk)

    def kept(self, r: Reindex) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers for the pre-activations the training form's forward keeps."""
        return self.x.new_empty(r.v_P.shape[0], self.ffn), self.x.new_empty(r.v_P.shape[0], self.ffn)

    def forward(self, cfg: KernelConfig, r: Reindex, keep: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        esmm_forward(self.x, self.idx, self.tw_N, self.w_up, self.w_gate, self.w_down, None, None, None, "silu", cfg,
                     r, keep=keep)

    def backward(self, cfg: KernelConfig, r: Reindex, kept: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        esfk_backward(self.g, self.x, self.idx, self.tw_N, self.w_up, self.w_gate, self.w_down, None, None, None,
                      "silu", cfg, r, kept=kept)


def sweep(model: str, num_t: int, reps: int, log: Callable[[dict[str, Any]], None],
          kernels: tuple[str, ...] = KERNELS, start: KernelConfig = SMALL_TILES) -> dict[str, Any]:
    case = Case(model, num_t)
    best = start  # the winners so far; the kernels not yet swept keep their tiles in ``start``

    def run(kernel: str, cfg: KernelConfig) -> Callable[[], Any]:
        r = case.reindex(cfg.blk)
        if kernel in FORWARD:
            return functools.partial(case.forward, cfg, r)
        kept = None
        if kernel == "kept":  # the backward of the training form: a forward fills the kept pre-activations
            kept = case.kept(r)
            case.forward(cfg, r, kept)
        return functools.partial(case.backward, cfg, r, kept)

    def measure(kernel: str, tiles: Tiles, blk: int = 128) -> float:
        cfg = dataclasses.replace(best, blk=blk, **{kernel: tiles})
        row: dict[str, Any] = dict(model=model, tokens=num_t, kernel=kernel, blk=blk, **dataclasses.asdict(tiles))
        try:
            row["ms"] = timed(run(kernel, cfg), reps)
        except Exception as exc:  # a candidate that does not fit is recorded and skipped
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            row["ms"] = float("inf")
            torch.cuda.synchronize()
        log(row)
        return row["ms"]

    for kernel in kernels:
        first: dict[tuple[int, int, int, int], float] = {}  # (block_f, block_h, warps, stages) -> ms
        for pf, ph in PAIRS:  # tiles past 128x128 also at 2 stages (3 rarely fit in shared memory)
            for stages in ((3, 2) if pf * ph > 128 * 128 else (3,)):
                first[(pf, ph, 8, stages)] = measure(kernel, Tiles(pf, ph, 8, stages))
        pf, ph, w0, s0 = min(first, key=lambda k: first[k])
        launch_ms = {(w0, s0): first[(pf, ph, w0, s0)]}
        for w, s in LAUNCH:
            if (w, s) not in launch_ms:
                launch_ms[(w, s)] = measure(kernel, Tiles(pf, ph, w, s))
        w, s = min(launch_ms, key=lambda k: launch_ms[k])
        best = dataclasses.replace(best, **{kernel: Tiles(pf, ph, w, s)})
    blk_ms = {}
    for blk in (64, 128) if start is SMALL_TILES else ():  # from the shipped tiles: their block stays
        blk_ms[blk] = timed(functools.partial(_step, case, dataclasses.replace(best, blk=blk), case.reindex(blk)), reps)
        log(dict(model=model, tokens=num_t, kernel="fwd+bwd", blk=blk, ms=blk_ms[blk]))
    return dict(model=model, tokens=num_t, best={k: dataclasses.asdict(getattr(best, k)) for k in KERNELS},
                blk_ms=blk_ms)


def _step(case: Case, cfg: KernelConfig, r: Reindex, kept: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """One forward and backward (the training form where ``kept`` buffers are given)."""
    case.forward(cfg, r, kept)
    case.backward(cfg, r, kept)


def group_sweep(model: str, num_t: int, reps: int, log: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Each kernel's time per program group (see the module note); returns the best group per kernel
    and the forward + backward times with those, with the default groups and with 0 (all blocks)."""
    case = Case(model, num_t)
    shipped = kernel_config(case.x, case.top_k, case.num_e, case.ffn)
    r = case.reindex(shipped.blk)
    kept = case.kept(r)
    case.forward(shipped, r, kept)  # fills the kept buffers the backward reads
    best: dict[str, int] = {}
    # the training form's launches: its backward's hidden launch runs with the ``kept`` tiles
    # (``hidden``'s are the recompute form's, which this sweep does not run)
    for kernel in ("up", "down", "kept", "esfk"):
        ms = {}
        call = case.forward if kernel in FORWARD else case.backward
        for group in GROUPS:
            ms[group] = timed(functools.partial(call, shipped.with_groups({kernel: group}), r, kept), reps)
            log(dict(model=model, tokens=num_t, kernel=kernel, blk=shipped.blk, group=group, ms=ms[group],
                     **{k: v for k, v in dataclasses.asdict(getattr(shipped, kernel)).items() if k != "group"}))
        best[kernel] = min(ms, key=lambda k: ms[k])
    both = {}
    for name, groups in (("best", best), ("default", {k: getattr(shipped, k).group for k in best}),
                         ("all blocks (0)", dict.fromkeys(best, 0))):
        both[name] = timed(functools.partial(_step, case, shipped.with_groups(groups), r, kept), reps)
        log(dict(model=model, tokens=num_t, kernel="fwd+bwd", blk=shipped.blk, groups=name, ms=both[name]))
    return dict(model=model, tokens=num_t, best_group=best, fwd_bwd_ms=both)


def breakdown(model: str, num_t: int, reps: int, log: Callable[[dict[str, Any]], None],
              keep_form: bool = False) -> None:
    from torch.profiler import ProfilerActivity, profile

    hidden, ffn, num_e, top_k = MODELS[model]
    args = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in make_args(num_t, hidden, ffn, num_e, top_k, torch.bfloat16, "cuda")]
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    g = torch.randn_like(args[0])

    blk = keep_blk(args[0], top_k, num_e)

    def call(keep: bool) -> None:
        if keep:  # the training form lower_kernels emits: pre-activations kept for the backward
            y = torch.ops.hiermoe.experts_triton_keep(*args, "silu", blk)[0]
        else:
            y = torch.ops.hiermoe.experts_triton(*args, "silu")
        torch.autograd.grad(y, leaves, g)

    variants = [("atomic", "1", True), ("atomic", "1", False)] if keep_form else \
        [(c, f, False) for c in ("atomic", "slots") for f in ("1", "0")]
    for combine, fused, keep in variants:
        os.environ["HIERMOE_TRITON_COMBINE"], os.environ["HIERMOE_TRITON_FUSED"] = combine, fused
        call(keep)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                call(keep)
            torch.cuda.synchronize()
        kernels: dict[str, float] = {}
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", 0.0)
            if us > 0:
                kernels[ev.key[:60]] = round(us / reps / 1000, 3)
        row = dict(model=model, tokens=num_t, combine=combine, fused=fused == "1", keep=keep,
                   total_ms=round(sum(kernels.values()), 3), kernels=kernels)
        if fused == "0":  # the launches of _esfk_kernel in order: ESTMM, ESMM (dx), ESS (only with biases)
            launches = [ev.device_time_total for ev in prof.events()
                        if ev.name.startswith("_esfk_kernel") and ev.device_time_total > 0]
            n = len(launches) // reps
            row["esfk_split_ms"] = {part: round(sum(launches[i::n]) / reps / 1000, 3)
                                    for i, part in enumerate(("estmm", "esmm_dx", "ess")[:n])}
        log(row)


def report(data: dict[str, Any]) -> str:
    """Markdown of one results JSON (a sweep or a breakdown)."""
    lines = [f"Command: `{data.get('command', '?')}`", "",
             f"Device: {data.get('device', '?')}; torch {data.get('torch', '?')}.", ""]
    sweep_rows = [r for r in data["rows"] if "kernels" not in r]
    if sweep_rows:
        lines += ["| model | T | kernel | blk | block_f | block_h | warps | stages | group | ms |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sweep_rows:
            ms = r.get("error") or f"{r['ms']:.2f}"
            lines.append(f"| {r['model']} | {r['tokens']} | {r['kernel']} | {r['blk']} | {r.get('block_f', '')} | "
                         f"{r.get('block_h', '')} | {r.get('num_warps', '')} | {r.get('num_stages', '')} | "
                         f"{r.get('group', r.get('groups', ''))} | {ms} |")
        for res in data.get("results", []):
            if "best_group" in res:
                lines += ["", f"{res['model']} T={res['tokens']}: best group per kernel "
                          + ", ".join(f"{k} {v}" for k, v in res["best_group"].items()) + "; fwd+bwd "
                          + ", ".join(f"{k} {v:.2f} ms" for k, v in res["fwd_bwd_ms"].items())]
                continue
            best = ", ".join(f"{k} {v['block_f']}x{v['block_h']} w{v['num_warps']} s{v['num_stages']}"
                             for k, v in res["best"].items())
            lines += ["", f"Best for {res['model']} T={res['tokens']}: {best}; fwd+bwd by blk: "
                      + ", ".join(f"{b}: {ms:.2f} ms" for b, ms in res["blk_ms"].items())]
    split = [r for r in data["rows"] if "kernels" in r]
    if split:
        names = sorted({k for r in split for k in r["kernels"] if k.startswith("_")})
        lines += ["| model | T | combine | backward | total ms | " + " | ".join(names) + " | other |",
                  "|---" * (5 + len(names) + 1) + "|"]
        for r in split:
            ours = [r["kernels"].get(k, 0.0) for k in names]
            split_ms = ", ".join(f"{k} {v:.2f}" for k, v in r.get("esfk_split_ms", {}).items())
            lines.append(f"| {r['model']} | {r['tokens']} | {r['combine']} | "
                         f"{'ESFK' if r['fused'] else 'separate launches'}{f' ({split_ms})' if split_ms else ''}"
                         f"{', kept pre-activations' if r.get('keep') else ''}"
                         f" | {r['total_ms']:.2f} | " + " | ".join(f"{v:.2f}" for v in ours)
                         + f" | {r['total_ms'] - sum(ours):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["mixtral", "qwen3"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[8192])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--breakdown", action="store_true", help="per-kernel times of the shipped op, no sweep")
    parser.add_argument("--keep", action="store_true",
                        help="--breakdown of the training form (kept pre-activations) and the recompute form, "
                             "atomic combine and fused backward only")
    parser.add_argument("--from-shipped", action="store_true",
                        help="sweep starting from the shipped Hopper tiles (HOPPER_TILES) instead of 64-wide ones")
    parser.add_argument("--groups", action="store_true", help="sweep each kernel's program group (module note)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "tune_kernels")
    parser.add_argument("--report", nargs="+", type=Path, default=None,
                        help="no GPU needed: rewrite bench/results/tune_kernels.md from these results JSONs")
    args = parser.parse_args()
    if args.report:
        parts = ["# Triton kernel launch tiles: sweeps and per-kernel breakdown", "",
                 "Written by `python bench/tune_kernels.py --report " + " ".join(map(str, args.report)) + "`.", ""]
        for path in args.report:
            parts += [f"## {path.name}", "", report(json.loads(path.read_text()))]
        (Path(__file__).parent / "results" / "tune_kernels.md").write_text("\n".join(parts))
        return
    if not torch.cuda.is_available():
        raise SystemExit("tune_kernels.py needs a CUDA device")
    rows: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    head = dict(command="python bench/tune_kernels.py " + " ".join(sys.argv[1:]),
                device=torch.cuda.get_device_name(), torch=torch.__version__)

    def log(row: dict[str, Any]) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        args.out.with_suffix(".json").write_text(json.dumps(dict(**head, rows=rows, results=results), indent=1))

    for model in args.models:
        for num_t in args.tokens:
            gc.collect()  # the previous shape's tensors go before the next shape's are made
            torch.cuda.empty_cache()
            if args.breakdown:
                breakdown(model, num_t, args.reps, log, args.keep)
                continue
            if args.groups:
                results.append(group_sweep(model, num_t, args.reps, log))
                print(json.dumps(results[-1]), flush=True)
                continue
            results.append(sweep(model, num_t, args.reps, log, tuple(args.kernels),
                                 SHIPPED if args.from_shipped else SMALL_TILES))
            print(json.dumps(results[-1]), flush=True)
    args.out.with_suffix(".json").write_text(json.dumps(dict(**head, rows=rows, results=results), indent=1))


if __name__ == "__main__":
    main()

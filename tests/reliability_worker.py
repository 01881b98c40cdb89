"""One rank of the reliability tests (tests/test_reliability.py; launched by tests/dist_utils.py).

Cases: ``unlucky`` (NaN or 0 tokens in one rank's first batch: ranks still agree, nothing hangs,
clean batches equal eager), ``hang`` and ``die`` (a rank that stops or exits: every other rank
raises within the process group timeout, naming the layer and the collective).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from compile_utils import rel_err  # noqa: E402  (relative to max(1, |b|): a gradient that cancels to 0 is noise)
from ep_worker import PARAMS, make_mesh, tiny  # noqa: E402

import moe_compile  # noqa: E402
from moe_compile.backend import collect_reports  # noqa: E402
from moe_compile.samples import SAMPLES  # noqa: E402


def first_batch(rank: int, H: int, gen: torch.Generator) -> torch.Tensor:  # noqa: N803
    x = torch.randn(2, 6, H, generator=gen)
    if rank == PARAMS.get("nan_rank"):
        x[0, 3, 5] = float("nan")  # one NaN: its token's routing and output are NaN, the others are not
    if rank == PARAMS.get("empty_rank"):
        x = x[:, :0]
    return x


def case_unlucky() -> dict[str, Any]:
    """Per kind: compile on each rank's own first batch (NaN on one rank, 0 tokens on another),
    then clean batches of other sizes; outputs and input gradients against eager on the clean
    batches, the layers each rank rewrote, and the reasons it gives for the others."""
    rank = dist.get_rank()
    mesh = make_mesh(PARAMS["shape"])
    out: dict[str, Any] = {}
    for kind in PARAMS["kinds"]:
        torch._dynamo.reset()
        if kind == "diverge":  # one rank's experts clamp their output: it alone cannot rewrite the layer
            from fuzz_moe import FuzzConfig, make

            extra = "clamp_out" if rank == PARAMS["diverge_rank"] else "none"
            model = make(FuzzConfig("loop", "stacked", "softmax_renorm", False, 1.0, "silu", True, False, extra,
                                    8, 2, 32, 16))
            hidden = 32
        else:
            spec = SAMPLES[kind]
            torch.manual_seed(0)  # the same weights on every rank
            model = spec.make(num_experts=8)
            hidden = spec.hidden_size
        ref = copy.deepcopy(model)
        compiled = torch.compile(model, backend="hiermoe", options={"mesh": mesh, "dimension": 2,
                                                                   "inner_compiler": "aot_eager"})
        gen = torch.Generator().manual_seed(100 + rank)
        with collect_reports() as graphs:
            compiled(first_batch(rank, hidden, gen))
        errs = []
        for step in range(2):
            x = torch.randn(2, 3 + step + rank, hidden, generator=gen)
            xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
            yc, ye = compiled(xc), ref(xe)
            g = torch.randn(ye.shape, generator=gen)
            (gc,) = torch.autograd.grad(yc, xc, g)
            (ge,) = torch.autograd.grad(ye, xe, g)
            errs.append(max(rel_err(yc.detach(), ye.detach()), rel_err(gc, ge)))
        code = "\n".join(gr.after for gr in graphs)
        out[kind] = {"errs": errs, "expert_parallel": code.count("hiermoe.ep_dispatch"),
                     "rewritten": [r.name for gr in graphs for r in gr.regions],
                     "verification": [r.verification for gr in graphs for r in gr.regions],
                     "skipped": [s.reason for gr in graphs for s in gr.skipped]}
    return out


def case_fuzz() -> dict[str, Any]:
    """tests/test_fuzz.py on 4 ranks: per case, a FuzzMoE layer (the same weights everywhere)
    compiled on each rank's own first batch (its size from the case, 0 on one rank, a NaN on
    another), then two clean steps of random sizes (0 included); per rank and step, outputs and
    input gradients against eager, and expert gradients summed over ranks against eager's sums."""
    from fuzz_moe import FuzzConfig, make

    rank = dist.get_rank()
    mesh = make_mesh(PARAMS["shape"])
    out = []
    for i, case in enumerate(PARAMS["cases"]):
        cfg = FuzzConfig(**case["cfg"])
        torch._dynamo.reset()
        model, ref = make(cfg), make(cfg)
        compiled = torch.compile(model, backend="hiermoe", options={"mesh": mesh, "dimension": 2,
                                                                   "inner_compiler": "aot_eager"})
        gen = torch.Generator().manual_seed(1000 * i + rank)
        x = torch.randn(1, case["sizes"][rank], cfg.hidden, generator=gen)
        if rank == case["nan_rank"]:
            x[0, 0, 0] = float("nan")
        with collect_reports() as graphs, torch.no_grad():
            compiled(x)
        errs = []
        for _ in range(2):
            x = torch.randn(1, int(torch.randint(0, 7, (1,), generator=gen)), cfg.hidden, generator=gen)
            xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
            yc, ye = compiled(xc), ref(xe)
            g = torch.randn(ye.shape, generator=gen)
            (yc * g).sum().backward()  # one backward each: parameter grads accumulate over the steps
            (ye * g).sum().backward()
            gc, ge = xc.grad, xe.grad
            assert gc is not None and ge is not None
            errs += [rel_err(yc.detach(), ye.detach()) if ye.numel() else 0.0, rel_err(gc, ge) if ge.numel() else 0.0]
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            a = torch.zeros_like(p) if p.grad is None else p.grad.clone()
            b = torch.zeros_like(q) if q.grad is None else q.grad.clone()
            dist.all_reduce(a)
            dist.all_reduce(b)
            errs.append(rel_err(a, b))
        if os.environ.get("HIERMOE_DEBUG_GRAPHS"):
            Path(os.environ["HIERMOE_DEBUG_GRAPHS"], f"rank{rank}_{i}.py").write_text("\n".join(gr.after for gr in graphs))
        out.append({"rewritten": any("hiermoe.ep_dispatch" in gr.after for gr in graphs), "errs": errs,
                    "skipped": [s.reason for gr in graphs for s in gr.skipped]})
    return {str(i): r for i, r in enumerate(out)}


def case_options_differ() -> dict[str, Any]:
    """Rank 0 compiles with dimension 1, the others with 2: every rank raises the same error at
    the first compile, before any expert-parallel collective."""
    rank = dist.get_rank()
    mesh = make_mesh(PARAMS["shape"])
    compiled = torch.compile(tiny("grouped_gemm", 8), backend="hiermoe", options={
        "mesh": mesh, "dimension": 1 if rank == 0 else 2, "inner_compiler": "aot_eager"})
    ids = torch.randint(0, 32, (2, 8))
    try:
        compiled(ids, ids)
        err = "no error"
    except Exception as e:  # noqa: BLE001 - the test asserts the message
        err = f"{type(e).__name__}: {e}"
    return {"error": err[:3000]}


def _stop(rank: int) -> dict[str, Any]:
    """Rank 1 stops after the first step (``how``: exits, or sleeps past the timeout); every other
    rank runs on and reports the error it gets and how long it took."""
    mesh = make_mesh(PARAMS["shape"])
    model = tiny("grouped_gemm", 8)
    compiled = torch.compile(model, backend="hiermoe", options={"mesh": mesh, "dimension": 2,
                                                               "inner_compiler": "aot_eager"})
    ids = torch.randint(0, 32, (2, 8))
    compiled(ids, ids)
    dist.barrier()
    if rank == 1:
        if PARAMS["how"] == "exit":
            os._exit(3)
        time.sleep(PARAMS["pg_timeout_s"] + 10)  # past the others giving up (they must not wait for this)
        os._exit(3)
    start = time.monotonic()
    try:
        for _ in range(3):
            compiled(ids, ids).backward()
        err = "no error"
    except Exception as e:  # noqa: BLE001 - the test asserts the message
        err = f"{type(e).__name__}: {e}"
    return {"error": err[:1500], "elapsed_s": time.monotonic() - start}


def case_stop() -> dict[str, Any]:
    return _stop(dist.get_rank())


def main() -> None:
    case = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(PARAMS.get("pg_timeout_s", 60))))
    result = globals()[f"case_{case}"]()
    Path(os.environ["HIERMOE_TEST_OUT"], f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    if case == "stop":
        os._exit(0)  # the process group lost a rank: no barrier, no destroy
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    assert moe_compile is not None
    main()

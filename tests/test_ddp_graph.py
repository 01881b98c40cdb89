"""A model under DistributedDataParallel, compiled: Dynamo's DDP optimizer would cut its graph at
DDP's gradient buckets, and an MoE layer whose experts outweigh a bucket would reach the backend
in pieces, never found whole. Importing moe_compile turns it off (README, "Global Dynamo
settings"); turned back on, the report says why the layers were left alone. One process, a
1-rank gloo group (the multi-rank DDP recipes: test_expert_parallel.py)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from dist_utils import one_rank_group
from hf_models import build, input_ids
from torch.nn.parallel import DistributedDataParallel

import moe_compile  # noqa: F401  (its import sets the Dynamo flags)
from moe_compile.backend import collect_reports

pytest.importorskip("transformers")


def _ddp_step(optimize_ddp: bool) -> tuple[float, float, list[int], list[str]]:
    """HF Mixtral (H=128, F=512: 6 MiB of experts per layer) under DDP with 1 MiB buckets,
    compiled with hiermoe: (loss, eager loss, layers rewritten per graph, reasons left alone)."""
    torch._dynamo.reset()
    model = build("mixtral", hidden_size=128, intermediate_size=512, head_dim=32)
    model.train()
    ref = copy.deepcopy(model)
    ids = input_ids(seq=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DDP on one CPU rank
        wrapped = DistributedDataParallel(model, bucket_cap_mb=1)
    with torch._dynamo.config.patch(optimize_ddp=optimize_ddp), collect_reports() as graphs:
        loss = torch.compile(wrapped, backend="hiermoe", options={"inner_compiler": "aot_eager"})(
            input_ids=ids, labels=ids).loss
        loss.backward()
    want = ref(input_ids=ids, labels=ids).loss
    return float(loss), float(want), [len(g.regions) for g in graphs], [s.reason for g in graphs for s in g.skipped]


def test_ddp_wrapped_model_is_compiled_whole_and_a_cut_one_says_why() -> None:
    assert torch._dynamo.config.optimize_ddp is False  # what importing moe_compile set
    with one_rank_group():
        loss, want, rewritten, _ = _ddp_step(optimize_ddp=False)
        assert rewritten == [2] and loss == pytest.approx(want, rel=1e-6)
        loss, want, rewritten, reasons = _ddp_step(optimize_ddp=True)
        assert len(rewritten) > 1 and sum(rewritten) < 2, rewritten  # cut in pieces, layers lost
        assert any("optimize_ddp = False" in r and "gradient buckets" in r for r in reasons), reasons
        assert loss == pytest.approx(want, rel=1e-6)

"""Training through the rewritten layers: the tiny LM compiled with hiermoe follows eager step by
step, and one end-to-end Inductor case (the default inner compiler) forward and backward.

Tolerance: each step's loss is compared; the rewritten graph sums in another order (~1e-7
relative per op) and Adam amplifies such differences only slowly over a handful of steps, so
1e-5 relative per loss is both safe and tight enough to catch a wrong gradient (which changes
the second loss already at the 1e-2 level)."""

from __future__ import annotations

import copy

import pytest
import torch
from compile_utils import compare_compiled, op_count

from moe_compile.backend import collect_reports
from moe_compile.report import Report
from moe_compile.samples import SAMPLES, TinyLMConfig, TinyMoELM, example_input
from moe_compile.samples.train_tiny_lm import train


@pytest.mark.parametrize("moe_kind,optimizer", [("expert_loop", "adamw"), ("grouped_gemm", "sgd")])
def test_tiny_lm_training_matches_eager(moe_kind: str, optimizer: str) -> None:
    torch.manual_seed(0)
    eager = TinyMoELM(TinyLMConfig(moe_kind=moe_kind))
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    with collect_reports() as graphs:
        compiled = torch.compile(model, backend="hiermoe", options={"inner_compiler": "aot_eager"})
        losses_c = train(compiled, steps=6, lr=1e-2, batch=4, seq=16, optimizer=optimizer, vocab_size=32)
    losses_e = train(eager, steps=6, lr=1e-2, batch=4, seq=16, optimizer=optimizer)
    report = Report(graphs=list(graphs))
    assert len(report.regions) == 2 and op_count(report) == 2  # both decoder layers rewritten
    for step, (c, e) in enumerate(zip(losses_c, losses_e)):
        assert abs(c - e) <= 1e-5 * abs(e), (step, losses_c, losses_e)
    assert losses_c[-1] < losses_c[0]
    if optimizer == "sgd":
        # SGD updates are linear in the gradients, so the weights must agree too.  (Adam divides
        # by sqrt(v): entries whose gradient is rounding noise, e.g. an expert that got one
        # token, move by ~lr either way, so only its losses are compared.)
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), n


def test_inductor_end_to_end_forward_and_backward() -> None:
    spec = SAMPLES["expert_loop"]
    torch.manual_seed(0)
    cmp = compare_compiled(spec.make(), [example_input(spec)], {"inner_compiler": "inductor"})
    cmp.assert_close()
    assert len(cmp.report.regions) == 1 and op_count(cmp.report) == 1

"""Golden graph code after the rewrite for two samples: the whole MoE layer becomes one
``hiermoe::experts`` call fed by the router's top-k, with stacked weights as views.

Regenerate after an intended change with HIERMOE_UPDATE_GOLDEN=1 and review the diff."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import moe_compile
from moe_compile.samples import SAMPLES, example_input

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("name", ["grouped_gemm", "expert_loop"])
def test_after_code_matches_golden(name: str) -> None:
    spec = SAMPLES[name]
    torch.manual_seed(0)
    report = moe_compile.explain(spec.make(), example_input(spec), options={"inner_compiler": "eager"})
    code = report.graphs[0].after.strip() + "\n"
    path = GOLDEN / f"{name}_after.py"
    if os.environ.get("HIERMOE_UPDATE_GOLDEN"):
        path.write_text(code)
    assert code == path.read_text(), f"graph code changed; diff against {path}"

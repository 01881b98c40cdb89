"""explain, the printed report, the dump directory, and backend registration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import moe_compile
from moe_compile.samples import SAMPLES, TinyLMConfig, TinyMoELM, example_input

OPTS = {"inner_compiler": "aot_eager"}


def test_explain_reports_every_layer_of_the_tiny_lm() -> None:
    torch.manual_seed(0)
    model = TinyMoELM(TinyLMConfig(num_layers=3, moe_kind="qwen3"))
    ids = torch.randint(0, 32, (2, 8))
    report = moe_compile.explain(model, ids, options=OPTS)
    assert [r.name for r in report.regions] == ["layers.0.mlp", "layers.1.mlp", "layers.2.mlp"]
    for r in report.regions:
        assert (r.num_experts, r.top_k, r.hidden_size, r.ffn_size) == (8, 2, 32, 48)
        assert (r.pattern, r.activation, r.gated, r.router, r.plan) == ("expert_loop", "silu", True, "softmax", "local")
    assert "torch.ops.hiermoe.experts" in report.after and "torch.ops.hiermoe.experts" not in report.before
    assert "index_add_" in report.before and "index_add_" not in report.after
    text = str(report)
    assert "3 MoE layer(s) rewritten" in text and "expert_loop" in text and "softmax" in text


def test_explain_does_not_change_the_model_outputs() -> None:
    spec = SAMPLES["dense_masked"]
    torch.manual_seed(0)
    model = spec.make()
    x = example_input(spec)
    before = model(x)
    moe_compile.explain(model, x, options=OPTS)
    assert torch.equal(model(x), before)


def test_dump_dir_writes_report_and_code(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("HIERMOE_DUMP_DIR", str(tmp_path))
    spec = SAMPLES["gathered_bmm"]
    report = moe_compile.explain(spec.make(), example_input(spec), options=OPTS)
    files = sorted(p.name for p in (tmp_path / "rank0").iterdir())
    stem = f"graph_{report.graphs[0].index:03d}"
    assert {f"{stem}_before.py", f"{stem}_after.py", f"{stem}_report.txt", f"{stem}_report.json"} <= set(files)
    after = (tmp_path / "rank0" / f"{stem}_after.py").read_text()
    assert "torch.ops.hiermoe.experts" in after
    data = json.loads((tmp_path / "rank0" / f"{stem}_report.json").read_text())
    assert data["regions"][0]["pattern"] == "gathered_bmm"


def test_dump_dir_option_overrides_env(tmp_path: Path) -> None:
    spec = SAMPLES["grouped_gemm"]
    moe_compile.explain(spec.make(), example_input(spec), options={**OPTS, "dump_dir": str(tmp_path / "d")})
    assert any(p.name.endswith("_after.py") for p in (tmp_path / "d" / "rank0").iterdir())


def test_backend_works_without_importing_moe_compile() -> None:
    """The torch_dynamo_backends entry point makes backend="hiermoe" resolvable on its own."""
    code = (
        "import sys, torch\n"
        "assert 'moe_compile' not in sys.modules\n"
        "from torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(s):\n"
        "        super().__init__(); s.r = nn.Linear(8, 4); s.w = nn.Parameter(torch.randn(4, 8, 8))\n"
        "    def forward(s, x):\n"
        "        v, i = torch.topk(s.r(x).softmax(-1), 2)\n"
        "        y = torch.einsum('tkoh,th->tko', s.w[i], x).relu()\n"
        "        return (y * v[..., None]).sum(1)\n"
        "m = M(); x = torch.randn(5, 8)\n"
        "y = torch.compile(m, backend='hiermoe', options={'inner_compiler': 'eager'})(x)\n"
        "assert 'moe_compile' in sys.modules\n"
        "assert torch.allclose(y, m(x), atol=1e-6)\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd="/", env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


def test_importing_registers_backend() -> None:
    assert "hiermoe" in torch._dynamo.list_backends()
    assert torch._dynamo.config.capture_dynamic_output_shape_ops
    assert torch._dynamo.config.capture_scalar_outputs

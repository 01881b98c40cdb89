"""Every sample MoE layer, compiled with hiermoe, is rewritten into the expert op and computes
what eager computes (outputs and every gradient); the report states what the finder saw."""

from __future__ import annotations

import pytest
import torch
from compile_utils import compare_compiled, op_count

from moe_compile.samples import SAMPLES, example_input

CASES = [(name, {}) for name in SAMPLES] + [
    ("grouped_gemm", {"gated": False, "bias": True, "activation": "gelu"}),
    ("grouped_gemm", {"hidden_size": 30, "ffn_size": 22}),
    ("gathered_bmm", {"gated": False, "activation": "relu"}),
    ("gathered_bmm", {"gated": False, "activation": "relu2"}),  # NemotronH's experts: an expr: activation
    ("gathered_bmm", {"router": "softmax+sort"}),  # top-k as the head of a sort
    ("sparsemixer", {"top_k": 3}),
    ("normed_router", {"router": "latent", "extra_rows": 1}),  # a latent router MLP; unrouted score rows
    ("sequential_mlp", {"style": "tolist", "gated": False, "activation": "gelu"}),  # slices by counts.tolist()
    ("sequential_mlp", {"style": "int"}),  # n = int(counts[e]) per expert
    ("grouped_gemm", {"gated": False, "bias": True, "activation": "relu2"}),
    ("expert_loop", {"gated": False, "bias": True, "activation": "relu"}),
    ("expert_loop", {"top_k": 8}),  # K == E
    ("dense_masked", {"gated": True, "norm_topk_prob": True, "activation": "silu"}),
    ("switch_einsum", {"gated": True, "activation": "gelu_tanh"}),
    ("gshard_einsum", {"top_k": 3, "capacity_factor": 0.75}),
    ("qwen3", {"norm_topk_prob": True, "top_k": 2}),
    ("deepseek_v3", {"hidden_size": 24, "ffn_size": 24}),  # H == F: orientation is ambiguous by shape
]


def _id(case: tuple[str, dict]) -> str:
    name, o = case
    return name + ("-" + "-".join(f"{k}={v}" for k, v in o.items()) if o else "")


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_sample_compiles_to_expert_op_and_matches_eager(case: tuple[str, dict]) -> None:
    name, overrides = case
    spec = SAMPLES[name]
    torch.manual_seed(0)
    model = spec.make(**overrides)
    x = example_input(spec, **overrides)
    cmp = compare_compiled(model, [x])
    cmp.assert_close()
    report = cmp.report
    assert len(report.regions) == 1, report
    assert op_count(report) == 1
    r, want = report.regions[0], spec.expected(**overrides)
    assert (r.num_experts, r.top_k, r.hidden_size, r.ffn_size) == (
        want["num_experts"], want["top_k"], want["hidden_size"], want["ffn_size"])
    assert (r.activation, r.gated, r.bias) == (want["activation"], want["gated"], want["bias"])
    assert r.drops == want["drops"]
    # router label: same score function, and group-limited routing recognized as such
    assert r.router.split("+")[0].replace("topk", "") in want["router"]
    assert ("grouped" in r.router) == ("grouped" in want["router"])
    assert r.verification == "verified" and r.forward_err <= 1e-4 and r.backward_err <= 1e-4
    assert r.plan == "local"


@pytest.mark.parametrize(("name", "overrides", "form"), [
    # gate and up: interleaved rows of a transposed [E, H, 2F] (views grouped_mm cannot take one by
    # one): the stored tensor, one matmul with 2F columns
    ("gpt_oss", {}, "experts_composite_gate_up"),
    ("grouped_gemm", {}, "experts_composite_gate_up"),
    # E modules, each one [2F, H] linear_fc1 with gate and up halves: per-module views, no stack
    ("sequential_mlp", {}, "experts_composite_list"),
    ("expert_loop", {}, "experts_composite_list"),
])
def test_cpu_lowering_takes_the_weights_as_stored(name: str, overrides: dict, form: str) -> None:
    """On CPU the expert op becomes the composite form that reads the weights as the model stores
    them (lower_kernels): no stacked copy of E modules' weights, one matmul where gate and up are
    one tensor; outputs and every gradient still equal eager's."""
    spec = SAMPLES[name]
    torch.manual_seed(0)
    cmp = compare_compiled(spec.make(**overrides), [example_input(spec, **overrides)])
    cmp.assert_close()
    code = cmp.report.after
    assert f"torch.ops.hiermoe.{form}.default(" in code, code
    assert "torch.stack(" not in code, code
    if name == "gpt_oss":
        # its gate and up biases are one stored [E, 2F] tensor too: added to the 2F-column
        # product before the split, so the backward reduces one gradient for both
        assert "b_gate_up = l_self_parameters_gate_up_proj_bias_" in code, code


def test_capacity_layer_keeps_its_drops() -> None:
    """GShard with a small capacity drops tokens; the rewrite must drop exactly the same ones
    (a dropless rewrite would give those tokens an output and fail this)."""
    spec = SAMPLES["gshard_einsum"]
    torch.manual_seed(1)
    model = spec.make(capacity_factor=0.5)
    x = example_input(spec)
    cmp = compare_compiled(model, [x])
    cmp.assert_close()
    assert cmp.report.regions[0].drops
    assert cmp.report.regions[0].pattern == "einsum_capacity"


@pytest.mark.parametrize("name", ["expert_loop", "grouped_gemm", "deepseek_v3", "sequential_mlp"])
def test_dynamic_shapes_compile_once_and_stay_correct(name: str) -> None:
    """With dynamic=True the rewrite must not specialize the token count: one graph serves
    several batch shapes, and each result equals eager."""
    from moe_compile.backend import collect_reports

    spec = SAMPLES[name]
    torch.manual_seed(0)
    model = spec.make()
    torch._dynamo.reset()
    with collect_reports() as graphs:
        compiled = torch.compile(model, backend="hiermoe", options={"inner_compiler": "aot_eager"}, dynamic=True)
        for batch, seq in ((2, 8), (3, 5), (4, 3)):
            x = example_input(spec, batch=batch, seq=seq)
            y, ref = compiled(x), model(x)
            assert (y - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item())
    assert len(graphs) == 1 and len(graphs[0].regions) == 1


@pytest.mark.parametrize("name", ["expert_loop", "grouped_gemm", "gshard_einsum"])
def test_bf16_layers_are_rewritten(name: str) -> None:
    """bf16 layers verify at bf16 precision (an fp32 routing-weight gradient computed from bf16
    expert outputs is only bf16-exact) and the compiled result stays within bf16 rounding of
    eager: 3e-2 of the output scale, about 4 bf16 ulps at the largest magnitude."""
    spec = SAMPLES[name]
    torch.manual_seed(0)
    model = spec.make().to(torch.bfloat16)
    x = example_input(spec).to(torch.bfloat16)
    cmp = compare_compiled(model, [x])
    cmp.assert_close(rtol=3e-2)
    assert len(cmp.report.regions) == 1 and cmp.report.regions[0].dtype == "bfloat16"

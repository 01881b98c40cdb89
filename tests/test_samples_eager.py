"""The sample MoE layers against an independent slow per-token reference, in eager and traced by Dynamo.

The reference below shares no code with samples/: it reads each layer's parameters by name, applies
the router rule named by ``spec.expected()["router"]`` token by token (so a wrong metadata claim fails
here too), and sums w * FFN_e(x_t) over the chosen experts. Capacity drops are replayed with a plain
per-choice counter in GShard priority order.

Tolerance: everything is fp32 and the layer and the reference differ only in summation order (batched
matmuls vs. per-token dot products of length <= 48, different expert-sum order), which moves results
by a few ulps of the output scale, about 1e-7 relative. 1e-5 relative to each tensor's max magnitude
leaves margin for that, while any wrong expert, weight or activation shows up at >= 1e-2 relative.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moe_compile.samples import SAMPLES, TinyLMConfig, TinyMoELM, example_input
from moe_compile.samples.train_tiny_lm import main as train_main
from moe_compile.samples.train_tiny_lm import train

REL_TOL = 1e-5

ACT = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
    "expr:square(relu(u))": lambda t: F.relu(t) ** 2,
}


def _gpt_oss_glu(gate, up, alpha: float = 1.702, limit: float = 7.0):
    """GPT-OSS's clamped SwiGLU, from the paper's formula: (clamp(u) + 1) * g sigmoid(alpha g), g <= limit."""
    g = torch.minimum(gate, torch.tensor(limit))
    return (torch.clamp(up, -limit, limit) + 1) * g * torch.sigmoid(alpha * g)


# gated activations the samples state as expressions: h from (gate, up)
GATED = {SAMPLES["gpt_oss"].activation: _gpt_oss_glu}


def _split(w, gated: bool):
    """Concatenated [gate; up] rows -> (gate, up); non-gated -> (None, w)."""
    if w is None:
        return None, None
    if not gated:
        return None, w
    half = w.shape[0] // 2
    return w[:half], w[half:]


def _expert(m, e: int, gated: bool) -> dict:
    """Expert e's weights as {gate [F,H] | None, up [F,H], down [H,F], b_gate, b_up, b_down}."""
    cls = type(m).__name__
    if cls in ("GroupedGemmMoE", "GatheredBmmMoE"):
        up_name = "gate_up_proj" if hasattr(m, "gate_up_proj") else "up_proj"
        gate, up = _split(getattr(m, up_name)[e], gated)
        bias = getattr(m, up_name + "_bias", None)
        b_gate, b_up = _split(None if bias is None else bias[e], gated)
        b_down = m.down_proj_bias[e] if hasattr(m, "down_proj_bias") else None
        return dict(gate=gate, up=up, down=m.down_proj[e], b_gate=b_gate, b_up=b_up, b_down=b_down)
    if cls == "SwitchEinsumMoE":
        bias = hasattr(m, "bi")
        return dict(
            gate=m.wi_gate[e].T if gated else None,
            up=m.wi[e].T,
            down=m.wo[e].T,
            b_gate=m.bi_gate[e] if gated and bias else None,
            b_up=m.bi[e] if bias else None,
            b_down=m.bo[e] if bias else None,
        )
    if cls == "GptOssMoE":  # [in, out] storage, gate and up in alternating columns
        w, b = m.gate_up_proj[e].T, m.gate_up_proj_bias[e]
        return dict(gate=w[0::2], up=w[1::2], down=m.down_proj[e].T, b_gate=b[0::2], b_up=b[1::2],
                    b_down=m.down_proj_bias[e])
    if cls == "NormedRouterMoE":
        gate, up = _split(m.gate_up_proj[e], True)
        return dict(gate=gate, up=up, down=m.down_proj[e], b_gate=None, b_up=None, b_down=None)
    if cls == "SparseMixerMoE":
        return dict(gate=m.w1[e], up=m.w3[e], down=m.w2[e], b_gate=None, b_up=None, b_down=None)
    if cls == "DeepseekV3MoE":
        gate, up = _split(m.experts.gate_up_proj[e], True)
        return dict(gate=gate, up=up, down=m.experts.down_proj[e], b_gate=None, b_up=None, b_down=None)
    if cls == "SequentialMLPMoE":
        fc1, fc2 = m.local_experts[e].linear_fc1.weight, m.local_experts[e].linear_fc2.weight
        gate, up = _split(fc1, gated)
        return dict(gate=gate, up=up, down=fc2, b_gate=None, b_up=None, b_down=None)
    names = {
        "MixtralSparseMoeBlock": ("w1", "w3", "w2"),
        "DenseMaskedMoE": ("fc_gate", "fc1", "fc2"),
        "Qwen3MoeSparseMoeBlock": ("gate_proj", "up_proj", "down_proj"),
    }[cls]
    if cls == "MixtralSparseMoeBlock" and not gated:
        names = (None, "w1", "w2")  # without a gate, w1 is the up projection
    gate_l, up_l, down_l = (getattr(m.experts[e], n) if n else None for n in names)
    return dict(
        gate=gate_l.weight if gate_l is not None else None,
        up=up_l.weight,
        down=down_l.weight,
        b_gate=gate_l.bias if gate_l is not None else None,
        b_up=up_l.bias,
        b_down=down_l.bias,
    )


def _linear(x, w, b):
    y = (w * x).sum(-1)  # per-token dot products, not a matmul, to differ from the layers
    return y if b is None else y + b


def _ffn(x_H, p: dict, act: str):
    if act in GATED:
        h = GATED[act](_linear(x_H, p["gate"], p["b_gate"]), _linear(x_H, p["up"], p["b_up"]))
    elif p["gate"] is not None:
        h = ACT[act](_linear(x_H, p["gate"], p["b_gate"])) * _linear(x_H, p["up"], p["b_up"])
    else:
        h = ACT[act](_linear(x_H, p["up"], p["b_up"]))
    return _linear(h, p["down"], p["b_down"])


def _rms(v):
    return v / torch.sqrt((v * v).mean() + 1e-6)


def _router(m):
    """(weight, bias or None) of the router's linear map."""
    for name in ("router", "gate", "wg"):
        sub = getattr(m, name, None)
        if sub is not None:
            return sub.weight, getattr(sub, "bias", None)
    raise AssertionError(type(m).__name__)


def _sparsemixer_route(logits_E, k: int, eps: float) -> tuple[list[int], torch.Tensor]:
    """PhiMoE's choice, one expert at a time: the best remaining score; its weight is a softmax
    over the remaining scores within a relative 2 eps of it, read at it."""
    chosen: list[int] = []
    weights = []
    for _ in range(k):
        rest = [e for e in range(logits_E.numel()) if e not in chosen]
        best = max(rest, key=lambda e: float(logits_E[e]))
        top = logits_E[best].detach()
        near = [e for e in rest if float((top - logits_E[e]) / torch.clamp(logits_E[e].abs(), min=top)) <= 2 * eps]
        weights.append(torch.softmax(logits_E[near], 0)[near.index(best)])
        chosen.append(best)
    return chosen, torch.stack(weights)


def _top(values, k: int) -> list[int]:
    values = values.detach()
    order = sorted(range(values.numel()), key=lambda e: -float(values[e]))
    return order[:k]


def _route_token(logits_E, meta: dict, spec_kwargs: dict, m) -> list[tuple[int, torch.Tensor]]:
    """[(expert, weight)] for one token, by the router rule the spec claims."""
    router, k = meta["router"], meta["top_k"]
    if router == "topk+softmax":
        idx = _top(logits_E, k)
        w = torch.softmax(logits_E[idx], dim=0)
    elif router == "topk+softmax+argmax":
        idx, w = _sparsemixer_route(logits_E, k, spec_kwargs["jitter_eps"])
    elif router in ("softmax", "softmax+sort", "softmax+renorm", "sigmoid", "sigmoid+renorm"):
        scores = torch.softmax(logits_E, 0) if router.startswith("softmax") else torch.sigmoid(logits_E)
        idx = _top(scores, k)
        w = scores[idx]
        if router.endswith("+renorm"):
            w = w / w.sum()
        if hasattr(m, "per_expert_scale") and m.latent is None:  # NormedRouterMoE's Gemma-4 router
            w = w * m.per_expert_scale[idx]
    elif router == "sigmoid+bias+grouped":
        scores = torch.sigmoid(logits_E)
        choice = (scores + m.gate.e_score_correction_bias).detach()
        n_group, topk_group = spec_kwargs["n_group"], spec_kwargs["topk_group"]
        per = choice.numel() // n_group
        group_score = [
            sum(sorted(choice[g * per : (g + 1) * per].tolist(), reverse=True)[:2]) for g in range(n_group)
        ]
        keep = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        # HF masks the other groups' experts to 0.0 (not -inf) before the final top-k.
        masked = torch.tensor([float(choice[e]) if e // per in keep else 0.0 for e in range(choice.numel())])
        idx = _top(masked, k)
        w = scores[idx]
        w = w / (w.sum() + 1e-20) if spec_kwargs["norm_topk_prob"] else w
    else:
        raise AssertionError(f"no reference for router {router!r}")
    w = w * meta["route_scale"]
    return list(zip(idx, w, strict=True))


def reference_forward(m, spec, x, overrides: dict) -> tuple[torch.Tensor, int]:
    """Slow per-token MoE; returns (output like x, number of dropped (token, choice) pairs)."""
    meta = spec.expected(**overrides)
    kwargs = {**spec.kwargs, **overrides}
    x_TH = x.reshape(-1, x.shape[-1])
    normed = type(m).__name__ == "NormedRouterMoE"
    if not normed:
        w_router, b_router = _router(m)
        logits = [w_router @ x_TH[t] + (0 if b_router is None else b_router) for t in range(x_TH.shape[0])]
    else:  # the router's own input (norm and scale, or a latent GELU layer), its unrouted rows cut
        w_router, num_e = m.proj.weight, meta["num_experts"]
        if m.latent is None:
            logits = [w_router @ (_rms(x_TH[t]) * m.router_scale * x_TH.shape[1] ** -0.5) for t in range(len(x_TH))]
        else:
            logits = [w_router @ F.gelu(m.latent.weight @ x_TH[t] + m.latent.bias) for t in range(len(x_TH))]
        logits = [v[:num_e] for v in logits]
        x_TH = torch.stack([_rms(x_TH[t]) * m.pre_norm for t in range(len(x_TH))])  # what the experts read
    routes = [_route_token(logits[t], meta, kwargs, m) for t in range(x_TH.shape[0])]

    num_dropped = 0
    if meta["drops"]:
        num_tokens, k, num_experts = x_TH.shape[0], meta["top_k"], meta["num_experts"]
        cap = max(
            math.ceil(meta["capacity_factor"] * num_tokens * k / num_experts), kwargs.get("min_capacity", 1)
        )
        kept = [[False] * k for _ in range(num_tokens)]
        used = [0] * num_experts
        for i in range(k):  # all first choices claim slots before any second choice
            for t in range(num_tokens):
                e = routes[t][i][0]
                kept[t][i] = used[e] < cap
                used[e] += 1
        num_dropped = sum(not kk for row in kept for kk in row)
        new_routes = []
        for t in range(num_tokens):
            chosen = [(e, w) for i, (e, w) in enumerate(routes[t]) if kept[t][i]]
            if meta["router"].endswith("+renorm") and chosen:  # GShard: renormalize the kept choices
                total = torch.clamp(sum(w for _, w in chosen), min=torch.finfo(torch.float32).eps)
                chosen = [(e, w / total) for e, w in chosen]
            new_routes.append(chosen)
        routes = new_routes

    experts = {}
    rows = []
    for t in range(x_TH.shape[0]):
        y = torch.zeros_like(x_TH[t])
        for e, w in routes[t]:
            if e not in experts:
                experts[e] = _expert(m, e, meta["gated"])
            y = y + w * _ffn(x_TH[t], experts[e], meta["activation"])
        rows.append(y)
    out = torch.stack(rows)
    if normed:
        out = torch.stack([_rms(row) * m.post_norm for row in out])
    if meta["shared_ffn_size"]:
        s = m.shared_experts
        shared = dict(
            gate=s.gate_proj.weight,
            up=s.up_proj.weight,
            down=s.down_proj.weight,
            b_gate=None,
            b_up=None,
            b_down=None,
        )
        out = out + torch.stack([_ffn(x_TH[t], shared, meta["activation"]) for t in range(x_TH.shape[0])])
    return out.reshape(x.shape), num_dropped


def _assert_close(actual, expected, what: str) -> None:
    atol = REL_TOL * float(expected.detach().abs().max()) + 1e-8
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=atol, msg=lambda m: f"{what}: {m}")


def _build(name: str, overrides: dict, seed: int = 0):
    spec = SAMPLES[name]
    torch.manual_seed(seed)
    m = spec.make(**overrides)
    if name == "deepseek_v3":
        # Nonzero selection bias, large enough to change choices, so "bias for selection only" is tested.
        with torch.no_grad():
            m.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    x = example_input(spec, **overrides)
    return spec, m, x


CASES = [(name, {}) for name in SAMPLES] + [
    ("grouped_gemm", {"gated": False, "bias": True, "activation": "gelu"}),
    ("grouped_gemm", {"impl": "fallback", "top_k": 3}),
    # 30 * 4 bytes is not 16-byte aligned: eager takes the custom-op fallback instead of _grouped_mm
    ("grouped_gemm", {"hidden_size": 30, "ffn_size": 22}),
    ("grouped_gemm_sigmoid", {"norm_topk_prob": True, "style": "hf"}),
    ("gathered_bmm", {"gated": False, "activation": "relu"}),
    ("gathered_bmm", {"gated": False, "activation": "relu2"}),
    ("gathered_bmm", {"router": "softmax+sort"}),
    ("sparsemixer", {"top_k": 3}),
    ("normed_router", {"router": "latent", "extra_rows": 1}),
    ("sequential_mlp", {"style": "tolist", "gated": False, "activation": "gelu"}),
    ("sequential_mlp", {"style": "int"}),
    ("expert_loop", {"gated": False, "bias": True, "activation": "relu"}),
    ("dense_masked", {"gated": True, "norm_topk_prob": True, "activation": "silu"}),
    ("switch_einsum", {"gated": True, "activation": "gelu_tanh"}),
    ("gshard_einsum", {"top_k": 3, "capacity_factor": 0.75}),
    ("qwen3", {"norm_topk_prob": True, "top_k": 2}),
]


@pytest.mark.parametrize(
    "name,overrides", CASES, ids=[f"{n}-{'-'.join(map(str, o.values())) or 'default'}" for n, o in CASES]
)
def test_sample_matches_per_token_reference(name: str, overrides: dict) -> None:
    spec, m, x = _build(name, overrides)
    x.requires_grad_(True)
    params = [p for p in m.parameters() if p.requires_grad]
    out = m(x)
    ref, num_dropped = reference_forward(m, spec, x, overrides)
    assert out.shape == x.shape
    _assert_close(out, ref, f"{name} forward")
    if spec.drops:
        # the example input must exercise drops, or the capacity logic is untested
        assert 0 < num_dropped < x.shape[0] * x.shape[1] * spec.expected(**overrides)["top_k"]

    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *params], grad_out, allow_unused=True, materialize_grads=True)
    want = torch.autograd.grad(ref, [x, *params], grad_out, allow_unused=True, materialize_grads=True)
    names = ["input"] + [n for n, p in m.named_parameters() if p.requires_grad]
    for n, g, r in zip(names, got, want, strict=True):
        _assert_close(g, r, f"{name} grad of {n}")


@pytest.mark.parametrize("name", list(SAMPLES))
def test_sample_traces_as_one_graph(name: str) -> None:
    spec, m, x = _build(name, {})
    num_graphs = 0

    def count_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        nonlocal num_graphs
        num_graphs += 1
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        out = torch.compile(m, backend=count_backend)(x)
    torch._dynamo.reset()
    assert num_graphs == 1, f"{name}: graph breaks ({num_graphs} graphs)"
    # The traced graph may take other code paths (grouped_gemm's custom-op fallback), same result.
    _assert_close(out, m(x), f"{name} traced forward")


def test_grouped_gemm_bf16_traces_aten_grouped_mm() -> None:
    # fp32 traces the custom-op fallback (the _grouped_mm meta accepts only bf16); bf16 keeps aten's op.
    spec, m, x = _build("grouped_gemm", {})
    targets: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        torch.compile(m, backend=backend)(x)
        fp32_targets = list(targets)
        targets.clear()
        torch._dynamo.reset()
        torch.compile(m.to(torch.bfloat16), backend=backend)(x.bfloat16())
    torch._dynamo.reset()
    assert sum("grouped_mm_fallback" in t for t in fp32_targets) == 2
    assert sum("_grouped_mm" in t and "fallback" not in t for t in targets) == 2


def test_registry_metadata() -> None:
    for name, spec in SAMPLES.items():
        meta = spec.expected()
        assert meta["drops"] == (meta["dispatch"] == "einsum_capacity"), name
        assert spec.top_k == meta["top_k"] and spec.num_experts == meta["num_experts"]
    assert {s.top_k for s in SAMPLES.values()} >= {1, 2, 4}
    assert SAMPLES["qwen3"].expected(norm_topk_prob=True)["router"] == "softmax+renorm"
    with pytest.raises(ValueError, match="cannot override"):
        SAMPLES["qwen3"].make(bias=True)


def test_tiny_lm_loss_decreases() -> None:
    torch.manual_seed(0)
    model = TinyMoELM(TinyLMConfig(moe_kind="grouped_gemm"))
    logits = model(torch.zeros(2, 5, dtype=torch.long))
    assert logits.shape == (2, 5, model.config.vocab_size)
    losses = train(model, steps=20, lr=1e-2, batch=8, seq=24, seed=0)
    assert all(math.isfinite(v) for v in losses)
    # log(32) = 3.47 at the start; the bigram part of the task alone brings it to log(3) = 1.1
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses


def test_train_script_runs(capsys: pytest.CaptureFixture[str]) -> None:
    train_main(["--steps", "2", "--moe-kind", "switch_einsum", "--layers", "1", "--seq", "8"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("step")

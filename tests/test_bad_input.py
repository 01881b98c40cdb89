"""Bad input: models without MoE, layers that fail verification, bad options, and the guarantee
that compiling never modifies the user's model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from compile_utils import compare_compiled, op_count
from torch import nn

import moe_compile
from moe_compile.samples import SAMPLES, example_input


def test_model_without_moe_compiles_unchanged() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    cmp = compare_compiled(model, [torch.randn(4, 16)])
    cmp.assert_close()
    assert cmp.report.regions == []
    assert any("no MoE layer found" in s.reason for s in cmp.report.skipped)
    g = cmp.report.graphs[0]
    assert g.before == g.after


class ClampedGLU(nn.Module):
    """An MoE whose experts clamp their outputs: not something the op computes (a clamped gate,
    as in GPT-OSS, it would compute as an ``expr:`` activation), so no interpretation accounts
    for the clamp and the layer must stay as written."""

    def __init__(self, h: int = 16, f: int = 24, e: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(h, e, bias=False)
        self.w_gate = nn.Parameter(torch.randn(e, f, h) / h**0.5)
        self.w_up = nn.Parameter(torch.randn(e, f, h) / h**0.5)
        self.w_down = nn.Parameter(torch.randn(e, h, f) / f**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = torch.topk(self.router(x).softmax(-1), 2)
        g = torch.einsum("tkfh,th->tkf", self.w_gate[idx], x)
        u = torch.einsum("tkfh,th->tkf", self.w_up[idx], x)
        y = torch.einsum("tkhf,tkf->tkh", self.w_down[idx], F.silu(g) * u).clamp(max=0.5)
        return (y * w.unsqueeze(-1)).sum(1)


def test_layer_failing_verification_is_left_alone_with_reason() -> None:
    cmp = compare_compiled(ClampedGLU(), [torch.randn(12, 16)])
    cmp.assert_close()
    assert cmp.report.regions == [] and op_count(cmp.report) == 0
    (skip,) = [s for s in cmp.report.skipped if "left unchanged" in s.reason]
    assert "`clamp` at test_bad_input.py:" in skip.reason and ".clamp(max=0.5)" in skip.reason


def test_unknown_option_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown hiermoe option\(s\) \['inner'\]; valid options are .*inner_compiler"):
        moe_compile.parse_options({"inner": "eager"})


@pytest.mark.parametrize(
    "options,match",
    [
        ({"inner_compiler": "tvm"}, r"'inner_compiler' must be one of \['inductor', 'aot_eager', 'eager'\]"),
        ({"disable_passes": ["fuse"]}, r"'disable_passes' names unknown pass\(es\) \['fuse'\]"),
        ({"disable_passes": "canonicalize"}, r"'disable_passes' must be a list"),
        ({"verify": "yes"}, r"'verify' must be True or False"),
        ({"pipeline": 0}, r"'pipeline' must be 'auto', 'tune', a chunk count n >= 1 or False"),
        ({"pipeline": "fast"}, r"'pipeline' must be 'auto', 'tune', a chunk count n >= 1 or False"),
        ({"pipeline": True}, r"'pipeline' must be 'auto', 'tune', a chunk count n >= 1 or False"),
        ({"pipeline": 4, "overlap": False}, r"'pipeline' overlaps the chunks' stages, which needs overlap=True"),
        ({"pipeline": 2}, r"'gather_compress', 'model_centric', 'replicated_experts' and 'sample_placement' set how expert-parallel "
                          r"layers communicate; they need options\['mesh'\]"),
        ({"model_centric": True}, r"'model_centric' must be 'auto', False or 'always'"),
        ({"model_centric": "always", "dimension": 2}, r"give one of them"),
        ({"model_centric": False}, r"they need options\['mesh'\]"),
        ({"sample_placement": True}, r"they need options\['mesh'\]"),
        ({"tune_strategy": True}, r"they need options\['mesh'\]"),
        ({"tune_strategy": "yes"}, r"'tune_strategy' must be True or False"),
        ({"sample_placement": "auto"}, r"'sample_placement' must be True or False"),
        ({"gather_compress": 0.5}, r"'gather_compress' must be None \(off\) or a compression ratio >= 1"),
        ({"gather_keep_bytes": -1}, r"'gather_keep_bytes' must be None"),
        ({"expert_gather": True}, r"'expert_gather' must be 'auto', False or the name of a mesh level"),
        ({"expert_gather": 0}, r"'expert_gather' must be 'auto', False or the name of a mesh level"),
        ({"expert_gather": "node", "dimension": 2}, r"give one of them"),
        ({"gather_prefetch": -1}, r"'gather_prefetch' must be 'auto' or an int >= 0"),
        ({"expert_gather": False}, r"they need options\['mesh'\]"),
        ({"tune_dimension": -1}, r"'tune_dimension' must be an int >= 0"),
        ({"tune_dimension": True}, r"'tune_dimension' must be an int >= 0"),
        ({"tune_dimension": 3}, r"they need options\['mesh'\]"),
    ],
)
def test_bad_option_values(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        moe_compile.parse_options(options)


def test_bad_option_fails_at_compile_time_through_torch_compile() -> None:
    spec = SAMPLES["expert_loop"]
    torch._dynamo.reset()
    compiled = torch.compile(spec.make(), backend="hiermoe", options={"inner_compiler": "nope"})
    with pytest.raises(Exception, match="inner_compiler"):
        compiled(example_input(spec))


def test_disabling_canonicalize_keeps_layer_and_says_so() -> None:
    spec = SAMPLES["gathered_bmm"]
    cmp = compare_compiled(spec.make(), [example_input(spec)], {"disable_passes": ["canonicalize"]})
    cmp.assert_close()
    assert cmp.report.regions == [] and op_count(cmp.report) == 0
    assert any("canonicalize pass is disabled" in s.reason for s in cmp.report.skipped)
    assert cmp.report.graphs[0].counters["canonicalize"] == {"disabled": 1}


def test_compiling_does_not_modify_the_model() -> None:
    spec = SAMPLES["expert_loop"]
    torch.manual_seed(0)
    model = spec.make()
    params_before = {n: p for n, p in model.named_parameters()}
    values_before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    modules_before = [type(m) for m in model.modules()]
    cmp = compare_compiled(model, [example_input(spec)])
    assert cmp.report.regions
    assert {n: p for n, p in model.named_parameters()} == params_before  # same objects
    for n, v in model.state_dict().items():
        assert torch.equal(v, values_before[n]), n
    assert [type(m) for m in model.modules()] == modules_before
    assert "OptimizedModule" not in type(model).__name__


def test_verify_false_rewrites_without_checking_and_says_so() -> None:
    spec = SAMPLES["qwen3"]
    cmp = compare_compiled(spec.make(), [example_input(spec)], {"verify": False})
    cmp.assert_close()
    (r,) = cmp.report.regions
    assert r.verification == "not verified (verify=False)"
    assert cmp.report.graphs[0].counters["canonicalize"]["verifications"] == 0


@pytest.mark.parametrize("name", ["grouped_gemm", "gathered_bmm", "expert_loop", "qwen3"])
def test_compiling_on_an_empty_batch_rewrites_and_runs(name: str) -> None:
    """A batch of 0 tokens is a batch (a data-parallel rank's last, a filtered one): the layer is
    rewritten (nothing to verify numerically; every interpretation that accounts for its ops) and
    the graph runs, forward and backward. The expert op once reshaped its [0, K*H] combine with a
    -1 that 0 elements cannot resolve, and the compile failed."""
    torch.manual_seed(0)
    spec = SAMPLES[name]
    model = spec.make()
    hidden = example_input(spec).shape[-1]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="hiermoe", options={"inner_compiler": "aot_eager"})
    with moe_compile.backend.collect_reports() as reports:
        empty = torch.randn(1, 0, hidden, requires_grad=True)
        y = compiled(empty)
        y.sum().backward()
    assert y.shape == (1, 0, hidden) and empty.grad is not None and empty.grad.shape == empty.shape
    assert sum(len(g.regions) for g in reports) == 1, [s.reason for g in reports for s in g.skipped]


@pytest.mark.parametrize("style", ["split", "tolist", "int"])
def test_a_loop_over_counts_compiles_on_an_empty_batch(style: str) -> None:
    """Megatron's SequentialMLP cuts expert-sorted tokens by counts read into Python ints (unbacked
    sizes under the flags ``import moe_compile`` sets). On 0 tokens, ``tokens[start:start + n]``
    slices an empty dimension with unbacked bounds, and Dynamo failed inside the slice's fake
    kernel (PendingUnbackedSymbolNotFound) under any backend, so a rank with no tokens could not
    compile and the others waited for it (``moe_compile.dynamo_fixes``). It compiles now, the
    layer rewritten, and equals eager forward and backward on the next batch."""
    torch.manual_seed(0)
    spec = SAMPLES["sequential_mlp"]
    model = spec.make(style=style)
    hidden = example_input(spec).shape[-1]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="hiermoe", options={"inner_compiler": "aot_eager"})
    with moe_compile.backend.collect_reports() as reports:
        empty = torch.randn(1, 0, hidden, requires_grad=True)
        compiled(empty).sum().backward()
    assert empty.grad is not None and empty.grad.shape == empty.shape
    assert sum(len(g.regions) for g in reports) == 1, [s.reason for g in reports for s in g.skipped]
    x = torch.randn(2, 5, hidden)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    yc, ye = compiled(xc), model(xe)
    yc.sum().backward()
    ye.sum().backward()
    assert torch.allclose(yc, ye, rtol=1e-5, atol=1e-6) and torch.allclose(xc.grad, xe.grad, rtol=1e-5, atol=1e-6)


class _BincountMoE(nn.Module):
    """Slots sorted by expert and cut by ``torch.bincount(ids, minlength=E).tolist()``: a count
    whose length depends on the data (bincount's is max(ids) + 1 when that exceeds minlength)."""

    def __init__(self, h: int = 16, f: int = 24, e: int = 4, k: int = 2) -> None:
        super().__init__()
        self.e, self.k = e, k
        self.router = nn.Linear(h, e, bias=False)
        self.w_up = nn.Parameter(torch.randn(e, f, h) / h**0.5)
        self.w_down = nn.Parameter(torch.randn(e, h, f) / f**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = torch.topk(F.softmax(self.router(x), dim=-1), self.k, dim=-1)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.e).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            slots = order[start:start + n]
            start += n
            tok = slots // self.k
            v = F.gelu(x[tok] @ self.w_up[e].t()) @ self.w_down[e].t()
            out = out.index_add(0, tok, v * w.reshape(-1)[slots, None])
        return out


def test_a_count_of_data_dependent_length_read_into_python_compiles() -> None:
    """``import moe_compile`` turns on ``capture_dynamic_output_shape_ops``; with it, Dynamo's
    ``tolist()`` of bincount's (unbacked-length) result raised GuardOnDataDependentSymNode, so a
    model that compiles without the package failed to compile at all, under any backend. The
    ``tolist()`` breaks the graph now, as the op did without the flag: the model runs and equals
    eager, and the split layer is left alone with the graph break named."""
    torch.manual_seed(0)
    model, x = _BincountMoE(), torch.randn(12, 16)
    for backend in ("aot_eager", "hiermoe"):
        torch._dynamo.reset()
        assert torch.allclose(torch.compile(model, backend=backend)(x), model(x), rtol=1e-5, atol=1e-6), backend
    cmp = compare_compiled(model, [x])
    cmp.assert_close()
    assert not cmp.report.regions
    assert any("graph break" in s.reason for s in cmp.report.skipped), cmp.report.skipped

"""What the README's "Reliability" section promises, one test per guarantee.

Exactness: a rewrite never changes what the model computes, also on values far outside the
compile batch (an op the expert op does not compute leaves the layer alone, named in the reason;
one it computes as an ``expr:`` activation is kept in the rewrite; numerical verification runs
on sample values of a wide range, not on the batch).
Agreement: every rank rewrites the same layers the same way, whatever its first batch holds.
Bounded failures: a rank that dies or hangs makes every other rank raise within the process
group timeout, naming the layer and the collective.

Tolerances: fp32, 1e-5 of each tensor's scale (compile_utils; summation order only).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from compile_utils import compare_compiled, op_count, rel_err
from dist_utils import WORKER, launch, run_ranks
from fuzz_moe import running_sum
from torch import nn

import moe_compile
from moe_compile.backend import collect_reports
from moe_compile.passes import canonicalize
from moe_compile.samples import SAMPLES, example_input

TOL = 1e-5


class LoopMoE(nn.Module):
    """A per-expert loop over stacked weights with one modification of the gated experts
    (``extra``), or none; clamps at ``limit``, which the compile batch never reaches (the GPT-OSS
    case: the clamp is inactive on the batch the layer is compiled on).  Between the projections
    (clamp, relu_gate, offset) the op computes it as an ``expr:`` activation; after the down
    projection (scale, clamp_out) it does not."""

    def __init__(self, extra: str = "none", h: int = 16, f: int = 32, e: int = 4, k: int = 2,
                 limit: float = 7.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(h, e, bias=False)
        self.w_gate = nn.Parameter(torch.randn(e, f, h) * 0.1)
        self.w_up = nn.Parameter(torch.randn(e, f, h) * 0.1)
        self.w_down = nn.Parameter(torch.randn(e, h, f) * 0.1)
        self.extra, self.e, self.k, self.limit = extra, e, k, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = self.router(x).softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(idx == e)
            h = x[tok]
            g = h @ self.w_gate[e].T
            u = h @ self.w_up[e].T
            if self.extra == "clamp":
                g = g.clamp(max=self.limit)
            if self.extra == "relu_gate":
                g = F.relu(g)  # positive pre-activations would hide it
            if self.extra == "offset":
                u = u + 1
            y = (F.silu(g) * u) @ self.w_down[e].T
            if self.extra == "scale":
                y = y * 0.5
            if self.extra == "clamp_out":
                y = y.clamp(max=self.limit)
            out.index_add_(0, tok, y * w[tok, slot, None])
        return out


def _compile_then_compare(model: nn.Module, compile_x: torch.Tensor, x: torch.Tensor,
                          options: dict | None = None) -> tuple[list, list[str], float]:
    """Compile on ``compile_x``, then compare with eager on ``x``: (regions, reasons left alone,
    the largest relative difference of outputs and gradients)."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="hiermoe", options={"inner_compiler": "aot_eager", **(options or {})})
    with collect_reports() as graphs:  # an input that requires grad, as below: the graph run there is this one
        compiled(compile_x.clone().requires_grad_())
    errs = []
    outs = []
    for fn in (compiled, model):
        xl = x.clone().requires_grad_()
        with collect_reports() as again:
            y = fn(xl)
        assert not again, "the comparison batch compiled a graph of its own instead of running the compile batch's"
        grads = torch.autograd.grad(y, [xl, *model.parameters()], torch.ones_like(y) * 0.5)
        outs.append((y.detach(), grads))
    (y_c, g_c), (y_e, g_e) = outs
    errs = [rel_err(y_c, y_e)] + [rel_err(a, b) for a, b in zip(g_c, g_e, strict=True)]
    return [r for g in graphs for r in g.regions], [s.reason for g in graphs for s in g.skipped], max(errs)


def _batches(extra: str) -> tuple[LoopMoE, torch.Tensor, torch.Tensor]:
    """The layer, a compile batch on which ``extra`` changes nothing, and a batch 100x larger."""
    gen = torch.Generator().manual_seed(0)
    small = torch.randn(8, 16, generator=gen) * 0.1
    model = LoopMoE(extra)
    if extra == "relu_gate":  # a batch on which every gate pre-activation is positive: relu is identity
        small = small.abs()
        with torch.no_grad():
            model.w_gate.abs_()
    return model, small, torch.randn(8, 16, generator=gen) * 100


@pytest.mark.parametrize("extra,named", [("scale", "scales the expert values by 0.5"),
                                         ("clamp_out", "`clamp` at test_reliability.py:")])
def test_inactive_modification_on_the_compile_batch_is_not_rewritten(extra: str, named: str) -> None:
    """Defect: a clamp the compile batch never reaches was "verified", and larger batches got
    outputs and gradients wrong by orders of magnitude. Now every op the rewrite would remove
    must be one the expert op computes: the layer is left alone, the op and its line named, and
    compiled equals eager on a batch 100x larger."""
    regions, reasons, err = _compile_then_compare(*_batches(extra))
    assert regions == [], f"{extra}: rewritten although the op does not compute it"
    assert any(named in r for r in reasons), reasons
    assert err <= TOL


@pytest.mark.parametrize("extra,expression", [("clamp", "silu(clamp(g,None,7.0))"), ("relu_gate", "silu(relu(g))"),
                                              ("offset", "add(u,1.0)")])
def test_inactive_modification_the_op_computes_is_kept_in_the_rewrite(extra: str, expression: str) -> None:
    """The same modifications between the projections (GPT-OSS's clamped gate): the op computes
    them as an ``expr:`` activation read off the graph, so the rewrite keeps them, and compiled
    equals eager on the batch 100x larger, where they act."""
    regions, reasons, err = _compile_then_compare(*_batches(extra))
    assert len(regions) == 1 and expression in regions[0].activation, (reasons, regions)
    assert err <= TOL


def test_numerical_verification_alone_catches_an_inactive_clamp(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second line: with the op accounting switched off, verification's "large values" case
    (sample tokens x16, not the compile batch) still sees the clamp on the experts' outputs."""
    monkeypatch.setattr(canonicalize, "unexplained_op", lambda *a, **k: None)
    regions, reasons, err = _compile_then_compare(*_batches("clamp_out"))
    assert regions == []
    assert any("large values: outputs differ" in r for r in reasons), reasons
    assert err <= TOL


def test_plain_layer_is_still_rewritten_and_exact_far_outside_the_compile_range() -> None:
    gen = torch.Generator().manual_seed(0)
    regions, reasons, err = _compile_then_compare(LoopMoE(), torch.randn(8, 16, generator=gen) * 0.1,
                                                  torch.randn(8, 16, generator=gen) * 100)
    assert len(regions) == 1 and regions[0].verification == "verified", reasons
    assert err <= TOL


def test_nan_in_the_compile_batch_does_not_disable_the_rewrite() -> None:
    """Defect: a NaN in the batch that triggered the compile failed verification and silently left
    the layer unrewritten for the rest of the run. Verification no longer reads the batch."""
    spec = SAMPLES["grouped_gemm"]
    torch.manual_seed(0)
    model = spec.make()
    x = example_input(spec)
    x_nan = x.clone()
    x_nan[0, 3, 5] = float("nan")
    regions, reasons, err = _compile_then_compare(model, x_nan, x)
    assert len(regions) == 1 and regions[0].verification == "verified", reasons
    assert err <= TOL


class _Inside(nn.Module):
    """Runs the layer under torch.autocast inside the compiled code (as accelerate's bf16 forward
    wrapper does)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.layer(x)


@pytest.mark.parametrize("where", ["inside", "around"])
def test_layers_under_autocast_compute_in_the_dtype_of_their_own_matmuls(where: str) -> None:
    """Before, the expert op computed in the tokens' dtype: under torch.autocast a layer whose
    matmuls ran in bf16 was computed in fp32 where autocast sat inside the compiled code (accelerate,
    the Trainer's bf16) and left alone where it sat around the call.  Now the op computes in bf16
    as the layer's own matmuls do, and sums them weighted in fp32 as the layer does (its result is
    in promote(tokens, routing weights)).  The per-expert loop's result then equals eager's under
    autocast, every element (before, the op rounded its result to bf16: 99.9 % of the elements
    differed); the gathered-bmm layer (bmm vs grouped matmul: other summation orders) is much
    nearer eager under autocast than eager in fp32 is.  And the compile leaves autocast as it
    found it."""
    size = {"hidden_size": 256, "ffn_size": 512}
    errs = {}
    for name in ("expert_loop", "gathered_bmm"):
        spec = SAMPLES[name]
        torch.manual_seed(0)
        layer = spec.make(**size)
        x = example_input(spec, **size)
        fp32 = layer(x).detach()
        model = _Inside(layer) if where == "inside" else layer
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "around"):
            ref = model(x).detach()
            torch._dynamo.reset()
            with collect_reports() as graphs:
                y = torch.compile(model, backend="hiermoe", options={"inner_compiler": "aot_eager"})(x).detach()
            assert torch.is_autocast_enabled("cpu") == (where == "around")
        regions = [r for g in graphs for r in g.regions]
        assert [r.dtype for r in regions] == ["bfloat16"], [s.reason for g in graphs for s in g.skipped]
        assert y.dtype == ref.dtype == torch.float32
        errs[name] = (float((y - ref).abs().mean()), float((fp32 - ref).abs().mean()))
        if name == "expert_loop":
            assert torch.equal(y, ref), errs
            assert not torch.equal(y, fp32)  # the check can fail: fp32 experts differ
    compiled_err, fp32_err = errs["gathered_bmm"]
    assert compiled_err <= 0.7 * fp32_err, errs


def _compiled_under_autocast(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                          list]:
    """(eager in fp32, eager under bf16 autocast, compiled under it, the compile's reports)."""
    fp32 = model(x).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x).detach()
        torch._dynamo.reset()
        with collect_reports() as graphs:
            y = torch.compile(model, backend="hiermoe", options={"inner_compiler": "aot_eager"})(x).detach()
    return fp32, ref, y, list(graphs)


def test_an_out_of_place_sum_over_stacked_experts_is_rewritten_under_autocast() -> None:
    """Every partial sum of ``y = y.index_add(...)`` reaches the stacked expert tensors, so they
    were the output candidates and the layer's sum was none: left alone, in fp32 and under
    autocast. Now rewritten in bf16 under autocast (its biases rounded inside the matmul, as
    ``F.linear`` does), nearer eager under autocast than eager in fp32 is, and equal to eager in
    fp32 outside it."""
    model = running_sum("linear")
    x = torch.randn(64, 16)
    fp32, ref, y, graphs = _compiled_under_autocast(model, x)
    regions = [r for g in graphs for r in g.regions]
    assert [r.dtype for r in regions] == ["bfloat16"], [s.reason for g in graphs for s in g.skipped]
    assert rel_err(y, ref) < 0.5 * rel_err(fp32, ref), (rel_err(y, ref), rel_err(fp32, ref))
    comparison = compare_compiled(model, [x])
    assert op_count(comparison.report) == 1 and comparison.out_err <= TOL, comparison
    assert max(comparison.grad_errs.values()) <= TOL, comparison.grad_errs


def test_a_layer_that_cannot_run_outside_autocast_is_verified_under_it() -> None:
    """The Switch sample's routing casts its masks to the router's dtype, which under autocast the
    graph bakes in as bf16: its region cannot run outside autocast, so verification compared
    nothing and left it alone.  Now both run under autocast, gradients too, at bf16 tolerance:
    rewritten in bf16, nearer eager under autocast than eager in fp32 is."""
    spec = SAMPLES["switch_einsum"]
    torch.manual_seed(0)
    fp32, ref, y, graphs = _compiled_under_autocast(spec.make(), example_input(spec))
    assert [r.dtype for g in graphs for r in g.regions] == ["bfloat16"], [s.reason for g in graphs for s in g.skipped]
    assert y.dtype == ref.dtype == torch.bfloat16
    assert rel_err(y.float(), ref.float()) < 0.75 * rel_err(fp32, ref.float())


def test_a_layer_autocast_changes_unseen_is_left_alone_and_the_reason_says_so() -> None:
    """The grouped-GEMM sample calls an opaque custom op whose own matmuls autocast turns to bf16,
    where the graph shows fp32: the op in fp32 differs from the layer under autocast, so
    verification (which also runs both under it) leaves the layer as written, saying why."""
    spec = SAMPLES["grouped_gemm"]
    torch.manual_seed(0)
    model = spec.make()
    x = example_input(spec)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x)
        torch._dynamo.reset()
        with collect_reports() as graphs:
            y = torch.compile(model, backend="hiermoe", options={"inner_compiler": "aot_eager"})(x)
    assert not [r for g in graphs for r in g.regions]
    reasons = [s.reason for g in graphs for s in g.skipped]
    assert any("under torch.autocast, router: outputs differ" in r and
               "runs under torch.autocast('cpu', torch.bfloat16) around the compiled call" in r for r in reasons), reasons
    assert torch.equal(y, ref)  # the layer as written: eager's autocast computation


def test_verify_false_warns() -> None:
    spec = SAMPLES["qwen3"]
    with pytest.warns(UserWarning, match="rewritten without numerical verification"):
        cmp = compare_compiled(spec.make(), [example_input(spec)], {"verify": False})
    cmp.assert_close()


@pytest.mark.ranks
def test_ranks_agree_on_nan_and_empty_first_batches() -> None:
    """Defect: each rank verified on its own first batch; a NaN (or, for gathered bmm, 0 tokens)
    on one rank left its layer local while the others waited in expert-parallel collectives.
    Rank 1's first batch holds a NaN, rank 2's has 0 tokens: every rank rewrites the same layers,
    rank 2 taking the interpretation the others verified. And where one rank cannot rewrite a
    layer (rank 3's experts clamp their outputs in "diverge"), no rank does, the reason naming it."""
    kinds = ["grouped_gemm", "gathered_bmm", "diverge"]
    results = run_ranks(4, "unlucky", timeout_s=300, worker="reliability_worker.py", shape=[2, 2], kinds=kinds,
                        nan_rank=1, empty_rank=2, diverge_rank=3)
    for kind in kinds:
        per_rank = [res[kind] for res in results]
        for rank, r in enumerate(per_rank):
            assert max(r["errs"]) <= TOL, (kind, rank, r)
        if kind == "diverge":
            assert all(r["expert_parallel"] == 0 for r in per_rank), per_rank
            for rank in (0, 1, 2):
                assert any("because rank 3 leaves it alone: left unchanged: `clamp`" in s
                           for s in per_rank[rank]["skipped"]), per_rank[rank]
        else:
            assert all(r["expert_parallel"] > 0 for r in per_rank), (kind, per_rank)
            assert [r["verification"] for r in per_rank] == [["verified"], ["verified"],
                                                             ["0 tokens here: verified by the ranks with tokens"],
                                                             ["verified"]], (kind, per_rank)


def test_a_rank_with_0_tokens_takes_a_place_some_rank_with_tokens_verified() -> None:
    """Found by the fuzz's large profile (4 ranks, gathered top-1, batches of 0, 1, 8 and 7 tokens):
    the rank of 1 token verified the per-slot product [1, 1, H] (its input's shape, the sum's
    value at K = 1), the others the sum; the rank of 0 tokens can form only the sum, and was
    asked for the first rank's place, so every rank left the layer alone. It takes the first
    place a rank with tokens verified that it can form; where it can form none, the layer stays
    as written everywhere, the reason naming that rank and the places."""
    from moe_compile.ep.agreement import Proposal, _combine

    key = "E=8 K=1 H=8 float32: experts"
    mul, total = "output mul #0, weights to #0", "output sum #0, weights to #0"

    def rank(where: str = "", candidates: tuple[str, ...] = ()) -> Proposal:
        return Proposal(anchor="router.weight", name="moe", key=None if candidates else key, reason="",
                        where=where, vacuous=bool(candidates), candidates=tuple((key, c) for c in candidates),
                        tokens=0 if candidates else 8)

    agreed = _combine("moe", [rank(candidates=(total,)), rank(mul), rank(total), rank(total)])
    assert (agreed.key, agreed.where) == (key, total), agreed
    # the first place in rank order wins when the rank of 0 tokens can form both
    agreed = _combine("moe", [rank(candidates=(total, mul)), rank(mul), rank(total), rank(total)])
    assert (agreed.key, agreed.where) == (key, mul), agreed
    # no place every rank of 0 tokens can form: left alone, and the reason names the rank
    agreed = _combine("moe", [rank(candidates=(total,)), rank(mul), rank(candidates=(mul,)), rank(mul)])
    assert agreed.key is None and "rank 0 (0 tokens in its batch) cannot form" in agreed.reason, agreed


@pytest.mark.ranks
def test_ranks_with_different_options_fail_alike() -> None:
    results = run_ranks(4, "options_differ", timeout_s=300, worker="reliability_worker.py", shape=[2, 2])
    for rank, res in enumerate(results):
        assert "different expert-parallel options" in res["error"] and "rank 0: mesh" in res["error"], (rank, res)


@pytest.mark.ranks
@pytest.mark.parametrize("how", ["exit", "hang"])
def test_a_stopped_rank_makes_the_others_raise_within_the_timeout(how: str) -> None:
    """Defect: expert-parallel subgroups were made without a timeout, so a rank that hung blocked
    the others for gloo's 30 minutes. Rank 1 exits, or sleeps past the 5 s process group timeout,
    after one step; the others must raise within the timeout (and a margin for 2 loaded cores),
    naming the layer and the collective."""
    timeout_s = 5.0
    with tempfile.TemporaryDirectory() as out:
        done = launch(4, "stop", {"shape": [2, 2], "how": how, "pg_timeout_s": timeout_s}, timeout_s=180,
                      out_dir=out, worker=WORKER.with_name("reliability_worker.py"))
        assert done[1].returncode == 3, done[1].stdout[-3000:]
        for rank in (0, 2, 3):
            assert done[rank].returncode == 0, done[rank].stdout[-3000:]
            res = json.loads(Path(out, f"rank{rank}.json").read_text())
            assert res["error"].startswith("RuntimeError: layer layers.0.mlp: the forward dispatch all-to-alls"), res
            assert res["elapsed_s"] < timeout_s + 10, res


def test_explain_and_dumps_name_the_reason_for_left_alone_layers() -> None:
    report = moe_compile.explain(LoopMoE("clamp_out"), torch.randn(8, 16), options={"inner_compiler": "aot_eager"})
    assert "`clamp` at test_reliability.py:" in str(report)

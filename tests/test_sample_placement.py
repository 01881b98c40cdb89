"""NetMoE's sample placement as a rewrite (passes/sample_placement.py, lowering/sample_exchange.py):
on one process, the analysis on real transformers graphs (where it cuts, what moves, what it
refuses and why) with the rewrite's own verification; on real gloo ranks, compiled Mixtral with
attention masks and labels against eager (loss, logits, gradients), and the inter-node token bytes
it saves on sample-affine routing."""

from __future__ import annotations

from typing import Any

import hf_models
import pytest
import torch
from dist_utils import run_ranks
from torch._subclasses.fake_tensor import FakeTensorMode

from moe_compile.options import parse_options
from moe_compile.passes.sample_placement import Layer, PlacementResult, sample_placement_pass
from moe_compile.pipeline import PassContext, _canonicalize, _find
from moe_compile.samples.tiny_lm import TinyLMConfig, TinyMoELM


def _place(model: torch.nn.Module, *args: Any, fuse: bool = False, **kwargs: Any) -> tuple[PlacementResult, Any, Any]:
    """Run find + canonicalize + the placement pass (one process: every exchange a derangement of
    the local samples) inside a compile; returns the pass's result, eager's and the compiled output.
    ``fuse``: every layer's combine may carry its output to the new ranks (``fusable``)."""
    results: list[PlacementResult] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        ctx = PassContext(gm, example_inputs, parse_options({}))
        _find(ctx)
        _canonicalize(ctx)
        assert ctx.canonical is not None and ctx.found is not None
        pos = {n: i for i, n in enumerate(gm.graph.nodes)}
        layers = [Layer(r.region.name, r.op_node, r.op_node.args[1], r.region.top_k, 4 * r.region.hidden_size,
                        input_scaled=r.weights.scales == "input")
                  for r in sorted(ctx.canonical.rewritten, key=lambda r: pos[r.op_node])]
        results.append(sample_placement_pass(gm, layers, example_inputs, ctx.found.params, world=1,
                                             fusable=frozenset(lay.name for lay in layers) if fuse else frozenset()))
        return gm.forward

    torch._dynamo.reset()
    want = model(*args, **kwargs)
    got = torch.compile(model, backend=backend)(*args, **kwargs)
    assert len(results) == 1
    return results[0], want, got


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_transformers_models_place_their_residual_stream(model_type: str) -> None:
    """Three layers: a cut after each of the first two MoE layers moves the residual stream (one
    [S, H] fp32 block per sample) and, where a later attention still reads it, the [1, S, S] bool
    attention mask: nothing else is live there; the home cut after the last returns the residual
    stream alone, before the loss; with every exchange a derangement of the 3 local samples the graph's
    outputs are the unpermuted graph's up to fp32 rounding (the pass's own verification: 0 on an
    Intel Xeon; 1.2e-7 on an AMD EPYC, whose matmul kernels round a token row differently at
    another position in its expert's block; an op that mixed samples would be off by O(1)), and
    the loss and logits eager's."""
    model = hf_models.build(model_type, num_hidden_layers=3)
    ids = hf_models.input_ids(batch=3, seq=8)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    res, want, got = _place(model, input_ids=ids, attention_mask=mask, labels=labels)
    assert res.reason is None, res.reason
    assert res.verify_err is not None and res.verify_err <= 1e-6, res.verify_err
    assert [c.home for c in res.cuts] == [False, False, True]
    for c in res.cuts:
        assert c.sample_bytes in (8 * 32 * 4, 8 * 32 * 4 + 8 * 8), c
        assert len(c.moved) == (1 if c.sample_bytes == 8 * 32 * 4 else 2), c
    assert res.cuts[-1].sample_bytes == 8 * 32 * 4
    assert res.returns == []
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3"])
def test_cuts_fused_with_the_combine_move_no_more(model_type: str) -> None:
    """Where a layer's combine can take its output to the samples' new ranks (``fusable``), its cut
    is made right after the expert op: the op's output moves (on one process a derangement, which
    the verification checks like any move) but is not counted in the samples' bytes, and the rest
    is about what the cut after the residual add moves (the residual stream before the layer
    instead of after it, the mask; for the second layer a 64 B value more, which dies before the
    best unfused cut). DeepSeek-V3's shared expert runs beside the routed experts: after the op
    its output would move too (2x the bytes), so its cuts stay after the add, unfused. The home
    cut is never fused (the samples' results are best combined where they are placed)."""
    model = hf_models.build(model_type, num_hidden_layers=3)
    ids = hf_models.input_ids(batch=3, seq=8)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    res, want, got = _place(model, input_ids=ids, attention_mask=mask, labels=ids, fuse=True)
    assert res.reason is None, res.reason
    assert res.verify_err is not None and res.verify_err <= 1e-6, res.verify_err
    fused = model_type == "mixtral"
    assert [c.fused for c in res.cuts] == [fused, fused, False], res.cuts
    for c in res.cuts[:2]:
        assert c.sample_bytes in (8 * 32 * 4, 8 * 32 * 4 + 8 * 8, 8 * 32 * 4 + 2 * 8 * 8), c
        assert (c.after.startswith("experts") and len(c.moved) in (2, 3)) if fused else len(c.moved) in (1, 2), c
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)


def test_a_node_read_from_two_fake_modes_gets_a_fake_value() -> None:
    """The placement pass fills the example values Dynamo's trace left out (the expert op's, the
    pieces of a tuple) by fake propagation in a mode of its own; a node a later pass adds without
    one (a model-centric layer's token all-gather reading the tokens and such a piece) then reads
    fakes of two modes. ``graph_index.fake_tensor`` converts them into one: before, compiling such
    a layer with sample placement (4 ranks, K = 8: the planner chose model0 for the first layer)
    failed with "Mixing fake modes NYI"."""
    from moe_compile.passes.graph_index import fake_tensor

    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    total = graph.call_function(torch.add, (a, b))
    graph.output(total)
    with FakeTensorMode() as one:
        a.meta["example_value"] = torch.empty(3, 4)
    with FakeTensorMode():
        b.meta["example_value"] = torch.empty(3, 4)
    got = fake_tensor(total)
    assert got is not None and got.shape == (3, 4) and got.fake_mode is one


def test_the_tiny_lm_permuting_its_samples_into_dim_1_is_followed() -> None:
    """The tiny LM's attention permutes [B, S, 3, h, d] to [3, B, h, S, d] and unpacks q, k, v: the
    analysis follows the samples into dim 1 and back to dim 0 (a sample axis per value), so its three
    layers place their residual stream like the transformers models and the loss is eager's."""
    model = TinyMoELM(TinyLMConfig(num_layers=3))
    ids = torch.randint(0, 32, (3, 8), generator=torch.Generator().manual_seed(0))
    res, want, got = _place(model, ids, ids)
    assert res.reason is None, res.reason
    assert res.verify_err is not None and res.verify_err <= 1e-6, res.verify_err  # fp32 rounding, as above
    assert [(c.home, c.sample_bytes) for c in res.cuts] == [(False, 8 * 32 * 4), (False, 8 * 32 * 4), (True, 8 * 32 * 4)]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


class _BatchMixer(torch.nn.Module):
    """Two MoE layers with a batch-statistic between them (an op the analysis cannot see through:
    a mean over dim 0 subtracted from every sample)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TinyMoELM(TinyLMConfig(num_layers=2, moe_kind="grouped_gemm"))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        lm = self.lm
        x = lm.embed_tokens(ids)
        x = x + lm.layers[0].mlp(x)
        x = x - x.mean(0, keepdim=True)  # mixes the samples
        x = x + lm.layers[1].mlp(x)
        return lm.lm_head(x)


def test_an_op_that_mixes_samples_between_layers_returns_them_first() -> None:
    """A mean over the batch between two MoE layers: a value that differs between ranks, which a
    moved sample would meet on another rank, so the next layer's tokens cannot follow the samples;
    the pass refuses, naming the op that blocks them."""
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    res, want, got = _place(_BatchMixer(), ids)
    assert res.reason is not None and "do not follow" in res.reason and "mean" in res.reason, res.reason
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_input_scaled_experts_place_their_samples() -> None:
    """Llama-4's routing weights scale the experts' input: the op's rows are the K products w_tk x_t
    of each token, token-major, so a sample's rows are one block K times its tokens' (before, the
    pass refused such layers). The samples are counted on the tokens the weights scale (3, not
    T*K). Between the layers the analysis follows the shared expert's output that the routed sum
    is added into in place, and the displaced layers' rotary embedding (view_as_complex,
    view_as_real) and scalar mask (x.new_ones(())). A cut after each of the first two layers moves
    the residual stream, the home cut returns it; with every exchange a derangement of the 3 local
    samples the graph's outputs are the unpermuted graph's (the pass's own verification), and the
    loss and logits eager's."""
    model = hf_models.build("llama4_text", None, num_hidden_layers=3, num_experts_per_tok=2)
    ids = hf_models.input_ids(batch=3, seq=8)
    res, want, got = _place(model, input_ids=ids, labels=ids)
    assert res.reason is None, res.reason
    assert res.samples == 3, res.samples
    assert res.verify_err is not None and res.verify_err <= 1e-6, res.verify_err
    assert [c.home for c in res.cuts] == [False, False, True], res.cuts
    # the residual stream ([S, H] fp32 per sample), and after the first layer the [1, S, S] bool
    # attention mask that a later attention still reads
    assert [(c.moved[-1].startswith("hidden_states"), c.sample_bytes) for c in res.cuts] == \
        [(True, 8 * 32 * 4 + 8 * 8), (True, 8 * 32 * 4), (True, 8 * 32 * 4)], res.cuts
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)


def test_one_sample_per_rank_is_refused() -> None:
    model = hf_models.build("mixtral", num_hidden_layers=2)
    res, _, _ = _place(model, input_ids=hf_models.input_ids(batch=1, seq=8))
    assert res.reason is not None and "1 sample per rank" in res.reason


@pytest.mark.ranks
def test_placement_equals_eager_and_keeps_tokens_inside_nodes() -> None:
    """4 gloo ranks (2 nodes x 2), Mixtral of 3 layers whose samples prefer the other node's experts,
    attention masks with padding and labels with ignored positions: with sample placement the loss
    and logits equal eager's on every rank and the gradients summed over the ranks equal eager's;
    the first cut moved every sample to the other node (8 of 8), after which the second found nothing
    to gain (it declined: perm = identity); the inter-node dispatch and combine bytes drop to a sixth:
    of the first layer's all-to-alls only its dispatch (and the combine-shaped backward of it) still
    crosses, its combine brings each sample's output to its new rank inside the experts' node
    (fused cuts, ``ep_combine_to``; a third while the combine went to the old rank and the move
    carried the output), and the samples' own bytes are counted."""
    results = run_ranks(4, "placement", worker="placement_worker.py", shape=[2, 2], layers=3)
    for rank, res in enumerate(results):
        on, off = res["True"], res["False"]
        for r in (on, off):
            assert abs(r["loss"] - r["loss_ref"]) <= 1e-6 * abs(r["loss_ref"]), rank
            assert r["logits_err"] < 1e-6, rank
            assert r["grad_err"] < 1e-5, rank
        assert on["moves"] == [1, 0] and on["moved"] == [8, 0] and on["pays"] == [True, False], (rank, on)
        assert 6 * on["sent"]["dispatch"] == off["sent"]["dispatch"], (rank, on["sent"], off["sent"])
        assert 6 * on["sent"]["combine"] == off["sent"]["combine"], (rank, on["sent"], off["sent"])
        assert on["fused"] == 2 and "its output goes to the new ranks in its combine" in on["report"], (rank, on)
        assert on["sent"]["samples"] > 0 and off["sent"]["samples"] == 0
        # explain's view: the cuts, and the first layer's decision with its predicted inter-node bytes
        assert "sample placement: after" in on["report"] and "samples go home" in on["report"], on["report"]
        assert "moved 8 samples" in on["report"], on["report"]
        assert "sample placement" not in off["report"]


@pytest.mark.ranks
@pytest.mark.parametrize("chunks", [3, 18])
def test_placement_on_8_ranks_equals_eager(chunks: int) -> None:
    """8 gloo ranks (2 nodes x 4, one expert each), two layers run in chunks (pipeline), the
    rewritten graph run by the eager inner compiler (autograd through the ops' own registrations,
    no AOTAutograd): every one of the 16 samples moves to the other node after the first layer and
    comes home after the second; the first layer's chunks each combine to the samples' new ranks,
    each chunk's tokens landing at their rows of the new rank's whole output (``ep_combine_to``'s
    offset): in 3 chunks a chunk's 6 or 5 tokens straddle the rank's two samples; in 18, 16
    chunks of one token and 2 of none. Loss, logits and summed gradients equal eager's on every
    rank. The node link is 10 Mbit: at 100 the saving on 16 tokens a rank no longer repays the
    start-ups of a redirect all-to-all over the world per chunk (``cost.netmoe``)."""
    results = run_ranks(8, "placement", worker="placement_worker.py", shape=[2, 4], layers=2, variants=[True],
                        inner_compiler="eager", pipeline=chunks, node_gbps=0.01, timeout_s=400)
    for rank, res in enumerate(results):
        on = res["True"]
        assert abs(on["loss"] - on["loss_ref"]) <= 1e-6 * abs(on["loss_ref"]), rank
        assert on["logits_err"] < 1e-6 and on["grad_err"] < 1e-5, (rank, on)
        assert on["moves"] == [1] and on["moved"] == [16] and on["pays"] == [True], (rank, on)
        assert on["fused"] == 1 and f"{chunks} chunks" in on["report"], (rank, on["fused"], on["report"])


@pytest.mark.ranks
def test_llama4_placement_over_ranks_equals_eager() -> None:
    """Llama-4 (K rows per token, the routing weights scaling the experts' input) of 3 layers on 4
    gloo ranks (2 nodes x 2) with sample placement: before, refused; now each of the 2 steps' loss
    and logits equal eager's on every rank and the gradients summed over the ranks equal eager's,
    and the two cuts between its layers decide on every step (from the [T*K, 1] routing of each
    token's K rows) and move samples."""
    results = run_ranks(4, "llama4", worker="placement_worker.py", shape=[2, 2])
    for rank, res in enumerate(results):
        for step in res["steps"]:
            assert abs(step["loss"] - step["loss_ref"]) <= 1e-6 * abs(step["loss_ref"]), (rank, step)
            assert step["logits_err"] < 1e-5 and step["grad_err"] < 1e-5, (rank, step)
        assert res["placed_layers"] == 3, res
        assert len(res["decided"]) == 2 and all(d >= 1 for d in res["decided"]), res["report"]
        assert sum(res["moved"]) > 0, res  # samples did move (3 and 4 of the 16 when written)
        assert "sample placement: after" in res["report"], res["report"]

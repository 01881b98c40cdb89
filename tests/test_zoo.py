"""The transformers MoE zoo (moe_compile/zoo.py): every causal-LM family whose config has
experts, built small (one layer where the family's layers are alike), compiled with hiermoe
under each experts implementation it has (``grouped_mm`` and ``batched_mm``, or its own
experts code), forward and backward against eager.

A family must have every MoE layer rewritten, or be listed in LEFT_ALONE with how many layers are
rewritten and the words of the reason ``explain`` gives for the others: the test fails when a
family regresses, when a listed one starts to be rewritten (update the list), when the reason
changes, and when a new transformers release adds a family that is not rewritten.  Compiled must
equal eager in every case (relative 1e-5 of each tensor's scale, as compile_utils: summation order
only).  The ``eager`` inner compiler keeps this quick; ``python -m moe_compile.zoo`` makes
the same table with ``aot_eager`` (bench/results/zoo.md).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from moe_compile.zoo import implementations, moe_families, survey  # noqa: E402

GRAPH_BREAK = "The expert computation is not in this graph: a graph break"
# family -> (layers rewritten, words of the reason for the others), for every implementation it has
LEFT_ALONE = {
    # their own experts loop over `expert_hit` (a .nonzero()): Dynamo breaks the graph there, and
    # transformers has no other experts code for them (the reason says so after GRAPH_BREAK's words)
    "dbrx": (0, "dbrx models have no other experts implementation to switch to"),
    "longcat_flash": (0, "longcat_flash models have no other experts implementation to switch to"),
    # product-key experts: rows of two embeddings picked by a top-k of key scores, no expert FFN
    "doge": (0, "top-k is not fed by a router projection"),
    # the routed MLP is rewritten; the mixture-of-attention heads have attention between their
    # projections, not an activation (its layers are alike: built with 1, holding both)
    "jetmoe": (1, "`neg` at modeling_jetmoe.py"),
}
FAMILIES = moe_families()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # type: ignore[no-untyped-def]
    """The models are tiny: intra-op threads only add synchronization, and on a busy 2-core
    machine OpenMP's waits made each family 4x slower (an index_add_ of 32 rows took 50 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_zoo_is_every_moe_family_and_the_list_is_current() -> None:
    assert len(FAMILIES) >= 50 and {"mixtral", "gpt_oss", "phimoe", "deepseek_v4"} <= set(FAMILIES)
    assert set(LEFT_ALONE) <= set(FAMILIES), "a family listed as left alone is gone: drop it from LEFT_ALONE"


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_rewritten_or_left_alone_with_its_reason(family: str) -> None:
    for impl in implementations(family):
        row = survey(family, impl, inner_compiler="eager")
        assert not row.error, f"{family} ({impl}) did not run: {row.error}"
        assert row.equal, f"{family} ({impl}): compiled differs from eager (out {row.out_err:.1e}, " \
                          f"grads {row.grad_err:.1e})"
        assert row.moe_layers > 0, f"{family} ({impl}): no MoE layer in the small model"
        rewritten, words = LEFT_ALONE.get(family, (row.moe_layers, ""))
        assert row.rewritten == rewritten, f"{family} ({impl}): {row.rewritten}/{row.moe_layers} layers " \
                                           f"rewritten, expected {rewritten}: {row.reasons}"
        if words:
            assert any(words in r for r in row.reasons), f"{family} ({impl}): reason changed: {row.reasons}"
        if family in ("dbrx", "longcat_flash"):
            assert any(GRAPH_BREAK in r for r in row.reasons), row.reasons


@pytest.mark.parametrize("family", ["mixtral", "llama4_text", "beam"])
def test_under_bf16_autocast_layers_are_rewritten_in_the_dtype_of_their_matmuls(family: str) -> None:
    """Under torch.autocast (a mixed-precision trainer), every layer is rewritten: grouped_mm
    experts (torch._grouped_mm, which autocast leaves in fp32) in fp32, equal to plain
    torch.compile under autocast to fp32's rounding; bmm experts (batched_mm, Llama-4's own) in bf16, nearer it than the
    fp32 model is.  Before, Llama-4 and Beam's batched_mm layers were left alone under autocast."""
    for impl in implementations(family):
        row = survey(family, impl, inner_compiler="eager", autocast=True)
        assert not row.error, f"{family} ({impl}) did not run: {row.error}"
        assert row.rewritten == row.moe_layers > 0, (family, impl, row.reasons)
        err = max(row.out_err, row.grad_err)
        if impl == "grouped_mm":
            assert set(row.dtypes) == {"float32"} and err <= 1e-5, (family, impl, row.dtypes, err)
        else:
            assert set(row.dtypes) == {"bfloat16"} and row.equal, (family, impl, row.dtypes, err, row.gap)

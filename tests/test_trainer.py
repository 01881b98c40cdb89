"""transformers' Trainer with hiermoe: ``model.compile(backend="hiermoe")`` before the Trainer is
built trains with eager's losses (the path the README gives Trainer and accelerate users), and
``TrainingArguments(torch_compile_backend="hiermoe")`` is refused by accelerate, whose backend
names are a fixed enum (this test notices the day it takes custom backends)."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from torch.utils.data import Dataset

import moe_compile  # noqa: F401  (registers the backend)
from moe_compile.backend import collect_reports


class Tokens(Dataset):  # type: ignore[type-arg]
    """12 sequences of 17 random token ids (vocabulary 64), each its own labels."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (12, 17), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_mixtral(num_experts: int) -> transformers.MixtralForCausalLM:
    """A 2-layer MixtralForCausalLM (vocabulary 64, hidden 32, top-2), seeded, grouped_mm experts."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=num_experts,
                                        num_experts_per_tok=2, max_position_embeddings=32)
    model = transformers.MixtralForCausalLM(config)
    model.set_experts_implementation("grouped_mm")
    return model


def _losses(tmp_path: object, compile_model: bool, experts: str = "grouped_mm", **args: object) -> list[float]:
    model = tiny_mixtral(4)
    model.set_experts_implementation(experts)
    if compile_model:
        model.compile(backend="hiermoe", options={"inner_compiler": "aot_eager"})
    training = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, learning_rate=1e-3, disable_tqdm=True, **args)
    trainer = transformers.Trainer(model=model, args=training, train_dataset=Tokens())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]


def test_trainer_with_a_compiled_model_trains_like_eager(tmp_path: object) -> None:
    torch._dynamo.reset()
    eager = _losses(tmp_path, compile_model=False)
    compiled = _losses(tmp_path, compile_model=True)
    assert len(eager) == len(compiled) == 3
    # the rewritten layers compute what eager computes up to fp32 summation order; three AdamW
    # steps do not amplify that beyond 1e-5 relative at this size
    for a, b in zip(compiled, eager, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (compiled, eager)


def test_trainer_in_bf16_trains_like_eager_with_the_experts_in_bf16(tmp_path: object) -> None:
    """``bf16=True``: accelerate runs the forward under torch.autocast inside the compiled code.
    The batched-matmul experts' bmm then computes in bf16, and so does the expert op the layers
    are rewritten into (before, it computed in fp32 there)."""
    torch._dynamo.reset()
    eager = _losses(tmp_path, compile_model=False, experts="batched_mm", bf16=True)
    with collect_reports() as graphs:
        compiled = _losses(tmp_path, compile_model=True, experts="batched_mm", bf16=True)
    assert [r.dtype for g in graphs for r in g.regions] == ["bfloat16"] * 2, [s.reason for g in graphs for s in g.skipped]
    assert len(eager) == len(compiled) == 3
    for a, b in zip(compiled, eager, strict=True):  # measured: 1e-5 relative (bf16 rounding)
        assert abs(a - b) <= 1e-4 * abs(b), (compiled, eager)


def test_trainer_with_gradient_checkpointing_rewrites_the_checkpointed_layers(tmp_path: object) -> None:
    """``gradient_checkpointing=True``: the Trainer wraps each decoder layer in
    torch.utils.checkpoint; both MoE layers are still rewritten (inside the checkpointed
    subgraphs Dynamo makes of them) and training keeps eager's losses."""
    torch._dynamo.reset()
    eager = _losses(tmp_path, compile_model=False, gradient_checkpointing=True)
    with collect_reports() as graphs:
        compiled = _losses(tmp_path, compile_model=True, gradient_checkpointing=True)
    assert sum(len(g.regions) for g in graphs) == 2, [s.reason for g in graphs for s in g.skipped]
    assert len(eager) == len(compiled) == 3
    for a, b in zip(compiled, eager, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (compiled, eager)


def test_training_arguments_cannot_name_the_backend(tmp_path: object) -> None:
    with pytest.raises(ValueError, match="'HIERMOE' is not a valid DynamoBackend"):
        _losses(tmp_path, compile_model=False, torch_compile=True, torch_compile_backend="hiermoe")

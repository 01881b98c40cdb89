"""Small random-config Hugging Face transformers MoE models (built in code; nothing is downloaded)."""

from __future__ import annotations

import warnings

import torch

_SMALL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_local_experts=8,
    n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=64, first_k_dense_replace=0,
    n_group=2, topk_group=1, shared_expert_intermediate_size=48, kv_lora_rank=16, q_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, decoder_sparse_step=1, mlp_only_layers=[],
    num_shared_experts=1, n_shared_experts=1, use_cache=False,
)


def build(model_type: str, experts_implementation: str | None = "grouped_mm", seed: int = 0,
          **overrides: object) -> torch.nn.Module:
    """``experts_implementation`` None: the family's own experts (one without transformers'
    experts interface, such as Llama-4)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type)
    for k, v in {**_SMALL, **overrides}.items():
        if hasattr(cfg, k):
            setattr(cfg, k, v)
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[: cfg.num_hidden_layers]
    if model_type.startswith("deepseek"):
        cfg.num_key_value_heads = cfg.num_attention_heads  # MLA: one kv head per q head
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(cfg)
    if experts_implementation is not None:
        model.set_experts_implementation(experts_implementation)
    return model


def input_ids(seed: int = 0, batch: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, _SMALL["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))

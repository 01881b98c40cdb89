"""Routing where samples prefer experts, in a real transformers model (for the sample-placement
tests and benchmark): a Mixtral from a small config whose token embeddings point along one of
``groups`` orthogonal directions (token t: t % groups) and whose routers score expert e by the
direction of its rank block (e * groups // E), so a token goes to the experts of its group's ranks in
every layer; a batch's samples then choose how their tokens spread over the groups:

  affine   every token of a sample from one group (drawn per sample)
  balanced every token of a sample from one group, the groups taken in turn over a rank's samples
           (from a random first one): every rank holds samples of every group, as a shuffled corpus
           of topics gives
  zipf     each sample ranks the groups at random and draws each token's group with Zipf(s)
           weights over that ranking
  uniform  every token's group uniform: the routing is token-affine, not sample-affine

Needs transformers (the test extra).
"""

from __future__ import annotations

import warnings

import torch

ROUTINGS = ("affine", "balanced", "zipf", "uniform")


def affine_mixtral(*, layers: int, experts: int, top_k: int, groups: int, hidden: int = 32, ffn: int = 48,
                   vocab: int = 64, seed: int = 0) -> torch.nn.Module:
    """The model (module docstring); ``groups`` divides ``experts`` and ``vocab``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    if experts % groups or vocab % groups or hidden < groups:
        raise ValueError(f"groups={groups} must divide experts={experts} and vocab={vocab}, hidden={hidden} >= groups")
    config = MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                           num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=256,
                           use_cache=False)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = MixtralForCausalLM(config)
    model.set_experts_implementation("grouped_mm")
    basis = torch.eye(hidden)[:groups]
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(2.0 * basis[torch.arange(vocab) % groups] + 0.1 * torch.randn(emb.shape, generator=gen))
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate.copy_(4.0 * basis[torch.arange(experts) * groups // experts]
                       + 0.1 * torch.randn(gate.shape, generator=gen))
    return model


def token_groups(routing: str, samples: int, seq: int, groups: int, gen: torch.Generator,
                 zipf_s: float = 1.2) -> torch.Tensor:
    """[samples, seq] the group of every token (module docstring's routings)."""
    if routing == "affine":
        return torch.randint(0, groups, (samples, 1), generator=gen).expand(samples, seq)
    if routing == "balanced":
        first = int(torch.randint(0, groups, (1,), generator=gen))
        return ((torch.arange(samples) + first) % groups)[:, None].expand(samples, seq)
    if routing == "zipf":
        weights = 1.0 / torch.arange(1, groups + 1, dtype=torch.float64) ** zipf_s
        out = []
        for _ in range(samples):
            ranking = torch.randperm(groups, generator=gen)
            out.append(ranking[torch.multinomial(weights, seq, replacement=True, generator=gen)])
        return torch.stack(out)
    if routing == "uniform":
        return torch.randint(0, groups, (samples, seq), generator=gen)
    raise ValueError(f"unknown routing {routing!r}; use one of {ROUTINGS}")


def token_ids(groups_BS: torch.Tensor, groups: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Token ids of the given groups (t % groups == group), drawn uniformly inside each group."""
    return torch.randint(0, vocab // groups, tuple(groups_BS.shape), generator=gen) * groups + groups_BS


def rank_token_ids(routing: str, rank: int, world: int, samples: int, seq: int, groups: int, vocab: int,
                   seed: int = 1000) -> torch.Tensor:
    """[samples, seq] the token ids of rank ``rank``'s samples: every rank's batch drawn from one
    generator (as a distributed sampler deals one shuffled corpus), this rank's taken.

    Not one generator per rank seeded ``seed + rank``: torch's Mersenne Twister gives nearby seeds
    correlated first draws (seeds 1000..1003 all draw groups [1, 1, 1, 0] for 4 samples in 2
    groups), so every rank would hold the same groups and the batch would not be the routing named."""
    gen = torch.Generator().manual_seed(seed)
    batches = [token_ids(token_groups(routing, samples, seq, groups, gen), groups, vocab, gen) for _ in range(world)]
    return batches[rank]


__all__ = ["ROUTINGS", "affine_mixtral", "rank_token_ids", "token_groups", "token_ids"]

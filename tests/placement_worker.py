"""One rank of the sample-placement tests (launched by tests/dist_utils.py with
worker="placement_worker.py"): NetMoE's sample exchanges (``passes.sample_placement``) on a Hugging
Face Mixtral from a small random config whose routing is made sample-affine, against the eager
model. Cases write this rank's results to $HIERMOE_TEST_OUT/rank<r>.json; tests/test_sample_placement.py
asserts on them."""

from __future__ import annotations

import copy
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from ep_worker import PARAMS, main, make_mesh, rel_err, summed_grad_err, topology_for  # noqa: E402

import moe_compile  # noqa: E402
from moe_compile.backend import collect_reports  # noqa: E402
from moe_compile.ep import runtime  # noqa: E402
from moe_compile.lowering import sample_exchange  # noqa: E402
from moe_compile.report import Report, parallel_summary  # noqa: E402
from moe_compile.samples.sample_affine import affine_mixtral, token_ids  # noqa: E402

VOCAB, GROUPS = 64, 4


def batch(rank: int, world: int, samples: int, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's samples, each in the tokens of one group whose experts sit on the other half of
    the mesh (so the placement has something to gain); the first sample left-padded by 2, its labels
    ignored there."""
    gen = torch.Generator().manual_seed(100 + rank)
    half = GROUPS // 2
    far = (rank * GROUPS // world + half) % GROUPS  # a group of the other half
    groups = torch.tensor([far + b % 2 if far % 2 == 0 else far - b % 2 for b in range(samples)])
    ids = token_ids(groups[:, None].expand(samples, seq), GROUPS, VOCAB, gen)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return ids, mask, labels


def _inter_bytes(level: str) -> dict[str, int]:
    c = runtime.counters()[level]
    return {ph: sum(c[ph][dr]["payload_bytes"] for dr in ("forward", "backward")) for ph in ("dispatch", "combine", "samples")}


def case_placement() -> dict[str, Any]:
    """Compiled with and without sample placement, one forward and backward each: loss and logits
    against eager on this rank's batch, gradients summed over the ranks against eager's, the
    payload each phase sent across the slowest level, and what the placement decided."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = make_mesh(PARAMS["shape"])
    slow = mesh.mesh_dim_names[0]
    topology = topology_for(mesh, node_gbps=PARAMS.get("node_gbps", 0.1), inner_gbps=10.0)
    out: dict[str, Any] = {}
    for place in PARAMS.get("variants", [True, False]):
        torch._dynamo.reset()
        model = affine_mixtral(layers=PARAMS["layers"], experts=PARAMS.get("E", 8), top_k=PARAMS.get("K", 2),
                               groups=GROUPS, vocab=VOCAB)
        ref = copy.deepcopy(model)
        # without placement (the bytes to compare with) the cheaper eager inner compiler
        inner = PARAMS.get("inner_compiler", "aot_eager") if place else "eager"
        opts = {"mesh": mesh, "topology": topology, "inner_compiler": inner,
                "expert_gather": False, "sample_placement": place,
                "replicated_experts": False,  # the experts are on every rank: else, unplaced, they run replicated
                "pipeline": PARAMS.get("pipeline", "auto")}
        compiled = torch.compile(model, backend="hiermoe", options=opts)
        ids, mask, labels = batch(rank, world, PARAMS.get("samples", 2), 8)
        with collect_reports() as reports:
            runtime.reset_counters()
            got = compiled(input_ids=ids, attention_mask=mask, labels=labels)
            got.loss.backward()
        want = ref(input_ids=ids, attention_mask=mask, labels=labels)
        want.loss.backward()
        records = [r for lay in runtime.layers() if (r := sample_exchange.record(lay.layer_id)) is not None]
        graphs = [replace(g, regions=[r if r.ep_layer is None else replace(r, parallel=parallel_summary(r.ep_layer))
                                      for r in g.regions]) for g in reports]
        out[str(place)] = {
            "loss": got.loss.item(), "loss_ref": want.loss.item(),
            "logits_err": rel_err(got.logits.detach(), want.logits.detach()),
            "grad_err": summed_grad_err(model, ref),
            "sent": _inter_bytes(slow),
            "moves": [r.moves for r in records], "moved": [r.moved_samples for r in records],
            "pays": [bool(r.last.pays) if r.last is not None else None for r in records],
            "report": str(Report(graphs=graphs)),
            "fused": sum(g.counters.get("expert_parallel", {}).get("fused_combines", 0) for g in reports),
        }
    return out


def case_llama4() -> dict[str, Any]:
    """transformers' Llama-4 (its routing weights scale the experts' input: K rows per token) of
    3 layers with sample placement over the mesh, 2 steps: loss and logits against eager on this
    rank's batch, gradients summed over the ranks against eager's, each cut's decisions."""
    from hf_models import build, input_ids

    rank = dist.get_rank()
    mesh = make_mesh(PARAMS["shape"])
    torch._dynamo.reset()
    model = build("llama4_text", None, num_hidden_layers=3, num_experts_per_tok=2)
    ref = copy.deepcopy(model)
    opts = {"mesh": mesh, "topology": topology_for(mesh, node_gbps=0.01, inner_gbps=10.0),
            "inner_compiler": "aot_eager", "expert_gather": False, "sample_placement": True,
            "replicated_experts": False}
    compiled = torch.compile(model, backend="hiermoe", options=opts)
    out: dict[str, Any] = {"steps": []}
    with collect_reports() as reports:
        for step in range(2):
            ids = input_ids(seed=10 * step + rank, batch=4, seq=8)
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
            got = compiled(input_ids=ids, labels=ids)
            got.loss.backward()
            want = ref(input_ids=ids, labels=ids)
            want.loss.backward()
            out["steps"].append({"loss": got.loss.item(), "loss_ref": want.loss.item(),
                                 "logits_err": rel_err(got.logits.detach(), want.logits.detach()),
                                 "grad_err": summed_grad_err(model, ref)})
    records = [r for lay in runtime.layers() if (r := sample_exchange.record(lay.layer_id)) is not None]
    out["decided"] = [r.steps + r.skipped for r in records]
    out["moved"] = [r.moved_samples for r in records]
    out["placed_layers"] = sum(len(g.regions) for g in reports)
    out["report"] = str(Report(graphs=list(reports)))
    return out


if __name__ == "__main__":
    assert moe_compile is not None
    main(globals())

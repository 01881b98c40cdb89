"""One rank of the shard_experts tests (launched by tests/dist_utils.py with worker="shard_worker.py"):
each rank keeps only its own experts, trained with DDP-style averaging by hand and inside
DistributedDataParallel. Cases write this rank's results to $HIERMOE_TEST_OUT/rank<r>.json;
tests/test_expert_parallel.py asserts on them."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

sys.path.insert(0, str(Path(__file__).parent))

from ep_worker import ADAM_EPS, PARAMS, average_grads, main, make_mesh, rel_err, tiny, topology_for  # noqa: E402

import moe_compile  # noqa: E402
from moe_compile.backend import collect_reports  # noqa: E402


def train_against_ddp(model: torch.nn.Module, compiled: Any, eager: Any, shard_report: Any, steps: int,
                      optimizers: list[torch.optim.Optimizer] | None = None, clip: float = 0.0,
                      norms: dict[str, list[float]] | None = None, autocast: bool = False
                      ) -> tuple[dict[str, list[float]], float, str]:
    """``steps`` AdamW steps of the sharded ``model`` (through ``compiled``, gradients averaged by
    hand) and of ``eager`` (DDP of the unsharded model), each rank on its own batches. Returns the
    losses of both, the largest relative error between this rank's shards after training and the
    eager model's rows of its experts, and the code of the compiled first step. ``autocast``: both
    forwards under torch.autocast("cpu", bfloat16), as a mixed-precision trainer runs them."""
    rank = dist.get_rank()
    losses: dict[str, list[float]] = {"eager": [], "compiled": []}
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, eps=ADAM_EPS)
    opt_c = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=ADAM_EPS)
    if optimizers is not None:  # the caller's handles on both (eager's, compiled's)
        optimizers += [opt_e, opt_c]
    gen = torch.Generator().manual_seed(100 + rank)
    after_code = ""
    for step in range(steps):
        batch = torch.randint(0, 32, (2, 9), generator=gen)
        mixed = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
        if step == 0:
            with collect_reports() as graphs, mixed:
                compiled(batch[:, :-1], batch[:, 1:])  # compiles; the code the step runs
            after_code = "\n".join(g.after for g in graphs)
        for label, module, opt in (("eager", eager, opt_e), ("compiled", compiled, opt_c)):
            with mixed:
                loss = module(batch[:, :-1], batch[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if label == "compiled":
                average_grads(model, shard_report)
            if clip:  # the gradient norms: moe_compile's over the sharded model, torch's over eager's and
                # torch's over the sharded model's parameters (this rank's experts only: what not to do)
                if label == "compiled":
                    local = [p.grad for p in model.parameters() if p.grad is not None]
                    assert norms is not None
                    norms["local"].append(float(torch.nn.utils.get_total_norm(local)))
                    norms["compiled"].append(float(moe_compile.clip_grad_norm_(model, shard_report, clip)))
                else:
                    assert norms is not None
                    norms["eager"].append(float(torch.nn.utils.clip_grad_norm_(eager.parameters(), clip)))
            opt.step()
            losses[label].append(float(loss))
    # the sharded weights after training equal the eager DDP model's rows for this rank's experts
    eager_params = dict(eager.module.named_parameters())
    weight_err = 0.0
    for s in shard_report.shards:
        if s.local is not None:
            ref = eager_params[s.name][s.first:s.first + s.num_local]
            weight_err = max(weight_err, rel_err(s.local.detach(), ref.detach()))
    return losses, weight_err, after_code


def checkpoint_checks(model: torch.nn.Module, report: Any, reference: torch.nn.Module, kind: str, mesh: Any,
                      batch: torch.Tensor, model_loss: float) -> dict[str, Any]:
    """``full_state_dict`` of the sharded, trained ``model`` against ``reference`` (the unsharded
    model trained alike): the same keys, the same values (every expert in logical order, wherever
    a swap moved it), ``rank0_only`` the same on the first rank and empty elsewhere; loaded back
    into ``model`` it changes nothing; an unsharded
    model that loads it computes the sharded model's loss on ``batch`` (``model_loss``); a freshly sharded model (other weights)
    that loads it holds this rank's rows of it."""
    full = moe_compile.full_state_dict(model, report)
    ref = reference.state_dict()
    first = moe_compile.full_state_dict(model, report, rank0_only=True)
    out: dict[str, Any] = {
        "keys_missing": sorted(set(ref) - set(full)), "keys_extra": sorted(set(full) - set(ref)),
        "state_err": max(rel_err(full[k], ref[k]) for k in ref if k in full),
        "rank0_keys": len(first), "rank0_err": max((rel_err(first[k], full[k]) for k in first), default=0.0)}
    # loading it back into the model itself changes nothing: each rank takes its rows in its slots'
    # order now (after any swap)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.load_state_dict(full)
    out["reload_err"] = max(rel_err(p.detach(), before[n]) for n, p in model.named_parameters())
    # the rank's own state dict says whose rows it holds: its rows reversed (and their experts with
    # them) load back into the rank's order; marked as another rank's, it is refused
    own = model.state_dict()
    ids = {k: v for k, v in own.items() if k.endswith("_shard_experts")}
    out["ids"] = {k: v.tolist() for k, v in ids.items()}
    flipped = dict(own)
    for k, v in ids.items():
        rows = k[: -len("_experts")]
        flipped[rows], flipped[k] = own[rows].flip(0), v.flip(0)
    model.load_state_dict(flipped)
    out["flipped_err"] = max(rel_err(p.detach(), before[n]) for n, p in model.named_parameters())
    out["foreign_error"] = ""
    if ids:
        foreign = dict(own)
        for k, v in ids.items():
            foreign[k] = (v + v.numel()) % 8  # the next rank's experts
        try:
            model.load_state_dict(foreign)
        except ValueError as e:
            out["foreign_error"] = str(e)
    out["foreign_unchanged"] = max(rel_err(p.detach(), before[n]) for n, p in model.named_parameters())
    unsharded = tiny(kind, 8, seed=1)
    unsharded.load_state_dict(full)
    with torch.no_grad():
        out["loaded_loss"] = float(unsharded(batch[:, :-1], batch[:, 1:]))
    out["model_loss"] = model_loss
    fresh = tiny(kind, 8, seed=2)
    fresh_report = moe_compile.shard_experts(fresh, mesh, batch[:, :-1], batch[:, 1:])
    fresh.load_state_dict(full)
    per = 8 // dist.get_world_size()
    first_expert = mesh_position(mesh) * per
    rows_err = 0.0
    fresh_params = dict(fresh.named_parameters())
    for name, value in full.items():
        if name + "_shard" in fresh_params:  # stacked: the contiguous rows of a fresh shard
            rows_err = max(rows_err, rel_err(fresh_params[name + "_shard"].detach(),
                                             value[first_expert:first_expert + per]))
        elif name in fresh_params:  # every other parameter, the rank's expert modules included
            rows_err = max(rows_err, rel_err(fresh_params[name].detach(), value))
    out["fresh_rows_err"] = rows_err
    out["fresh_local_bytes"] = fresh_report.local_bytes
    return out


def optim_checks(model: torch.nn.Module, opt: torch.optim.Optimizer, report: Any, reference: torch.nn.Module,
                 ref_opt: torch.optim.Optimizer, kind: str) -> dict[str, Any]:
    """``full_optim_state_dict`` of the sharded model's optimizer against the unsharded reference's
    (``get_optimizer_state_dict``, trained alike): the same parameters and state, every expert's
    rows in logical order; ``rank0_only`` on the first rank only; loaded back into the sharded
    optimizer it changes nothing; an unsharded model's optimizer loads it and gives it back."""
    full = moe_compile.full_optim_state_dict(model, opt, report)
    ref = get_optimizer_state_dict(reference, ref_opt)
    first = moe_compile.full_optim_state_dict(model, opt, report, rank0_only=True)
    out: dict[str, Any] = {"keys_missing": sorted(set(ref["state"]) - set(full["state"])),
                           "keys_extra": sorted(set(full["state"]) - set(ref["state"])),
                           "groups_equal": [sorted(g["params"]) for g in full["param_groups"]]
                           == [sorted(g["params"]) for g in ref["param_groups"]]}
    out["state_err"] = max(_state_err(full["state"][k], ref["state"][k]) for k in ref["state"] if k in full["state"])
    out["rank0_keys"] = len(first)
    out["rank0_err"] = max((_state_err(first["state"][k], full["state"][k]) for k in first.get("state", {})),
                           default=0.0)
    before = {k: {s: v.clone() for s, v in st.items()} for k, st in get_optimizer_state_dict(model, opt)["state"].items()}
    moe_compile.load_full_optim_state_dict(model, opt, report, full)
    after = get_optimizer_state_dict(model, opt)["state"]
    out["reload_err"] = max(_state_err(after[k], before[k]) for k in before)
    unsharded = tiny(kind, 8, seed=1)
    unsharded.load_state_dict(moe_compile.full_state_dict(model, report))
    opt_u = torch.optim.AdamW(unsharded.parameters(), lr=1e-2, eps=ADAM_EPS)
    set_optimizer_state_dict(unsharded, opt_u, full)
    back = get_optimizer_state_dict(unsharded, opt_u)["state"]
    out["unsharded_err"] = max(_state_err(back[k], full["state"][k]) for k in full["state"])
    out.update(foreign_optim_checks(model, opt))
    return out


def foreign_optim_checks(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """A rank's own ``opt.state_dict()``: loaded on another rank (the first rank's on every rank,
    as a trainer that saves one file does) the next step is refused on every rank, nothing
    updated; its rows reordered (as an expert swap since would have them) they are put back in
    the rank's order; loaded back as it is, the step runs. The steps run without gradients, so
    AdamW changes no weight and no state by itself."""
    from moe_compile.sharding import ROWS_KEY

    grads = {n: p.grad for n, p in model.named_parameters()}
    opt.zero_grad(set_to_none=True)
    own = opt.state_dict()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state_before = copy.deepcopy(own["state"])
    out: dict[str, Any] = {"tagged": [len(g.get(ROWS_KEY, ())) for g in own["param_groups"]],
                           "world": dist.get_world_size()}
    first: list[Any] = [copy.deepcopy(own) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(first, src=0)
    opt.load_state_dict(first[0])
    try:
        opt.step()
        out["foreign_error"] = ""
    except RuntimeError as e:
        out["foreign_error"] = str(e)
    out["foreign_weights_err"] = max(rel_err(p.detach(), before[n]) for n, p in model.named_parameters())
    # this rank's rows in reverse order, and the tag saying so: loaded, they come back in order
    flipped = copy.deepcopy(own)
    reversed_rows = 0
    for group in flipped["param_groups"]:
        for i, _name, experts in group.get(ROWS_KEY, ()):
            if len(experts) > 1:
                pid = group["params"][i]
                for k, v in flipped["state"].get(pid, {}).items():
                    if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == len(experts):
                        flipped["state"][pid][k] = v.flip(0)
                        reversed_rows += 1
                experts.reverse()
    out["reversed_rows"] = reversed_rows
    flipped_err = 0.0
    for _ in range(2):  # the same dict twice: putting the rows in order left the caller's dict as it was
        opt.load_state_dict(flipped)
        opt.step()
        flipped_err = max(flipped_err, *(_state_err(opt.state_dict()["state"][k], state_before[k])
                                         for k in state_before))
    out["flipped_state_err"] = flipped_err
    opt.load_state_dict(own)
    opt.step()
    out["own_state_err"] = max(_state_err(opt.state_dict()["state"][k], state_before[k]) for k in state_before)
    out["own_weights_err"] = max(rel_err(p.detach(), before[n]) for n, p in model.named_parameters())
    for n, p in model.named_parameters():
        p.grad = grads[n]
    return out


def _state_err(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest relative error over one parameter's optimizer state (inf if the kinds differ)."""
    if sorted(a) != sorted(b):
        return float("inf")
    return max(rel_err(torch.as_tensor(a[k]).float(), torch.as_tensor(b[k]).float()) for k in a)


def mesh_position(mesh: Any) -> int:
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    return ranks.index(dist.get_rank())


def case_shard() -> dict[str, Any]:
    """shard_experts: per-rank expert memory, outputs/grads against eager, no expert-weight copy in
    the compiled step, and AdamW steps equal to eager DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    mesh = make_mesh(PARAMS["shape"])
    out: dict[str, Any] = {}
    for kind in PARAMS["kinds"]:
        torch._dynamo.reset()
        model = tiny(kind, 8)
        eager = DDP(copy.deepcopy(model))
        ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(rank))
        before = sum(p.numel() for p in model.parameters())
        shard_report = moe_compile.shard_experts(model, mesh, ids[:, :-1], ids[:, 1:])
        after = sum(p.numel() for p in model.parameters())
        expert_numel = shard_report.full_bytes // 4
        opts: dict[str, Any] = {"mesh": mesh, "dimension": 2, "inner_compiler": "aot_eager"}
        if PARAMS.get("tune_strategy"):  # the planner's candidates timed on the ranks (passes.autotune)
            opts = {"mesh": mesh, "inner_compiler": "aot_eager", "tune_strategy": True,
                    "topology": topology_for(mesh, node_gbps=0.1, inner_gbps=10.0)}
        compiled = torch.compile(model, backend="hiermoe", options=opts)
        with collect_reports() as graphs:
            optimizers: list[torch.optim.Optimizer] = []
            norms: dict[str, list[float]] = {"local": [], "compiled": [], "eager": []}
            losses, weight_err, after_code = train_against_ddp(model, compiled, eager, shard_report, PARAMS["steps"],
                                                               optimizers, PARAMS.get("clip", 0.0), norms)
        # a deep copy of the sharded model reuses the compiled graph (same code, weights are
        # inputs): stacked experts' placeholders are no shard's, so it must fail, not run on the
        # original's shards; E modules keep the local ones real, and the copy runs on its own
        twin_model = copy.deepcopy(model)
        twin = torch.compile(twin_model, backend="hiermoe", options=opts)
        copy_loss, zeroed_loss, copy_error = float("nan"), float("nan"), ""
        try:
            copy_loss = float(twin(ids[:, :-1], ids[:, 1:]))
            owned = {n for n, p in model.named_parameters() if shard_report.owns(p)}
            with torch.no_grad():  # the copy's own experts, zeroed: its loss must move
                for n, p in twin_model.named_parameters():
                    if n in owned:
                        p.zero_()
            zeroed_loss = float(twin(ids[:, :-1], ids[:, 1:]))
        except ValueError as e:
            copy_error = str(e)
        out[kind] = {"copy_error": copy_error, "copy_loss": copy_loss, "zeroed_loss": zeroed_loss,
                     "loss_now": float(compiled(ids[:, :-1], ids[:, 1:])), "pipelines": [r.pipeline for g in graphs for r in g.regions],
                     "plans": [r.plan for g in graphs for r in g.regions],
                     "full_bytes": shard_report.full_bytes, "local_bytes": shard_report.local_bytes,
                     "param_numel_before": before, "param_numel_after": after, "expert_numel": expert_numel,
                     "losses": losses, "weight_err": weight_err, "after_code": after_code,
                     "text": str(shard_report), "norms": norms}
        if PARAMS.get("checkpoint"):
            out[kind]["checkpoint"] = checkpoint_checks(model, shard_report, eager.module, kind, mesh, ids,
                                                          out[kind]["loss_now"])
            out[kind]["optim"] = optim_checks(model, optimizers[1], shard_report, eager.module, optimizers[0], kind)
    return out


def case_ddp_shard() -> dict[str, Any]:
    """Sharded experts under DistributedDataParallel, as a trainer wraps them: prepare_ddp, then
    model.compile(...) and DDP(model); AdamW steps against eager DDP of the unsharded model."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    mesh = make_mesh(PARAMS["shape"])
    torch._dynamo.config.optimize_ddp = PARAMS.get("optimize_ddp", False)
    model = tiny(PARAMS["kind"], 8)
    eager = DDP(copy.deepcopy(model))
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(rank))
    report = moe_compile.shard_experts(model, mesh, ids[:, :-1], ids[:, 1:])
    ignored = moe_compile.prepare_ddp(model, report)
    model.compile(backend="hiermoe", options={"mesh": mesh, "dimension": 2, "inner_compiler": "aot_eager"})
    wrapped = DDP(model)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, eps=ADAM_EPS)
    opt_c = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, eps=ADAM_EPS)
    gen = torch.Generator().manual_seed(100 + rank)
    losses: dict[str, list[float]] = {"eager": [], "compiled": []}
    with collect_reports() as graphs:
        for _ in range(PARAMS["steps"]):
            batch = torch.randint(0, 32, (2, 9), generator=gen)
            for label, module, opt in (("eager", eager, opt_e), ("compiled", wrapped, opt_c)):
                loss = module(batch[:, :-1], batch[:, 1:])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses[label].append(float(loss))
    return {"losses": losses, "ignored": ignored,
            "rewritten": sum(len(g.regions) for g in graphs)}


def case_trainer_shard() -> dict[str, Any]:
    """transformers' Trainer under torchrun with sharded experts, the way the README gives it:
    shard_experts, prepare_ddp, model.compile(...), then the Trainer, which wraps the model in
    DistributedDataParallel itself (accelerate); its logged losses (averaged over the ranks) against
    a Trainer of the unsharded eager model on the same batches, and its logged gradient norms
    (``ShardedExperts`` clips over the whole model). With ``save``: the compiled run
    saves a checkpoint halfway (``ShardedExperts``), and a second sharded model with other
    weights resumes from it; its losses are the uninterrupted run's, and the checkpoint loads into
    the unsharded model with from_pretrained; resumed without ``ShardedExperts`` it stops."""
    import warnings

    import transformers
    from test_trainer import Tokens, tiny_mixtral

    from moe_compile.trainer import ShardedExperts

    mesh = make_mesh(PARAMS["shape"])
    steps = PARAMS["steps"]
    save = PARAMS.get("save", 0)  # the step the checkpoint is saved at (0: none)
    shared = str(Path(os.environ["HIERMOE_TEST_OUT"]) / "trainer")  # one output folder, as torchrun runs have

    norms: dict[str, list[float]] = {}

    def losses(model: torch.nn.Module, out: str, callbacks: list[Any] | None = None, resume: str | None = None
               ) -> tuple[list[float], str]:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=2, max_steps=steps, logging_steps=1,
            report_to=[], save_strategy="steps" if save else "no", save_steps=save or 500, use_cpu=True,
            ddp_backend="gloo", learning_rate=1e-2, disable_tqdm=True, seed=0, dataloader_num_workers=0,
            adam_epsilon=ADAM_EPS,  # weights compared after AdamW steps: see ADAM_EPS
            max_grad_norm=PARAMS.get("max_grad_norm", 1.0), gradient_accumulation_steps=PARAMS.get("accumulate", 1))
        # the Trainer moves the model to its device when it is built (Module.to gives every buffer a
        # new tensor: the shard placeholders too, which the shard records must still know)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train(resume_from_checkpoint=resume)
        # a resumed run's history starts with the checkpoint's: only the steps it ran
        first = 0 if resume is None else save
        norms[out if resume is None else "resumed"] = [float(h["grad_norm"]) for h in trainer.state.log_history
                                                       if "grad_norm" in h and h["step"] > first]
        norms[f"{out}/max_grad_norm after"] = [float(args.max_grad_norm)]
        return ([float(h["loss"]) for h in trainer.state.log_history if "loss" in h and h["step"] > first],
                type(trainer.model_wrapped).__name__)

    def sharded(seed: int) -> tuple[torch.nn.Module, Any, list[str]]:
        model = tiny_mixtral(8)
        if seed:  # other weights than the run that saved: what resuming must replace
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)
        ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
        report = moe_compile.shard_experts(model, mesh, input_ids=ids, labels=ids)
        ignored = moe_compile.prepare_ddp(model, report)
        model.compile(backend="hiermoe", options={"mesh": mesh, "dimension": 2, "inner_compiler": "aot_eager"})
        return model, report, ignored

    eager = tiny_mixtral(8)
    model, report, ignored = sharded(0)
    callbacks = [ShardedExperts(report)]  # clipping over the whole model (and checkpoints, with save)
    with collect_reports() as graphs:
        compiled, wrapper = losses(model, shared, callbacks)
    out: dict[str, Any] = {"wrapper": wrapper, "rewritten": sum(len(g.regions) for g in graphs),
                           "sharded": len(report.shards), "ignored": ignored}
    eager_out = str(Path(os.environ["HIERMOE_TEST_OUT"]) / "eager")  # shared too: its first rank writes
    reference, _ = losses(eager, eager_out)
    if save:  # the checkpoint holds the unsharded model's weights at that step: eager's
        folder = os.path.join(shared, f"checkpoint-{save}")
        dist.barrier()  # the first rank wrote both checkpoints
        out["saved"] = sorted(os.listdir(folder))
        unsharded, info = transformers.MixtralForCausalLM.from_pretrained(folder, output_loading_info=True)
        out["loading_info"] = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys")}
        ref = dict(transformers.MixtralForCausalLM.from_pretrained(os.path.join(eager_out, f"checkpoint-{save}"))
                   .named_parameters())
        out["checkpoint_err"] = max((rel_err(p.detach(), ref[n].detach()), n) for n, p in unsharded.named_parameters())
        resumed_model, resumed_report, _ = sharded(1)
        out["losses_resumed"], _ = losses(resumed_model, shared, [ShardedExperts(resumed_report)], resume=folder)
        # resumed without ShardedExperts, the Trainer loads its first rank's optimizer state on
        # every rank (its optimizer.pt): the first step refuses it on every rank
        try:
            losses(resumed_model, shared, [], resume=folder)
            out["no_callback_error"] = ""
        except RuntimeError as e:
            out["no_callback_error"] = str(e)
    out["losses"] = {"compiled": compiled, "eager": reference}
    out["grad_norms"] = {"compiled": norms[shared], "eager": norms[eager_out],
                         "args after": norms[f"{shared}/max_grad_norm after"]}
    return out


def case_left_alone() -> dict[str, Any]:
    """A sharded layer that is not rewritten would read its placeholders' zeros: compiling it must
    fail, saying why the layer was left alone (the canonicalize pass disabled; the model called
    under torch.autocast, which the expert op does not follow, so verification fails)."""
    mesh = make_mesh(PARAMS["shape"])
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    out: dict[str, Any] = {}
    for label, options, autocast in (("disabled", {"disable_passes": ["canonicalize"]}, False),
                                     ("autocast", {}, True)):
        torch._dynamo.reset()
        model = tiny("grouped_gemm", 8)
        moe_compile.shard_experts(model, mesh, ids[:, :-1], ids[:, 1:])
        compiled = torch.compile(model, backend="hiermoe",
                                 options={"mesh": mesh, "dimension": 2, "inner_compiler": "aot_eager", **options})
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out[label] = {"loss": float(compiled(ids[:, :-1], ids[:, 1:])), "error": ""}
        except Exception as e:  # Dynamo wraps the backend's ValueError
            out[label] = {"loss": None, "error": str(e)}
    return out


def case_autocast() -> dict[str, Any]:
    """Sharded, expert-parallel training under torch.autocast (bf16) against eager DDP under it:
    the layers are rewritten, their expert op computing in bf16 as the layers' own matmuls do."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    mesh = make_mesh(PARAMS["shape"])
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {}
    for kind in PARAMS["kinds"]:
        torch._dynamo.reset()
        model = tiny(kind, 8)
        eager = DDP(copy.deepcopy(model))
        report = moe_compile.shard_experts(model, mesh, ids[:, :-1], ids[:, 1:])
        compiled = torch.compile(model, backend="hiermoe",
                                 options={"mesh": mesh, "dimension": 2, "inner_compiler": "aot_eager"})
        with collect_reports() as graphs:
            losses, weight_err, _ = train_against_ddp(model, compiled, eager, report, PARAMS["steps"],
                                                      autocast=True)
        sent: dict[str, list[dict[str, int]]] = {}
        if kind == PARAMS["kinds"][0]:  # one forward's payload bytes per level, in fp32 and under autocast
            for label, on in (("fp32", False), ("autocast", True)):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
                    explained = moe_compile.explain(model, ids[:, :-1], ids[:, 1:], options={
                        "mesh": mesh, "dimension": 2, "inner_compiler": "aot_eager"})
                sent[label] = [r.parallel["bytes_per_phase"] for r in explained.regions]
        out[kind] = {"losses": losses, "weight_err": weight_err, "sent": sent,
                     "dtypes": [r.dtype for g in graphs for r in g.regions],
                     "skipped": [s.reason for g in graphs for s in g.skipped]}
    return out


def case_generate() -> dict[str, Any]:
    """Greedy generation (transformers' generate) of a sharded, expert-parallel Mixtral, each rank
    its own prompt length; rank 0 stops early at an end-of-sequence token while the others go on
    (synced_gpus=True keeps its forwards, and so its layers' collectives, running). Against the
    eager unsharded model's generate on the same prompt."""
    import warnings

    from test_trainer import tiny_mixtral

    rank = dist.get_rank()
    mesh = make_mesh(PARAMS["shape"])
    model = tiny_mixtral(8).eval()
    eager = copy.deepcopy(model)
    prompt = torch.randint(3, 64, (1, 5 + rank), generator=torch.Generator().manual_seed(rank))
    steps = PARAMS["new_tokens"]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = eager.generate(prompt, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
        # rank 0 ends at its second new token; the others never end early
        eos = int(free[0, prompt.shape[1] + 1]) if rank == 0 else None
        want = eager.generate(prompt, max_new_tokens=steps, do_sample=False, eos_token_id=eos, pad_token_id=0)
        report = moe_compile.shard_experts(model, mesh, input_ids=prompt)
        model.compile(backend="hiermoe", options={"mesh": mesh, "dimension": 2, "inner_compiler": "aot_eager"})
        with collect_reports() as graphs:
            got = model.generate(prompt, max_new_tokens=steps, do_sample=False, eos_token_id=eos, pad_token_id=0,
                                 synced_gpus=True)
    return {"want": want.tolist(), "got": got.tolist(), "sharded": len(report.shards),
            "rewritten": max((len(g.regions) for g in graphs), default=0), "graphs": len(graphs)}


if __name__ == "__main__":
    main(globals())

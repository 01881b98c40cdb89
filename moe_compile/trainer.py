"""transformers' ``Trainer`` on a model whose experts ``shard_experts`` split over the ranks
(``from moe_compile.trainer import ShardedExperts``; needs transformers).

The Trainer clips, saves and resumes as if every rank held the same model. It clips with
``clip_grad_norm_(model.parameters())``: each rank's norm then covers only its own experts, so the
ranks scale their replicated gradients differently and their dense weights drift apart. Its first
rank writes ``model.state_dict()`` (only that rank's expert rows) and ``optimizer.state_dict()``
(only that rank's experts' state), and on resume every rank loads those files: a quarter of the
experts kept on 4 ranks, and every rank given the first rank's optimizer state.
``ShardedExperts`` makes each of these the unsharded model's:

- gradient clipping: at train begin it takes over ``args.max_grad_norm`` (sets it to 0 for the
  Trainer, puts it back at train end) and clips before each optimizer step with
  ``sharding.clip_grad_norm_`` (the whole model's norm, the experts' part summed over the mesh);
  the logged ``grad_norm`` is that norm;
- ``on_save`` (every rank, after the Trainer wrote the checkpoint): the weights gathered by
  ``sharding.full_state_dict`` replace the model file (``save_pretrained`` under the model's own
  parameter names: the folder loads into the unsharded model with ``from_pretrained``, and into
  the Trainer's resume, which transformers' original names do not), and the optimizer state
  gathered by ``sharding.full_optim_state_dict`` goes beside it as ``hiermoe_optimizer.pt``;
- on resume the Trainer loads that model file with ``load_state_dict`` (each rank keeps its rows,
  ``shard_experts``' pre-hook), then its own optimizer file; ``on_train_begin`` then puts every
  rank's own optimizer state in place from ``hiermoe_optimizer.pt``
  (``sharding.load_full_optim_state_dict``), before the first step.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import TrainerCallback

from moe_compile.ep.shard import ShardReport
from moe_compile.sharding import (
    clip_grad_norm_,
    full_optim_state_dict,
    full_state_dict,
    load_full_optim_state_dict,
)

OPTIMIZER_FILE = "hiermoe_optimizer.pt"
CHECKPOINT_PREFIX = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR: output_dir/checkpoint-<step>


class ShardedExperts(TrainerCallback):  # type: ignore[misc]
    """Give it the ``ShardReport`` ``shard_experts`` returned: ``Trainer(..., callbacks=[ShardedExperts(report)])``.
    ``resume_from``: the checkpoint folder a resumed run starts from, where it is not
    ``output_dir/checkpoint-<step>`` (``trainer.train(resume_from_checkpoint=True)`` and the
    Trainer's own folders are)."""

    def __init__(self, report: ShardReport, resume_from: str | None = None) -> None:
        self.report = report
        self.resume_from = resume_from
        self.max_grad_norm = 0.0  # the clipping taken over from the Trainer's arguments (0: none)
        self.last_norm: float | None = None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                              **kwargs: Any) -> None:
        if self.max_grad_norm > 0:
            assert model is not None, "the Trainer passes its model"
            self.last_norm = float(clip_grad_norm_(model, self.report, self.max_grad_norm))

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """The Trainer logs the norm it computes, over this rank's experts only: the whole model's."""
        if self.last_norm is None or logs is None or "grad_norm" not in logs:
            return
        logs["grad_norm"] = self.last_norm
        if state.log_history and "grad_norm" in state.log_history[-1]:
            state.log_history[-1]["grad_norm"] = self.last_norm

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.max_grad_norm > 0:  # the user's arguments as they were
            args.max_grad_norm = self.max_grad_norm

    def on_save(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                optimizer: Any = None, **kwargs: Any) -> None:
        assert model is not None and optimizer is not None, "the Trainer passes its model and optimizer"
        folder = os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}-{state.global_step}")
        # gathered to the mesh's first rank only where that rank is the one that writes (global rank 0)
        first_only = self.report.comm is not None and self.report.comm.ranks[0] == 0
        weights = full_state_dict(model, self.report, rank0_only=first_only)
        optim = full_optim_state_dict(model, _inner(optimizer), self.report, rank0_only=first_only)
        if args.should_save:
            # under the model's own parameter names: the Trainer's resume loads them with
            # load_state_dict, which does not convert transformers' original checkpoint names back
            # (transformers 5.24: an MoE model resumed from its own checkpoint silently keeps its
            # initial experts, a warning of missing keys); from_pretrained loads either
            model.save_pretrained(folder, state_dict=weights, save_original_format=False)  # type: ignore[operator]
            torch.save(optim, os.path.join(folder, OPTIMIZER_FILE))

    def on_train_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        if args.max_grad_norm is not None and args.max_grad_norm > 0:  # clipped here, not by the Trainer
            self.max_grad_norm = float(args.max_grad_norm)
            args.max_grad_norm = 0.0
        if state.global_step == 0:  # a fresh start: nothing to restore
            return
        assert model is not None and optimizer is not None, "the Trainer passes its model and optimizer"
        folder = self.resume_from or os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}-{state.global_step}")
        path = os.path.join(folder, OPTIMIZER_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"resuming at step {state.global_step} with sharded experts needs the optimizer state "
                f"ShardedExperts saved, but {path} does not exist: resume from a checkpoint saved with "
                "ShardedExperts, and give its folder as ShardedExperts(report, resume_from=...) where it "
                "is not output_dir/checkpoint-<step>")
        saved = torch.load(path, map_location=next(model.parameters()).device, weights_only=True)
        load_full_optim_state_dict(model, _inner(optimizer), self.report, saved)


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """accelerate's AcceleratedOptimizer wraps the torch optimizer the state belongs to."""
    return getattr(optimizer, "optimizer", optimizer)

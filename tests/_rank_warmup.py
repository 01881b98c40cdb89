"""Imported once by the forkserver the gloo ranks are forked from (dist_utils._PRELOAD): one
compile of the tiny LM with hiermoe, forward and backward, so the ranks start warm.

A process's first torch.compile pays for what every later one reuses: lazy imports inside Dynamo,
AOTAutograd and the fake-tensor machinery, sympy's caches, the custom ops' first dispatch.
Measured on the 2-core CI-sized VM: a 4-rank launch compiling the tiny LM over a 2x2 mesh spent
4.8 s of CPU per rank cold and 3.5 s after this warm-up (done once, not once per rank).

Nothing of it reaches a test: it runs on one process without a mesh (no expert-parallel layer,
process group or swap is created), and Dynamo's caches are reset after it.
"""

from __future__ import annotations

import torch

from moe_compile.samples.tiny_lm import TinyLMConfig, TinyMoELM


def _warm() -> None:
    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    torch.set_num_threads(1)  # no OpenMP pool in the process the ranks are forked from
    try:
        torch.manual_seed(0)
        model = TinyMoELM(TinyLMConfig(moe_kind="grouped_gemm", num_experts=8))
        compiled = torch.compile(model, backend="hiermoe", options={"inner_compiler": "aot_eager"})
        ids = torch.randint(0, 32, (2, 8))
        compiled(ids, ids).backward()
    finally:
        torch._dynamo.reset()
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)  # the ranks start from the state a fresh interpreter has


_warm()

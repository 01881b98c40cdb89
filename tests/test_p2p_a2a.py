"""``lowering.p2p_a2a.all_to_all_single_recv_first`` against ``dist.all_to_all_single`` and
``all_gather_recv_first`` against ``dist.all_gather_into_tensor``: one real 4-process gloo run
(this file is also the ranks' script), uneven splits with empty chunks, all chunks empty, equal
splits into a non-contiguous output, a non-contiguous and an empty all-gather input, on the world
and on 2-rank subgroups."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _rank_main() -> None:
    import torch
    import torch.distributed as dist

    from moe_compile.lowering.p2p_a2a import (
        all_gather_recv_first,
        all_to_all_single_recv_first,
        use_recv_first,
    )

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    halves = [dist.new_group([r for r in range(world) if r % 2 == k]) for k in range(2)]
    failures = []
    for name, group, ranks in (("world", None, list(range(world))),
                               ("subgroup", halves[rank % 2], [r for r in range(world) if r % 2 == rank % 2])):
        for trial in range(3):
            counts = torch.randint(0, 4, (world, world), generator=torch.Generator().manual_seed(trial))
            if trial == 2:
                counts.zero_()
            send_sizes = [int(counts[rank, d]) for d in ranks]
            recv_sizes = [int(counts[s, rank]) for s in ranks]
            x = torch.cat([torch.full((n, 3), 100.0 * rank + d) for n, d in zip(send_sizes, ranks)])
            got, want = torch.empty(sum(recv_sizes), 3), torch.empty(sum(recv_sizes), 3)
            all_to_all_single_recv_first(got, x, recv_sizes, send_sizes, group=group)
            dist.all_to_all_single(want, x, recv_sizes, send_sizes, group=group)
            if not torch.equal(got, want):
                failures.append(f"{name} trial {trial}")
        x = torch.arange(len(ranks) * 4.0).reshape(-1, 2) + 10 * rank
        got, want = torch.empty(2, len(ranks) * 2).t(), torch.empty(len(ranks) * 2, 2)
        all_to_all_single_recv_first(got, x, group=group)
        dist.all_to_all_single(want, x, group=group)
        if not torch.equal(got, want):
            failures.append(f"{name} equal splits, non-contiguous output")
        for cols in (5, 0):  # a transposed (non-contiguous) input, and an empty one
            mine = (torch.arange(2.0 * cols).reshape(cols, 2) + 100 * rank).t()
            want = torch.empty(len(ranks) * mine.numel())
            dist.all_gather_into_tensor(want, mine.contiguous().reshape(-1), group=group)
            if not torch.equal(all_gather_recv_first(mine, group), want):
                failures.append(f"{name} all-gather of {mine.numel()} elements")
        if not use_recv_first(group):
            failures.append(f"{name}: use_recv_first is False on gloo")
    dist.destroy_process_group()
    print(f"rank {rank}: " + ("ok" if not failures else "FAILED " + ", ".join(failures)), flush=True)
    sys.exit(1 if failures else 0)


@pytest.mark.ranks
def test_matches_library_all_to_all_on_four_gloo_ranks() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", __file__]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == 4, proc.stdout


def test_bad_split_sizes() -> None:
    from moe_compile.lowering.p2p_a2a import _splits

    assert _splits(None, 6, 3, "input") == [2, 2, 2]
    assert _splits([0, 5, 1], 6, 3, "input") == [0, 5, 1]
    with pytest.raises(ValueError, match="not divisible"):
        _splits(None, 5, 3, "input")
    with pytest.raises(ValueError, match="summing to its 6 rows"):
        _splits([1, 2], 6, 3, "output")


if __name__ == "__main__":
    _rank_main()

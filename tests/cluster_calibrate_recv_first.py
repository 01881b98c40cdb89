"""``moe_compile.calibrate`` with gloo's ``all_to_all_single`` replaced by point-to-point ops that
post every receive before any send (run under ``moe-cluster run``, same arguments as calibrate).

gloo's all-to-all posts its send to a peer before its receive from it; a rank that starts later
finds the peer's receive-ready notice waiting, writes its whole chunk into the TCP stream, and only
then its own receive-ready notice, which reaches the peer after that chunk: the two directions of
a pair then run one after the other on a full-duplex link.  Posting receives first puts both
notices on the wire before any bulk data, so this calibration measures the link itself
(bench/results/cluster_calibration.md compares both).

    moe-cluster run --nodes 2 --ranks-per-node 2 --rate 400mbit -- python \\
        tests/cluster_calibrate_recv_first.py --mesh node=2,gpu=2 --out /tmp/recv_first.toml
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from moe_compile import calibrate


def all_to_all_recv_first(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                          input_split_sizes: Any = None, group: Any = None, async_op: bool = False) -> None:
    assert output_split_sizes is None and input_split_sizes is None and not async_op  # calibrate's use only
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    me = ranks.index(dist.get_rank())
    send, recv = input.chunk(len(ranks)), output.chunk(len(ranks))
    reqs = [dist.irecv(recv[i], src=r, group=group) for i, r in enumerate(ranks) if i != me]
    reqs += [dist.isend(send[i], dst=r, group=group) for i, r in enumerate(ranks) if i != me]
    recv[me].copy_(send[me])
    for req in reqs:
        assert req is not None  # None only for ranks outside the group
        req.wait()


def main(argv: list[str] | None = None) -> int:
    dist.all_to_all_single = all_to_all_recv_first
    return calibrate.main(argv)


if __name__ == "__main__":
    sys.exit(main())

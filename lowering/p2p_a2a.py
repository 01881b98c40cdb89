"""An all-to-all built from point-to-point ops that posts every receive before any send.

gloo's own ``all_to_all_single`` posts its send to a peer before its receive from it.  A send of an
unbound buffer waits for the peer's receive-ready notice; a rank that starts later finds that notice
already there, writes its whole chunk into the TCP stream, and only then its own notice, which
reaches the peer behind the chunk: the two directions of a pair then run one after the other and a
full-duplex link is half idle (bench/results/cluster_calibration.md measured 65-94 % of the link's
payload rate for gloo's all-to-all, 99 % with receives first).  Posting every ``irecv`` first puts
all receive-ready notices on the wire before any bulk data, so both directions run at once.

``all_to_all_single_recv_first`` has ``dist.all_to_all_single``'s contract (synchronous only);
``use_recv_first(group)`` says whether a group's backend is gloo, where it pays off;
``all_to_all_rows`` picks for a group, and every exchange of payload rows goes through it (the
token all-to-alls, the expert gathers' and model-centric's all-gathers and reduce-scatters, the
sample moves).  NCCL's own all-to-all has no such problem and stays the one to use there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["all_gather_recv_first", "all_to_all_rows", "all_to_all_single_recv_first", "use_recv_first"]


def _group_ranks(group: dist.ProcessGroup | None) -> tuple[list[int], int]:
    """(the global ranks of ``group`` in group-rank order, this rank's group rank); None: the world."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return ranks, ranks.index(dist.get_rank())


def _splits(sizes: Sequence[int] | None, rows: int, num_ranks: int, what: str) -> list[int]:
    if sizes is None or len(sizes) == 0:
        if rows % num_ranks:
            raise ValueError(f"all_to_all_single_recv_first: {what} has {rows} rows, not divisible by the "
                             f"{num_ranks} ranks of the group; give its split sizes")
        return [rows // num_ranks] * num_ranks
    sizes = [int(s) for s in sizes]
    if len(sizes) != num_ranks or sum(sizes) != rows or min(sizes) < 0:
        raise ValueError(f"all_to_all_single_recv_first: {what} split sizes {sizes} must be {num_ranks} "
                         f"non-negative row counts summing to its {rows} rows")
    return sizes


def all_to_all_single_recv_first(output: torch.Tensor, input: torch.Tensor,
                                 output_split_sizes: Sequence[int] | None = None,
                                 input_split_sizes: Sequence[int] | None = None,
                                 group: dist.ProcessGroup | None = None) -> None:
    """``dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group)`` from
    ``irecv``/``isend``: every receive is posted (from group rank me-1, me-2, ...) before any send
    (to me+1, me+2, ...), this rank's own chunk is copied locally, then all are waited for.

    Split sizes count rows of dim 0 (None: equal parts) in group rank order; the input chunk for
    group rank j of rank i must have the size of rank j's output chunk from i, as for the library
    call.  Empty chunks are neither sent nor received (both ends know the size is 0)."""
    ranks, me = _group_ranks(group)
    num_ranks = len(ranks)
    if input.dim() == 0 or output.dim() == 0:
        raise ValueError("all_to_all_single_recv_first: input and output need at least one dimension")
    out_sizes = _splits(output_split_sizes, output.shape[0], num_ranks, "output")
    in_sizes = _splits(input_split_sizes, input.shape[0], num_ranks, "input")
    if out_sizes[me] != in_sizes[me]:
        raise ValueError(f"all_to_all_single_recv_first: this rank's own chunk is {in_sizes[me]} rows in the "
                         f"input but {out_sizes[me]} in the output")
    send = input.contiguous()
    recv = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    _exchange_chunks(torch.split(send, in_sizes), torch.split(recv, out_sizes), ranks, me, group)
    if recv is not output:
        output.copy_(recv)


def _exchange_chunks(send_chunks: Sequence[torch.Tensor], recv_chunks: Sequence[torch.Tensor], ranks: list[int],
                     me: int, group: dist.ProcessGroup | None) -> None:
    """Group rank j's ``recv_chunks[j]`` from its ``send_chunks[me]``: every receive posted (from
    group rank me-1, me-2, ...) before any send (to me+1, me+2, ...), this rank's own chunk copied
    locally, then all waited for. Empty chunks are neither sent nor received."""
    num_ranks = len(ranks)
    reqs = []
    for step in range(1, num_ranks):  # receives first
        src = (me - step) % num_ranks
        if recv_chunks[src].numel():
            reqs.append(dist.irecv(recv_chunks[src], src=ranks[src], group=group))
    for step in range(1, num_ranks):
        dst = (me + step) % num_ranks
        if send_chunks[dst].numel():
            reqs.append(dist.isend(send_chunks[dst], dst=ranks[dst], group=group))
    if recv_chunks[me].numel():
        recv_chunks[me].copy_(send_chunks[me])
    for req in reqs:
        assert req is not None  # None only on ranks outside the group
        req.wait()


def all_gather_recv_first(send: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[peers * n]: every group rank's ``send`` ([n], the same n everywhere) in group-rank order,
    from ``irecv``/``isend`` with every receive posted first (as ``all_to_all_single_recv_first``:
    gloo's all-gather runs rounds between neighbours). The one buffer is sent to every peer as it
    is: no [peers, n] copy of it is made, as an all-to-all of it repeated would."""
    ranks, me = _group_ranks(group)
    send = send.contiguous().reshape(-1)
    recv = send.new_empty((len(ranks), send.numel()))
    _exchange_chunks([send] * len(ranks), list(recv.unbind(0)), ranks, me, group)
    return recv.reshape(-1)


def use_recv_first(group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> bool:
    """True when ``group`` runs collectives on ``device`` with gloo (``dist.get_backend``; a combined
    backend such as ``"cpu:gloo,cuda:nccl"`` is looked up by the device type)."""
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:
        by_device = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
        backend = by_device.get(torch.device(device).type, "")
    return backend == "gloo"


def all_to_all_rows(t: torch.Tensor, recv_counts: Sequence[int] | None, send_counts: Sequence[int] | None,
                    group: dist.ProcessGroup | None) -> torch.Tensor:
    """``t``'s rows ([sum(send_counts), ...]; None: equal parts) to the group's ranks, each rank's
    rows back ([sum(recv_counts), ...]), counts in group-rank order: on gloo with every receive
    posted before any send (``all_to_all_single_recv_first``), else the library's all-to-all."""
    rows = sum(recv_counts) if recv_counts is not None else t.shape[0]
    out = t.new_empty((rows, *t.shape[1:]))
    if use_recv_first(group, t.device):
        all_to_all_single_recv_first(out, t.contiguous(), recv_counts, send_counts, group=group)
    else:
        dist.all_to_all_single(out, t.contiguous(), None if recv_counts is None else list(recv_counts),
                               None if send_counts is None else list(send_counts), group=group)
    return out

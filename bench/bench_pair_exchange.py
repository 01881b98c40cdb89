"""Two ranks on different nodes swap 4 MiB each way with gloo's isend/irecv, the send posted first
against the receive posted first (moe_compile/swap/transfer.py's ``exchange``; lowering/p2p_a2a.py
says why the order matters on gloo); the other ranks idle. Rank 2 starts 20 ms later, as ranks do.
Medians of 12 per order (interleaved), printed by rank 0:

    moe-cluster run --config bench/clusters/two_node_100mbit.toml -- python bench/bench_pair_exchange.py
"""

import datetime
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    peer = {0: 2, 2: 0}.get(rank)
    n = 4 << 20
    send = torch.full((n,), rank, dtype=torch.uint8)
    recv = torch.empty(n, dtype=torch.uint8)
    res = {}
    for order in ("send first", "recv first") * 4:
        times = []
        for _ in range(3):
            dist.barrier()
            if peer is not None:
                if rank == 2:
                    time.sleep(0.02)  # one side starts later, as ranks do
                t0 = time.perf_counter()
                if order == "send first":
                    reqs = [dist.isend(send, peer), dist.irecv(recv, peer)]
                else:
                    reqs = [dist.irecv(recv, peer), dist.isend(send, peer)]
                for r in reqs:
                    r.wait()
                times.append(time.perf_counter() - t0)
        res.setdefault(order, []).extend(times)
    if rank == 0:
        for k, v in res.items():
            print(f"{k}: median {statistics.median(v) * 1e3:.0f} ms over {len(v)} (4 MiB each way at 100 Mbit: "
                  f"{4 * 8.388608 / 0.96 / 100 * 1e3:.0f} ms one direction alone)")
    dist.destroy_process_group()

if __name__ == "__main__":
    main()

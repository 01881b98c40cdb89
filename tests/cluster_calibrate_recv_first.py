"""``python -m moe_compile.tools.calibrate --a2a recv-first ARGS...``: kept as a script for
tests/cluster_a2a_script.py's ``--calibrate`` (which runs it in the processes it already started)
and for older command lines.

The receives-first all-to-all it used to patch in is now ``lowering/p2p_a2a.py``'s
``all_to_all_single_recv_first``, the default of ``moe_compile.tools.calibrate`` on gloo (and what the
expert-parallel dispatch and combine run on gloo): gloo's own all-to-all posts its send to a peer
before its receive from it, so the two directions of a pair run one after the other on a
full-duplex link (bench/results/cluster_calibration.md).

    moe-cluster run --nodes 2 --ranks-per-node 2 --rate 400mbit -- python \\
        tests/cluster_calibrate_recv_first.py --mesh node=2,gpu=2 --out /tmp/recv_first.toml
"""

from __future__ import annotations

import sys

from moe_compile.tools import calibrate


def main(argv: list[str] | None = None) -> int:
    return calibrate.main(["--a2a", "recv-first", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())

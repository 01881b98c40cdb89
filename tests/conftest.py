import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

# compile_utils lives beside the tests
sys.path.insert(0, os.path.dirname(__file__))

# Fuzz profiles (tests/test_fuzz.py): "ci" is what `make test` runs, a fixed seed (derandomize)
# and few examples so it stays quick; "large" draws many fresh examples:
#   make pytest PYTEST_ARGS='tests/test_fuzz.py --hypothesis-profile=large'
_common = dict(deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=24, derandomize=True, **_common)
settings.register_profile("large", max_examples=400, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Under ``pytest -n 2`` (``make pytest``) each worker computes on one intra-op thread: the two
# workers and the ranks one of them starts already fill CI's 2 cores, and OpenMP threads waiting
# for a core spin. Measured beside two busy processes: test_golden + test_explain took 101 s (84 s
# of CPU) with torch's default 2 threads, 45 s (31 s of CPU) with one. Processes a test starts
# inherit PYTEST_XDIST_WORKER and so take one thread too.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``ranks`` start several processes (gloo ranks, torchrun, the emulated
    cluster) that already keep both of CI's 2 cores busy. Under ``pytest -n 2 --dist loadgroup``
    (what ``make pytest`` runs) they go to one worker, one after another, while the other worker
    takes the single-process tests: two rank launches at once would oversubscribe the cores
    (timeouts stretch, a module's shared launch would run twice)."""
    for item in items:
        if item.get_closest_marker("ranks") is not None:
            item.add_marker(pytest.mark.xdist_group("ranks"))

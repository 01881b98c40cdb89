import os
import sys

import pytest
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

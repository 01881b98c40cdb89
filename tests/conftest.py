import os
import sys

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

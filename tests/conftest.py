import os
import sys

# compile_utils lives beside the tests
sys.path.insert(0, os.path.dirname(__file__))

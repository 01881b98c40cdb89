"""Standard MoE layers written the ways people write them, and a tiny trainable MoE language model.

These are test subjects for the MoE finder: each layer keeps its source project's idiom (grouped
GEMM, gathered bmm, per-expert loops, dense masking, capacity-limited einsum, DeepSeek-V3 and Qwen3
routers). Nothing here imports the rewrites. ``SAMPLES`` maps a name to a ``SampleSpec`` that builds
the layer and states the metadata the finder should report.
"""

from .registry import SAMPLES, SampleSpec, example_input
from .tiny_lm import TinyLMConfig, TinyMoELM

__all__ = ["SAMPLES", "SampleSpec", "TinyLMConfig", "TinyMoELM", "example_input"]

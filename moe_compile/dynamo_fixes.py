"""Two repairs to Dynamo's tracing under the flags ``import moe_compile`` sets
(``capture_dynamic_output_shape_ops``, ``capture_scalar_outputs``; README "Global Dynamo
settings"), where a model that compiles without the flags would fail to compile at all, under any
backend:

- ``tolist()`` of a tensor whose length depends on the data (``torch.bincount(ids, minlength=E)``,
  ``torch.unique``, ``nonzero``) raised GuardOnDataDependentSymNode. It breaks the graph now, as
  the op itself did without the flag: the list is made eagerly.
- a slice with data-dependent bounds of a dimension of size 0 (``order[start:start + n]`` with ``n``
  read from the counts, on a batch of 0 tokens) raised PendingUnbackedSymbolNotFound: the fake
  kernel made a new unbacked size for the result, then proved it 0, so the size it made was not
  in the result. Any slice of an empty dimension is empty, which is now its size.

Both patch torch 2.13's Dynamo and FakeTensor internals (``TensorVariable.method_tolist``, the
``aten.slice.Tensor`` fake kernel): a torch that has moved them fails ``import moe_compile`` with
the AttributeError or KeyError that says which.
"""

from __future__ import annotations

from typing import Any

import torch


def install() -> None:
    _tolist_of_a_data_dependent_length_breaks_the_graph()
    _slice_of_an_empty_dimension_is_empty()


def _tolist_of_a_data_dependent_length_breaks_the_graph() -> None:
    from torch._dynamo.exc import unimplemented
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase
    from torch._dynamo.variables.base import VariableTracker
    from torch._dynamo.variables.tensor import TensorVariable
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    traced = TensorVariable.method_tolist
    if getattr(traced, "_moe_compile", False):
        return

    def method_tolist(self: TensorVariable, tx: InstructionTranslatorBase) -> VariableTracker:
        value = self.as_proxy().node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and free_unbacked_symbols(value.shape):
            unimplemented(gb_type="Tensor.tolist() of a tensor with a data-dependent length",
                          context=f"call_method {self} tolist",
                          explanation=f"the tensor's length {tuple(value.shape)} depends on its data (an op like "
                                      "bincount, unique or nonzero made it), so the list cannot be traced",
                          hints=["Give the op a length that does not depend on the data, e.g. "
                                 "`torch.nn.functional.one_hot(ids, E).sum(0)` for `torch.bincount(ids, minlength=E)`"])
        return traced(self, tx)

    method_tolist._moe_compile = True  # type: ignore[attr-defined]
    TensorVariable.method_tolist = method_tolist  # type: ignore[method-assign]


def _slice_of_an_empty_dimension_is_empty() -> None:
    from torch._prims_common import canonicalize_dim
    from torch._subclasses import fake_impls

    op = torch.ops.aten.slice.Tensor
    kernel = fake_impls.op_implementations_dict[op]
    if getattr(kernel, "_moe_compile", False):
        return

    def slice_forward(fake_mode: Any, func: Any, self: Any, dim: int = 0, start: Any = None, end: Any = None,
                      step: int = 1) -> Any:
        if self.dim() > 0 and isinstance(step, int) and step > 0:
            d = canonicalize_dim(self.dim(), dim)
            if isinstance(self.size(d), int) and self.size(d) == 0:
                strides = list(self.stride())
                strides[d] *= step
                return self.as_strided(self.size(), strides, self.storage_offset())
        return kernel(fake_mode, func, self, dim, start, end, step)

    slice_forward._moe_compile = True  # type: ignore[attr-defined]
    fake_impls.op_implementations_dict[op] = slice_forward

"""Strategy rules, one module per operator family; importing this package registers them all."""

from autopar.ops import (conv, elementwise, indexing, loss, matmul, movement, norm, pool, reduce,  # noqa: F401
                         shape)
from autopar.ops.base import OpSpec, has_rule, registered_op_types, spec_for

__all__ = ["OpSpec", "has_rule", "registered_op_types", "spec_for"]

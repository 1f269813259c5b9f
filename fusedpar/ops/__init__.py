"""autograd Functions and the functional API, one module per op family."""

from fusedpar.ops.attention import flash_attn
from fusedpar.ops.linear import all_gather_matmul, matmul_reduce_scatter

__all__ = ["all_gather_matmul", "flash_attn", "matmul_reduce_scatter"]

"""fusedpar: Triton kernels that fuse compute with communication for transformer training."""

from fusedpar import comm, nn, ops, testing
from fusedpar.ops import all_gather_matmul, flash_attn, matmul_reduce_scatter

__version__ = "0.1.0"

__all__ = [
    "all_gather_matmul",
    "comm",
    "flash_attn",
    "matmul_reduce_scatter",
    "nn",
    "ops",
    "testing",
]

"""fusedpar: Triton kernels that fuse compute with communication for transformer training."""

from fusedpar import comm, nn, ops, testing
from fusedpar.ops import flash_attn

__version__ = "0.1.0"

__all__ = ["comm", "flash_attn", "nn", "ops", "testing"]

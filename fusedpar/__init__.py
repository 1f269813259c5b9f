"""fusedpar: Triton kernels that fuse compute with communication for transformer training."""

from fusedpar import comm, nn, ops, testing

__version__ = "0.1.0"

__all__ = ["comm", "nn", "ops", "testing"]

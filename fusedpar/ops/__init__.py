"""autograd Functions and the functional API, one module per op family."""

from fusedpar.ops.attention import flash_attn

__all__ = ["flash_attn"]

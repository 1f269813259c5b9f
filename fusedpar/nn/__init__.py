"""nn.Modules built from fusedpar.ops: parallel linears, attention, MoE."""

from fusedpar.nn.linear import ColumnParallelLinear, ParallelSwiGLU, RowParallelLinear

__all__ = ["ColumnParallelLinear", "ParallelSwiGLU", "RowParallelLinear"]

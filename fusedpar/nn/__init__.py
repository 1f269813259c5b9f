"""nn.Modules built from fusedpar.ops: parallel linears, attention, MoE."""

from fusedpar.nn.attention import ParallelAttention
from fusedpar.nn.linear import ColumnParallelLinear, ParallelSwiGLU, RowParallelLinear
from fusedpar.nn.moe import MoE

__all__ = [
    "ColumnParallelLinear",
    "MoE",
    "ParallelAttention",
    "ParallelSwiGLU",
    "RowParallelLinear",
]

"""nn.Modules built from fusedpar.ops: parallel linears, attention (and DeepSeek's latent
attention), Gated DeltaNet, Kimi's KDA, MoE, RMSNorm (and
`add_aux_loss`, which carries a MoE layer's auxiliary loss to the gradients); the specs
they are built from with a `fusedpar.Placement` (`fusedpar.nn.specs`)."""

from fusedpar.nn.attention import ParallelAttention
from fusedpar.nn.aux_loss import add_aux_loss
from fusedpar.nn.gated_deltanet import GatedDeltaNet
from fusedpar.nn.kimi_delta import KimiDeltaAttention, KimiDeltaSpec
from fusedpar.nn.linear import ColumnParallelLinear, ParallelSwiGLU, RowParallelLinear
from fusedpar.nn.mla import ParallelMLA
from fusedpar.nn.moe import MoE
from fusedpar.nn.norm import RMSNorm
from fusedpar.nn.specs import (
    AttentionSpec,
    GatedDeltaNetSpec,
    MLASpec,
    MLPSpec,
    MoESpec,
)

__all__ = [
    "AttentionSpec",
    "ColumnParallelLinear",
    "GatedDeltaNet",
    "GatedDeltaNetSpec",
    "KimiDeltaAttention",
    "KimiDeltaSpec",
    "MLASpec",
    "MLPSpec",
    "MoE",
    "MoESpec",
    "ParallelAttention",
    "ParallelMLA",
    "ParallelSwiGLU",
    "RMSNorm",
    "RowParallelLinear",
    "add_aux_loss",
]

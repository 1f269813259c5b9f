"""autograd Functions and the functional API, one module per op family."""

from fusedpar.ops.attention import flash_attn, flash_attn_varlen
from fusedpar.ops.linear import all_gather_matmul, matmul_reduce_scatter
from fusedpar.ops.linear_attention import gated_delta_rule
from fusedpar.ops.linear_attention_parts import causal_conv1d
from fusedpar.ops.norm import rms_norm, rms_norm_gated
from fusedpar.ops.ring_attention import ring_attn
from fusedpar.ops.sequence import gather_sequence, sequence_positions, shard_sequence
from fusedpar.ops.ulysses import ulysses_attn
from fusedpar.ops.virtual_ring import virtual_ring_attn

__all__ = [
    "all_gather_matmul",
    "causal_conv1d",
    "flash_attn",
    "flash_attn_varlen",
    "gated_delta_rule",
    "gather_sequence",
    "matmul_reduce_scatter",
    "ring_attn",
    "rms_norm",
    "rms_norm_gated",
    "sequence_positions",
    "shard_sequence",
    "ulysses_attn",
    "virtual_ring_attn",
]

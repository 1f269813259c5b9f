"""fusedpar: Triton kernels that fuse compute with communication for transformer training."""

import importlib

from fusedpar import checkpoint, checks, comm, nn, ops, pipeline
from fusedpar.clip import clip_grad_norm_
from fusedpar.kernels.attention import AttentionMask
from fusedpar.kernels.impl import implementation
from fusedpar.kernels.impl import summary as implementation_summary
from fusedpar.ops import (
    all_gather_matmul,
    flash_attn,
    flash_attn_varlen,
    gated_delta_rule,
    gather_sequence,
    matmul_reduce_scatter,
    ring_attn,
    rms_norm,
    sequence_positions,
    shard_sequence,
    ulysses_attn,
)
from fusedpar.parallel import ParallelDims
from fusedpar.placement import Placement
from fusedpar.recompute import checkpoint_policy
from fusedpar.storage import distribute

__version__ = "0.1.0"


def __getattr__(name: str):
    """``fp.testing`` (the test harness: hypothesis, subprocess ranks), imported at first
    use, so that ``import fusedpar`` does not load it."""
    if name == "testing":
        return importlib.import_module("fusedpar.testing")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ParallelDims",
    "AttentionMask",
    "Placement",
    "all_gather_matmul",
    "checkpoint",
    "checkpoint_policy",
    "checks",
    "clip_grad_norm_",
    "comm",
    "distribute",
    "flash_attn",
    "flash_attn_varlen",
    "gated_delta_rule",
    "gather_sequence",
    "implementation",
    "implementation_summary",
    "matmul_reduce_scatter",
    "pipeline",
    "nn",
    "ops",
    "ring_attn",
    "rms_norm",
    "sequence_positions",
    "shard_sequence",
    "ulysses_attn",
    "testing",
]

"""Activation checkpointing: what selective checkpointing saves, and how a layer tells a
recompute from a forward.

    from torch.utils.checkpoint import checkpoint
    y = checkpoint(block, x, use_reentrant=False, context_fn=fp.checkpoint_policy())

`checkpoint_policy` keeps the outputs of the ops named in `save` and recomputes the
rest; by default every op that communicates and the routing (no repeated collective):

| ops kept                                                      | why                       |
| ------------------------------------------------------------- | ------------------------- |
| ``fusedpar::all_gather_matmul``, ``matmul_reduce_scatter``    | TP's rings                |
| ``fusedpar::ring_attn``                                       | the K/V ring              |
| ``fusedpar::moe_dispatch``, ``moe_return``                    | EP's all-to-alls          |
| ``fusedpar::scatter_heads``, ``gather_heads``                 | Ulysses' all-to-alls      |
| ``fusedpar::moe_route``                                       | a recompute could re-route|

A one-rank layer that is one op (``fusedpar::attention_layer``, ``fusedpar::gated_mlp``)
is kept when an op of its composed path is. ``also=`` keeps more, ``save=`` replaces
the list. docs/plan.md compares this policy with torchtitan's.
"""

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

COMMUNICATION_OPS = (
    "fusedpar::all_gather_matmul",
    "fusedpar::matmul_reduce_scatter",
    "fusedpar::ring_attn",
    "fusedpar::moe_dispatch",
    "fusedpar::moe_return",
    "fusedpar::scatter_heads",
    "fusedpar::gather_heads",
    "fusedpar::conv_halo",
)
ROUTING_OPS = ("fusedpar::moe_route",)
SAVED_BY_DEFAULT = COMMUNICATION_OPS + ROUTING_OPS
# A layer that runs on one rank as one op is kept when an op its composed path runs
# elsewhere is kept: a policy names the ops of the parallel model, the same on one rank.
ONE_RANK_OPS = {
    "fusedpar::attention_layer": (
        "fusedpar::all_gather_matmul",
        "fusedpar::matmul_reduce_scatter",
        "fusedpar::flash_attn",
        "fusedpar::rms_norm",
        "fusedpar::rope",
    ),
    "fusedpar::gated_mlp": (
        "fusedpar::all_gather_matmul",
        "fusedpar::matmul_reduce_scatter",
        "fusedpar::gated",
    ),
}


def _packet(op) -> torch._ops.OpOverloadPacket:
    """The op packet of "namespace::name", an OpOverloadPacket or an OpOverload."""
    if isinstance(op, torch._ops.OpOverload):
        return op.overloadpacket
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op
    if isinstance(op, str) and "::" in op:
        # The fusedpar:: ops are registered: importing this module ran fusedpar/__init__,
        # which imports fusedpar.ops (and fusedpar.ops, through fusedpar.checks, this module).
        namespace, name = op.split("::", 1)
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            return packet
    raise ValueError(
        f"checkpoint_policy: {op!r} is not an op ('namespace::name', e.g. "
        f"'fusedpar::ring_attn', or torch.ops.<namespace>.<name>)"
    )


def checkpoint_policy(save=SAVED_BY_DEFAULT, *, also=()):
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
    that saves the outputs of the ops in `save` (plus `also`) and recomputes the rest.
    Ops are "namespace::name" strings or ``torch.ops`` objects; an unknown name raises
    here, not in the backward."""
    kept = {_packet(op) for op in (*save, *also)}
    kept |= {
        _packet(layer)
        for layer, parts in ONE_RANK_OPS.items()
        if any(_packet(part) in kept for part in parts)
    }
    kept = frozenset(kept)

    def policy(ctx, op, *args, **kwargs):
        if op.overloadpacket in kept:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def is_recomputing() -> bool:
    """Whether this forward runs inside autograd's engine (a graph task is executing),
    which is where activation checkpointing's recompute runs; so does a module called
    from a backward hook. A layer skips its side effects there (statistics, counters),
    so they count each forward once. Under torch.compile the recompute is part of the
    compiled backward and never re-runs the Python forward, so this is False while
    tracing."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1

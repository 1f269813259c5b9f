"""The pieces around the linear-attention recurrence, as differentiable ops:
`causal_conv1d` (Gated DeltaNet's short depthwise convolution over q|k|v).

| op              | forward                                     | saved for the backward    |
| --------------- | ------------------------------------------- | ------------------------- |
| `causal_conv1d` | ``y = act(bias + sum_j w[:, j] x[t-W+1+j])``, | x, weight, bias, initial  |
|                 | final_states the last W - 1 inputs          | states (y is recomputed)  |

The kernels: `fusedpar.kernels.linear_attention.conv1d`. Both directions are
``torch.library`` custom ops (a model using them compiles as one graph); the gated
RMSNorm after the recurrence is `fusedpar.ops.norm.rms_norm_gated`.
"""

import torch
from torch import Tensor

from fusedpar.comm import Group, active_group
from fusedpar.kernels.attention import check_cu_seqlens
from fusedpar.kernels.linear_attention import conv1d as kernels
from fusedpar.ops import conv_halo
from fusedpar.ops.registration import asked, autograd_op, direct_op
from fusedpar.ops.sequence import check_layout
from fusedpar.ops.span_exchange import Exchange
from fusedpar.ops.spans import Spans


def _activation(name: str):
    return None if name == "none" else name


@torch.library.custom_op("fusedpar::causal_conv1d", mutates_args=())
def _causal_conv1d_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str,
    cu_seqlens: Tensor | None,
    initial_states: Tensor | None,
    output_final_states: bool,
) -> tuple[Tensor, Tensor]:
    """(y (x's shape and dtype), final_states (N, C, W - 1), or an empty (0,) tensor
    where not asked for)."""
    y, final = kernels.causal_conv1d(
        x,
        weight,
        bias,
        _activation(activation),
        cu_seqlens,
        initial_states,
        output_final_states,
    )
    return y, x.new_empty(0) if final is None else final


def _documents(x, cu_seqlens) -> int:
    return x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


@_causal_conv1d_op.register_fake
def _(x, weight, bias, activation, cu_seqlens, initial_states, output_final_states):
    final = (_documents(x, cu_seqlens), x.shape[2], weight.shape[1] - 1)
    return x.new_empty(x.shape), x.new_empty(final if output_final_states else 0)


@torch.library.custom_op("fusedpar::causal_conv1d_backward", mutates_args=())
def _causal_conv1d_backward_op(
    dy: Tensor,
    dfinal: Tensor | None,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str,
    cu_seqlens: Tensor | None,
    initial_states: Tensor | None,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias, dinitial_states); a gradient not asked for (or of an absent
    input) comes back as an empty (0,) tensor."""
    grads = kernels.causal_conv1d_backward(
        dy, dfinal, x, weight, bias, _activation(activation), cu_seqlens, initial_states, needs
    )
    return tuple(x.new_empty(0) if g is None else g for g in grads)


@_causal_conv1d_backward_op.register_fake
def _(dy, dfinal, x, weight, bias, activation, cu_seqlens, initial_states, needs):
    inputs = (x, weight, bias, initial_states)
    return tuple(
        t.new_empty(t.shape) if need and t is not None else x.new_empty(0)
        for t, need in zip(inputs, needs, strict=True)
    )


def _setup(ctx, inputs, output):
    x, weight, bias, activation, cu_seqlens, initial_states, output_final_states = inputs
    ctx.options = (activation, output_final_states)
    ctx.needs = [t is not None and t.requires_grad for t in (x, weight, bias, initial_states)]
    ctx.save_for_backward(x, weight, bias, cu_seqlens, initial_states)


def _backward(ctx, dy, dfinal):
    x, weight, bias, cu_seqlens, initial_states = ctx.saved_tensors
    activation, output_final_states = ctx.options
    dfinal = dfinal if output_final_states else None
    grads = _causal_conv1d_backward(
        dy, dfinal, x, weight, bias, activation, cu_seqlens, initial_states, ctx.needs
    )
    dx, dw, db, dinit = asked(grads, ctx.needs)
    return dx, dw, db, None, None, dinit, None


_causal_conv1d_backward = direct_op(_causal_conv1d_backward_op)
_causal_conv1d = autograd_op(_causal_conv1d_op, _backward, _setup)  # the bodies, in plain eager


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    activation: str | None = "silu",
    cu_seqlens: Tensor | None = None,
    initial_states: Tensor | None = None,
    output_final_states: bool = False,
    group: Group = None,
    layout: str = "zigzag",
) -> tuple[Tensor, Tensor | None]:
    """``(y, final_states)``: the depthwise causal convolution of x (B, T, C) by weight
    (C, W) (W <= 4), plus bias (C,), then SiLU (``activation="silu"``) or nothing
    (None); y in x's dtype, computed in fp32 and rounded once; any strides.

    ``cu_seqlens`` (int32, N + 1 entries, B = 1): packed documents; no input crosses a
    document start. ``initial_states`` (N, C, W - 1), x's dtype: the W - 1 inputs before
    each sequence (or document), oldest first; zeros if None. ``final_states`` (N, C,
    W - 1) when ``output_final_states``, else None: the last W - 1 inputs of
    ``[initial_states ; x]`` per sequence (causal-conv1d's convention: pass them as the
    next call's initial_states to continue; a document shorter than W - 1 keeps older
    initial entries, zeros without). Gradients reach x, weight, bias and initial_states,
    from y and final_states.

    With a context-parallel ``group`` (more than one rank), x is this rank's shard as
    ``fp.shard_sequence(x_full, group, layout=layout)`` gives it, and y this rank's shard
    of the single-device y: each span's W - 1 inputs before it come from the ranks that
    hold them (`fusedpar.ops.conv_halo`), their gradient goes back. cu_seqlens are the
    global stream's and initial_states the sequence's own, the same on every rank;
    final_states the single-device ones, on every rank (their gradient taken once, as
    one replicated value's). The gradients of weight, bias and initial_states are this
    rank's share: their sum over the group is the single-device one."""
    if group is not None:
        check_layout(layout)
    exchange = group if isinstance(group, Exchange) else None
    if exchange is None and active_group(group) is not None:
        exchange = Exchange(group)
    if exchange is not None:
        options = (cu_seqlens, initial_states, output_final_states, exchange, layout)
        return _causal_conv1d_cp(x, weight, bias, activation, *options)
    # (cu_seqlens' values are read inside the op, on a CPU, where a graph does not see it)
    kernels.check_inputs(x, weight, bias, activation, cu_seqlens, initial_states, values=False)
    y, final = _causal_conv1d(
        x,
        weight,
        bias,
        "none" if activation is None else activation,
        cu_seqlens,
        initial_states,
        bool(output_final_states),
    )
    return y, (final if output_final_states else None)


def _check_cp(x, weight, bias, activation, cu_seqlens, initial_states, spans: Spans) -> int:
    """The documents N of a sharded call (ValueError/TypeError naming the sizes, the
    same on every rank when the ranks pass the same shapes)."""
    kernels.check_inputs(x, weight, bias, activation)
    B, T, C = x.shape
    W, N = weight.shape[1], B
    if cu_seqlens is not None:
        # the values read on a CPU only (a host sync on a GPU), and not by a graph
        values = x.device.type == "cpu" and not torch.compiler.is_compiling()
        what = "causal_conv1d: the global cu_seqlens"
        check_cu_seqlens(cu_seqlens, spans.seq_len, what, values=values)
        if B != 1:
            raise ValueError(
                f"causal_conv1d: with cu_seqlens the documents are packed into one "
                f"sequence (B = 1), got this rank's x {tuple(x.shape)}"
            )
        N = cu_seqlens.shape[0] - 1
    if initial_states is not None:
        if initial_states.shape != (N, C, W - 1):
            raise ValueError(
                f"causal_conv1d: initial_states (the sequence's own, the same on every "
                f"rank) must be (N, C, W - 1) = ({N}, {C}, {W - 1}), got "
                f"{tuple(initial_states.shape)}"
            )
        if initial_states.dtype != x.dtype or initial_states.device != x.device:
            raise TypeError(
                f"causal_conv1d: initial_states must be x's {x.dtype} on {x.device}, got "
                f"{initial_states.dtype} on {initial_states.device}"
            )
    return N


def _causal_conv1d_cp(
    x, weight, bias, activation, cu_seqlens, initial_states, final, exchange, layout
):
    """`causal_conv1d` on this rank's shard (`fusedpar.ops.conv_halo`) over `exchange`'s
    ranks (`fusedpar.ops.span_exchange`: a group, or the hybrid layout's two axes)."""
    spans = exchange.spans(layout, x.shape[1])
    N = _check_cp(x, weight, bias, activation, cu_seqlens, initial_states, spans)
    history = weight.shape[1] - 1
    if history:
        halo = conv_halo.halo(x, exchange, layout, history)  # (the ranks' shapes checked first)
        stream, cu, init = conv_halo.local_inputs(x, spans, halo, cu_seqlens, initial_states)
    else:  # W = 1: no halo (and no states)
        stream, cu, init = x, None, None
    y, _ = causal_conv1d(
        stream, weight, bias, activation=activation, cu_seqlens=cu, initial_states=init
    )
    y = y.view(x.shape)
    if not final:
        return y, None
    if not history:
        return y, x.new_zeros((N, x.shape[2], 0))
    return y, conv_halo.final_states(x, spans, history, cu_seqlens, initial_states, exchange)

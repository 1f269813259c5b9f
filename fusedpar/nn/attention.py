"""`ParallelAttention`: GQA self-attention, heads split over TP, the sequence over CP
(ring attention, Ulysses' head all-to-all, or both), with the rotary embedding at its
tokens' global positions (`fusedpar.nn.rotary`) and one mask, built from its spec.

Activations are sequence-first, as in Megatron: x (S_loc, B, d_model), S_loc this
rank's share (S / CP in `cp_layout`, S / (CP U) in the hybrid; under sequence
parallelism a further 1 / TP of them).

| step        | op                                        | shape on a rank               |
| ----------- | ----------------------------------------- | ----------------------------- |
| QKV (gate)  | `all_gather_matmul(x, [wq, wk, wv], tp)`  | (S/CP, B, (Hq+2Hkv)/TP * hd)  |
| RoPE        | at `sequence_positions(S, cp)`            | q (B, S/CP, Hq/TP, hd)        |
| attention   | `ring_attn(q, k, v, cp, causal, ulysses_group=u)` | (B, S/CP, Hq/TP, hd)  |
| projection  | `matmul_reduce_scatter(o, wo, tp)`        | (S/CP/TP, B, d_model)         |

Options for today's open models: biases, `head_dim`, `qk_norm`, `softmax_scale`, `output_gate`,
`rope=` (Llama's tables, ``None``, or a callable ``positions -> (cos, sin)`` called at
the global positions), `rotary_dim`. RoPE pairs dims (i, i + r/2) as Hugging Face does
(`from_dense(..., rope_layout="interleaved")` permutes a (2i, 2i + 1) checkpoint's
rows). `cp_mode` is read off the groups or checked against them. docs/attention.md.
"""

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from fusedpar import comm
from fusedpar.kernels.common import accumulator, check_float_dtype
from fusedpar.local_params import forward_params
from fusedpar.nn.attention_heads import (  # noqa: F401 (kv_heads_per_rank: public here too)
    head_layouts,
    kv_heads_per_rank,
    own_kv,
)
from fusedpar.nn.attention_parts import (  # noqa: F401 (rope_tables: public here too)
    QK_NORMS,
    ROPE_LAYOUTS,
    apply_rope,
    apply_rope_qk,
    half_to_interleaved,
    interleaved_to_half,
    joins_rope,
    norm_weight,
    qk_rms_norm,
    rope_tables,
    rotates_by_formula,
    sigmoid_gate,
    split_gate,
)
from fusedpar.nn.linear import bias_per_weight, linear_parts
from fusedpar.nn.rotary import RotaryPositions
from fusedpar.nn.specs import DEFAULT_ROPE, AttentionSpec, FromSpec
from fusedpar.ops.attention_layer import attention_layer
from fusedpar.ops.linear import all_gather_matmul, matmul_reduce_scatter
from fusedpar.ops.ring_attention import masked_ring_attn
from fusedpar.ops.ulysses import check_heads
from fusedpar.placement import CP_MODES, Placement  # noqa: F401 (CP_MODES: public here too)
from fusedpar.storage import local_tensor


class ParallelAttention(FromSpec, RotaryPositions, nn.Module):
    """GQA self-attention over TP (heads) and CP (sequence). See the module doc.

    | parameter                        | shape on a rank     | with           |
    | -------------------------------- | ------------------- | -------------- |
    | `q_weight`                       | (Hq/TP * hd, d)     | always         |
    | `k_weight`, `v_weight`           | (Hkv/TP * hd, d)    | always         |
    | `o_weight`                       | (d, Hq/TP * hd)     | always         |
    | `q_bias`; `k_bias`, `v_bias`     | (Hq/TP * hd,); (Hkv/TP * hd,) | ``bias=True`` |
    | `o_bias`                         | (d,), whole         | ``o_bias=True`` |
    | `q_norm_weight`, `k_norm_weight` | (hd,), whole        | ``qk_norm="head"`` |
    | `q_norm_weight`; `k_norm_weight` | (Hq/TP * hd,); (Hkv/TP * hd,) | ``qk_norm="full"`` |
    | `sinks`                          | (Hq/TP,)            | ``sinks=True``  |
    | `gate_weight`; `gate_bias`       | (Hq/TP * hd, d); (Hq/TP * hd,) | ``output_gate=True`` |

    ``qk_norm`` (True is "head"; see `fusedpar.nn.attention_parts`) with ``norm_eps``
    and ``norm_offset`` (1: Gemma's ``(1 + weight)``). ``sinks``: a learned logit per
    query head in the softmax denominator (gpt-oss; `fusedpar.flash_attn`'s `sinks`).
    ``output_gate``: ``out * sigmoid(x gate_weight^T)`` before the o projection
    (Qwen3-Next). TP a multiple of Hkv (> Hkv): `k_weight`, `v_weight` (and biases, and
    a "full" `k_norm_weight`) are (Hkv * hd, d) whole on each rank, which computes with
    its query heads' KV head (`param_layouts`). docs/attention.md, "The layer".

    ``rope(positions)`` returns cos, sin of shape (S, r/2), or (S, r) with equal halves
    (Hugging Face's layout; leading dims of 1 are dropped), r = `rotary_dim` (default
    head_dim). A table is recognised by its width, and a (S, r/2) table whose halves
    are equal (Hugging Face's layout of a rotary_dim of r/2) is refused, never read as
    the other layout. ``rope=None``: no rotary embedding; left out: the tables of
    `rope_theta`. ``softmax_scale`` (> 0; default head_dim ** -0.5) multiplies q k^T.

    ``sliding_window=W`` has Hugging Face's meaning (Mistral, Gemma 2/3): a query sees
    itself and the W - 1 keys before it, i.e. ``window=(W - 1, 0)`` of `flash_attn`.
    ``softcap``: Gemma 2's ``attn_logit_softcapping``. ``forward(x, cu_seqlens)`` takes
    packed documents (see `forward`). ``overlap``: the schedule of the sequence-parallel
    projections over TP (`fusedpar.ops.linear`; None: ``FUSEDPAR_OVERLAP``, else "auto");
    ``reduce_dtype``: the dtype their reduce-scatters' partial sums travel in (None: fp32).

    Built from these keywords, or ``from_spec(spec, placement)``: an `AttentionSpec` (the
    keywords but the groups') and a `fusedpar.Placement` (`fusedpar.nn.specs`), the same
    layer either way, which keeps both (``self.spec``, ``self.placement``).
    """

    GROUP_AXES = {"tp_group": ("tp",), "cp_group": ("cp",), "ulysses_group": ("ulysses",)}
    READS_FORWARD_PARAMS = True  # through `fusedpar.local_params.forward_params`: no hooks
    SPEC = AttentionSpec
    _fusedpar_checked = False  # until the first call's checks pass (`fusedpar.checks`)

    def __init__(
        self,
        d_model,
        n_heads,
        n_kv_heads=None,
        *,
        head_dim=None,
        bias=False,
        o_bias=False,
        qk_norm: bool | str = False,
        norm_eps=1e-6,
        norm_offset=0.0,
        sinks: bool = False,
        rope: Callable | str | None = DEFAULT_ROPE,
        rotary_dim: int | None = None,
        softmax_scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        tp_group=None,
        cp_group=None,
        causal=True,
        sequence_parallel=True,
        cp_layout="zigzag",
        rope_theta=10000.0,
        ulysses_group=None,
        cp_mode: str | None = None,
        overlap=None,
        reduce_dtype=None,
        output_gate: bool = False,
        device=None,
        dtype=None,
    ):
        placement = Placement(
            tp_group=tp_group,
            cp_group=cp_group,
            ulysses_group=ulysses_group,
            cp_mode=cp_mode,
            cp_layout=cp_layout,
            sequence_parallel=sequence_parallel,
            overlap=overlap,
            reduce_dtype=reduce_dtype,
        )
        spec = AttentionSpec(
            d_model,
            n_heads,
            n_kv_heads,
            head_dim=head_dim,
            bias=bias,
            o_bias=o_bias,
            qk_norm=qk_norm,
            norm_eps=norm_eps,
            norm_offset=norm_offset,
            sinks=sinks,
            rope=rope,
            rotary_dim=rotary_dim,
            softmax_scale=softmax_scale,
            sliding_window=sliding_window,
            softcap=softcap,
            causal=causal,
            rope_theta=rope_theta,
            output_gate=output_gate,
        )
        self._build(spec, placement, device, dtype)

    def _build(self, spec: AttentionSpec, placement: Placement, device, dtype) -> None:
        """The layer of `spec` on `placement` (`__init__` and `from_spec`): the checks
        that need the groups (heads over TP and Ulysses), then the parameters."""
        super().__init__()  # (cooperative: a subclass's other bases too)
        self.spec, self.placement = spec, placement
        n_heads, (n_kv_heads, head_dim, rotary_dim, qk_norm) = spec.n_heads, spec.resolved()
        tp_group, ulysses_group = placement.tp_group, placement.ulysses_group
        tp = comm.group_size(tp_group)
        # KV heads per rank; more TP ranks than KV heads: each KV head on tp / Hkv ranks
        kv_local = kv_heads_per_rank(n_heads, n_kv_heads, tp)
        self.kv_replicas = max(1, tp // n_kv_heads)
        ulysses = comm.group_size(ulysses_group)
        if ulysses > 1:
            check_heads(
                n_heads // tp,
                kv_local,
                ulysses,
                f"ParallelAttention (n_heads {n_heads}, n_kv_heads {n_kv_heads}, TP {tp})",
            )
        # the TP projections' schedule and the dtype their partial sums travel in
        self.overlap, self.reduce_dtype = placement.overlap, placement.reduce_dtype
        self.cp_mode = placement.cp_mode
        self.d_model, self.n_heads, self.n_kv_heads = spec.d_model, n_heads, n_kv_heads
        self.head_dim, self.norm_eps, self.rope = head_dim, spec.norm_eps, spec.rope
        self.qk_norm, self.norm_offset = qk_norm, spec.norm_offset
        self.rotary_dim, self.softmax_scale = rotary_dim, spec.softmax_scale
        self.tp_group, self.cp_group, self.ulysses_group = (
            tp_group,
            placement.cp_group,
            ulysses_group,
        )
        self.tp, self.tp_rank = tp, comm.group_rank(tp_group)
        self.causal, self.sequence_parallel = spec.causal, placement.sequence_parallel
        self.cp_layout, self.rope_theta = placement.cp_layout, spec.rope_theta
        self.sliding_window, self.softcap = spec.sliding_window, spec.softcap
        self.output_gate = spec.output_gate
        # the mask of every call (its sinks aside: a parameter, joined per call), and its
        # parts as attributes: Hugging Face's W keys (the query's own included) is
        # flash-attn's (W - 1, 0)
        self._mask = spec.mask
        self.window = self._mask.window
        hd, d_model, factory = head_dim, spec.d_model, {"device": device, "dtype": dtype}
        # replicated KV heads: every KV head whole on each rank, the forward reads its own
        q_rows = n_heads // tp * hd
        kv_rows = (n_kv_heads if self.kv_replicas > 1 else kv_local) * hd
        self.q_weight = nn.Parameter(torch.empty(q_rows, d_model, **factory))
        self.k_weight = nn.Parameter(torch.empty(kv_rows, d_model, **factory))
        self.v_weight = nn.Parameter(torch.empty(kv_rows, d_model, **factory))
        self.o_weight = nn.Parameter(torch.empty(d_model, q_rows, **factory))

        def optional(on, *shape):  # noqa: E306
            return nn.Parameter(torch.empty(shape, **factory)) if on else None

        self.q_bias = optional(spec.bias, q_rows)
        self.gate_weight = optional(spec.output_gate, q_rows, d_model)
        self.gate_bias = optional(spec.output_gate and spec.bias, q_rows)
        self.k_bias, self.v_bias = optional(spec.bias, kv_rows), optional(spec.bias, kv_rows)
        self.o_bias = optional(spec.o_bias, d_model)
        full = qk_norm == "full"
        self.q_norm_weight = optional(qk_norm, q_rows if full else hd)
        self.k_norm_weight = optional(qk_norm, kv_rows if full else hd)
        self.sinks = optional(spec.sinks, n_heads // tp)
        self._rope_tables: dict = {}  # (length, device) -> (cos, sin); not state
        self._rope_layout_checked = False  # a callable's table layout: checked once
        if self.q_weight.device.type != "meta":
            self.reset_parameters()

    @property
    def has_bias(self) -> bool:
        return self.q_bias is not None

    def reset_parameters(self) -> None:
        """``nn.Linear`` initialization of the full projections and biases (float32, CPU,
        current RNG state: the same model for any TP degree), then this rank's heads;
        norm weights 1 (with their offset), sinks 0."""
        d, hd, bias = self.d_model, self.head_dim, self.has_bias
        # gated: q's rows [q_h | gate_h] per head, as Hugging Face's (`load_dense`)
        q = nn.Linear(d, self.n_heads * hd * (2 if self.output_gate else 1), bias=bias)
        k = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        v = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        o = nn.Linear(self.n_heads * hd, d, bias=self.o_bias is not None)
        extras = {}
        if self.qk_norm is not None:
            full = self.qk_norm == "full"
            for name, heads in (("q_norm", self.n_heads), ("k_norm", self.n_kv_heads)):
                extras[name] = torch.full((heads * hd if full else hd,), 1.0 - self.norm_offset)
        if self.sinks is not None:
            extras["sinks"] = torch.zeros(self.n_heads)
        self.load_dense(q, k, v, o, **extras)

    def load_dense(
        self,
        q,
        k,
        v,
        o,
        *,
        q_norm=None,
        k_norm=None,
        sinks=None,
        bias=None,
        rope_layout: str = "half",
    ) -> None:
        """Copy this rank's heads of dense projections: q, k, v, o as ``nn.Linear``s or
        Hugging Face ``Conv1D``s (with biases where this layer has them), or weight
        tensors in ``nn.Linear``'s layout (q (Hq*hd, d), k and v (Hkv*hd, d), o
        (d, Hq*hd)) with their biases in ``bias=(q, k, v, o)`` (tensors or None);
        q_norm, k_norm with ``qk_norm`` ((hd,); "full": (Hq*hd,), (Hkv*hd,)); sinks (Hq,)
        with ``sinks``. `rope_layout`: "half" (the dense rows pair dims (i, i + r/2), as
        this layer and Hugging Face do) or "interleaved" (pairs (2i, 2i + 1), Meta's and
        torchtitan's): q's and k's rows, biases and norm weights are then permuted into
        this layer's layout (`interleaved_to_half`), which leaves every score unchanged.
        With ``output_gate``, q is (Hq*2hd, d) in Hugging Face's layout, each head's hd
        q rows then its hd gate rows (its bias likewise): each rank takes its heads' q
        and gate rows. Replicated KV heads (TP > Hkv): k and v are copied whole.
        Raises ValueError for anything this layer would not compute: a bias it has no
        place for, a missing one, a shape that does not fit."""
        if rope_layout not in ROPE_LAYOUTS:
            raise ValueError(f"rope_layout must be one of {ROPE_LAYOUTS}, got {rope_layout!r}")
        if rope_layout == "interleaved" and self.rope is None:
            raise ValueError(
                "rope_layout='interleaved' with rope=None: a layer without a rotary "
                "embedding has no rotary pairs to reorder"
            )
        d, hd = self.d_model, self.head_dim

        def permute(t):  # the dense q/k rows (or norm weights) in this layer's layout
            return interleaved_to_half(t, hd, self.rotary_dim) if rope_layout != "half" else t

        gates = 2 if self.output_gate else 1
        expected = {
            "q": (self.n_heads * hd * gates, d),
            "k": (self.n_kv_heads * hd, d),
            "v": (self.n_kv_heads * hd, d),
            "o": (d, self.n_heads * hd),
        }
        biases = bias_per_weight("ParallelAttention", bias, 4)
        copies = []  # (parameter, full tensor, split dim or None)
        for name, t, given in zip("qkvo", (q, k, v, o), biases, strict=True):
            weight, bias = linear_parts(name, t, given)
            if tuple(weight.shape) != expected[name]:
                raise ValueError(
                    f"dense {name} must be {expected[name]} (heads x head_dim "
                    f"{hd}), got {tuple(weight.shape)}"
                )
            param_bias = getattr(self, f"{name}_bias")
            if (bias is None) != (param_bias is None):
                flag = "o_bias" if name == "o" else "bias"
                raise ValueError(
                    f"dense {name} has {'a' if bias is not None else 'no'} bias but this "
                    f"ParallelAttention was built with {flag}={param_bias is not None}"
                )
            if name == "q" and self.output_gate:  # [q_h | gate_h] per head: split them
                (weight, gate), (bias, gate_bias) = split_gate(weight, hd), split_gate(bias, hd)
                copies.append((self.gate_weight, gate, 0))
                if gate_bias is not None:
                    copies.append((self.gate_bias, gate_bias, 0))
            if name in "qk":
                weight, bias = permute(weight), None if bias is None else permute(bias)
            # o: split by its columns; replicated k and v: whole; else by heads
            dim = 1 if name == "o" else None if name in "kv" and self.kv_replicas > 1 else 0
            copies.append((getattr(self, f"{name}_weight"), weight, dim))
            if bias is not None:
                copies.append((param_bias, bias, None if name == "o" else dim))
        full = self.qk_norm == "full"
        extras = (
            ("q_norm", q_norm, self.n_heads),
            ("k_norm", k_norm, self.n_kv_heads),
            ("sinks", sinks, self.n_heads),
        )
        for name, t, heads in extras:
            param = self.sinks if name == "sinks" else getattr(self, f"{name}_weight")
            if (t is None) != (param is None):
                given = "given" if t is not None else "missing"
                flag = (
                    f"sinks={param is not None}" if name == "sinks" else f"qk_norm={self.qk_norm!r}"
                )
                raise ValueError(f"{name} {given} but this ParallelAttention was built with {flag}")
            if t is None:
                continue
            weight = norm_weight(name, t)
            split = full or name == "sinks"  # per head: this rank's heads
            shape = (heads,) if name == "sinks" else (heads * hd,) if full else (hd,)
            if tuple(weight.shape) != shape:
                what = "one per head" if name == "sinks" else f"qk_norm={self.qk_norm!r}"
                raise ValueError(f"{name} must be {shape} ({what}), got {tuple(weight.shape)}")
            weight = weight if name == "sinks" else permute(weight)  # sinks: one per head
            split = split and not (name == "k_norm" and self.kv_replicas > 1)  # whole: as k
            copies.append((param, weight, 0 if split else None))
        with torch.no_grad():
            for param, full, dim in copies:
                part = (
                    full.detach()
                    if dim is None
                    else full.detach().chunk(self.tp, dim)[self.tp_rank]
                )
                local_tensor(param).copy_(part)

    def param_layouts(self) -> dict:
        """For `fusedpar.distribute`: each parameter's layout over TP (`head_layouts`:
        heads split, replicated KV heads whole with their gradient partial over TP)."""
        return head_layouts(self.tp_group, self.qk_norm, self.kv_replicas)

    @classmethod
    def from_dense(
        cls,
        q,
        k,
        v,
        o,
        d_model,
        n_heads,
        n_kv_heads=None,
        *,
        q_norm=None,
        k_norm=None,
        sinks=None,
        bias=None,
        rope_layout: str = "half",
        **kwargs,
    ):
        """A layer holding this TP rank's heads of dense q, k, v, o (``nn.Linear``s,
        ``Conv1D``s, or weight tensors with ``bias=(q, k, v, o)`` beside them) and
        optional q/k norms and sinks. The flags `bias` (True/False), `o_bias`, `qk_norm`
        ("head" or "full" by the norm's width), `sinks` and `head_dim` are read off the
        dense parts unless given (and then must agree). ``rope_layout="interleaved"``:
        the dense q and k pair their rotary dims (2i, 2i + 1) (Meta's and torchtitan's
        checkpoints), permuted here into this layer's (i, i + r/2) (see `load_dense`).
        Pass ``rope_theta`` (default 10000) or ``rope``: the layer builds its own
        tables, and a model of another base would be silently off. ``output_gate=True``
        (never read off the shapes): q holds each head's q and gate rows (Hugging Face's
        Qwen3-Next q_proj, (Hq*2hd, d); see `load_dense`)."""
        if rope_layout not in ROPE_LAYOUTS:
            raise ValueError(f"rope_layout must be one of {ROPE_LAYOUTS}, got {rope_layout!r}")
        flag = bias if isinstance(bias, bool) else None
        biases = None if isinstance(bias, bool) else bias
        given = bias_per_weight("ParallelAttention.from_dense", biases, 4)
        weight, q_bias = linear_parts("q", q, given[0])
        n_kv_heads = n_kv_heads or n_heads
        gated = bool(kwargs.get("output_gate"))
        per_head = 2 * n_heads if gated else n_heads  # q's and gates' rows
        if weight.shape[0] % per_head:
            what = f"2 x n_heads ({n_heads}: output_gate)" if gated else f"n_heads ({n_heads})"
            raise ValueError(f"dense q has {weight.shape[0]} rows, not a multiple of {what}")
        kwargs.setdefault("head_dim", weight.shape[0] // per_head)
        k_rows = linear_parts("k", k, given[1])[0].shape[0]
        if not gated and weight.shape[0] * n_kv_heads == 2 * k_rows * n_heads:
            raise ValueError(
                f"dense q has {weight.shape[0]} rows, twice n_heads ({n_heads}) x k's head "
                f"dim ({k_rows // n_kv_heads}): a gated q (Qwen3-Next)? pass output_gate=True"
            )
        kwargs["bias"] = q_bias is not None if flag is None else flag
        kwargs.setdefault("o_bias", linear_parts("o", o, given[3])[1] is not None)
        if q_norm is not None:
            width = norm_weight("q_norm", q_norm).numel()
            q_rows = n_heads * kwargs["head_dim"]  # (the gate rows aside)
            kwargs.setdefault(
                "qk_norm", "full" if width == q_rows != kwargs["head_dim"] else "head"
            )
        kwargs.setdefault("sinks", sinks is not None)
        kwargs.setdefault("dtype", weight.dtype)
        device = kwargs.pop("device", weight.device)
        layer = cls(d_model, n_heads, n_kv_heads, device="meta", **kwargs)
        layer.to_empty(device=device)
        layer.load_dense(
            q,
            k,
            v,
            o,
            q_norm=q_norm,
            k_norm=k_norm,
            sinks=sinks,
            bias=biases,
            rope_layout=rope_layout,
        )
        return layer

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x (S_loc, B, d_model) -> the same shape (see the module doc). `cu_seqlens`
        (int32, the same on every rank): the documents packed into the full sequence
        (B = 1), as in `fusedpar.flash_attn_varlen`; a token attends within its own
        document, and its RoPE position restarts at each document's start."""
        tables = self._start_call(x, cu_seqlens, self.q_weight)
        hd, rotary = self.head_dim, tables is not None
        cos, sin = tables if rotary else (None, None)
        one_op = takes_one_op(self, x, cos, sin)
        # after fusedpar.distribute: the local tensors, or the DTensors for the one op
        params = forward_params(self, x if one_op else None)
        if one_op:
            return self._one_op(x, params, (cos, sin) if rotary else (), cu_seqlens)
        weights = [params["q_weight"], *self._own_kv(params["k_weight"], params["v_weight"])]
        biases = [params.get("q_bias"), *self._own_kv(params.get("k_bias"), params.get("v_bias"))]
        if self.output_gate:  # the gates: a fourth GEMM of the same gather
            weights, biases = [*weights, params["gate_weight"]], [*biases, params.get("gate_bias")]
        # RoPE joins the QKV GEMMs (their epilogue, or one launch after them) where no q/k
        # norm comes between
        joined = rotary and self.qk_norm is None and not rotates_by_formula(x, cos, sin)
        turned = [True, True, False, False][: len(weights)]  # q and k
        rope = dict(rope=(cos, sin), rotate=turned, head_dim=hd) if joined else {}
        if self.sequence_parallel:
            q, k, v, *gate = all_gather_matmul(
                x,
                weights,
                self.tp_group,
                bias=biases,
                overlap=self.overlap,
                reduce_dtype=self.reduce_dtype,
                **rope,
            )
        else:  # classic TP: every rank holds x whole, so the GEMMs gather nothing
            x = comm.copy_to_region(x, self.tp_group)
            q, k, v, *gate = all_gather_matmul(x, weights, None, bias=biases, **rope)
        seq, batch = q.shape[0], q.shape[1]
        q, k, v = (t.view(seq, batch, -1, hd) for t in (q, k, v))  # (S, B, H, hd)
        # ... or the q/k head norm's kernel rotates its output (one launch each way per tensor)
        normed = rotary and not joined and joins_rope(self.qk_norm, q, cos, sin)
        if self.qk_norm is not None:  # (on rows that flatten: the norm kernel reads them in place)
            norm = dict(
                kind=self.qk_norm,
                offset=self.norm_offset,
                tp_group=self.tp_group,
                rope=(cos, sin) if normed else None,
            )
            q = qk_rms_norm(q, params["q_norm_weight"], self.norm_eps, **norm)
            # a "full" k norm's weight of replicated KV heads: whole, this rank's head read
            full = self.qk_norm == "full"
            k_norm = params["k_norm_weight"]
            k_norm = self._own_kv(k_norm)[0] if full else k_norm
            k = qk_rms_norm(k, k_norm, self.norm_eps, **norm)
        # (S, B, H, hd) -> (B, S, H, hd): a strided view, read in place by the kernels
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        if rotary and not joined and not normed:
            q, k = apply_rope_qk(q, k, cos, sin)  # one launch for both, each way
        mask = self._mask
        sinks = params.get("sinks")
        if sinks is not None:  # (a parameter: read per call)
            mask = replace(mask, sinks=sinks.to(accumulator(x.dtype)))
        out = masked_ring_attn(
            q,
            k,
            v,
            self.cp_group,
            mask,
            layout=self.cp_layout,
            cu_seqlens=cu_seqlens,
            ulysses_group=self.ulysses_group,
        )
        out = out.transpose(0, 1).reshape(seq, batch, -1)  # (S, B, Hq/TP * hd)
        if gate:  # (the gate's rows are q's: the same tokens, in the same order)
            out = sigmoid_gate(out, gate[0])
        if self.sequence_parallel:
            # Each rank adds the o bias to its own tokens: its gradient is summed over TP.
            o_bias = params.get("o_bias")
            bias = None if o_bias is None else comm.copy_to_region(o_bias, self.tp_group)
            return matmul_reduce_scatter(
                out,
                params["o_weight"],
                self.tp_group,
                bias=bias,
                overlap=self.overlap,
                reduce_dtype=self.reduce_dtype,
            )
        y = comm.reduce_from_region(F.linear(out, params["o_weight"]), self.tp_group)
        o_bias = params.get("o_bias")
        return y if o_bias is None else y + o_bias

    def _own_kv(self, *tensors):
        """k's and v's tensors this rank computes with (`own_kv`)."""
        return own_kv(tensors, self.head_dim, self.tp_rank, self.kv_replicas)

    def _one_op(self, x, params: dict, tables, cu_seqlens):
        """The forward on one rank as one op (`fusedpar.ops.attention_layer`), of
        `params` (`forward_params`)."""
        check_float_dtype("ParallelAttention: x", x)
        norms = () if self.qk_norm is None else (params["q_norm_weight"], params["k_norm_weight"])
        weights = tuple(params[f"{n}_weight"] for n in ("q", "k", "v", "o"))
        biases = tuple(params.get(f"{n}_bias") for n in ("q", "k", "v", "o"))
        if self.output_gate:  # (after o's: the op's own order)
            weights, biases = (*weights, params["gate_weight"]), (*biases, params.get("gate_bias"))
        for t in (*weights, *biases, *norms):  # what the composed path's ops each check
            if t is not None and (t.dtype != x.dtype or t.device != x.device):
                name = next(n for n, p in params.items() if p is t)
                raise TypeError(
                    f"ParallelAttention: x is {x.dtype} on {x.device} but "
                    f"{name} is {t.dtype} on {t.device}"
                )
        return attention_layer(
            x,
            weights,
            biases,
            norms,
            tables,
            cu_seqlens,
            head_dim=self.head_dim,
            mask=self._mask,
            norm_eps=self.norm_eps,
            norm_offset=self.norm_offset,
        )


def takes_one_op(layer: ParallelAttention, x, cos, sin) -> bool:
    """Whether `layer`'s forward runs as one op (`fusedpar.ops.attention_layer`): on one
    rank (no tp, cp or Ulysses group of more than one), with sequence parallelism (classic
    TP's o projection is ``F.linear``), no sinks, no q/k norm or a "head" one, and RoPE
    tables (cos, sin; None: no RoPE) the kernels take."""
    one_rank = all(
        comm.group_size(g) == 1 for g in (layer.tp_group, layer.cp_group, layer.ulysses_group)
    )
    return (
        one_rank
        and layer.sequence_parallel
        and layer.sinks is None
        and layer.qk_norm in (None, "head")
        and (cos is None or not rotates_by_formula(x, cos, sin))
    )

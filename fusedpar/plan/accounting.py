"""What fusedpar's layers hold and save, per rank, from their sizes: the description the
planner's memory is computed from, and that tests/plan/test_plan.py holds equal to what a
real step allocates and saves.

Sizes of one rank for one microbatch of B sequences of S tokens, on a layout of degrees
cp (ring), u (Ulysses), t (tensor), ep (experts), with e bytes per activation:

| tokens              | where                                                    |
| ------------------- | -------------------------------------------------------- |
| n = S B / (c u t)   | the sequence-parallel stream: norms, residuals, MoE      |
| m = S B / (c u)     | TP's gathered tokens: projections' outputs, the MLP      |
| a = S B / c         | attention's tokens (heads Hq / (t u), KV heads per rank) |

What each layer saves for the backward (per layer, under no checkpointing, "selective"
and "full"), and a converted Hugging Face model's own norms and loss, are in the
functions below and tabulated in docs/plan.md. The MoE's rows depend on the routing:
the planner takes it balanced (R' = n k), which the tests hold exact summed over an EP
group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: fusedpar.plan.model imports this module
    from fusedpar.plan.model import ModelSpec

POLICIES = ("none", "selective", "full")


@dataclass(frozen=True)
class Local:
    """One rank's sizes for one microbatch (see the module doc)."""

    seq: int  # S
    batch: int  # B: sequences per microbatch
    cp: int = 1
    ulysses: int = 1
    tp: int = 1
    ep: int = 1
    e: int = 2  # bytes per activation element
    latent_ring: bool = False  # MLA's ring moves the latent (`ParallelMLA`'s cp_ring)
    span_rank: int = 1  # the cp x ulysses rank whose GDN halo routes count (`linear_traffic`)

    @property
    def n(self) -> int:  # the sequence-parallel stream's tokens
        return self.seq * self.batch // (self.cp * self.ulysses * self.tp)

    @property
    def m(self) -> int:  # TP's gathered tokens
        return self.seq * self.batch // (self.cp * self.ulysses)

    @property
    def a(self) -> int:  # attention's tokens
        return self.seq * self.batch // self.cp

    def heads(self, spec: ModelSpec) -> tuple[int, int]:
        """(query heads, KV heads) one rank's attention runs: KV heads fewer than the
        TP degree, or than the Ulysses degree, are replicated, one a rank."""
        kv = kv_heads_held(spec, self.tp)
        return spec.n_heads // (self.tp * self.ulysses), max(kv // self.ulysses, 1)


def kv_replicated(spec: ModelSpec, tp: int) -> bool:
    """Whether TP exceeds the KV heads (`ParallelAttention`'s KV-head replication: each
    rank holds every KV head's weights whole, their gradient partial over TP, and
    computes with KV head rank // (tp / Hkv))."""
    return not spec.mla and tp > spec.n_kv_heads


def kv_heads_held(spec: ModelSpec, tp: int) -> int:
    """KV heads one TP rank's attention computes with: Hkv / tp, or 1 when replicated."""
    return max(spec.n_kv_heads // tp, 1)


def kv_heads_exchanged(spec: ModelSpec, tp: int, ulysses: int) -> int:
    """KV heads one rank's Ulysses exchange sends (and receives): its own, or, fewer than
    the Ulysses degree, each repeated to one a Ulysses rank (`ops.ulysses.check_heads`)."""
    held = kv_heads_held(spec, tp)
    return max(held, ulysses) if ulysses > 1 else held


def kv_rows(spec: ModelSpec, tp: int) -> int:
    """Heads of K (and of V) one TP rank projects: Hkv / tp, or all Hkv when replicated
    (the rank's head is a view of the whole projection)."""
    return spec.n_kv_heads if kv_replicated(spec, tp) else spec.n_kv_heads // tp


def check_heads(spec: ModelSpec, dims) -> int | None:
    """What the layers refuse of `dims` that `ParallelDims.validate` does not check, as
    the layers word it: GDN k-heads not split over TP; TP neither dividing the KV heads
    nor a multiple of them. Returns the KV heads `validate` should check (None where TP
    replicates them: one a TP rank, which Ulysses replicates again over its ranks)."""
    if spec.linear_layers and spec.linear_k_heads % dims.tp:
        raise ValueError(
            f"GatedDeltaNet: n_k_heads ({spec.linear_k_heads}) is not divisible by the TP "
            f"degree ({dims.tp})"
        )
    if spec.mla or dims.tp <= spec.n_kv_heads:
        return spec.n_kv_heads
    if dims.tp % spec.n_kv_heads:
        raise ValueError(
            f"n_kv_heads ({spec.n_kv_heads}) and the TP degree ({dims.tp}): one must divide "
            "the other (KV heads split over TP, or each replicated on TP / n_kv_heads ranks)"
        )
    return None


def gdn_tensors(spec: ModelSpec, tp: int = 1) -> list[tuple]:
    """`GatedDeltaNet`'s parameters on one TP rank (hk = Hk / tp, hv = Hv / tp):
    q, k (hk K, d); v, z (hv V, d); b, a (hv, d); the conv's q, k (hk K, W) and v
    (hv V, W) channels; A_log, dt_bias (hv,); o (d, hv V); the gated norm's (V,) whole,
    its gradient partial over TP."""
    d, K, V, W = spec.d_model, spec.linear_k_dim, spec.linear_v_dim, spec.linear_conv
    hk, hv = spec.linear_k_heads // tp, spec.linear_v_heads // tp
    shapes = [(hk * K, d)] * 2 + [(hv * V, d)] * 2 + [(hv, d)] * 2
    shapes += [(hk * K, W)] * 2 + [(hv * V, W), (hv,), (hv,), (d, hv * V)]
    return [(s, "tp") for s in shapes] + [((V,), "whole")]


# --- parameters ----------------------------------------------------------------------------


def layer_tensors(spec: ModelSpec, layer: int, tp: int = 1, ep: int = 1) -> list[tuple]:
    """(local shape, kind) of each parameter of block `layer` on one rank; kind is "expert"
    for the routed experts' (split over ep), "whole" for those every rank of the block
    holds whole (norms, routers, shared experts), "tp" for TP shards, "summed" for the
    biases added after a TP reduction (whole; `comm.copy_to_region` sums their gradient
    over tp in the layer's backward)."""
    d, hd, hv, t = spec.d_model, spec.head_dim, spec.v_dim, tp
    out = [((d,), "whole"), ((d,), "whole")]  # the two norms
    if spec.is_linear(layer):
        out += gdn_tensors(spec, t)
    elif spec.mla:
        hq = spec.n_heads // t
        if spec.q_lora_rank:
            out += [
                ((spec.q_lora_rank, d), "whole"),
                ((spec.q_lora_rank,), "whole"),
                ((hq * hd, spec.q_lora_rank), "tp"),
            ]
        else:
            out.append(((hq * hd, d), "tp"))
        out += [
            ((spec.kv_lora_rank + spec.rope_dim, d), "whole"),
            ((spec.kv_lora_rank,), "whole"),
            ((hq * (hd - spec.rope_dim + hv), spec.kv_lora_rank), "tp"),
            ((d, hq * hv), "tp"),
        ]
        if spec.attention_bias:  # q_a's (q_proj's has none) and kv_a's
            out += [((spec.q_lora_rank,), "whole")] if spec.q_lora_rank else []
            out.append(((spec.kv_lora_rank + spec.rope_dim,), "whole"))
    else:
        # replicated K and V: every KV head whole on each rank, gradient partial over TP
        q, kv, k_kind = spec.n_heads // t * hd, kv_rows(spec, t) * hd, "tp"
        if kv_replicated(spec, t):
            k_kind = "whole"
        out += [((q, d), "tp"), ((kv, d), k_kind), ((kv, d), k_kind), ((d, q), "tp")]
        if spec.attention_bias:
            out += [((q,), "tp"), ((kv,), k_kind), ((kv,), k_kind)]
        if spec.qk_norm:
            out += [((hd,), "whole"), ((hd,), "whole")]
        if spec.output_gate:  # gate_weight (and gate_bias), split like q
            out += [((q, d), "tp")] + ([((q,), "tp")] if spec.attention_bias else [])
    if spec.o_bias and not spec.is_linear(layer):  # added after the reduction
        out.append(((d,), "summed"))
    if spec.is_moe(layer):
        out += moe_tensors(spec, ep)
    else:
        h = spec.d_hidden // t
        out += [((h, d), "tp"), ((h, d), "tp"), ((d, h), "tp")][1 - spec.gated :]
        if spec.mlp_bias:  # gate's and up's (fc's) split like their rows; down's summed
            out += [((h,), "tp"), ((h,), "tp"), ((d,), "summed")][1 - spec.gated :]
    return [(shape, kind) for shape, kind in out]


def moe_tensors(spec: ModelSpec, ep: int = 1) -> list[tuple]:
    """(local shape, kind) of one `MoE` module's parameters, the last of its block's
    `layer_tensors`: the router, the routed experts (E / ep of them: "expert"), the
    shared expert and its gate. FSDP2 treats the module as a unit of its own where
    experts take part of dp (`memory.fsdp_units`)."""
    d, E, h = spec.d_model, spec.num_experts, spec.expert_hidden
    out = [((E, d), "whole")] + [((E // ep, *s), "expert") for s in ((h, d), (h, d), (d, h))]
    if spec.shared_hidden:
        hs = spec.shared_hidden
        out += [((hs, d), "whole"), ((d, hs), "whole"), ((hs, d), "whole")]
    if spec.shared_gate:
        out.append(((1, d), "whole"))
    return out


def model_end_tensors(spec: ModelSpec, *, first: bool, last: bool) -> list[tuple[int, str]]:
    """(numel, kind) of the embedding (`first`), the final norm and the head (`last`):
    whole on every rank of their stage; a tied head is the embedding's tensor."""
    out = []
    if first:
        out.append((spec.vocab * spec.d_model, "whole"))
    if last:
        out.append((spec.d_model, "whole"))
        if not (spec.tied and first):
            out.append((spec.vocab * spec.d_model, "whole"))
    return out


def fsdp_numel(shape: tuple, dp: int) -> int:
    """Elements FSDP2 keeps of a tensor on each of dp ranks: dim 0 padded to a multiple of
    dp and split (the largest rank's share; all of it at dp = 1)."""
    rest = math.prod(shape[1:])
    return math.ceil(shape[0] / dp) * rest if dp > 1 else math.prod(shape)


# --- saved activations ---------------------------------------------------------------------


def norm_saved(spec: ModelSpec, z: Local) -> int:
    """Bytes an RMSNorm over the stream saves, its output included (the next layer's
    input): fusedpar's x, the output (n d e each), rstd (4 n); Hugging Face's x in fp32
    (4 n d, the input itself in fp32), rstd, the normalized x before the weight and the
    output (n d e each)."""
    d, e = spec.d_model, z.e
    return z.n * ((4 + 2 * e) * d + 4) if spec.hf else z.n * (2 * d * e + 4)


def rope_tables(spec: ModelSpec, z: Local) -> int:
    """Bytes of RoPE's cos and sin (fp32, over the rotary dims) one attention layer saves:
    the same tensors for every microbatch of a sequence length (cached per layer), so the
    microbatches a pipeline holds in flight share them."""
    return 4 * (spec.rope_dim or spec.head_dim) * (z.seq // (z.cp * z.ulysses))


def mla_saved(spec: ModelSpec, z: Local) -> int:
    """Bytes one `ParallelMLA` saves with no checkpointing, its input norm included: the
    latents' norms (inputs: q_a's output, kv_a's (r + dr wide, the latent a view of it);
    rstd; outputs), q and k after RoPE, kv_b's output (v a view of it), the output and
    its LSE, RoPE's tables over the rotary dims; with cp > 1 the ring's masks. Held exact
    with the ring (and Ulysses) moving the expanded K/V, and with the ring that moves the
    latent (``z.latent_ring``: ``cp_ring="latent"``, or "auto" on a GPU where it moves
    less), which saves q, what travels, the output and its LSE.
    Under Ulysses v is exchanged (kv_b's output is then not kept) and o-proj takes the
    gathered output."""
    e, hd, hv, dr, r = z.e, spec.head_dim, spec.v_dim, spec.rope_dim, spec.kv_lora_rank
    hq = spec.n_heads // (z.tp * z.ulysses)
    saved = norm_saved(spec, z)
    if spec.q_lora_rank:
        saved += z.m * (2 * spec.q_lora_rank * e + 4)
    saved += z.m * ((2 * r + dr) * e + 4)
    saved += rope_tables(spec, z)
    if z.latent_ring and z.cp > 1:  # q; what travels: the latent beside k_rope (B, S / c,
        # r + dr); no K, no kv_b output, the latent's norm output not kept, masks not saved
        return saved - z.m * r * e + z.a * (hq * hd + r + dr) * e + z.a * hq * (hv * e + 4)
    saved += 2 * z.a * hq * hd * e  # q and k after RoPE
    if z.ulysses > 1:  # v exchanged (kv_b's output not kept); o-proj's gathered input
        saved += z.a * hq * hv * e + z.m * spec.n_heads // z.tp * hv * e
    else:  # kv_b's output, v a view of it
        saved += z.m * spec.n_heads // z.tp * (hd - dr + hv) * e
    if z.cp > 1:
        saved += 16 * z.seq  # the ring's masks: (cp, 4, S / cp) int32
    return saved + z.a * hq * hv * e + 4 * z.a * hq


def attention_saved(spec: ModelSpec, z: Local, policy: str = "none") -> int:
    """Bytes one attention layer saves, its input norm included (the module doc's table);
    under a checkpointing policy, the outputs the policy keeps."""
    e, d, hd, hv = z.e, spec.d_model, spec.head_dim, spec.v_dim
    hq, hkv = z.heads(spec)
    q_k_v = z.a * (hq * hd + hkv * (hd + hv)) * e
    out_lse = z.a * hq * hv * e + 4 * z.a * hq
    gathered_out = z.m * spec.n_heads // z.tp * hv * e  # o-proj's input under Ulysses
    qk_norms = 0  # per-head norms of q and k: their inputs and rstd
    if spec.qk_norm and not spec.mla:
        qk_norms = z.m * (spec.n_heads // z.tp + kv_heads_held(spec, z.tp)) * (hd * e + 4)
    gate = z.m * spec.n_heads // z.tp * hd * e if spec.output_gate else 0  # its GEMM's
    if policy == "full":
        return 0
    if policy == "selective" and spec.mla:  # the latents' gathered projections, o-proj's
        kept = z.m * (spec.q_lora_rank + spec.kv_lora_rank + spec.rope_dim) * e + z.n * d * e
        if z.cp > 1 and not z.latent_ring:  # the ring's output (the latent ring's is
            kept += out_lse  # no op the policy names: recomputed, its sends repeated)
        if z.ulysses > 1:  # the exchanged q, k, v and the gathered output
            kept += q_k_v + gathered_out
        return kept
    if policy == "selective":
        if z.tp == 1 and z.cp == 1 and z.ulysses == 1:  # one rank: the layer is one op
            return z.n * d * e + q_k_v + out_lse + qk_norms + gate
        kv = kv_heads_held(spec, z.tp) * (hd + hv)
        projections = z.m * (spec.n_heads // z.tp * hd + kv) * e + gate
        kept = projections + z.n * d * e  # + o-proj's reduce-scattered output
        if z.cp > 1:
            kept += out_lse  # the ring's output
        if z.ulysses > 1:  # the exchanged q, k, v and the gathered output
            kept += q_k_v + gathered_out
        return kept
    if spec.mla:
        return mla_saved(spec, z)
    saved = norm_saved(spec, z)  # its norm: x, rstd, the output
    saved += q_k_v + out_lse + qk_norms + gate
    if gate and not (z.tp == 1 and z.cp == 1 and z.ulysses == 1):  # the gated output,
        saved += z.m * spec.n_heads // z.tp * hv * e  # o-proj's input (one op: not kept)
    saved += rope_tables(spec, z)
    if z.cp > 1:
        saved += 16 * z.seq  # the ring's masks: (cp, 4, S / cp) int32
    if z.ulysses > 1:
        saved += gathered_out
    return saved


def gdn_saved(spec: ModelSpec, z: Local, policy: str = "none") -> int:
    """Bytes one `GatedDeltaNet` saves, its input norm included (cp = 1: m tokens; C =
    2 hk K + hv V the conv's channels, hk, hv this TP rank's heads). Selective: its
    projections' outputs (q|k|v, z, b, a) and out's reduce-scattered output. None:

    | tensor                                              | bytes                     |
    | --------------------------------------------------- | ------------------------- |
    | the conv's input (the q, k, v projections; each its | m C e                     |
    | own GEMM and conv, on the parameters: no copy)      |                           |
    | the conv's outputs: v (the recurrence's), q and k   | m hv V e (+ 2 m hk K e    |
    | (the l2-norm's, where it reads them without a copy) | in fp32)                  |
    | beta = sigmoid(b) (2 sigmoid(b): and the sigmoid's) | m hv e (2 m hv e)         |
    | the decay g's chain in fp32: exp(A_log), -exp,      | 2 hv 4 + 3 m hv 4         |
    | softplus' input and output; g (the recurrence's)    |                           |
    | q, k l2-normalized (recurrence's), their rsqrt fp32 | 2 m hk (K e + 4)          |
    | and, from 16-bit q and k, their fp32 copies         | + 2 m hk K 4              |
    | the gated norm: o, z (a copy), rstd (fp32)          | 2 m hv V e + m hv 4       |
    | out's input (the norm's output)                     | m hv V e                  |
    """
    e, d, m = z.e, spec.d_model, z.m
    hk, hv = spec.linear_k_heads // z.tp, spec.linear_v_heads // z.tp
    K, V = spec.linear_k_dim, spec.linear_v_dim
    C = 2 * hk * K + hv * V
    if policy == "full":
        return 0
    if policy == "selective":
        return m * (C + hv * V + 2 * hv) * e + z.n * d * e
    saved = norm_saved(spec, z) + m * C * e  # the conv's input
    saved += m * (hv * V + (2 * hk * K if e == 4 else 0)) * e  # the conv's outputs
    saved += m * hv * e * (2 if spec.linear_neg_eigval else 1)  # beta
    saved += 2 * hv * 4 + 3 * m * hv * 4  # g
    saved += 2 * m * hk * (K * e + 4 + (K * 4 if e != 4 else 0))  # q, k
    return saved + 3 * m * hv * V * e + m * hv * 4


def mlp_saved(spec: ModelSpec, z: Local, moe: bool, policy: str = "none", received=None) -> int:
    """Bytes one MLP saves, its input norm included. `received`: the rows this EP rank's
    experts get (None: balanced, n k)."""
    e, d = z.e, spec.d_model
    if policy == "full":
        return 0
    if not moe:
        h = spec.d_hidden // z.tp
        gate_up = 2 * z.m * h * e
        if policy == "selective":
            return gate_up + z.n * d * e  # + the down projection's output
        return norm_saved(spec, z) + gate_up
    E, k, h, n = spec.num_experts, spec.top_k, spec.expert_hidden, z.n
    rows = n * k if received is None else received
    routing = 4 * n * E + 8 * n * k  # probs (fp32), ids (int32), weights (fp32)
    if policy == "selective":
        kept = routing
        if z.ep > 1:  # the dispatched rows, their order, the counts received (ep, E / ep)
            # and the splits (2, ep), int64; the returned rows
            kept += rows * (d * e + 8) + 8 * E + 16 * z.ep + n * k * d * e
        return kept
    saved = norm_saved(spec, z)  # its norm, the output the router's input
    if spec.router == "sigmoid":  # the scores' sum, their normalization (the aux loss's)
        saved += 4 * n
    if z.ep == 1:
        saved += routing + 4 * n * k + 8 * (E + 1) + 4 * E + n * k * (8 + (2 * h + d) * e)
    else:
        local = E // z.ep
        saved += routing + 8 * n * k + 16 * z.ep + 8 * local + 4 * E + n * k * d * e
        saved += rows * (8 + (d + 2 * h) * e)
    if spec.shared_hidden:
        saved += 2 * n * spec.shared_hidden * e
    if spec.shared_gate:  # its sigmoid's output and the shared experts' it scales
        saved += n * (d + 1) * e
    return saved


def block_saved(spec: ModelSpec, layer: int, z: Local, policy: str = "none", received=None) -> int:
    """Bytes block `layer` keeps for its backward, per microbatch: its layers' saved
    tensors, or under checkpointing its input and what the policy keeps."""
    if policy not in POLICIES:
        raise ValueError(f"checkpointing must be one of {POLICIES}, got {policy!r}")
    mixer = gdn_saved if spec.is_linear(layer) else attention_saved
    saved = mixer(spec, z, policy) + mlp_saved(spec, z, spec.is_moe(layer), policy, received)
    if policy != "none":
        saved += z.n * spec.d_model * z.e  # the block's input, kept by the checkpoint
    return saved


def ends_saved(spec: ModelSpec, z: Local, *, first: bool, last: bool) -> int:
    """Bytes the embedding (`first`) and the final norm, head and loss (`last`) save."""
    saved = 8 * z.m if first else 0  # the token ids (TP's rows are a view of them)
    if last:
        saved += norm_saved(spec, z)  # the final norm
        saved += z.n * (4 * spec.vocab + 8) + 4  # fp32 log-probs, labels, the count
        if spec.hf:  # `parallelize`'s loss divides by the count: a view of (sum, count)
            saved += 8
    return saved


def stage_shared(spec: ModelSpec, layers, z: Local, policy: str) -> int:
    """Bytes of `stage_saved` that every microbatch of a stage shares (RoPE's tables,
    saved with no checkpointing: a checkpointed block recomputes them)."""
    attention = sum(not spec.is_linear(i) for i in layers)  # GDN layers have no RoPE
    return attention * rope_tables(spec, z) if policy == "none" else 0


def stage_saved(spec: ModelSpec, layers, z: Local, policy: str, *, first: bool, last: bool) -> int:
    """Bytes one microbatch leaves saved on a rank holding blocks `layers` (and the
    embedding / the head when `first` / `last`)."""
    kinds: dict[tuple, int] = {}
    for i in layers:  # blocks of one kind save alike
        kinds[spec.kind(i)] = kinds.get(spec.kind(i), 0) + 1
    blocks = sum(
        count * block_saved(spec, next(i for i in layers if spec.kind(i) == kind), z, policy)
        for kind, count in kinds.items()
    )
    return blocks + ends_saved(spec, z, first=first, last=last)

"""What one GDN layer sends under context parallelism, per rank and step (forward and
backward), by the two ways of splitting its sequence (issue #56;
docs/context_parallel.md's linear-attention section):

| mode        | forward                                         | backward          |
| ----------- | ----------------------------------------------- | ----------------- |
| "summaries" | all-gather each span's ``[E, M]``: hv K (V + K) | each span's D:    |
|             | fp32; the conv's halo, W - 1 tokens of q, k, v  | hv K V fp32; halo |
| "ulysses"   | all-to-all of q, k, v, b, a in and o out (then  | the same          |
|             | the summaries over the ring, of hv / U heads)   |                   |

`payload` is what a rank puts into its collectives (the issue's accounting: one span's
``[E, M]`` is 4 MiB at Qwen3.5-35B); `wire` what leaves it under ring algorithms: an
all-gather sends W - 1 of its W shares, an all-to-all all but its own share.
`GatedDeltaNet`'s ``linear_cp_mode=None`` picks the mode of fewer wire bytes.
"""

from dataclasses import dataclass

STATE_BYTES = 4  # the summaries and their fold stay fp32 (bf16 grows the error per span)


@dataclass(frozen=True)
class LinearSizes:
    """A GDN layer's heads on one TP rank (hk, hv), head dims and conv taps."""

    hk: int
    hv: int
    K: int
    V: int
    conv: int

    @classmethod
    def of(cls, spec, tp: int = 1) -> "LinearSizes":
        """From a `fusedpar.plan.ModelSpec`'s GDN fields."""
        return cls(
            spec.linear_k_heads // tp,
            spec.linear_v_heads // tp,
            spec.linear_k_dim,
            spec.linear_v_dim,
            spec.linear_conv,
        )


@dataclass(frozen=True)
class ContextBytes:
    """Bytes per rank per GDN layer and step (forward + backward)."""

    payload: int
    wire: int

    def __add__(self, other: "ContextBytes") -> "ContextBytes":
        return ContextBytes(self.payload + other.payload, self.wire + other.wire)


def summaries(sizes: LinearSizes, ranks: int, *, layout: str = "zigzag", act: int = 2):
    """The span summaries' and the conv halo's bytes over `ranks` sequence shards (W, or
    W U on the hybrid layout): independent of the sequence length. `act`: the
    activations' bytes (bf16: 2)."""
    if ranks <= 1:
        return ContextBytes(0, 0)
    spans = 2 if layout == "zigzag" else 1
    K, V = sizes.K, sizes.V
    forward = spans * sizes.hv * K * (V + K) * STATE_BYTES
    backward = spans * sizes.hv * K * V * STATE_BYTES
    channels = 2 * sizes.hk * K + sizes.hv * V
    halo = 2 * spans * (sizes.conv - 1) * channels * act  # x forward, its gradient back
    payload = forward + backward + halo
    return ContextBytes(payload, (ranks - 1) * (forward + backward) + halo)


def head_all_to_all(sizes: LinearSizes, ulysses: int, tokens: int, *, z=False, act: int = 2):
    """The head exchange's bytes for `tokens` tokens a rank over `ulysses` ranks: q, k,
    v, b, a in and o out, forward and backward alike (`z`: z in too, as Megatron's
    head-parallel GDN sends it: 33 kB a token at Qwen3.5-35B)."""
    hk, hv, K, V = sizes.hk, sizes.hv, sizes.K, sizes.V
    per_token = (2 * hk * K + hv * V + 2 * hv + hv * V + (hv * V if z else 0)) * act
    payload = 2 * tokens * per_token
    return ContextBytes(payload, payload * (ulysses - 1) // ulysses)


def layer_bytes(sizes, mode: str, ring: int, ulysses: int, tokens: int, *, layout: str):
    """One GDN layer's bytes in `mode` with a ring of `ring` ranks and a Ulysses group of
    `ulysses` (`tokens` a rank): "summaries" over all ring x Ulysses shards, or
    "ulysses": the heads over Ulysses, then the summaries of hv / U heads over the ring."""
    if mode == "summaries":
        return summaries(sizes, ring * ulysses, layout=layout)
    per_rank = LinearSizes(sizes.hk // ulysses, sizes.hv // ulysses, sizes.K, sizes.V, sizes.conv)
    return head_all_to_all(sizes, ulysses, tokens) + summaries(per_rank, ring, layout=layout)


def layer_mode(sizes: LinearSizes, ring: int, ulysses: int, tokens: int, layout: str) -> str:
    """The mode `GatedDeltaNet` runs with ``linear_cp_mode=None`` (its `SequenceSplit`):
    the summaries without a Ulysses group or where the heads do not divide by it, else
    the one of fewer wire bytes at `tokens` tokens a rank."""
    if ulysses == 1 or sizes.hk % ulysses:
        return "summaries"
    wire = {m: layer_bytes(sizes, m, ring, ulysses, tokens, layout=layout).wire for m in MODES}
    return min(wire, key=wire.get)


MODES = ("summaries", "ulysses")

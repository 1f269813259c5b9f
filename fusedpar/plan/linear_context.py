"""What one GDN layer sends under context parallelism, per rank and step (forward and
backward), by the two ways of splitting its sequence (issue #56;
docs/context_parallel.md's linear-attention section):

| mode        | forward                                         | backward          |
| ----------- | ----------------------------------------------- | ----------------- |
| "summaries" | all-gather each span's ``[E, M]``: Hv K (V + K) | each span's D:    |
|             | fp32; the conv's halo, W - 1 tokens of q, k, v  | Hv K V fp32; halo |
| "ulysses"   | all-to-all of q, k, v, z, b, a in and o out     | the same          |

`payload` is what a rank puts into its collectives (the issue's accounting: one span's
``[E, M]`` is 4 MiB at Qwen3.5-35B); `wire` what leaves it under ring algorithms: an
all-gather sends W - 1 of its W shares, an all-to-all all but its own share.
"""

from dataclasses import dataclass

from fusedpar.plan.model import ModelSpec

STATE_BYTES = 4  # the summaries and their fold stay fp32 (bf16 grows the error per span)


@dataclass(frozen=True)
class ContextBytes:
    """Bytes per rank per GDN layer and step (forward + backward)."""

    payload: int
    wire: int


def summaries(spec: ModelSpec, cp: int, *, layout: str = "zigzag", tp: int = 1, act: int = 2):
    """The span summaries' and the conv halo's bytes: independent of the sequence length.
    `act`: the activations' bytes (bf16: 2)."""
    spans = 2 if layout == "zigzag" else 1
    hv = spec.linear_v_heads // tp
    K, V = spec.linear_k_dim, spec.linear_v_dim
    forward = spans * hv * K * (V + K) * STATE_BYTES
    backward = spans * hv * K * V * STATE_BYTES
    conv = (2 * spec.linear_k_heads * K + spec.linear_v_heads * V) // tp
    halo = 2 * spans * (spec.linear_conv - 1) * conv * act  # x forward, its gradient back
    payload = forward + backward + halo
    return ContextBytes(payload, (cp - 1) * (forward + backward) + halo)


def ulysses(spec: ModelSpec, cp: int, tokens: int, *, tp: int = 1, act: int = 2):
    """The head-parallel all-to-alls' bytes for `tokens` tokens a rank: q, k, v, z, b, a
    in and o out, forward and backward alike."""
    hk, hv = spec.linear_k_heads // tp, spec.linear_v_heads // tp
    K, V = spec.linear_k_dim, spec.linear_v_dim
    per_token = (2 * hk * K + 2 * hv * V + 2 * hv + hv * V) * act
    payload = 2 * tokens * per_token
    return ContextBytes(payload, payload * (cp - 1) // cp)

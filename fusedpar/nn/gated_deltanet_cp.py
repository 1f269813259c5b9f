"""`GatedDeltaNet` under context parallelism: how its sequence is split and the two ways
it runs there (the placement's ``linear_cp_mode``; docs/context_parallel.md):

| mode        | before the conv          | conv and recurrence           | after     |
| ----------- | ------------------------ | ----------------------------- | --------- |
| "summaries" | nothing                  | halos and span summaries over | nothing   |
|             |                          | every shard (ring x Ulysses)  |           |
| "ulysses"   | q, k, v, b, a: heads     | halos and span summaries over | o's heads |
|             | over Ulysses (all-to-all) | the ring                     | back      |

z never travels: the gated norm runs once o is back on its tokens. None picks the mode
of fewer bytes at the call's length (`fusedpar.plan.linear_context`); "ulysses" needs a
Ulysses group and this rank's k-heads divisible by it.
"""

from dataclasses import dataclass

from torch import Tensor

from fusedpar import comm
from fusedpar.ops.linear_attention import gated_delta_rule, l2norm_heads
from fusedpar.ops.linear_attention_cp import context_parallel_gated_delta
from fusedpar.ops.linear_attention_parts import causal_conv1d
from fusedpar.ops.span_exchange import MeshExchange
from fusedpar.ops.ulysses import gather_heads, scatter_heads
from fusedpar.plan.linear_context import LinearSizes, layer_bytes

LINEAR_CP_MODES = ("summaries", "ulysses")


@dataclass(frozen=True)
class SequenceSplit:
    """A GDN layer's sequence shards: a ring (`ring`, `layout`) and a Ulysses group,
    either of one rank; `mode` the placement's ``linear_cp_mode`` (None: by bytes)."""

    ring: object
    ulysses: object
    layout: str
    mode: str | None

    @property
    def ring_size(self) -> int:
        return comm.group_size(self.ring)

    @property
    def ulysses_size(self) -> int:
        return comm.group_size(self.ulysses)

    @property
    def splits(self) -> bool:
        return self.ring_size * self.ulysses_size > 1

    def check(self, hk: int, hv: int) -> None:
        """ValueError, naming the sizes, for a mode the heads or groups cannot run."""
        U = self.ulysses_size
        if self.mode == "ulysses" and (U == 1 or hk % U):
            raise ValueError(
                f"GatedDeltaNet: linear_cp_mode='ulysses' sends this rank's {hk} k-heads "
                f"({hv} v-heads) over the Ulysses group of {U} ranks: they must divide by it"
            )

    def mode_for(self, sizes: LinearSizes, tokens: int) -> str:
        """The mode this call runs: the placement's, else the one that sends fewer bytes
        for `tokens` tokens a rank ("summaries" where the heads do not divide)."""
        if self.ulysses_size == 1:
            return "summaries"
        if self.mode is not None:
            return self.mode
        if sizes.hk % self.ulysses_size:
            return "summaries"
        split = (self.ring_size, self.ulysses_size, tokens)
        wire = {m: layer_bytes(sizes, m, *split, layout=self.layout).wire for m in LINEAR_CP_MODES}
        return min(wire, key=wire.get)

    def exchange_heads(self, tensors: list[Tensor], heads: list[int]) -> list[Tensor]:
        """Each (B, S, heads_i D_i) -> (B, S U, heads_i / U D_i): the Ulysses group's
        whole sequence (its ring rank's share) for this rank's heads."""
        shaped = [t.unflatten(-1, (h, -1)) for t, h in zip(tensors, heads, strict=True)]
        return [t.flatten(-2) for t in scatter_heads(shaped, comm.resolve_group(self.ulysses))]

    def return_heads(self, o: Tensor) -> Tensor:
        """o (B, S U, h, V) -> (B, S, U h, V): this rank's tokens again, every head."""
        return gather_heads([o], comm.resolve_group(self.ulysses))[0]

    def heads_of(self, t: Tensor) -> Tensor:
        """This Ulysses rank's rows of a per-head parameter (its heads' channels, rows
        in head order): its gradient stays partial, as other shards' tokens make it."""
        U, u = self.ulysses_size, comm.group_rank(self.ulysses)
        rows = t.shape[0] // U
        return t[u * rows : (u + 1) * rows]

    def conv(self, x: Tensor, weight: Tensor, cu_seqlens, mode: str) -> Tensor:
        """The short conv (SiLU) of this rank's shard (B, S, C), its halo from the
        shards before it."""
        if self.ring_size == 1 and (mode == "ulysses" or self.ulysses_size == 1):
            return causal_conv1d(x, weight, cu_seqlens=cu_seqlens)[0]  # the whole sequence
        group = self.ring
        if mode == "summaries" and self.ulysses_size > 1:
            group = MeshExchange(self.ring, self.ulysses)
        return causal_conv1d(x, weight, cu_seqlens=cu_seqlens, group=group, layout=self.layout)[0]

    def recurrence(self, inputs, cu_seqlens, mode: str) -> Tensor:
        """o (B, S, h, V) of `gated_delta_rule` (q, k L2-normalized) over the shards."""
        q, k, v, g, beta = inputs
        if mode == "summaries" and self.ulysses_size > 1:
            q, k = l2norm_heads(q), l2norm_heads(k)
            o, _ = context_parallel_gated_delta(
                (q, k, v, g, beta),
                scale=q.shape[-1] ** -0.5,
                initial_state=None,
                cu_seqlens=cu_seqlens,
                want_final=False,
                group=MeshExchange(self.ring, self.ulysses),
                layout=self.layout,
            )
            return o
        o, _ = gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=True,
            group=self.ring,
            layout=self.layout,
        )
        return o

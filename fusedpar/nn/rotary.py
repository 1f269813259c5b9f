"""`RotaryPositions`: what a sequence-first attention layer (`ParallelAttention`,
`ParallelMLA`) does as its call starts: the checks of x and the packed documents (on
the first call, alike over the groups too: `fusedpar.checks`), and the rotary tables of
its local tokens, at their global positions (`sequence_positions`: zigzag shards, the
Ulysses split, packed documents restarting at 0). The tables are Llama's of
`rope_theta` (`rope_tables`), or a `rope` callable's, whose layout (Hugging Face's width
r with equal halves, or r/2) is checked once.
"""

import torch

from fusedpar import checks, comm
from fusedpar.kernels.attention import check_cu_seqlens
from fusedpar.kernels.common import accumulator
from fusedpar.nn.attention_parts import rope_tables
from fusedpar.nn.specs import DEFAULT_ROPE
from fusedpar.ops.sequence import sequence_positions


class RotaryPositions:
    """A sequence-first attention layer's call: its checks and the rotary tables of its
    local tokens (`_start_call`), for layers that set ``d_model``, ``rope``
    (`DEFAULT_ROPE`, a callable or None), ``rotary_dim``, ``rope_theta``, the TP and CP
    groups, layout and ``sequence_parallel``, and start ``_rope_tables = {}``,
    ``_rope_layout_checked = False``."""

    def _start_call(self, x: torch.Tensor, cu_seqlens, weight: torch.Tensor):
        """Check x (S_loc, B, d_model) and `cu_seqlens` (and on the first call, x and
        `weight` alike over the groups); returns (cos, sin) at this call's local tokens'
        positions, or None without a rotary embedding."""
        if not self._fusedpar_checked and not checks.skipped(x):
            # this rank's checks (cu_seqlens' values read: once), then x, weights and
            # cu_seqlens alike over tp, cp, ulysses: one rank's refusal raised on all
            verdict = checks.Verdict()
            verdict.run(self._check_call, x, cu_seqlens, values=True)
            groups = {
                "tp_group": self.tp_group,
                "cp_group": self.cp_group,
                "ulysses_group": self.ulysses_group,
            }
            fields = checks.alike(x, weight) | {"cu_seqlens": checks.Content(cu_seqlens)}
            checks.first_call(self, x, groups, fields, verdict)
        full_len = self._check_call(x, cu_seqlens)
        if self.rope is None:
            return None
        return self._rope(full_len, x.device, cu_seqlens, accumulator(x.dtype))

    def _check_call(self, x: torch.Tensor, cu_seqlens, values: bool = False) -> int:
        """This rank's checks of x and `cu_seqlens` (their `values` read with values=True);
        returns the length of the full sequence."""
        name = type(self).__name__
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"{name} takes x (S_loc, B, d_model={self.d_model}), got {tuple(x.shape)}"
            )
        seq = x.shape[0] * (comm.group_size(self.tp_group) if self.sequence_parallel else 1)
        full_len = seq * comm.group_size(self.cp_group) * comm.group_size(self.ulysses_group)
        if cu_seqlens is not None:
            if x.shape[1] != 1:
                raise ValueError(
                    f"{name}: packed documents (cu_seqlens) take one sequence, x "
                    f"(S_loc, 1, d); got batch {x.shape[1]}"
                )
            check_cu_seqlens(cu_seqlens, full_len, values=values)
        return full_len

    def _rope(self, full_len: int, device: torch.device, cu_seqlens=None, dtype=torch.float32):
        """cos, sin (S_loc, hd/2) of `dtype` (fp32; float64 for a float64 x) at this rank's
        positions: global ones, kept per length; with packed documents, restarting in
        each (built per call)."""
        key = (full_len, device, dtype)
        if cu_seqlens is None and key in self._rope_tables:
            return self._rope_tables[key]
        positions = sequence_positions(
            full_len,
            self.cp_group,
            layout=self.cp_layout,
            device=device,
            cu_seqlens=cu_seqlens,
            ulysses_group=self.ulysses_group,
        )
        if self.rope == DEFAULT_ROPE:
            tables = rope_tables(positions, self.rotary_dim, self.rope_theta, dtype)
        else:
            tables = tuple(self._rope_table(t, len(positions), dtype) for t in self.rope(positions))
        if cu_seqlens is None:
            if len(self._rope_tables) >= 4:  # lengths that vary (evaluation): keep a few
                self._rope_tables.clear()
            self._rope_tables[key] = tables
        return tables

    def check_rope_layout(self, device="cpu") -> None:
        """Check a `rope` callable's table layout now, on positions 0..3 on `device` (the
        callable's tensors'), as the first eager call would: for a model compiled before
        any eager call, whose traced calls skip the check. `parallelize` runs it."""
        if not callable(self.rope) or self._rope_layout_checked:
            return
        positions = torch.arange(4, device=device)
        for t in self.rope(positions):
            self._rope_table(t, len(positions), torch.float32)

    def _rope_table(self, t: torch.Tensor, length: int, dtype) -> torch.Tensor:
        """One of a `rope` callable's tables as (S, r/2) of `dtype`, r = rotary_dim."""
        half = self.rotary_dim // 2
        while t.dim() > 2 and t.shape[0] == 1:
            t = t[0]
        # the layout checks below: once per layer (a host sync), in eager calls only (a
        # data-dependent branch breaks a compiled graph: `check_rope_layout` runs them
        # ahead of one). Angles all 0 (position 0) tell nothing: checked again.
        check = not self._rope_layout_checked and not checks.skipped(t)
        if t.dim() == 2 and t.shape == (length, 2 * half):
            if check:
                # a table of width r is Hugging Face's, each angle in both halves; one
                # with each angle twice in a row (GPT-J's, Meta's repeat_interleave)
                # would pass for it, its first half read as the angles: refused
                informative = bool((t != t.flatten()[0]).any())
                if informative and not torch.equal(t[:, :half], t[:, half:]):
                    raise ValueError(
                        f"rope(positions) gives ({length}, {2 * half}) tables whose halves "
                        f"differ: the width of rotary_dim {2 * half} is taken in Hugging "
                        f"Face's layout (each angle in both halves); give each pair's angle "
                        f"once, ({length}, {half}) (an interleaved table t: t[:, ::2])"
                    )
                self._rope_layout_checked = informative
            t = t[:, :half]  # Hugging Face's layout: the same angles twice
        elif t.shape != (length, half):
            raise ValueError(
                f"rope(positions) must give cos, sin of ({length}, {half}) or "
                f"({length}, {2 * half}) for rotary_dim {2 * half}, got "
                f"{tuple(t.shape)}"
            )
        elif check and half % 2 == 0:
            # Hugging Face's table of a rotary_dim of r/2 (GPT-NeoX's rotary_pct 0.5)
            # has our width; its halves repeat, ours (distinct frequencies) do not.
            first, second = t[:, : half // 2], t[:, half // 2 :]
            informative = bool((first != first.flatten()[0]).any())
            if informative and torch.equal(first, second):
                raise ValueError(
                    f"rope(positions) gives ({length}, {half}) tables whose halves repeat: "
                    f"Hugging Face's layout for rotary_dim {half}, not this layer's "
                    f"rotary_dim {2 * half}: pass rotary_dim={half} (partial rotary)"
                )
            self._rope_layout_checked = informative
        return t.to(dtype).contiguous()  # (HF's half a row: the GEMM epilogue reads rows)

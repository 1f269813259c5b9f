"""Where a rank's tokens sit in the full sequence, and which documents cross them: the
geometry the recurrent ops need under context parallelism (a state or a convolution's
history carried from one span to the next, in global order).

A *span* is one of the layout's chunks (`fusedpar.ops.sequence`): 2W of them under
"zigzag" (rank r holds spans r and 2W-1-r), W under "contiguous" (rank r holds span r).
Spans are numbered in global order; every span has ``span_len`` tokens.

    W = 2, zigzag, 8 tokens, documents [0, 3, 8):
    span       0       | 1     | 2     | 3
    tokens     0 1     | 2 3   | 4 5   | 6 7
    rank       0       | 1     | 1     | 0
    documents  0 0     | 0 1   | 1 1   | 1 1
    carries in  -        yes     yes     yes  (no span starts a document but span 0)
"""

import bisect
from dataclasses import dataclass
from functools import cached_property

from fusedpar.ops.sequence import check_layout


@dataclass(frozen=True)
class Spans:
    """This rank's spans: `rank` of `size` ranks, a `layout`, `local_len` tokens here.

    With `ulysses` = U > 1 (the hybrid layout of `fusedpar.shard_sequence`: each ring
    rank's share split again, contiguously, over U ranks), `size` is the ring's W and
    `rank` is r U + u (ring rank r, Ulysses rank u); every ring span is cut into U spans,
    so each rank holds two (zigzag) or one (contiguous) of ``local_len / 2`` or
    ``local_len`` tokens, as without Ulysses.
    """

    rank: int
    size: int
    layout: str
    local_len: int
    ulysses: int = 1

    def __post_init__(self):
        check_layout(self.layout)
        per_rank = 2 if self.layout == "zigzag" else 1
        if self.local_len % per_rank:
            raise ValueError(
                f"a zigzag shard holds two equal spans, but this rank holds {self.local_len} tokens"
            )

    @property
    def ranks(self) -> int:
        """The ranks holding spans: W, or W U."""
        return self.size * self.ulysses

    @property
    def count(self) -> int:
        """Spans in the whole sequence."""
        return (2 * self.size if self.layout == "zigzag" else self.size) * self.ulysses

    @property
    def span_len(self) -> int:
        return self.local_len // (2 if self.layout == "zigzag" else 1)

    @property
    def seq_len(self) -> int:
        return self.span_len * self.count

    def of_rank(self, rank: int) -> tuple[int, ...]:
        """The spans `rank` holds, in its local order."""
        ring, u = divmod(rank, self.ulysses)
        U = self.ulysses
        if self.layout == "contiguous":
            return (ring * U + u,)
        # the ring share [ring span r | ring span 2W-1-r], U spans each: u holds 2u, 2u+1
        mirror = 2 * self.size - 1 - ring
        return tuple(ring * U + i if i < U else mirror * U + i - U for i in (2 * u, 2 * u + 1))

    @property
    def mine(self) -> tuple[int, ...]:
        return self.of_rank(self.rank)

    @cached_property
    def _owners(self) -> dict:
        return {s: (r, i) for r in range(self.ranks) for i, s in enumerate(self.of_rank(r))}

    def owner(self, span: int) -> tuple[int, int]:
        """``(rank, slot)``: who holds `span`, and at which of its local spans."""
        return self._owners[span]

    def start(self, span: int) -> int:
        """The global position of the span's first token."""
        return span * self.span_len

    def locate(self, begin: int, end: int) -> list[tuple[int, int, int]]:
        """``(span, lo, hi)`` for each span holding some of the global positions
        [begin, end) (clipped to the sequence), in global order; lo and hi are offsets
        in the span (a convolution's halo: the W - 1 positions before a span)."""
        begin, end, n = max(begin, 0), min(end, self.seq_len), self.span_len
        if not n or end <= begin:
            return []
        spans = range(begin // n, (end - 1) // n + 1)
        return [(s, max(begin - s * n, 0), min(end - s * n, n)) for s in spans]


@dataclass(frozen=True)
class SpanDocuments:
    """The documents of a packed stream (the global ``cu_seqlens`` as a list, the same
    on every rank) seen span by span."""

    spans: Spans
    bounds: tuple[int, ...]

    def __post_init__(self):
        b = self.bounds
        if (
            not b
            or b[0] != 0
            or b[-1] != self.spans.seq_len
            or any(y < x for x, y in zip(b, b[1:], strict=False))
        ):
            raise ValueError(
                f"cu_seqlens must start at 0, never decrease and end at the full length "
                f"{self.spans.seq_len} (W x local length), got {list(b)}"
            )

    @cached_property
    def _starts(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.bounds[:-1])))

    def document_at(self, position: int) -> int:
        """The document holding the token at global `position` (empty documents hold
        none)."""
        return bisect.bisect_right(self.bounds, position) - 1

    def carries_in(self, span: int) -> bool:
        """Whether a document crosses into `span` from the span before it."""
        start = self.spans.start(span)
        return span > 0 and start not in self._starts

    def document_start(self, position: int) -> int:
        """The global start of the document holding `position`."""
        return self.bounds[self.document_at(position)]

    def pieces(self, span: int) -> list[tuple[int, int, int]]:
        """``(document, begin, end)`` of every non-empty document piece in `span`, in
        order; begin and end are offsets in the span."""
        lo = self.spans.start(span)
        hi = lo + self.spans.span_len
        out = []
        doc = self.document_at(lo)
        while doc < len(self.bounds) - 1 and self.bounds[doc] < hi:
            begin, end = max(self.bounds[doc], lo), min(self.bounds[doc + 1], hi)
            if end > begin:
                out.append((doc, begin - lo, end - lo))
            doc += 1
        return out

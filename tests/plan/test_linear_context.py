"""`fusedpar.plan.linear_context`: a GDN layer's bytes under context parallelism, the
span summaries against the head-parallel all-to-all, at Qwen3.5-35B-A3B's sizes (the
issue's target: a rank's summaries <= 1/50 of its all-to-all bytes at 32k tokens a rank
over CP 4). The op's own traffic is counted against the same formula in
tests/linear_attention/test_gdn_cp.py."""

import pytest

from fusedpar.plan import model_spec
from fusedpar.plan.linear_context import summaries, ulysses

SPEC = model_spec("qwen3.5-35b-a3b")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_summaries_are_a_fiftieth_of_the_all_to_all_at_32k_tokens(layout):
    ours, theirs = summaries(SPEC, 4, layout=layout), ulysses(SPEC, 4, 32768)
    # one span's [E, M] is 4 MiB (the figure); zigzag holds two spans
    spans = 2 if layout == "zigzag" else 1
    assert ours.payload == spans * (4 * 2**20 + 2 * 2**20) + spans * 2 * 3 * 8192 * 2
    assert ours.payload * 50 <= theirs.wire
    # on the wire a ring all-gather sends W - 1 shares: still under the all-to-all's
    # 1/40 (zigzag 1/42.6, contiguous 1/85)
    assert ours.wire * (40 if layout == "zigzag" else 80) <= theirs.wire


def test_summaries_do_not_grow_with_the_sequence_and_the_all_to_all_does():
    assert ulysses(SPEC, 4, 2048).wire * 16 == ulysses(SPEC, 4, 32768).wire
    # the crossover on the wire: between 512 and 1024 tokens a rank at CP 4 (zigzag)
    assert ulysses(SPEC, 4, 512).wire < summaries(SPEC, 4).wire < ulysses(SPEC, 4, 1024).wire

"""`fusedpar.plan.linear_context`: a GDN layer's bytes under context parallelism, the
span summaries against the head-parallel all-to-all, at Qwen3.5-35B-A3B's sizes (the
issue's target: a rank's summaries <= 1/50 of its all-to-all bytes at 32k tokens a rank
over CP 4). The op's own traffic is counted against the same formula in
tests/linear_attention/test_gdn_cp.py."""

import pytest

from fusedpar.plan import model_spec
from fusedpar.plan.linear_context import LinearSizes, head_all_to_all, layer_bytes, summaries

SIZES = LinearSizes.of(model_spec("qwen3.5-35b-a3b"))


def megatron(cp, tokens):
    """Megatron's head-parallel GDN: q, k, v, z, b, a in and o out (33 kB a token)."""
    return head_all_to_all(SIZES, cp, tokens, z=True)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_summaries_are_a_fiftieth_of_the_all_to_all_at_32k_tokens(layout):
    ours, theirs = summaries(SIZES, 4, layout=layout), megatron(4, 32768)
    # one span's [E, M] is 4 MiB (the figure); zigzag holds two spans
    spans = 2 if layout == "zigzag" else 1
    assert ours.payload == spans * (4 * 2**20 + 2 * 2**20) + spans * 2 * 3 * 8192 * 2
    assert ours.payload * 50 <= theirs.wire
    # on the wire a ring all-gather sends W - 1 shares: still under the all-to-all's
    # 1/40 (zigzag 1/42.6, contiguous 1/85)
    assert ours.wire * (40 if layout == "zigzag" else 80) <= theirs.wire


def test_summaries_do_not_grow_with_the_sequence_and_the_all_to_all_does():
    assert megatron(4, 2048).wire * 16 == megatron(4, 32768).wire
    # the crossover on the wire: between 512 and 1024 tokens a rank at CP 4 (zigzag)
    assert megatron(4, 512).wire < summaries(SIZES, 4).wire < megatron(4, 1024).wire


def test_the_layer_s_two_modes_cross_over():
    """GatedDeltaNet's ``linear_cp_mode=None`` picks by these: on a ring 2 x Ulysses 2
    mesh the head exchange wins at a few hundred tokens a rank, the summaries over all
    four shards at thousands."""

    def mode(tokens):
        costs = {
            m: layer_bytes(SIZES, m, 2, 2, tokens, layout="zigzag").wire
            for m in ("summaries", "ulysses")
        }
        return min(costs, key=costs.get)

    assert mode(256) == "ulysses"
    assert mode(8192) == "summaries"

"""No wasted collectives: none on a group of one rank, and a training step of the
example model at TP2 x CP2 x DP1 reduces its whole parameters' gradients in a few
bucketed all-reduces, not one per parameter (`fusedpar.testing.collectives`)."""

import contextlib
import warnings

import torch
from torch.distributed.fsdp import FSDPModule

import fusedpar as fp
from fusedpar import comm
from fusedpar.testing.collectives import Collectives


def _on_a_group_of_one():
    mesh = fp.ParallelDims(cp=2, tp=2).build_mesh("cpu")
    one = mesh["dp"]  # an axis of one rank
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    with Collectives() as seen:
        outs = [
            comm.all_gather(x, one),
            comm.reduce_scatter(x, one),
            comm.all_reduce(x, one),
            comm.copy_to_region(x, one),
            comm.reduce_from_region(x, one),
            comm.gather_from_region(x, one),
            comm.all_to_all(x, one),
            fp.all_gather_matmul(x, w, one),
            fp.matmul_reduce_scatter(x, w, one),
        ]
        asyncs = (
            comm.all_gather_async,
            comm.all_reduce_async,
            comm.reduce_scatter_async,
            comm.all_to_all_async,
        )
        outs += [start(x, one).wait() for start in asyncs]
        # the layers' first calls (their cross-rank checks: none on a group of one)
        h = torch.randn(4, 2, 16, requires_grad=True)
        layers = [
            fp.nn.ColumnParallelLinear(16, 8, one),
            fp.nn.ParallelSwiGLU(16, 12, one),
            fp.nn.ParallelAttention(16, 2, tp_group=one, cp_group=one),
        ]
        outs += [layer(h) for layer in layers] + [fp.nn.MoE(16, 6, 4, 2, one)(h)[0]]
        outs.append(fp.nn.RowParallelLinear(8, 4, one)(outs[-4]))
        sum(o.sum() for o in outs).backward()
    return dict(seen.counts)


def test_no_collective_on_a_group_of_one(world):
    assert world(4).run(_on_a_group_of_one) == [{}] * 4


def _step_counts(moe: bool, fully_shard: bool = False) -> dict:
    """The collectives of one training step (forward, backward, AdamW) of the example
    model at TP2 x CP2 x DP1, after a warm-up step; with `fully_shard`, after
    ``dims.fully_shard`` (skipped at dp 1: the module comes back as it was, with a
    warning)."""
    from tiny_llama import Config, ParallelTransformer, Transformer

    cfg = Config(
        vocab=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_hidden=64,
        num_experts=4 if moe else 0,
        top_k=2,
    )
    dims = fp.ParallelDims(dp=1, cp=2, tp=2)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = fp.distribute(ParallelTransformer(Transformer(cfg), dims.groups(mesh)), mesh)
    if fully_shard:
        fp.parallel._warned_dp1 = False  # once per process: an earlier test may have warned
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert dims.fully_shard(model, mesh) is model
        assert not isinstance(model, FSDPModule)
        assert any("nothing to shard" in str(w.message) for w in caught), caught
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    data = torch.randint(0, cfg.vocab, (2, 17), generator=torch.Generator().manual_seed(1))

    def step():
        model(data[:, :-1], data[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    with Collectives() as seen:
        step()
    return dict(seen.counts)


def _steps_counts():
    return [_step_counts(False), _step_counts(True), _step_counts(False, fully_shard=True)]


def test_a_training_step_runs_no_collective_on_one_rank_and_few_all_reduces(world):
    """The gradients of whole parameters (norms, embedding, head, routers) and of TP
    shards used on CP-split tokens are partial sums: before, one all-reduce each per step
    (dense 21, MoE 23; 21 too under FSDP2 at dp 1, which reduces each parameter alone);
    now one per bucket: the shards over cp, the whole ones over cp x tp (the forward's
    all-reduces are none: TP and CP run on rings)."""
    for per_rank in world(4).run(_steps_counts):
        for counts in per_rank:  # dense, MoE, dense after fully_shard at dp 1
            assert counts and not [key for key in counts if key[1] == 1], counts
            assert counts.get(("all_reduce", 2)) == 1 and counts.get(("all_reduce", 4)) == 1


def _accumulated_grads_match():
    """Two backwards before a step (gradient accumulation) give the gradients of one
    backward of the summed losses: each backward's bucketed sums land in the
    parameters' placements, and the next one accumulates onto them."""
    from tiny_llama import Config, ParallelTransformer, Transformer

    cfg = Config(vocab=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_hidden=64)
    dims = fp.ParallelDims(cp=2, tp=2)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = fp.distribute(ParallelTransformer(Transformer(cfg), dims.groups(mesh)), mesh)
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randint(0, cfg.vocab, (2, 17), generator=gen) for _ in range(2))
    (model(a[:, :-1], a[:, 1:]) + model(b[:, :-1], b[:, 1:])).backward()
    once = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    model.zero_grad()
    model(a[:, :-1], a[:, 1:]).backward()
    model(b[:, :-1], b[:, 1:]).backward()
    for name, p in model.named_parameters():
        assert p.grad.placements == p.placements, name
        torch.testing.assert_close(p.grad.full_tensor(), once[name], rtol=1e-5, atol=1e-7)
    return True


def test_gradient_accumulation_over_backwards(world):
    assert all(world(4).run(_accumulated_grads_match))


def _check_counts() -> list:
    """The collectives of a ColumnParallelLinear's first call, its second, and its
    second under FUSEDPAR_CHECKS=all (`fusedpar.checks`), on a TP group of 2."""
    mesh = fp.ParallelDims(cp=2, tp=2).build_mesh("cpu")
    x = torch.randn(4, 2, 8)
    out = []
    for every_call in (False, True):
        torch.manual_seed(0)
        layer = fp.nn.ColumnParallelLinear(8, 8, mesh["tp"])
        with fp.checks.every_call() if every_call else contextlib.nullcontext():
            for _ in range(2):
                with Collectives() as seen:
                    layer(x)
                out.append(dict(seen.counts))
    return out


def test_the_cross_rank_checks_run_at_the_first_call_only(world):
    """One all-gather over the group at the first call; none after it, unless
    FUSEDPAR_CHECKS=all; the layer's own collectives alike in every call."""
    for first, second, first_all, second_all in world(4).run(_check_counts):
        assert first_all == first and second_all == first, (first, first_all, second_all)
        extra = dict(first)
        extra[("all_gather", 2)] -= 1
        assert second == {k: n for k, n in extra.items() if n}, (first, second)

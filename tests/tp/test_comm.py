"""fusedpar.comm against single-process math, forward and backward, at W = 2 and 4.

Every rank rebuilds every rank's inputs from the seed, so each can check its own result
against the single-process computation. Gathers and all-to-alls move data without
arithmetic, so they are exact; sums are checked with the tolerance rule.
"""

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given
from hypothesis import strategies as st

from fusedpar import comm
from fusedpar.testing import WorldError, assert_close
from fusedpar.testing.strategies import randn, seeds

DTYPES = [torch.float32, torch.float16]


def _inputs(seed, shape, dtype, world_size):
    """x_r and the upstream gradient g_r of every rank r."""
    xs = [randn(shape, dtype, seed + 2 * r) for r in range(world_size)]
    return xs, lambda out_shape: [
        randn(out_shape, dtype, seed + 2 * r + 1) for r in range(world_size)
    ]


def _fp16_sum(parts):
    return torch.stack(parts).to(parts[0].dtype).sum(0)


def _run_collective(name, seed, rows, dtype):
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    xs, grads_for = _inputs(seed, (rows * size, 3), dtype, size)
    x = xs[rank].clone().requires_grad_()
    op = getattr(comm, name)
    y = op(x, group)
    gs = grads_for(tuple(y.shape))
    y.backward(gs[rank])

    x64 = [t.double() for t in xs]
    g64 = [t.double() for t in gs]
    chunk = slice(rank * rows, (rank + 1) * rows)  # this rank's rows of a reduce-scatter
    if name == "all_gather":
        chunk = slice(rank * x.shape[0], (rank + 1) * x.shape[0])
        assert torch.equal(y, torch.cat(xs))
        # d/dx_r of sum_s <g_s, cat(x)> = sum_s g_s[rows of r]
        ref = sum(g[chunk] for g in g64)
        assert_close(x.grad, ref, _fp16_sum([g[chunk] for g in gs]), name="all_gather dx")
    elif name == "reduce_scatter":
        assert_close(y, sum(x64)[chunk], _fp16_sum([t[chunk] for t in xs]), name="reduce_scatter y")
        assert torch.equal(x.grad, torch.cat(gs))
    elif name in ("all_reduce", "reduce_from_region"):
        assert_close(y, sum(x64), _fp16_sum(xs), name=f"{name} y")
        if name == "all_reduce":
            assert_close(x.grad, sum(g64), _fp16_sum(gs), name="all_reduce dx")
        else:
            assert torch.equal(x.grad, gs[rank])
    elif name == "copy_to_region":
        assert torch.equal(y, xs[rank])
        assert_close(x.grad, sum(g64), _fp16_sum(gs), name="copy_to_region dx")
    return True


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "name", ["all_gather", "reduce_scatter", "all_reduce", "copy_to_region", "reduce_from_region"]
)
def test_collective_forward_and_backward(world, world_size, dtype, name):
    assert all(world(world_size).run(_run_collective, name, 1234, 3, dtype))


def _run_all_to_all(seed, splits, dtype):
    """splits[s][d]: rows that rank s sends to rank d (zeros allowed)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    xs = [randn((sum(splits[s]), 5), dtype, seed + s) for s in range(size)]
    x = xs[rank].clone().requires_grad_()
    recv = [splits[s][rank] for s in range(size)]
    y = comm.all_to_all(x, dist.group.WORLD, recv, splits[rank])
    gs = [
        randn((sum(splits[s][d] for s in range(size)), 5), dtype, seed + 100 + d)
        for d in range(size)
    ]
    y.backward(gs[rank])

    def rows(s, d, t):  # the rows of t (rank s's send buffer) bound for d
        start = sum(splits[s][:d])
        return t[start : start + splits[s][d]]

    assert torch.equal(y, torch.cat([rows(s, rank, xs[s]) for s in range(size)]))
    # my rows for d came back as part of d's upstream gradient, at rank-order offset
    expected = []
    for d in range(size):
        offset = sum(splits[s][d] for s in range(rank))
        expected.append(gs[d][offset : offset + splits[rank][d]])
    assert torch.equal(x.grad, torch.cat(expected))
    return True


@st.composite
def split_matrices(draw):
    size = draw(st.sampled_from([2, 4]))
    row = st.lists(st.integers(0, 3), min_size=size, max_size=size)
    return draw(st.lists(row, min_size=size, max_size=size))


@given(splits=split_matrices(), seed=seeds(), dtype=st.sampled_from(DTYPES))
@example(splits=[[0, 0], [0, 0]], seed=0, dtype=torch.float32)  # nothing anywhere
@example(splits=[[0, 0], [3, 2]], seed=1, dtype=torch.float16)  # rank 0 sends nothing
@example(
    splits=[[2, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 3, 0, 0]], seed=2, dtype=torch.float32
)
def test_all_to_all_variable_splits(world, splits, seed, dtype):
    assert all(world(len(splits)).run(_run_all_to_all, seed, splits, dtype))


def _run_async(seed, dtype):
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    xs = [randn((2 * size, 3), dtype, seed + r) for r in range(size)]
    x = xs[rank]
    gathered = comm.all_gather_async(x, group)
    scattered = comm.reduce_scatter_async(x, group)
    summed = comm.all_reduce_async(x, group)
    assert torch.equal(gathered.wait(), torch.cat(xs))
    x64 = sum(t.double() for t in xs)
    assert_close(
        scattered.wait(), x64[2 * rank : 2 * rank + 2], _fp16_sum(xs)[2 * rank : 2 * rank + 2]
    )
    assert_close(summed.wait(), x64, _fp16_sum(xs))
    assert torch.equal(x, xs[rank])  # inputs untouched
    try:
        summed.wait()
    except RuntimeError as e:
        return "already" in str(e)
    return False


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_async_collectives(world, dtype):
    assert all(world(4).run(_run_async, 7, dtype))


def _run_ring(seed, dtype):
    """Pass K and V (two tensors, one exchange) around the ring; every rank sees all."""
    rank, size = dist.get_rank(), dist.get_world_size()
    ring = comm.Ring(dist.group.WORLD)
    kv = [randn((3, 2), dtype, seed + r) for r in range(size)]
    k, v = kv[rank], kv[rank] * 2
    seen, ptrs = [], []
    for step in range(size):
        if step + 1 < size:
            incoming = ring.send_recv([k, v])
            ptrs.append(incoming[0].data_ptr())
        seen.append(k.clone())  # "compute" on the current block
        assert torch.equal(v, k * 2)
        if step + 1 < size:
            k, v = ring.wait()
            assert k.data_ptr() == incoming[0].data_ptr()
    # step s holds the block of rank r - s
    assert all(torch.equal(seen[s], kv[(rank - s) % size]) for s in range(size))
    # double buffering: two receive buffers, used in turn
    assert len(set(ptrs)) == min(2, size - 1) and ptrs[::2] == ptrs[:1] * len(ptrs[::2])
    return True


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ring_visits_every_rank(world, world_size):
    assert all(world(world_size).run(_run_ring, 3, torch.float32))


def _run_ring_misuse():
    ring = comm.Ring(dist.group.WORLD)
    x = torch.ones(4)
    errors = []
    for bad in (ring.wait, lambda: ring.send_recv(torch.ones(4, 2).T)):
        try:
            bad()
        except (RuntimeError, ValueError) as e:
            errors.append(type(e).__name__)
    ring.send_recv(x)
    try:
        ring.send_recv(x)
    except RuntimeError as e:
        errors.append(type(e).__name__)
    ring.wait()
    return errors


def test_ring_raises_on_misuse(world):
    assert world(2).run(_run_ring_misuse) == [["RuntimeError", "ValueError", "RuntimeError"]] * 2


def _run_bad_reduce_scatter(rows):
    comm.reduce_scatter(torch.ones(rows, 2), dist.group.WORLD)


def test_validation_raises_on_every_rank_before_communicating(world):
    with pytest.raises(WorldError) as info:
        world(4).run(_run_bad_reduce_scatter, 6)
    assert sorted(info.value.exceptions) == [0, 1, 2, 3]
    for e in info.value.exceptions.values():
        assert isinstance(e, ValueError) and "6" in str(e) and "group size 4" in str(e)


def test_no_group_means_identity():
    x = torch.randn(5, 3, requires_grad=True)
    for op in (
        comm.all_gather,
        comm.reduce_scatter,
        comm.all_reduce,
        comm.copy_to_region,
        comm.reduce_from_region,
        comm.all_to_all,
    ):
        assert op(x, None) is x
    assert comm.group_size(None) == 1 and comm.group_rank(None) == 0
    ring = comm.Ring(None)
    assert torch.equal(ring.send_recv(x.detach()), x.detach()) and ring.size == 1
    assert torch.equal(ring.wait(), x.detach())
    assert torch.equal(comm.all_gather_async(x.detach(), None).wait(), x.detach())


def test_bad_groups_and_splits():
    with pytest.raises(TypeError, match="ProcessGroup"):
        comm.resolve_group("world")
    with pytest.raises(ValueError, match="one entry per rank"):
        comm.all_to_all(torch.ones(3, 1), None, [3, 0], [3])
    with pytest.raises(ValueError, match="sum to 2"):
        comm.all_to_all(torch.ones(3, 1), None, [3], [2])


def _run_device_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    y = comm.all_gather(torch.full((1,), float(dist.get_rank())), tp)
    try:
        comm.resolve_group(mesh)
    except ValueError as e:
        two_d = "2-D" in str(e)
    return y.tolist(), comm.group_size(tp), two_d


def test_device_mesh_groups(world):
    results = world(4).run(_run_device_mesh)
    assert [r[0] for r in results] == [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0]]
    assert all(r[1] == 2 and r[2] for r in results)


def _run_streams_on_gpu(value):
    """Async collectives and the ring on CUDA. The input is written late on the caller's
    stream (after a sleep): a side stream that did not wait for it would send stale
    data, and a caller that did not wait for the side stream would read too early."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time on the caller's stream
    x.fill_(value + rank)
    gathered = comm.all_gather_async(x, dist.group.WORLD).wait()
    ring = comm.Ring(dist.group.WORLD)
    ring.send_recv([x, x * 2])
    torch.cuda._sleep(50_000_000)
    k, v = ring.wait()
    expected = torch.cat([torch.full_like(x, value + r) for r in range(size)])
    prev = value + (rank - 1) % size
    return bool(
        torch.equal(gathered, expected)
        and (k == prev).all().item()
        and (v == 2 * prev).all().item()
    )


@pytest.mark.gpu
def test_async_collectives_on_gpu_streams():
    from fusedpar.testing import World

    size = min(2, torch.cuda.device_count())  # 2 ranks exercise NCCL P2P when there are GPUs
    with World(size, backend="nccl") as w:
        assert w.run(_run_streams_on_gpu, 5.0) == [True] * size


def _run_gather_from_region(seed, dim):
    """Forward: concatenation along `dim`. Backward, with the same upstream gradient on
    every rank (a replicated downstream): this rank's chunk of it."""
    rank, size = dist.get_rank(), dist.get_world_size()
    xs = [randn((3, 2, 4), torch.float32, seed + r) for r in range(size)]
    x = xs[rank].clone().requires_grad_()
    y = comm.gather_from_region(x, dist.group.WORLD, dim=dim)
    g = randn(tuple(y.shape), torch.float32, seed + 99)
    y.backward(g)
    return torch.equal(y, torch.cat(xs, dim=dim)) and torch.equal(
        x.grad, g.chunk(size, dim=dim)[rank]
    )


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dim", [-1, 1, 0])
def test_gather_from_region(world, world_size, dim):
    assert all(world(world_size).run(_run_gather_from_region, 11, dim))

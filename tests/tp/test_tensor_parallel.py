"""Tensor parallelism against the dense single-process computation, at W = 2 and 4.

Every rank rebuilds the full inputs, weights and upstream gradients from the seed, runs
its share, and checks its own outputs and gradients against the dense math in float64
(and in the op's dtype, for the tolerance rule's PyTorch term).
"""

import functools
import re

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given
from hypothesis import strategies as st
from torch import nn

import fusedpar as fp
from fusedpar.nn.attention_parts import apply_rope, rope_tables
from fusedpar.testing import assert_close, exception_of
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds

WORLD = dist.group.WORLD  # read inside the ranks, after init_process_group


def _schedule(chunks: int) -> dict:
    """The ops' and layers' keywords for a drawn `chunks`: 0 is the serial schedule (one
    collective, one GEMM), n > 0 the ring with n chunks per rank."""
    return {"chunks_per_rank": max(1, chunks), "overlap": "serial" if chunks == 0 else "ring"}


def _tokens_shape(p, tokens):
    """(tokens, K) flat, or sequence-first (tokens, B, K)."""
    return (tokens, p["batch"]) if p["seq_first"] else (tokens,)


def _maybe_strided(t, strided):
    """The same values as `t`, read through a non-contiguous view when `strided`."""
    if not strided:
        return t
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def _check_all(results):
    for name, got, ref64, same_dtype in results:
        assert_close(got, ref64, same_dtype, name=name)
    return True


def _run_all_gather_matmul(p):
    rank, size = dist.get_rank(), dist.get_world_size()
    n, K, dtype, seed = p["rows"], p["K"], p["dtype"], p["seed"]
    lead = _tokens_shape(p, n * size)
    X = randn((*lead, K), torch.float64, seed, exact_in=dtype)
    # every rank's weights, biases and upstream gradients (rank s: index s)

    def draw(shape_of, offset):  # [rank][weight] -> a float64 tensor
        return [
            [
                randn(shape_of(N), torch.float64, seed + 100 * s + offset + i, exact_in=dtype)
                for i, N in enumerate(p["Ns"])
            ]
            for s in range(size)
        ]

    Ws, dYs = draw(lambda N: (N, K), 0), draw(lambda N: (*lead, N), 80)
    bs = draw(lambda N: (N,), 50) if p["bias"] else [[None] * len(p["Ns"])] * size

    x = _maybe_strided(X[rank * n : (rank + 1) * n].to(dtype), p["strided"]).requires_grad_()
    ws = [w.to(dtype).requires_grad_() for w in Ws[rank]]
    b_in = [None if b is None else b.to(dtype).requires_grad_() for b in bs[rank]]
    ys = fp.all_gather_matmul(
        x, ws, WORLD, bias=b_in, save_gathered_input=p["save"], **_schedule(p["chunks"])
    )
    torch.autograd.backward(ys, [dy.to(dtype) for dy in dYs[rank]])

    def dense(X, Ws, bs, dYs, dt):  # outputs, dX rows of this rank, dWs, dbs
        X = X.to(dt)
        ys = [
            X @ w.to(dt).T + (0 if b is None else b.to(dt))
            for w, b in zip(Ws[rank], bs[rank], strict=True)
        ]  # noqa: E501
        dx = sum(
            dy.to(dt) @ w.to(dt) for s in range(size) for dy, w in zip(dYs[s], Ws[s], strict=True)
        )  # noqa: E501
        dws = [dy.to(dt).flatten(0, -2).T @ X.flatten(0, -2) for dy in dYs[rank]]
        dbs = [dy.to(dt).flatten(0, -2).sum(0) for dy in dYs[rank]]
        return ys, dx[rank * n : (rank + 1) * n], dws, dbs

    ref, same = dense(X, Ws, bs, dYs, torch.float64), dense(X, Ws, bs, dYs, dtype)
    checks = [("y", y, r, t) for y, r, t in zip(ys, ref[0], same[0], strict=True)]
    checks.append(("dx", x.grad, ref[1], same[1]))
    checks += [("dw", w.grad, r, t) for w, r, t in zip(ws, ref[2], same[2], strict=True)]
    if p["bias"]:
        checks += [("db", b.grad, r, t) for b, r, t in zip(b_in, ref[3], same[3], strict=True)]
    return _check_all(checks)


@given(
    world_size=st.sampled_from([2, 4]),
    rows=st.integers(1, 4),
    K=st.integers(1, 20),
    Ns=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    bias=st.booleans(),
    chunks=st.integers(0, 3),
    dtype=cpu_dtypes(),
    seq_first=st.booleans(),
    batch=st.integers(1, 2),
    strided=st.booleans(),
    save=st.booleans(),
    seed=seeds(),
)
@example(
    world_size=4,
    rows=0,
    K=5,
    Ns=[3],
    bias=True,
    chunks=1,
    dtype=torch.float32,
    seq_first=False,
    batch=1,
    strided=False,
    save=False,
    seed=0,
)  # no tokens
@example(
    world_size=2,
    rows=3,
    K=33,
    Ns=[17, 5, 9],
    bias=True,
    chunks=2,
    dtype=torch.float16,
    seq_first=True,
    batch=2,
    strided=True,
    save=True,
    seed=1,
)  # fused QKV
@example(
    world_size=4,
    rows=2,
    K=6,
    Ns=[5, 3],
    bias=True,
    chunks=0,
    dtype=torch.float16,
    seq_first=True,
    batch=2,
    strided=True,
    save=False,
    seed=2,
)  # serial
def test_all_gather_matmul(world, world_size, **p):
    assert all(world(world_size).run(_run_all_gather_matmul, p))


def test_the_rings_on_triton_kernels(world, triton_kernels):
    """A fused-QKV gather and a reduce-scatter with fusedpar's Triton GEMM (the
    interpreter here) on every rank: its fp32 partials and slices inside the TP rings,
    q and k turned in its epilogue, and a gated MLP's gradient in it."""
    p = dict(
        rows=3,
        K=33,
        Ns=[17, 5, 9],
        bias=True,
        chunks=2,
        dtype=torch.float16,
        seq_first=True,
        batch=2,
        strided=True,
        save=True,
        seed=1,
    )
    assert all(world(2).run(_run_all_gather_matmul, p))
    p = dict(
        rows=2,
        K=9,
        heads=[2, 1, 1],
        head_dim=16,
        rotary=16,
        chunks=3,
        batch=2,
        dtype=torch.float16,
        seed=0,
    )
    assert all(world(2).run(_run_all_gather_matmul_rope, p))
    p = dict(
        rows=3,
        K=7,
        N=19,
        bias=True,
        chunks=3,
        dtype=torch.float16,
        seq_first=True,
        batch=2,
        strided=True,
        seed=2,
    )
    assert all(world(2).run(_run_matmul_reduce_scatter, p))
    # the SwiGLU's backward: the ring's dh GEMMs (two chunks of 3 rows) ending in dgate,
    # dup and h; and classic TP's plain GEMM ending in them
    assert all(world(2).run(_run_layers, "geglu-bias", True, False, torch.float16, 3, 2))
    assert all(world(2).run(_run_layers, "swiglu", False, False, torch.float32, 4))


def _turned(y, cos, sin, head_dim):
    """y (T, ..., N) with its heads turned at the positions of dim 0: `apply_rope` (the
    PyTorch formula, in y's dtype) on its (B, T, H, hd) view."""
    heads = y.reshape(*y.shape[:2], y.shape[-1] // head_dim, head_dim).transpose(0, 1)
    return apply_rope(heads, cos, sin).transpose(0, 1).reshape(y.shape)


def _run_all_gather_matmul_rope(p):
    """Q, K, V projections with q and k turned (`rope=`), every gradient, against the
    dense float64 math through autograd: every rank's weights (a shard of the heads each)
    feed the dense dX."""
    rank, size = dist.get_rank(), dist.get_world_size()
    n, K, hd, dtype, seed = p["rows"], p["K"], p["head_dim"], p["dtype"], p["seed"]
    T, lead = n * size, (n * size, p["batch"])
    Ns = [hd * h for h in p["heads"]]
    X = randn((*lead, K), torch.float64, seed, exact_in=dtype)

    def draw(shape_of, offset):  # [rank][weight] -> a float64 tensor
        return [
            [
                randn(shape_of(N), torch.float64, seed + 100 * s + offset + i, exact_in=dtype)
                for i, N in enumerate(Ns)
            ]
            for s in range(size)
        ]

    Ws, bs, dYs = draw(lambda N: (N, K), 1), draw(lambda N: (N,), 5), draw(lambda N: (*lead, N), 9)
    cos, sin = rope_tables(torch.arange(T) * 2 + 1, p["rotary"], 1000.0)
    rotate = [True, True, False][: len(Ns)]

    def run(dt, ours):  # this rank's outputs and the gradients of (x, *ws, *bs)
        x = X[rank * n : (rank + 1) * n] if ours else X
        x = x.detach().to(dt).requires_grad_()
        for s in [rank] if ours else range(size):  # dense: X's gradient from every shard
            params = [t.detach().to(dt).requires_grad_() for t in (*Ws[s], *bs[s])]
            ws, b = params[: len(Ns)], params[len(Ns) :]
            if ours:
                ys = fp.all_gather_matmul(
                    x,
                    ws,
                    WORLD,
                    bias=b,
                    rope=(cos, sin),
                    rotate=rotate,
                    head_dim=hd,
                    **_schedule(p["chunks"]),
                )
            else:
                ys = [x @ w.T + bias for w, bias in zip(ws, b, strict=True)]
                ys = [_turned(y, cos, sin, hd) if r else y for y, r in zip(ys, rotate, strict=True)]
            torch.autograd.backward(ys, [dy.to(dt) for dy in dYs[s]])
            if s == rank:
                mine = ys, [t.grad for t in params]
        return mine[0], [x.grad if ours else x.grad[rank * n : (rank + 1) * n], *mine[1]]

    (ys, grads), ref, same = run(dtype, True), run(torch.float64, False), run(dtype, False)
    names = ["dx", *(f"dw{i}" for i in range(len(Ns))), *(f"db{i}" for i in range(len(Ns)))]
    checks = [(f"y{i}", *c) for i, c in enumerate(zip(ys, ref[0], same[0], strict=True))]
    checks += list(zip(names, grads, ref[1], same[1], strict=True))
    return _check_all(checks)


@given(
    world_size=st.sampled_from([2, 4]),
    rows=st.integers(1, 3),
    K=st.integers(1, 20),
    heads=st.lists(st.integers(1, 3), min_size=2, max_size=3),
    shape=st.sampled_from([(8, 8), (16, 16), (16, 8), (12, 12)]),
    chunks=st.integers(0, 3),
    batch=st.integers(1, 2),
    dtype=cpu_dtypes(),
    seed=seeds(),
)
@example(
    world_size=2,
    rows=2,
    K=9,
    heads=[2, 1, 1],
    shape=(16, 16),
    chunks=3,
    batch=2,
    dtype=torch.float16,
    seed=0,
)  # chunks starting mid-position
@example(
    world_size=2,
    rows=0,
    K=3,
    heads=[1, 1],
    shape=(12, 12),
    chunks=1,
    batch=2,
    dtype=torch.float32,
    seed=0,
)  # no tokens, turned after the ring
@example(
    world_size=4,
    rows=1,
    K=5,
    heads=[2, 1, 1],
    shape=(16, 8),
    chunks=0,
    batch=2,
    dtype=torch.float16,
    seed=3,
)  # serial, partial rotary
def test_all_gather_matmul_turns_q_and_k(world, world_size, shape, **p):
    """`rope=`: heads of 8 or 16 turned in the GEMMs' epilogue (chunks of the ring start at
    any row, not only at a position's first), partial rotary (16, 8) and heads of 12 turned
    after the ring; q and k turned, v not."""
    p.update(head_dim=shape[0], rotary=shape[1])
    assert all(world(world_size).run(_run_all_gather_matmul_rope, p))


def _tables(tokens=4, half=4, **changes):
    cos, sin = rope_tables(torch.arange(tokens), 2 * half, 100.0)
    return cos.to(**changes), sin.to(**changes)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"rope": _tables(tokens=5)}, ValueError, r"\(T=4, r/2\)"),
        ({"rope": _tables(dtype=torch.float64)}, TypeError, "float32"),
        ({"rope": tuple(t.requires_grad_() for t in _tables())}, ValueError, "no gradient"),
        ({"rope": _tables(), "rotate": [True]}, ValueError, "2 weights but 1 rotate"),
        ({"rope": _tables(), "head_dim": 6}, ValueError, "8 rotated dims"),
        ({"rope": _tables(half=2), "head_dim": 16}, ValueError, "not whole heads of head_dim=16"),
        ({"rotate": [True, False]}, ValueError, "go with rope"),
    ],
)
def test_a_bad_rotation_is_refused_before_any_transfer(kwargs, error, match):
    x, weights = torch.ones(4, 3), [torch.ones(8, 3), torch.ones(24, 3)]
    with pytest.raises(error, match=match):
        fp.all_gather_matmul(x, weights, None, **kwargs)


def _run_matmul_reduce_scatter(p):
    rank, size = dist.get_rank(), dist.get_world_size()
    n, k, N, dtype, seed = p["rows"], p["K"], p["N"], p["dtype"], p["seed"]
    lead = _tokens_shape(p, n * size)
    X = randn((*lead, k * size), torch.float64, seed, exact_in=dtype)
    Wt = randn((N, k * size), torch.float64, seed + 1, exact_in=dtype)
    b = randn((N,), torch.float64, seed + 2, exact_in=dtype) if p["bias"] else None
    dYs = [
        randn((*_tokens_shape(p, n), N), torch.float64, seed + 10 + s, exact_in=dtype)
        for s in range(size)
    ]
    cols = slice(rank * k, (rank + 1) * k)

    x = _maybe_strided(X[..., cols].to(dtype), p["strided"]).requires_grad_()
    w = Wt[:, cols].to(dtype).requires_grad_()
    b_in = None if b is None else b.to(dtype).requires_grad_()
    y = fp.matmul_reduce_scatter(x, w, WORLD, bias=b_in, **_schedule(p["chunks"]))
    y.backward(dYs[rank].to(dtype))

    def dense(dt):
        full = X.to(dt) @ Wt.to(dt).T + (0 if b is None else b.to(dt))
        dY = torch.cat(dYs).to(dt)
        return (
            full[rank * n : (rank + 1) * n],
            dY @ Wt[:, cols].to(dt),
            dY.flatten(0, -2).T @ X[..., cols].to(dt).flatten(0, -2),
            dYs[rank].to(dt).flatten(0, -2).sum(0),
        )

    ref, same = dense(torch.float64), dense(dtype)
    checks = [
        ("y", y, ref[0], same[0]),
        ("dx", x.grad, ref[1], same[1]),
        ("dw", w.grad, ref[2], same[2]),
    ]
    if b is not None:
        checks.append(("db", b_in.grad, ref[3], same[3]))
    return _check_all(checks)


@given(
    world_size=st.sampled_from([2, 4]),
    rows=st.integers(1, 4),
    K=st.integers(1, 9),
    N=st.integers(1, 20),
    bias=st.booleans(),
    chunks=st.integers(0, 3),
    dtype=cpu_dtypes(),
    seq_first=st.booleans(),
    batch=st.integers(1, 2),
    strided=st.booleans(),
    seed=seeds(),
)
@example(
    world_size=2,
    rows=0,
    K=3,
    N=4,
    bias=True,
    chunks=2,
    dtype=torch.float32,
    seq_first=False,
    batch=1,
    strided=False,
    seed=0,
)  # no tokens
@example(
    world_size=4,
    rows=3,
    K=7,
    N=19,
    bias=True,
    chunks=3,
    dtype=torch.float16,
    seq_first=True,
    batch=2,
    strided=True,
    seed=1,
)
@example(
    world_size=4,
    rows=2,
    K=5,
    N=7,
    bias=True,
    chunks=0,
    dtype=torch.float16,
    seq_first=False,
    batch=2,
    strided=True,
    seed=4,
)  # serial
def test_matmul_reduce_scatter(world, world_size, **p):
    assert all(world(world_size).run(_run_matmul_reduce_scatter, p))


# --- layers ----------------------------------------------------------------------------


def _activation(kind):
    if kind == "geglu-bias":  # Gemma's MLP (fusedpar.kernels.gated's "gelu_tanh")
        return functools.partial(nn.functional.gelu, approximate="tanh")
    return nn.functional.silu


def _dense_model(kind, d_in, d_hidden, seed):
    """The dense module in float64 and, per parameter, the dim a rank holds a slice of
    (None: whole on every rank)."""
    torch.manual_seed(seed)
    if kind in ("swiglu", "geglu-bias"):
        bias = kind == "geglu-bias"
        gate, up = nn.Linear(d_in, d_hidden, bias=bias), nn.Linear(d_in, d_hidden, bias=bias)
        down = nn.Linear(d_hidden, d_in, bias=bias)
        model = nn.ModuleDict({"gate": gate, "up": up, "down": down}).double()
        model.forward = lambda x: down(_activation(kind)(gate(x)) * up(x))
        if bias:
            params = [gate.weight, up.weight, down.weight, gate.bias, up.bias, down.bias]
            return model, params, [0, 0, 1, 0, 0, None]
        return model, [gate.weight, up.weight, down.weight], [0, 0, 1]
    in_f, out_f = (d_in, d_hidden) if kind == "column" else (d_hidden, d_in)
    model = nn.Linear(in_f, out_f).double()
    return model, [model.weight, model.bias], [0, 0] if kind == "column" else [1, None]


def _run_layers(kind, sequence_parallel, gather_output, dtype, seed, chunks=1):
    """A layer made with from_dense against the dense module, forward and backward
    (`chunks`: the ring's chunks per rank, 0 for the serial schedule: `_schedule`)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    T, d_in, d_hidden = 3 * size, 6, 4 * size
    model, dense_params, split = _dense_model(kind, d_in, d_hidden, seed)
    with torch.no_grad():  # the oracle sees exactly the weights the layer gets
        for param in dense_params:
            param.copy_(param.to(dtype))
    if kind == "swiglu":
        layer = fp.nn.ParallelSwiGLU.from_dense(
            *(p.to(dtype) for p in dense_params),
            WORLD,
            sequence_parallel=sequence_parallel,
            **_schedule(chunks),
        )
        layer_params = [layer.gate_weight, layer.up_weight, layer.down_weight]
    elif kind == "geglu-bias":  # from the nn.Linear modules: biases read off them
        layer = fp.nn.ParallelSwiGLU.from_dense(
            *(model[n].to(dtype) for n in ("gate", "up", "down")),
            WORLD,
            activation=_activation(kind),
            sequence_parallel=sequence_parallel,
            **_schedule(chunks),
        )
        model.double()
        layer_params = [
            getattr(layer, f"{n}_{p}") for p in ("weight", "bias") for n in ("gate", "up", "down")
        ]
    else:
        cls = fp.nn.ColumnParallelLinear if kind == "column" else fp.nn.RowParallelLinear
        kwargs = {"gather_output": gather_output} if kind == "column" else {}
        layer = cls.from_dense(
            model.to(dtype),
            WORLD,
            sequence_parallel=sequence_parallel,
            **kwargs,
            **_schedule(chunks),
        )
        model.double()
        layer_params = [layer.weight, layer.bias]

    def mine(t, dim):  # this rank's slice of a dense tensor along dim (None: all of it)
        return t if dim is None else t.chunk(size, dim)[rank]

    token_dim = 0 if sequence_parallel else None
    feature_in = 1 if kind == "row" else None  # the row layer takes split features
    feature_out = 1 if kind == "column" and not gather_output else None
    tokens_out = None if kind == "column" else token_dim  # column-parallel outputs hold every token

    X = randn((T, d_hidden if kind == "row" else d_in), torch.float64, seed + 1, exact_in=dtype)
    with torch.no_grad():  # dLoss/dY of the dense model
        G = torch.randn_like(model(X)).to(dtype).double()
    x = mine(mine(X, token_dim if kind != "row" else None), feature_in).to(dtype).requires_grad_()
    y = layer(x)
    y.backward(mine(mine(G, tokens_out), feature_out).to(dtype))

    refs = []
    for dt in (torch.float64, dtype):
        xd = X.to(dt, copy=True).requires_grad_()
        model.to(dt).zero_grad()
        yd = model(xd)
        yd.backward(G.to(dt))
        y_ref = mine(mine(yd.detach(), tokens_out), feature_out)
        dx_ref = mine(mine(xd.grad, token_dim if kind != "row" else None), feature_in)
        grads = [mine(p.grad, dim) for p, dim in zip(dense_params, split, strict=True)]
        refs.append([y_ref, dx_ref, *grads])
    model.double()
    names = ["y", "dx"] + [f"d{i}" for i in range(len(layer_params))]
    got = [y, x.grad] + [p.grad for p in layer_params]
    return _check_all(zip(names, got, refs[0], refs[1], strict=True))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "kind, sequence_parallel, gather_output",
    [
        ("column", True, False),
        ("column", True, True),
        ("column", False, False),
        ("column", False, True),
        ("row", True, False),
        ("row", False, False),
        ("swiglu", True, False),
        ("swiglu", False, False),
        ("geglu-bias", True, False),
        ("geglu-bias", False, False),
    ],
)
def test_layers_equal_dense(world, world_size, kind, sequence_parallel, gather_output):
    """fp32 on the ring, fp16 in the serial schedule."""
    for dtype, seed, chunks in ((torch.float32, 0, 1), (torch.float16, 1, 0)):
        assert all(
            world(world_size).run(
                _run_layers, kind, sequence_parallel, gather_output, dtype, seed, chunks
            )
        )


def _run_init(seed):
    torch.manual_seed(seed)
    dense_col, dense_row = nn.Linear(5, 8), nn.Linear(8, 5)
    gate, up, down = (
        nn.Linear(5, 8, bias=False),
        nn.Linear(5, 8, bias=False),
        nn.Linear(8, 5, bias=False),
    )
    torch.manual_seed(seed)
    col, row = fp.nn.ColumnParallelLinear(5, 8, WORLD), fp.nn.RowParallelLinear(8, 5, WORLD)
    mlp = fp.nn.ParallelSwiGLU(5, 8, WORLD)
    r, size = dist.get_rank(), dist.get_world_size()
    pairs = [
        (col.weight, dense_col.weight.chunk(size, 0)[r]),
        (col.bias, dense_col.bias.chunk(size, 0)[r]),
        (row.weight, dense_row.weight.chunk(size, 1)[r]),
        (row.bias, dense_row.bias),
        (mlp.gate_weight, gate.weight.chunk(size, 0)[r]),
        (mlp.up_weight, up.weight.chunk(size, 0)[r]),
        (mlp.down_weight, down.weight.chunk(size, 1)[r]),
    ]
    return all(torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_initialization_is_the_dense_one_for_any_world_size(world, world_size):
    assert all(world(world_size).run(_run_init, 3))


def test_no_group_is_a_plain_layer():
    torch.manual_seed(0)
    dense = nn.Linear(7, 5)
    torch.manual_seed(0)
    col = fp.nn.ColumnParallelLinear(7, 5)
    x = randn((4, 7), torch.float32, 1)
    assert torch.equal(col.weight, dense.weight) and torch.equal(col.bias, dense.bias)
    torch.testing.assert_close(col(x), dense(x))
    y = fp.all_gather_matmul(x, dense.weight, None, bias=dense.bias)
    torch.testing.assert_close(y, dense(x))
    y = fp.matmul_reduce_scatter(x, dense.weight, None, bias=dense.bias)
    torch.testing.assert_close(y, dense(x))


def _run_bad_input(case):
    x = torch.ones(5, 4) if case != "fp16 weight" else torch.ones(4, 4)
    weight = torch.ones(3, 4)
    if case == "indivisible tokens":
        fp.matmul_reduce_scatter(x, weight, WORLD)
    elif case == "wrong K":
        fp.all_gather_matmul(x, torch.ones(3, 6), WORLD)
    elif case == "fp16 weight":
        fp.matmul_reduce_scatter(x, weight.half(), WORLD)
    elif case == "indivisible features":
        fp.nn.ColumnParallelLinear(4, 6, WORLD)


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("indivisible tokens", ValueError, r"5 tokens.*group size 4"),
        ("wrong K", ValueError, "K=4.*K=6"),
        ("fp16 weight", TypeError, "float16"),
        ("indivisible features", ValueError, r"out_features \(6\).*group size \(4\)"),
    ],
)
def test_bad_input_fails_on_every_rank(world, case, error, match):
    for e in world(4).run(exception_of, _run_bad_input, case):
        assert isinstance(e, error) and re.search(match, str(e)), repr(e)

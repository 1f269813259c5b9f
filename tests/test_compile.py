"""torch.compile and activation checkpointing at 2 and 4 ranks (gloo, CPU).

- every ``fusedpar::`` custom op passes ``torch.library.opcheck`` (schema, fake, autograd
  registration, AOT dispatch), run on every rank of a group of 2, as the op communicates;
- the example model (dense at TP2 x CP2, MoE with EP2 over tp) compiles full-graph with
  the ``aot_eager`` backend, no graph break, and its loss and every gradient equal
  eager's bit for bit (the same kernels run, in the same order);
- activation checkpointing of its blocks (full, and selective with
  `fusedpar.checkpoint_policy`) gives bitwise the losses and gradients of no
  checkpointing; the policy keeps every communicating op out of the backward, and the
  MoE's statistics are not touched by the recompute.
"""

import pytest
import torch
import torch.distributed as dist
from tiny_llama import Block, Config, ParallelBlock, ParallelTransformer, Transformer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, noop_context_fn

import fusedpar as fp
from fusedpar.comm import group_name
from fusedpar.nn.attention_parts import rope_tables
from fusedpar.recompute import COMMUNICATION_OPS

SEQ, BATCH = 16, 2


def _ops():
    return torch.ops.fusedpar


# --- opcheck ------------------------------------------------------------------------------


def _leaf(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def _opcheck_cases(group: str):
    """(op, args) for every fusedpar custom op, small and random; float inputs require
    grad so that the autograd registration is exercised."""
    ops = _ops()
    W = dist.get_world_size()
    q, k, v = _leaf(1, 8, 4, 16), _leaf(1, 8, 2, 16), _leaf(1, 8, 2, 16)
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    opts = (True, None, -1, -1, 0.0)
    out, lse = ops.flash_attn(q, k, v, None, None, *opts)
    ring_opts = (group, True, None, "zigzag", -1, -1, 0.0, False)
    ring_out, ring_lse = ops.ring_attn(q, k, v, *ring_opts, None)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    # the layer's layout: (S, B, H, D) projections viewed as (B, S, H, D), not contiguous
    qt, kt, vt = (_leaf(8, 2, h, 16).transpose(0, 1) for h in (4, 2, 2))
    out_t, lse_t = ops.flash_attn(qt, kt, vt, None, None, *opts)
    xt = _leaf(3, 4, 8).transpose(0, 1)  # (4, 3, 8), strided
    x, w1, w2, b1 = _leaf(4, 3, 8), _leaf(6, 8), _leaf(5, 8), _leaf(6)
    wr = _leaf(8, 8)  # a head of 8 turned by RoPE
    tables8, tables6 = (list(rope_tables(torch.arange(4 * W), hd, 100.0)) for hd in (8, 6))
    norm_rope = rope_tables(torch.arange(4), 6, 100.0)  # xt's 4 positions, 6 of 8 dims turned
    dy_t, rstd_t = torch.randn(4, 3, 8), torch.rand(4, 3)  # xt's gradient and rstd
    dy5, rstd5 = torch.randn(5, 8), torch.rand(5)
    y = torch.randn(4 * W, 3, 6)
    T, E, top_k, d, h = 5, 4, 2, 8, 6
    xm = _leaf(T, d)
    ids = torch.stack([torch.randperm(E)[:top_k] for _ in range(T)])
    counts, order, pos = fp.kernels.moe_permute.dispatch_metadata(ids, E)
    wts = torch.rand(T, top_k).requires_grad_()
    ew1, ew3, ew2 = _leaf(E, h, d), _leaf(E, h, d), _leaf(E, d, h)
    rows = order // top_k
    experts = (xm, ew1, ew3, ew2, counts, rows, pos)
    eout, h13 = ops.expert_swiglu(*experts, True)
    # gpt-oss's experts: biases (b1, b3, b2) and the clamped SwiGLU
    oss = (_leaf(E, h), _leaf(E, h), _leaf(E, d), "clamped_swiglu", 1.702, 7.0)
    oss_out, oss_h13 = ops.expert_swiglu(*experts, True, *oss)
    ep = (xm, order, pos, counts, top_k, group)
    recv, *_, splits = ops.moe_dispatch(*ep)
    _, route_ids, route_probs = ops.moe_route(torch.randn(T, 5), None, 2, "softmax", True)
    # the one-rank attention layer (x (4, 2, 16), heads 2/1 of 8): RoPE in the GEMMs; biases,
    # head norms turning 6 of 8 dims; packed documents with a window and softcap, no RoPE
    xa, wa = _leaf(4, 2, 16), [_leaf(16, 16), _leaf(8, 16), _leaf(8, 16), _leaf(16, 16)]
    mask = (True, None, -1, -1, 0.0)
    layer_cases = [
        (
            xa,
            wa,
            [],
            [False] * 4,
            [],
            list(rope_tables(torch.arange(4), 8, 100.0)),
            None,
            8,
            *mask,
            1e-6,
            0.0,
        ),
        (
            xa,
            wa,
            [_leaf(16), _leaf(8), _leaf(8), _leaf(16)],
            [True] * 4,
            [_leaf(8), _leaf(8)],
            list(rope_tables(torch.arange(4), 6, 100.0)),
            None,
            8,
            *mask,
            1e-6,
            1.0,
        ),
        (
            _leaf(7, 1, 16),
            wa,
            [_leaf(16)],
            [False, False, False, True],
            [],
            [],
            torch.tensor([0, 3, 3, 7], dtype=torch.int32),
            8,
            True,
            0.5,
            2,
            0,
            3.0,
            1e-6,
            0.0,
        ),
    ]
    layer_saved = ops.attention_layer(*layer_cases[1])[1]
    return [
        (ops.flash_attn, (q, k, v, None, None, *opts)),
        (ops.flash_attn, (q[0, None], k[0, None], v[0, None], cu, cu, *opts)),
        (ops.flash_attn_backward, (dout, dlse, q, k, v, out, lse, None, None, *opts)),
        (ops.ring_attn, (q, k, v, *ring_opts, None)),
        (ops.ring_attn, (qt, kt, vt, *ring_opts, None)),
        (
            ops.ring_attn_backward,
            (
                torch.randn_like(out_t),
                torch.randn_like(lse_t),
                qt,
                kt,
                vt,
                out_t,
                lse_t,
                *ring_opts,
                None,
            ),
        ),
        (
            ops.flash_attn_backward,
            (
                torch.randn_like(out_t),
                torch.randn_like(lse_t),
                qt,
                kt,
                vt,
                out_t,
                lse_t,
                None,
                None,
                *opts,
            ),
        ),
        (ops.all_gather_matmul, (xt, [w1], [b1], [True], group, 1, True, [], [False], 0, None)),
        (
            ops.all_gather_matmul_backward,
            (
                [torch.randn(4 * W, 3, 6)],
                xt,
                None,
                [w1],
                group,
                1,
                True,
                [True],
                [True],
                [],
                [False],
                0,
                None,
            ),
        ),
        (
            ops.matmul_reduce_scatter_backward,
            (
                torch.randn(4, 3, 8),
                y.transpose(0, 1).contiguous().transpose(0, 1),
                torch.randn(8, 6),
                group,
                1,
                True,
                True,
                True,
            ),
        ),
        (ops.ring_attn, (q, k, v, *ring_opts, torch.tensor([0, 5, 16], dtype=torch.int32))),
        (ops.ring_attn_backward, (dout, dlse, q, k, v, ring_out, ring_lse, *ring_opts, None)),
        (
            ops.all_gather_matmul,
            (x, [w1, w2], [b1], [True, False], group, 2, False, [], [False] * 2, 0, None),
        ),
        (ops.all_gather_matmul, (x, [w1], [], [False], group, 1, True, [], [False], 0, None)),
        # RoPE: heads of 8 in the GEMM's epilogue; of 6 (not a power of 2) after the ring
        (
            ops.all_gather_matmul,
            (
                x,
                [wr, w1],
                [b1],
                [False, True],
                group,
                0,
                False,
                tables8,
                [True, False],
                8,
                torch.bfloat16,
            ),  # serial (chunks 0), dX's partials in bf16
        ),
        (ops.all_gather_matmul, (xt, [w1], [b1], [True], group, 1, True, tables6, [True], 6, None)),
        (
            ops.all_gather_matmul_backward,
            (
                [torch.randn(4 * W, 3, 6)],
                x,
                None,
                [w1],
                group,
                1,
                True,
                [True],
                [False],
                [],
                [False],
                0,
                torch.float16,
            ),
        ),
        (
            ops.all_gather_matmul_backward,
            (
                [torch.randn(4 * W, 3, 8)],
                x,
                None,
                [wr],
                group,
                1,
                True,
                [True],
                [False],
                tables8,
                [True],
                8,
                None,
            ),
        ),
        (
            ops.matmul_reduce_scatter,
            (_leaf(4 * W, 3, 6), _leaf(8, 6), _leaf(8), group, 1, torch.float16),
        ),
        (
            ops.matmul_reduce_scatter_backward,
            (torch.randn(4, 3, 8), y, torch.randn(8, 6), group, 1, True, True, True),
        ),
        (ops.expert_swiglu, (*experts, True)),
        (ops.expert_swiglu_backward, (torch.randn_like(eout), *experts, h13, [True] * 4)),
        (ops.expert_swiglu, (*experts, True, *oss)),
        (
            ops.expert_swiglu_backward,
            (torch.randn_like(oss_out), *experts, oss_h13, [True] * 7, *oss[3:]),
        ),
        (ops.moe_permute, (xm, rows, pos)),
        (ops.moe_permute_backward, (torch.randn(T * top_k, d), pos)),
        (ops.moe_combine, (_leaf(T * top_k, d), wts, pos, order)),
        (
            ops.moe_combine_backward,
            (torch.randn(T, d), torch.randn(T * top_k, d), wts.detach(), pos, order, True, True),
        ),
        # the routing: softmax and sigmoid (with the selection's bias), some gradients absent
        (ops.moe_route, (_leaf(T, 5), None, 2, "softmax", True)),
        (ops.moe_route, (_leaf(T, 6), torch.randn(6), 3, "sigmoid", False)),
        (
            ops.moe_route_backward,
            (torch.randn(T, 2), torch.randn(T, 5), route_probs, route_ids, "softmax", True),
        ),
        (
            ops.moe_route_backward,
            (None, torch.randn(T, 5), route_probs, route_ids, "sigmoid", False),
        ),
        (ops.rms_norm, (xt, _leaf(8), 1e-5, 0.0, None, None)),
        (ops.rms_norm, (_leaf(5, 8, dtype=torch.float16), _leaf(8), 1e-6, 1.0, None, None)),
        (ops.rms_norm, (xt, _leaf(8), 1e-5, 0.0, *norm_rope)),  # a q/k norm joined by RoPE
        (ops.rms_norm_backward, (dy_t, xt, _leaf(8), rstd_t, 1e-5, 0.0, None, None, True, True)),
        (ops.rms_norm_backward, (dy_t, xt, _leaf(8), rstd_t, 1e-5, 0.0, *norm_rope, True, True)),
        (
            ops.rms_norm_backward,
            (dy5, _leaf(5, 8), _leaf(8), rstd5, 1e-6, 1.0, None, None, False, True),
        ),
        # the gated activation (no autograd of its own: `_GatedDown` holds it): strided
        # (a fused gate/up's halves), each activation
        (ops.gated, (torch.randn(4, 16)[:, :8], torch.randn(4, 16)[:, 8:], "silu")),
        (ops.gated, (torch.randn(3, 5).half(), torch.randn(3, 5).half(), "gelu")),
        # the TP path's backward: the ring's dh GEMMs ending in dgate, dup, h (and classic
        # TP's plain GEMM: group ""), some gradients not asked for
        (
            ops.gated_down_backward,
            (
                torch.randn(3, 2, 8),
                torch.randn(3 * W, 2, 5),
                torch.randn(3 * W, 2, 5),
                torch.randn(8, 5),
                "gelu_tanh",
                group,
                1,
                [True, True, True],
            ),
        ),
        (
            ops.gated_down_backward,
            (
                torch.randn(4, 8),
                torch.randn(4, 5),
                torch.randn(4, 5),
                torch.randn(8, 5),
                "silu",
                "",
                1,
                [True, False, False],
            ),
        ),
        (
            ops.gated_down_backward,
            (
                torch.randn(2, 8),
                torch.randn(2 * W, 5),
                torch.randn(2 * W, 5),
                torch.randn(8, 5),
                "silu",
                group,
                2,
                [False, True, True],
            ),
        ),
        # RoPE: a strided head range of a projection, whole and partial rotary; q and k
        (ops.rope, ([_leaf(2, 5, 7, 16)[:, :, 1:4]], torch.randn(5, 8), torch.randn(5, 8), False)),
        (
            ops.rope,
            ([_leaf(1, 3, 2, 16, dtype=torch.float16)], torch.randn(3, 4), torch.randn(3, 4), True),
        ),
        (
            ops.rope,
            (
                [_leaf(2, 5, 7, 16)[:, :, :4], _leaf(2, 5, 7, 16)[:, :, 4:6]],
                torch.randn(5, 6),
                torch.randn(5, 6),
                False,
            ),
        ),
        # the one-rank gated MLP, with and without biases, some gradients not asked for
        (ops.gated_mlp, (xt, _leaf(5, 8), _leaf(5, 8), _leaf(8, 5), [], "silu")),
        (
            ops.gated_mlp,
            (
                _leaf(3, 8),
                _leaf(5, 8),
                _leaf(5, 8),
                _leaf(8, 5),
                [_leaf(5), _leaf(5), _leaf(8)],
                "gelu_tanh",
            ),
        ),
        (
            ops.gated_mlp_backward,
            (
                torch.randn(4, 3, 8),
                xt,
                torch.randn(4, 3, 5),
                torch.randn(4, 3, 5),
                torch.randn(5, 8),
                torch.randn(5, 8),
                torch.randn(8, 5),
                "silu",
                [True, False, True, True],
            ),
        ),
        *((ops.attention_layer, args) for args in layer_cases),
        (
            ops.attention_layer_backward,
            (
                torch.randn(4, 2, 16),
                xa,
                layer_saved,
                wa,
                layer_cases[1][4],
                layer_cases[1][5],
                None,
                *layer_cases[1][7:],
                [True, False, True, True, True, True, False, True, True, True, False],
            ),
        ),
        (ops.moe_dispatch, ep),
        (ops.moe_return, (recv.detach().requires_grad_(), splits, group, False)),
        # Ulysses: q, k, v (strided, KV replicated W times) and the LSE's (B, S, H, 1) view
        (ops.scatter_heads, ([qt, kt[:, :, :1], vt[:, :, :1]], group, [1, W, W])),
        (ops.scatter_heads, ([q, k], group, [1, 1])),
        (ops.gather_heads, ([_leaf(1, 8 * W, 2, 16), _leaf(1, 8 * W, 1, 16)], group, [1, W])),
        (ops.gather_heads, ([_leaf(2, 2, 8 * W).transpose(1, 2)[..., None]], group, [1])),
    ]


def _run_opcheck():
    """opcheck of every case with a collective (those given the group) on every rank, and
    of the others on one rank each, in turn (they are the same on every rank: the
    second rank's time goes to other cases)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    group = group_name(dist.group.WORLD)
    failures, checked = [], set()
    for i, (op, args) in enumerate(_opcheck_cases(group)):
        collective = any(isinstance(a, str) and a == group for a in args)
        if not collective and i % size != rank:
            continue
        if op._qualified_op_name.endswith("_backward"):  # no double backward: plain inputs
            args = torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, args)
        results = torch.library.opcheck(op, args, raise_exception=False)
        bad = {test: repr(err)[:300] for test, err in results.items() if err != "SUCCESS"}
        if bad:
            failures.append(f"{op}: {bad}")
        checked.add(op._qualified_op_name)
    return failures, checked


def test_every_custom_op_passes_opcheck(world):
    registered = sorted(
        name for name in torch._C._dispatch_get_all_op_names() if name.startswith("fusedpar::")
    )
    checked = set()
    for failures, mine in world(2).run(_run_opcheck):
        assert failures == [], "\n".join(failures)
        checked |= mine
    assert sorted(checked) == registered


# --- the example model: compiled, and under activation checkpointing ------------------------


def _build(moe: bool):
    dims = fp.ParallelDims(cp=2, tp=2, ep="tp" if moe else None)
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
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = fp.distribute(ParallelTransformer(Transformer(cfg), dims.groups(mesh)), mesh)
    data = torch.randint(0, cfg.vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return model, (data[:, :-1], data[:, 1:])


def _loss_and_grads(model, step, batch):
    model.zero_grad(set_to_none=True)
    loss = step(*batch)
    loss.backward()
    return [loss.detach(), *(p.grad.to_local().clone() for p in model.parameters())]


def _bitwise(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _run_compiled(moe):
    model, batch = _build(moe)
    eager = _loss_and_grads(model, model, batch)
    torch._dynamo.reset()
    # EP > 1: the rows a rank receives depend on the routing (an unbacked size).
    # fullgraph=True raises at any graph break (a torch._dynamo.explain count of 0 said
    # the same, at a second trace's time).
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        got = _loss_and_grads(model, compiled, batch)
    torch._dynamo.reset()
    return _bitwise(eager, got)


def test_the_example_model_compiles_full_graph_and_matches_eager(world):
    """The MoE model: its attention runs TP2 x CP2 (all_gather_matmul, ring_attn,
    matmul_reduce_scatter), its experts EP2 over tp. (The dense model, the same minus
    the experts, is one test's time more: 45 s on 2 cores.)"""
    assert world(4).run(_run_compiled, True, timeout=600) == [True] * 4


class _OpLog(TorchDispatchMode):
    """The fusedpar communication ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket._qualified_op_name in COMMUNICATION_OPS:
            self.seen.append(func.overloadpacket._qualified_op_name)
        return func(*args, **(kwargs or {}))


class _Checkpointed(torch.nn.Module):
    def __init__(self, block, context_fn):
        super().__init__()
        self.block, self.context_fn = block, context_fn

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False, context_fn=self.context_fn)


def _run_checkpointed(moe):
    model, batch = _build(moe)
    blocks = list(model.blocks)
    results = {}
    for mode, context_fn in (
        ("none", None),
        ("full", noop_context_fn),
        ("selective", fp.checkpoint_policy()),
    ):
        for i, block in enumerate(blocks):
            model.blocks[i] = block if context_fn is None else _Checkpointed(block, context_fn)
        model.zero_grad(set_to_none=True)
        loss = model(*batch)
        for block in blocks:  # the recompute must not count its tokens again
            block.mlp.last_stats = {"untouched": True}
        with _OpLog() as log:
            loss.backward()
        grads = [loss.detach(), *(p.grad.to_local().clone() for p in model.parameters())]
        untouched = all(block.mlp.last_stats == {"untouched": True} for block in blocks)
        results[mode] = (grads, sorted(log.seen), untouched)
    plain = results.pop("none")
    return {
        mode: (_bitwise(plain[0], grads), seen, plain[1], untouched)
        for mode, (grads, seen, untouched) in results.items()
    }


def test_activation_checkpointing_is_bitwise_and_the_policy_repeats_no_collective(world):
    """The MoE model's blocks (TP2 x CP2 attention, EP2 experts) checkpointed. The
    communicating ops that run in the backward: without checkpointing, the all-to-alls'
    own backward; under full checkpointing, the forward's again; under the policy,
    exactly those of no checkpointing."""
    moe = True
    for results in world(4).run(_run_checkpointed, moe, timeout=600):
        for mode, (equal, seen, plain, untouched) in results.items():
            assert equal, f"{mode} checkpointing changed the loss or a gradient"
            assert untouched, f"{mode} checkpointing's recompute touched MoE.last_stats"
            if mode == "selective":
                assert seen == plain, f"the policy's backward ran {seen}, not {plain}"
            else:  # full recompute repeats the forward's collectives
                repeated = {"fusedpar::ring_attn", "fusedpar::all_gather_matmul"}
                repeated |= {"fusedpar::moe_dispatch"} if moe else set()
                assert repeated <= set(seen) and len(seen) > len(plain), seen


# --- GPU tier ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_graph_capture_of_the_dense_block_equals_eager():
    """Forward and backward of the dense parallel block (one GPU: its groups of one) in
    one CUDA graph: after warm-up (the tuner's picks are made there) nothing in the
    step syncs with the host or allocates outside the graph's pool."""
    torch.manual_seed(0)
    cfg = Config(d_model=256, n_heads=4, n_kv_heads=2, d_hidden=512)
    block = ParallelBlock(Block(cfg), cfg, {"tp": None, "cp": None, "ep": None})
    block = block.to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(256, 2, cfg.d_model, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)

    def step(inputs):
        block(inputs).backward(dy)

    eager_x = x.clone().requires_grad_()
    eager_y = block(eager_x)
    eager_y.backward(dy)
    eager = [eager_y.detach(), eager_x.grad, *(p.grad.clone() for p in block.parameters())]
    # Drop the eager graph: while it lives, the parameters' AccumulateGrad nodes keep the
    # default stream they were made on, and the captured backward would sync with it
    # (seen on an H100: cudaErrorStreamCaptureImplicit).
    del eager_y
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
        for _ in range(3):
            block.zero_grad(set_to_none=True)
            step(x.clone().requires_grad_())
    torch.cuda.current_stream().wait_stream(side)
    block.zero_grad(set_to_none=True)
    static_x = x.clone().requires_grad_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = block(static_x)
        static_y.backward(dy)
    graph.replay()
    torch.cuda.synchronize()
    got = [static_y.detach(), static_x.grad, *(p.grad for p in block.parameters())]
    assert _bitwise(eager, got), "the replayed graph differs from eager"


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe-ep1"])
def test_cuda_graph_capture_of_a_whole_training_step_equals_eager(moe):
    """A whole step of the example model on one GPU (groups of one; MoE at EP 1):
    embedding, blocks, head, loss, backward and a capturable AdamW step, captured once
    after a side-stream warm-up (where the tuner picks) and replayed for two steps:
    the same parameters, bit for bit, as two eager steps from the same start. A host
    sync or a data-dependent host branch in the step fails the capture."""
    torch.manual_seed(0)
    cfg = Config(
        vocab=256,
        d_model=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_hidden=256,
        num_experts=4 if moe else 0,
        top_k=2,
    )
    groups = {"tp": None, "cp": None, "ep": None}
    tokens = torch.randint(0, cfg.vocab, (2, 64), device="cuda")
    labels = torch.randint(0, cfg.vocab, (2, 64), device="cuda")

    def fresh():
        torch.manual_seed(1)
        model = ParallelTransformer(Transformer(cfg), groups).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
        return model, optimizer

    def step(model, optimizer):
        optimizer.zero_grad(set_to_none=False)
        model(tokens, labels).backward()
        optimizer.step()

    eager_model, eager_optimizer = fresh()
    for _ in range(2):
        step(eager_model, eager_optimizer)
    model, optimizer = fresh()
    for p in model.parameters():  # gradients allocated before capture, zeroed in place
        p.grad = torch.zeros_like(p)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the tuner's picks, the optimizer's state
        for _ in range(3):
            step(model, optimizer)
    torch.cuda.current_stream().wait_stream(side)
    model.load_state_dict(snapshot)
    for state in optimizer.state.values():  # back to the start: moments and step zeroed
        for value in state.values():
            value.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(model, optimizer)
    model.load_state_dict(snapshot)
    for state in optimizer.state.values():
        for value in state.values():
            value.zero_()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    expected, got = list(eager_model.parameters()), list(model.parameters())
    assert _bitwise(expected, got), "the replayed steps differ from eager"


def test_the_policy_keeps_a_one_rank_layer_when_its_composed_path_is_kept():
    """On one rank `ParallelAttention` and `ParallelSwiGLU` are one op each: a policy
    keeps it when it keeps an op the layer's composed path runs on many ranks."""
    from torch.utils.checkpoint import CheckpointPolicy

    def decide(context_fn, op):
        return context_fn.args[0](None, op)  # the policy inside checkpoint_policy's partial

    layer, mlp = _ops().attention_layer.default, _ops().gated_mlp.default
    saved, recomputed = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    default = fp.checkpoint_policy()  # the projections (communicating ops elsewhere)
    assert decide(default, layer) == decide(default, mlp) == saved
    nothing = fp.checkpoint_policy(save=())
    assert decide(nothing, layer) == decide(nothing, mlp) == recomputed
    attention = fp.checkpoint_policy(save=(), also=("fusedpar::flash_attn",))
    assert (decide(attention, layer), decide(attention, mlp)) == (saved, recomputed)

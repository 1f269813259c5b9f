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
from fusedpar.recompute import COMMUNICATION_OPS
from tests.attention import cases as attention_cases
from tests.elementwise import cases as elementwise_cases
from tests.linear_attention import cases as linear_attention_cases
from tests.linear_attention import conv_cases
from tests.moe import cases as moe_cases
from tests.ring import cases as ring_cases
from tests.tp import cases as tp_cases

SEQ, BATCH = 16, 2


def _ops():
    return torch.ops.fusedpar


# --- opcheck ------------------------------------------------------------------------------


# each family's cases, in turn
OPCHECK_FAMILIES = (
    attention_cases,
    ring_cases,
    tp_cases,
    moe_cases,
    elementwise_cases,
    linear_attention_cases,
    conv_cases,
)


def _opcheck_cases(group: str):
    """(op, args) for every fusedpar custom op, small and random (each family's
    `opcheck_cases`); float inputs require grad so that the autograd registration is
    exercised."""
    return [case for family in OPCHECK_FAMILIES for case in family.opcheck_cases(group)]


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

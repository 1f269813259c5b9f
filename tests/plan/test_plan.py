"""`fusedpar.plan` against the code: what the planner says a rank holds, saves and sends
equals, exactly, what the example model's real step allocates, saves and sends, at one
process and on 4 gloo ranks at TP2 x DP2, TP2 x CP2, CP2 x Ulysses 2, TP2 x CP2 with EP
over tp (and, for saved activations, over cp x tp and dp x tp: EP 4), PP2 x TP2 (1F1B
under selective checkpointing; and Interleaved1F1B with EP over tp), and experts over dp
ranks under FSDP2 (`EP_DP_LAYOUTS`).

- parameters, gradients and AdamW's state: the bytes of the real tensors (AdamW's
  ``step`` is one fp32 scalar a parameter; FSDP2 over dp at DP2 x TP2, a pipeline rank's
  stages at PP2 x TP2);
- the collectives of a training step and the bytes of their tensors, as
  ``fusedpar.testing.Collectives`` counts them (the CPU's shape checks included);
- saved activations of one forward, under each checkpointing policy: the distinct
  storages ``saved_tensors_hooks`` packs plus those selective checkpointing keeps (its
  cache), parameters left out (`fusedpar.testing.SavedActivations`). A MoE rank's rows
  depend on the routing: the planner takes it balanced, so an EP group's sum is what is
  held equal;
- the most saved bytes a rank holds at once in a training step (`check_peaks`): one
  microbatch's without a pipeline, its in-flight microbatches' in one.
"""

import pytest
import torch
from tiny_llama import Config, ParallelTransformer, Transformer
from torch.utils.checkpoint import checkpoint, noop_context_fn

import fusedpar as fp
from fusedpar import plan
from fusedpar.plan.accounting import POLICIES
from fusedpar.testing import SavedActivations
from tests.plan.helpers import check_peaks, held_state
from tests.support import tiny

SEQ, BATCH = 32, 2


def _config(moe: bool, experts: int = 4) -> Config:
    return tiny.config(moe, vocab=96, d_model=64, n_layers=2, d_hidden=96, experts=experts)


class Checkpointed(torch.nn.Module):
    """A block run under ``torch.utils.checkpoint`` with `context_fn`."""

    def __init__(self, block, context_fn):
        super().__init__()
        self.block, self.context_fn = block, context_fn

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False, context_fn=self.context_fn)


def saved_in_forward(model, tokens, labels, policy: str) -> int:
    """Bytes of the distinct storages one forward keeps for its backward under `policy`:
    those saved_tensors_hooks packs, and the outputs selective checkpointing caches."""
    saved = SavedActivations(model.parameters())
    blocks = model.blocks
    if policy != "none":
        wrap = saved.recorded(fp.checkpoint_policy()) if policy == "selective" else noop_context_fn
        model.blocks = torch.nn.ModuleList(Checkpointed(b, wrap) for b in blocks)
    try:
        with saved:
            loss = model(tokens, labels)
    finally:
        model.blocks = blocks
    del loss
    return saved.nbytes


def _measure(kw: dict, moe: bool, ep=None, dtype=torch.float16) -> dict:
    """On each rank: the planner's numbers and the real ones, for the example model at
    the degrees `kw` (one process when empty)."""
    cfg = _config(moe)
    dims = fp.ParallelDims(ep=ep, **kw)
    groups = dims.groups(dims.build_mesh("cpu")) if kw else {"tp": None, "cp": None, "ep": None}
    torch.manual_seed(0)
    model = ParallelTransformer(Transformer(cfg), groups).to(dtype)
    data = torch.randint(0, cfg.vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    got = {policy: saved_in_forward(model, tokens, labels, policy) for policy in POLICIES}
    spec = plan.model_spec(cfg)
    want = {
        policy: plan.activation_bytes(
            spec, dims, seq_len=SEQ, micro_batch=BATCH, dtype=dtype, checkpointing=policy
        )
        for policy in POLICIES
    }
    return {"saved": got, "planned": want}


LAYOUTS = [
    ({"tp": 2, "dp": 2}, False, None),
    ({"cp": 2, "tp": 2}, False, None),
    ({"cp": 2, "ulysses": 2}, False, None),
    ({"cp": 2, "tp": 2}, True, "tp"),
    ({"cp": 2, "tp": 2}, True, ("cp", "tp")),
    ({"dp": 2, "tp": 2}, True, ("dp", "tp")),
]  # EP 4: one expert a rank
EP_GROUPS = {"tp": ((0, 1), (2, 3)), ("cp", "tp"): ((0, 1, 2, 3),), ("dp", "tp"): ((0, 1, 2, 3),)}


def _all_layouts():
    return [_measure(*layout) for layout in LAYOUTS]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_saved_activations_at_one_process(moe, dtype):
    result = _measure({}, moe, dtype=dtype)
    assert result["saved"] == result["planned"]


def test_saved_activations_on_four_ranks(world):
    per_rank = world(4).run(_all_layouts)
    for i, (kw, moe, ep) in enumerate(LAYOUTS):
        results = [rank[i] for rank in per_rank]
        if ep is None:
            for result in results:
                assert result["saved"] == result["planned"], (kw, moe)
        else:  # a rank's rows follow the routing: an EP group's sum is exact
            for policy in POLICIES:
                for group in EP_GROUPS[ep]:
                    got = sum(results[r]["saved"][policy] for r in group)
                    want = sum(results[r]["planned"][policy] for r in group)
                    assert got == want, (kw, policy, group)


def _step(kw: dict, moe: bool, ep=None, schedule=None, policy="none", experts=4) -> dict:
    """On each rank, after two training steps (the blocks checkpointed under `policy`):
    the parameters, gradients and AdamW state it holds, the collectives of the second
    step (`Collectives`) and the most saved bytes it held at once, real and planned."""
    from fusedpar.plan import traffic
    from fusedpar.plan.memory import rank_stages, saved_peaks, state_bytes
    from fusedpar.testing.collectives import Collectives

    cfg = _config(moe, experts)
    cfg.n_layers = 4 if schedule == "Interleaved1F1B" else 2  # one block per stage
    dims = fp.ParallelDims(ep=ep, **kw)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = ParallelTransformer(Transformer(cfg), dims.groups(mesh))
    microbatches = 4 if dims.pp > 1 else 1
    data = torch.randint(0, cfg.vocab, (4, SEQ + 1), generator=torch.Generator().manual_seed(1))
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def context_fn():  # selective checkpointing's cache followed by the step's `saved`
        if policy == "selective":
            return saved.recorded(fp.checkpoint_policy())()
        return noop_context_fn()

    if policy != "none":
        model.blocks = torch.nn.ModuleList(Checkpointed(b, context_fn) for b in model.blocks)
    pp_rank = 0
    if dims.pp > 1:
        pipe = fp.pipeline.split(
            model, dims, mesh, schedule=schedule, microbatches=microbatches, loss_fn=model.loss
        )
        model = fp.distribute(pipe.model, dims.stage_mesh(mesh))
        pp_rank = fp.comm.group_rank(dims.groups(mesh)["pp"])

        def forward_backward():
            pipe.step(tokens, target=labels)
    else:
        model = fp.distribute(model, mesh)
        if dims.dp > 1:  # each block a unit, the root another
            for block in model.blocks:
                dims.fully_shard(block, mesh)
            dims.fully_shard(model, mesh)

        def forward_backward():
            model(tokens, labels).backward()

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for _ in range(2):  # the second step is counted
        saved = SavedActivations(model.parameters())
        with Collectives() as seen, saved:
            forward_backward()
            optimizer.step()
            real_state = held_state(model, optimizer)
            optimizer.zero_grad()
    spec = plan.model_spec(cfg)
    # (every dp rank takes this batch of 4 here)
    z = plan.Local(SEQ, 4 // microbatches, dims.cp, dims.ulysses, dims.tp, dims.ep_size, 4)
    rank = rank_stages(spec, dims, schedule)[pp_rank]
    peak = None  # FSDP2 saves its gathered weights too; EP in a pipeline: `check_peaks`
    if dims.dp == 1 and not (dims.pp > 1 and dims.ep_size > 1):
        views = tokens.nbytes + labels.nbytes if dims.pp > 1 else 0  # the ids and labels (int64)
        peak = (
            saved.peak,
            saved_peaks(spec, dims, z, policy, schedule, microbatches)[pp_rank],
            views,
        )
    ledger = traffic.step(spec, dims, z, rank, microbatches, policy=policy, cpu_checks=True)
    counts, nbytes = ledger.by_group_size()
    state = state_bytes(spec, dims, rank, param_dtype=torch.float32, optimizer="adamw")
    state.pop("numel")
    return {
        "peak": peak,
        "real": (dict(seen.counts), dict(seen.bytes)),
        "planned": (counts, nbytes),
        "real_state": real_state,
        "planned_state": state,
    }


STEP_LAYOUTS = [
    ({"tp": 2, "dp": 2}, False, None, None),
    ({"cp": 2, "tp": 2}, False, None, None),
    ({"cp": 2, "ulysses": 2}, False, None, None),
    ({"cp": 2, "tp": 2}, True, "tp", None),
    ({"pp": 2, "tp": 2}, False, None, "1F1B", "selective"),
    ({"pp": 2, "tp": 2}, True, "tp", "Interleaved1F1B"),
]


def _all_steps():
    return [_step(*layout) for layout in STEP_LAYOUTS]


def test_held_state_collectives_and_bytes_of_a_step(world):
    """Parameters, gradients, AdamW state, collectives: per rank, exactly; with EP the
    all-to-alls' bytes (the routed rows) summed over the ranks (the planner's routing is
    balanced). The most saved bytes a rank held at once: `check_peaks` (not under FSDP2,
    whose gathered weights are saved too, nor with EP in a pipeline)."""
    per_rank = world(4).run(_all_steps)
    for i, layout in enumerate(STEP_LAYOUTS):
        results = [rank[i] for rank in per_rank]
        _check_step(results, layout, ep=layout[2] is not None, per_rank_bytes=False)
        if results[0]["peak"] is not None:
            check_peaks(results, layout, summed=layout[2] is not None)


def _check_step(results, layout, *, ep: bool, per_rank_bytes: bool) -> None:
    """Each rank's state and calls exactly as planned; its bytes exactly without EP;
    with it, the all-to-alls' bytes summed over the ranks (the planner's routing is
    balanced), and with `per_rank_bytes` every other collective's bytes per rank."""
    for result in results:
        assert result["real_state"] == result["planned_state"], layout
        assert result["real"][0] == result["planned"][0], layout
        if not ep:
            assert result["real"][1] == result["planned"][1], layout
        elif per_rank_bytes:
            for key, got in result["real"][1].items():
                if key[0] != "all_to_all":
                    assert got == result["planned"][1].get(key), (layout, key)
    if ep:
        for key in results[0]["real"][1]:
            got = sum(r["real"][1].get(key, 0) for r in results)
            assert got == sum(r["planned"][1].get(key, 0) for r in results), (layout, key)


# Experts over dp ranks (FSDP2 over dp, each block a unit): EP 4 over dp 2 x tp 2 and over
# dp 4, EP 2 over dp 2 beside tp 2 (the experts FSDP2's ignored_params), EP 2 over the
# inner half of dp 4 (each MoE a unit over the outer half, its router summed over the
# inner half first). 8 experts: 2 a rank at EP 4, which FSDP2 over 4 would pad and
# split, as the planner would have wrongly.
EP_DP_LAYOUTS = [
    ({"dp": 2, "tp": 2}, True, ("dp", "tp")),
    ({"dp": 2, "tp": 2}, True, "dp"),  # EP 2 beside tp 2: experts partial over tp
    ({"dp": 4}, True, "dp"),
    ({"dp": 4, "ep_degree": 2}, True, "dp"),
]


def _ep_dp_steps():
    return [_step(kw, moe, ep, experts=8) for kw, moe, ep in EP_DP_LAYOUTS]


def test_experts_over_dp_ranks_state_collectives_and_bytes(world):
    """As `test_held_state_collectives_and_bytes_of_a_step`, with the EP group over dp
    ranks: state and calls per rank, bytes per rank but the all-to-alls' (summed)."""
    per_rank = world(4).run(_ep_dp_steps)
    for i, layout in enumerate(EP_DP_LAYOUTS):
        _check_step([rank[i] for rank in per_rank], layout, ep=True, per_rank_bytes=True)

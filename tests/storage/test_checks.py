"""Mistakes no rank sees alone (`fusedpar.checks`), at 4 ranks: one rank given a shorter
sequence, its activations in fp16, its model cast after `distribute`, a pipeline stage
given another batch: each is a ValueError on every rank of the groups involved, naming
the rank and the values, where gloo aborted or the other ranks waited; a check one rank
fails alone (attention's cu_seqlens, a pipeline batch that does not split) is that rank's
message on every rank; FUSEDPAR_CHECKS=all catches a mismatch at a later call. And no
graph break from the checks: undistributed layers (whose warning used to be raised inside
forward) compile full-graph."""

import os
import re
import warnings

import torch
import torch.distributed as dist
from tiny_llama import Block, Config, ParallelBlock, ParallelTransformer, Transformer

import fusedpar as fp
from fusedpar.testing import exception_of
from tests.support import tiny

CFG = Config(vocab=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_hidden=64)


def _layer_cases() -> dict:
    """Each case on TP2 x CP2 (mesh (dp, cp, tp): rank = 2 cp + tp): {case: the
    exception each rank raised, as (type, message), None where it returned}."""
    rank = dist.get_rank()
    dims = fp.ParallelDims(cp=2, tp=2, ep="tp")
    mesh = dims.build_mesh("cpu")
    g = dims.groups(mesh)
    torch.manual_seed(0)
    attn = fp.nn.ParallelAttention(32, 4, 2, tp_group=g["tp"], cp_group=g["cp"])
    mlp = fp.nn.ParallelSwiGLU(32, 64, g["tp"])
    row = fp.nn.RowParallelLinear(64, 32, g["tp"])
    moe = fp.nn.MoE(32, 16, 4, 2, g["ep"])
    model = fp.distribute(ParallelTransformer(Transformer(CFG), g), mesh)
    x = torch.randn(4, 2, 32)
    cases = {
        # the sequence: 4 local tokens, 3 on rank 2
        "shorter sequence": lambda: attn(x[: 3 if rank == 2 else 4]),
        "fp16 activations": lambda: mlp(x.half() if rank == 1 else x),
        "model cast after distribute": lambda: (model.half() if rank == 1 else model)(*_batch(CFG)),
        "row input": lambda: row(torch.randn(5 if rank == 3 else 4, 2, 32)),
        "moe in fp16": lambda: moe(x.half() if rank == 0 else x),
    }
    out = {name: exception_of(case) for name, case in cases.items()}
    # packed documents: 16 tokens, (4, 1, 32) on each rank; cu_seqlens the same on all
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    documents = {
        "cu_seqlens refused on one rank": [0, 5, 15],
        "other documents on one rank": [0, 7, 16],
    }
    for name, mine in documents.items():
        layer = fp.nn.ParallelAttention(32, 4, 2, tp_group=g["tp"], cp_group=g["cp"])
        given = torch.tensor(mine, dtype=torch.int32) if rank == 2 else cu
        out[name] = exception_of(layer, x[:, :1], cu_seqlens=given)
    col = fp.nn.ColumnParallelLinear(32, 16, g["tp"])
    before = os.environ.get("FUSEDPAR_CHECKS")
    os.environ["FUSEDPAR_CHECKS"] = "all"  # read at call time
    try:
        col(x)  # agreed: checked again at the next call
        out["later call, FUSEDPAR_CHECKS=all"] = exception_of(col, x[: 3 if rank == 3 else 4])
        os.environ["FUSEDPAR_CHECKS"] = "every"
        out["unknown mode"] = exception_of(fp.nn.ColumnParallelLinear(32, 16, g["tp"]), x)
    finally:
        os.environ.pop("FUSEDPAR_CHECKS")
        if before is not None:
            os.environ["FUSEDPAR_CHECKS"] = before
    return {name: e and (type(e).__name__, str(e)) for name, e in out.items()}


def _batch(cfg, batch=2, seq=16):
    return tiny.batch(cfg, 1, batch, seq)


LAYER_CASES = {  # case: (the ranks that raise, what their message says)
    "shorter sequence": (
        range(4),
        r"^ParallelAttention \(over its tp_group, cp_group\): the "
        r"ranks disagree: rank 2 has x \(3, 2, 32\) where ranks 0, 1, 3 have "
        r"x \(4, 2, 32\)",
    ),
    "fp16 activations": (
        (0, 1),
        r"^ParallelSwiGLU .*: rank 1 has x dtype float16 where "
        r"rank 0 has x dtype float32",
    ),
    "model cast after distribute": (
        range(4),
        r"rank 1 has x dtype float16, weight dtype "
        r"float16 where ranks 0, 2, 3 have x dtype float32, "
        r"weight dtype float32",
    ),
    "row input": ((2, 3), r"^RowParallelLinear .*rank 3 has x \(5, 2, 32\) where rank 2 has"),
    "moe in fp16": ((0, 1), r"^MoE \(over its ep_group\).*rank 0 has x dtype float16"),
    "later call, FUSEDPAR_CHECKS=all": ((2, 3), r"rank 3 has x \(3, 2, 32\) where rank 2"),
    "unknown mode": (
        range(4),
        r"FUSEDPAR_CHECKS must be one of \('first', 'all'\), got "
        r"'every'",
    ),
    # a check that one rank fails alone, before the gather: its message on every rank
    "cu_seqlens refused on one rank": (
        range(4),
        r"^rank 2: cu_seqlens must end at the total "
        r"length 16, got 15 \(ranks 0, 1, 3 passed their "
        r"checks; every rank raises this\)$",
    ),
    "other documents on one rank": (
        range(4),
        r"rank 2 has cu_seqlens \(3,\) #[0-9a-f]{6} "
        r"where ranks 0, 1, 3 have cu_seqlens \(3,\) #[0-9a-f]{6}",
    ),
}


def test_what_ranks_disagree_on_is_named_on_every_rank(world):
    results = world(4).run(_layer_cases, timeout=180)  # (a rank left waiting: fails here)
    for case, (raising, match) in LAYER_CASES.items():
        for rank, out in enumerate(results):
            if rank not in raising:
                assert out[case] is None, (case, rank, out[case])
                continue
            assert out[case] is not None and out[case][0] == "ValueError", (case, rank, out)
            assert re.search(match, out[case][1]), (case, rank, out[case][1])
        assert len({out[case] for out in results if out[case] is not None}) <= 1, case


def _pipeline_cases() -> dict:
    """PP2 x TP2 (the first stage on ranks 0, 1), torch's convention: the inputs on the
    first stage's ranks, the target on the last's."""
    dims = fp.ParallelDims(pp=2, tp=2)
    mesh = dims.build_mesh("cpu")
    cfg = Config(vocab=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, d_hidden=16)
    torch.manual_seed(0)
    model = ParallelTransformer(Transformer(cfg), dims.groups(mesh))
    out = {}
    for case, first_batch in (("does not split", 3), ("another batch", 2)):
        pipe = fp.pipeline.split(model, dims, mesh, microbatches=2, loss_fn=model.loss)
        tokens, labels = _batch(cfg, first_batch if pipe.has_first else 4, seq=8)
        given = dict(target=labels) if pipe.has_last else {}
        e = exception_of(pipe.step, *([tokens] if pipe.has_first else []), **given)
        out[case] = e and (type(e).__name__, str(e))
    return out


def test_a_pipeline_stage_given_another_batch_raises_on_every_rank(world):
    """Before: the first stage raised, the last waited in the schedule (gloo's error).
    The same ValueError on every rank, the refusing ranks' message included."""
    expected = {
        "does not split": r"^ranks 0, 1: pipeline step: input 0 \(3, 8\) does not split into "
        r"2 microbatches .* \(ranks 2, 3 passed their checks; every rank "
        r"raises this\)$",
        "another batch": r"different batch sizes \(ranks 0, 1: 2; ranks 2, 3: 4\)",
    }
    results = world(4).run(_pipeline_cases, timeout=180)
    for case, match in expected.items():
        assert len({out[case] for out in results}) == 1, (case, results)
        kind, message = results[0][case]
        assert kind == "ValueError" and re.search(match, message), (case, message)


# --- no graph break from the checks --------------------------------------------------------


class _TPBlock(torch.nn.Module):
    """A Megatron MLP: column-parallel, relu, row-parallel (sequence-parallel)."""

    def __init__(self, group):
        super().__init__()
        self.up = fp.nn.ColumnParallelLinear(32, 64, group)
        self.down = fp.nn.RowParallelLinear(64, 32, group)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _compiled_undistributed() -> list:
    """A TP block at TP 2 and the example's block at TP2 x CP2, never distributed,
    compiled full-graph (any graph break raises) forward and backward; then an eager
    call, which gives the once-per-process warning the compiled calls left out."""
    import fusedpar.storage

    fusedpar.storage._warned_undistributed = False
    groups = fp.ParallelDims(cp=2, tp=2).groups(fp.ParallelDims(cp=2, tp=2).build_mesh("cpu"))
    torch.manual_seed(0)
    blocks = [_TPBlock(groups["tp"]), ParallelBlock(Block(CFG), CFG, groups)]
    x = torch.randn(4, 2, 32, requires_grad=True)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for block in blocks:
            torch.compile(block, fullgraph=True, backend="aot_eager")(x).sum().backward()
        compiled = [str(w.message) for w in caught]
        blocks[0](x)
    torch._dynamo.reset()
    said = [str(w.message) for w in caught if "fusedpar.distribute" in str(w.message)]
    return [compiled, said, [b._fusedpar_checked for b in blocks[0].children()]]


def test_undistributed_layers_compile_full_graph(world):
    for compiled, said, checked in world(4).run(_compiled_undistributed):
        assert not [w for w in compiled if "fusedpar" in w], compiled
        assert len(said) == 1 and "ColumnParallelLinear runs over more than one rank" in said[0]
        assert checked == [True, True]  # the eager call's checks ran, and passed

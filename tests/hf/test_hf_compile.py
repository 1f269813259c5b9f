"""torch.compile(model, fullgraph=True) of a model converted by
`fusedpar.integrations.hf.parallelize` (Llama, Qwen3-MoE): compiled before and after an
eager call, at TP2 x CP2 on 4 gloo ranks (EP over tp for the MoE) and in one process,
the loss and every gradient bit for bit eager's; the eager call runs the first call's
batch check that the compiled calls skip; a padded mask raises inside the graph. The
hybrids (Qwen3.5 dense and MoE: Gated DeltaNet layers among gated attention) likewise,
in one process, their GDN layers' ops custom ops in the one graph (under CP the
recurrence's summaries are an autograd.Function: a graph break, not tested)."""

import pytest
import torch

import fusedpar as fp
from fusedpar.testing import exception_of

transformers = pytest.importorskip(
    "transformers", reason="the [test] extra installs transformers; absent on purpose here"
)
hf = pytest.importorskip("fusedpar.integrations.hf")

from tests.support.hf_models import BATCH, MOE, PADDED, SEQ, VOCAB  # noqa: E402
from tests.support.hf_models import tiny_model as _model  # noqa: E402

COMPILED = {"llama": {}, "qwen3_moe": dict(num_hidden_layers=1, mlp_only_layers=[])}
HYBRID = {"qwen3_5_text": {}, "qwen3_5_moe_text": {}}  # a GDN layer, then gated attention
# the GDN layer's ops, each a node of the compiled graph (not traced into)
GDN_OPS = {
    "fusedpar.causal_conv1d.default",
    "fusedpar.gated_delta_rule.default",
    "fusedpar.rms_norm_gated.default",
}


def _compiled_and_eager(
    family: str, degrees: dict | None, tokenizer: bool = False, orders=("first", "after")
) -> list:
    """A converted model compiled full-graph (aot_eager) before any eager call, then
    called eagerly (its first-call checks run), then compiled afresh: [compiled first ==
    eager, compiled after == eager (loss and every gradient, bit for bit), the batch
    check passed at the eager call]. `tokenizer`: the calls pass a tokenizer's all-ones
    attention_mask and position_ids 0..S-1 too (asserted inside the graph), and a padded
    mask's compiled call is appended: its error's message, or None. `orders`: which
    compiled calls run ("first", "after"); one left out is reported True. Last: for a
    hybrid, whether the graphs called every op of `GDN_OPS` (else None)."""
    model = _model(family, 0, **{**COMPILED, **HYBRID}[family])
    hf.parallelize(model, None if degrees is None else fp.ParallelDims(**degrees))
    layouts = [m._rope_layout_checked for m in model.modules() if hasattr(m, "rope")]
    assert layouts and all(layouts)  # checked at conversion: a compiled call skips it
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    call = dict(input_ids=ids, labels=ids)
    if tokenizer:
        call |= dict(attention_mask=torch.ones_like(ids), position_ids=torch.arange(SEQ)[None])

    def step(forward) -> list:
        model.zero_grad(set_to_none=True)
        loss = forward(**call).loss
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        return [loss.detach(), *(g.to_local() if hasattr(g, "to_local") else g for g in grads)]

    ops = set()

    def backend(graph, inputs):  # aot_eager, noting the ops the graph calls
        ops.update(str(n.target) for n in graph.graph.nodes if n.op == "call_function")
        return torch._dynamo.backends.debugging.aot_eager(graph, inputs)

    # EP > 1 (the MoE at TP2 x CP2): the rows a rank receives are an unbacked size
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch._dynamo.reset()
        if "first" in orders:
            first = step(torch.compile(model, fullgraph=True, backend=backend))
        eager = step(model)
        first = first if "first" in orders else eager
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        after = step(compiled) if "after" in orders else eager
        if tokenizer:
            call["attention_mask"] = PADDED
            padded = exception_of(compiled, **call)
        torch._dynamo.reset()
    checked = getattr(model._fusedpar_batch, "_fusedpar_checked", False)
    same = [all(map(torch.equal, got, eager)) and len(got) == len(eager) for got in (first, after)]
    gdn = GDN_OPS.issubset(ops) if family in HYBRID else None
    return [*same, checked, *([padded and str(padded)] if tokenizer else []), gdn]


@pytest.mark.parametrize("family, order", [("llama", "first"), ("qwen3_moe", "after")])
def test_a_converted_model_compiles_full_graph_before_and_after_an_eager_call(world, family, order):
    """TP2 x CP2 (EP2 over tp for the MoE): the compiled model's loss and gradients are
    eager's bit for bit, compiled before any eager call (llama) or after one (qwen3_moe;
    one process takes both orders for both families: a compile on 4 CPU ranks is ~20 s);
    the eager call ran the batch check that the compiled calls skip."""
    degrees = dict(cp=2, tp=2, ep="tp" if family in MOE else None)
    results = world(4).run(_compiled_and_eager, family, degrees, False, (order,), timeout=600)
    assert results == [[True, True, True, None]] * 4


def test_a_converted_model_compiles_full_graph_in_one_process():
    """dims=None (every group None): both families, compiled before and after an eager
    call, with a tokenizer's mask and positions, bit for bit eager's (no batch check in
    one process); a padded mask raises inside the compiled graph."""
    for family in COMPILED:
        first, after, checked, padded, _ = _compiled_and_eager(family, None, tokenizer=True)
        assert first and after and not checked, family
        assert padded is not None and "takes no padding" in padded, (family, padded)


def test_a_converted_hybrid_compiles_full_graph_in_one_process():
    """Every group None: Qwen3.5 dense compiled before an eager call, its MoE after one,
    bit for bit eager's, the GDN layer's conv, recurrence and gated norm custom ops of
    the one graph (no break: fullgraph), a padded mask raising inside it."""
    for family, order in zip(HYBRID, ("first", "after"), strict=True):
        got = _compiled_and_eager(family, None, tokenizer=True, orders=(order,))
        first, after, checked, padded, gdn = got
        assert first and after and gdn and not checked, family
        assert padded is not None and "takes no padding" in padded, (family, padded)

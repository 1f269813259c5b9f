"""A training step of the example model on one GPU, eager and captured in a CUDA graph.

The host-time side of #29 (`bench/host_overhead.py` counts fusedpar's Python with
launches stubbed): here the whole step runs on the GPU, so where the host cannot keep up
the eager step's time shows it, and the graph's replay does not.

| row                 | what one step runs                                                  |
| ------------------- | ------------------------------------------------------------------- |
| dense / moe, a size | `examples/tiny_llama.py`'s `ParallelTransformer` on groups of one   |
|                     | (MoE at EP 1): embedding, blocks, head, loss, backward and a         |
|                     | capturable AdamW step, bf16                                          |

Columns: ``eager_ms`` (`time_ms` of the step: the GPU's time, gaps where it waited on
the host included), ``plan_ms`` (`fusedpar.plan.estimate`'s step time for the same
model on one GPU of this kind, and ``vs_plan``: eager over it; the planner's time model
has no host time and takes tuned tiles, so the medium size is its check), ``graph_ms``
(the step captured once after a side-stream warm-up, as `tests/test_compile.py`
captures it, and replayed), ``host_ms`` (issuing one eager
step), ``graph_speedup`` (eager over graph). The tiles are the tuner's first candidates
(``FUSEDPAR_TUNING=first`` while this runs): the point is the launch path, not the tile.
"""

import contextlib
import os
import sys
from pathlib import Path

import torch

from bench.common import host_ms, quick, require_gpu, time_ms, write_results

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# (name, d_model, heads, kv heads, hidden, tokens per sequence): "small" is where a
# TP 8 or CP block's share of the work lands (host-bound), "medium" a 1B-class layer.
SIZES = [("small", 512, 8, 2, 1408, 1024), ("medium", 2048, 16, 4, 5632, 4096)]
LAYERS, BATCH, VOCAB, EXPERTS, TOP_K = 2, 2, 32000, 8, 2


def build(moe: bool, size: tuple, device, dtype=torch.bfloat16):
    """(step, model): ``step()`` runs one training step of the example model."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    from tiny_llama import Config, ParallelTransformer, Transformer

    _, d, heads, kv_heads, hidden, seq = size
    cfg = Config(
        vocab=VOCAB,
        d_model=d,
        n_layers=LAYERS,
        n_heads=heads,
        n_kv_heads=kv_heads,
        d_hidden=hidden // 4 if moe else hidden,
        num_experts=EXPERTS if moe else 0,
        top_k=TOP_K,
    )
    torch.manual_seed(0)
    groups = {"tp": None, "cp": None, "ep": None}
    model = ParallelTransformer(Transformer(cfg), groups).to(device=device, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=device.type == "cuda")
    for p in model.parameters():  # gradients allocated once, zeroed in place
        p.grad = torch.zeros_like(p)
    tokens = torch.randint(0, VOCAB, (BATCH, seq), device=device)
    labels = torch.randint(0, VOCAB, (BATCH, seq), device=device)

    def step():
        optimizer.zero_grad(set_to_none=False)
        model(tokens, labels).backward()
        optimizer.step()

    return step, model


def graph_ms(step) -> tuple[float | None, str | None]:
    """``(ms, None)`` of `step` captured once and replayed, or ``(None, reason)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
        torch.cuda.synchronize()
    except Exception as error:  # recorded with its reason, not raised
        torch.cuda.synchronize()
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    try:
        return time_ms(graph.replay), None
    finally:
        del graph


@contextlib.contextmanager
def _first_tiles():
    old = os.environ.get("FUSEDPAR_TUNING")
    os.environ["FUSEDPAR_TUNING"] = "first"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FUSEDPAR_TUNING")
        else:
            os.environ["FUSEDPAR_TUNING"] = old


def planned_ms(moe: bool, size: tuple) -> float | None:
    """`fusedpar.plan`'s estimate of the step `build` makes, on this GPU's kind (None on
    a GPU the planner has no entry for)."""
    import fusedpar as fp
    from fusedpar import plan

    name = torch.cuda.get_device_name().lower()
    kind = next((k for k in plan.DEVICES if k in name), None)
    if kind is None:
        return None
    _, d, heads, kv_heads, hidden, seq = size
    spec = plan.ModelSpec(
        "example",
        VOCAB,
        d,
        LAYERS,
        heads,
        kv_heads,
        d // heads,
        hidden // 4 if moe else hidden,
        num_experts=EXPERTS if moe else 0,
        top_k=TOP_K,
    )
    est = plan.estimate(
        spec,
        fp.ParallelDims(),
        seq_len=seq,
        micro_batch=BATCH,
        param_dtype=torch.bfloat16,
        device=kind,
        memory_margin=10.0,
    )
    return est.step_time_s * 1e3


def measure(device) -> list[dict]:
    rows = []
    sizes = SIZES[:1] if quick() else SIZES
    for size in sizes:
        for moe in (False, True):
            step, model = build(moe, size, device)
            step()  # compiles and picks outside every timing
            eager = time_ms(step, warmup=3, rep=20)
            host = host_ms(step, reps=5)
            graphed, note = graph_ms(step)
            estimate = planned_ms(moe, size)
            rows.append(
                {
                    "plan_ms": estimate,
                    "vs_plan": eager / estimate if estimate else None,
                    "model": "moe-ep1" if moe else "dense",
                    "size": size[0],
                    "d_model": size[1],
                    "tokens": BATCH * size[5],
                    "eager_ms": eager,
                    "graph_ms": graphed,
                    "host_ms": host,
                    "graph_speedup": eager / graphed if graphed else None,
                    "note": note,
                }
            )
            print(
                f"{rows[-1]['model']:8s} {size[0]:7s} eager {eager:.2f} ms, graph "
                f"{graphed if graphed is None else round(graphed, 2)} ms, host {host:.2f} ms"
                f"{'' if note is None else ' (' + note + ')'}"
            )
            del step, model
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    if not require_gpu("step_time"):
        return
    with _first_tiles():
        rows = measure(torch.device("cuda"))
    columns = [
        "model",
        "size",
        "d_model",
        "tokens",
        "eager_ms",
        "plan_ms",
        "vs_plan",
        "graph_ms",
        "host_ms",
        "graph_speedup",
        "note",
    ]

    def plot(ax):
        labels = [f"{r['model']} {r['size']}" for r in rows]
        xs = range(len(rows))
        ax.bar([i - 0.2 for i in xs], [r["eager_ms"] for r in rows], 0.4, label="eager")
        ax.bar([i + 0.2 for i in xs], [r["graph_ms"] or 0 for r in rows], 0.4, label="CUDA graph")
        ax.set_xticks(list(xs), labels, rotation=15)
        ax.set_ylabel("ms per training step")
        ax.set_title("The example model's step, eager and captured")
        ax.legend()

    meta = {
        "layers": LAYERS,
        "batch": BATCH,
        "vocab": VOCAB,
        "experts": EXPERTS,
        "top_k": TOP_K,
        "dtype": "bfloat16",
        "tiles": "FUSEDPAR_TUNING=first",
    }
    write_results("step_time", rows, columns, meta, plot)

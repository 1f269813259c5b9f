"""fp.gated_delta_rule against Hugging Face's torch fallback and flash-linear-attention.

Qwen3.5-35B-A3B's GDN shapes: Hk = 16 key heads, Hv = 32 value heads, K = V = 128, one
sequence (B = 1), q, k, v and beta bf16 (fp32 on a CPU), g fp32, q and k L2-normalized
in the op (``use_qk_l2norm_in_kernel``, as the models call it). T = 4k, 16k and 64k on a
GPU (``BENCH_QUICK=1``: 4k and 16k), 256 and 1024 on a CPU.

| peer             | what runs                                                        |
| ---------------- | ---------------------------------------------------------------- |
| `fusedpar`       | `fp.gated_delta_rule` as a user gets it (``FUSEDPAR_IMPL``)      |
| `fusedpar-torch` | the same on torch's implementation (GPU only: on a CPU it is     |
|                  | `fusedpar`)                                                      |
| `hf`             | transformers' `torch_chunk_gated_delta_rule` (Qwen3-Next)        |
| `fla`            | flash-linear-attention's `chunk_gated_delta_rule`, where it      |
|                  | imports (GPU)                                                    |

Milliseconds of the forward and of the backward (forward + backward less forward; the
final state is not asked for), and fusedpar's speedups over `hf` and `fla` (targets on
an H100: >= 1.0x fla both ways). A peer that fails a point (out of memory, not
installed, not implemented) is null, its reason in the row's ``notes``.
"""

import os
import time

import torch

import fusedpar as fp
from bench.common import environment, quick, time_ms, write_results

HK, HV, HEAD_DIM = 16, 32, 128  # Qwen3.5-35B-A3B's GDN layer
GPU_TOKENS = (4096, 16384, 65536)
CPU_TOKENS = (256, 1024)
PEERS = ("fusedpar", "fusedpar-torch", "hf", "fla")


def _hf():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule


def _fla():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def peer_function(name: str):
    """``fn(q, k, v, g, beta) -> o`` of a peer (raises where it cannot run)."""
    if name in ("fusedpar", "fusedpar-torch"):
        implementation = "torch" if name == "fusedpar-torch" else None

        def ours(*tensors):
            if implementation is None:
                return fp.gated_delta_rule(*tensors, use_qk_l2norm_in_kernel=True)[0]
            with fp.implementation(implementation):
                return fp.gated_delta_rule(*tensors, use_qk_l2norm_in_kernel=True)[0]

        return ours
    peer = _hf() if name == "hf" else _fla()
    return lambda *tensors: peer(*tensors, use_qk_l2norm_in_kernel=True)[0]


def make_inputs(T: int, device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """q, k, v, g, beta as the layer makes them (random projections' outputs), leaves."""
    gen = torch.Generator(device=device).manual_seed(T)

    def randn(*shape, dt=dtype):
        return torch.randn(shape, generator=gen, device=device, dtype=dt)

    q, k = randn(1, T, HK, HEAD_DIM), randn(1, T, HK, HEAD_DIM)
    v = randn(1, T, HV, HEAD_DIM)
    g = -torch.nn.functional.softplus(randn(1, T, HV, dt=torch.float32)) * 0.5  # fp32, < 0
    beta = torch.sigmoid(randn(1, T, HV))
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _cpu_ms(fn, reps: int = 3) -> float:
    """The fastest of `reps` runs after a warm-up: on a shared CPU the others' load only
    ever adds time."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def measure(name: str, inputs, do) -> tuple[float, float]:
    """(forward ms, backward ms) of a peer on `inputs`."""
    fn = peer_function(name)

    def forward():
        with torch.no_grad():
            fn(*inputs)

    def both():
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(do)

    timer = time_ms if inputs[0].is_cuda else _cpu_ms
    fwd = timer(forward)
    return fwd, timer(both) - fwd


def point(T: int, device: str, dtype, peers) -> dict:
    row, notes = {"T": T}, []
    inputs = make_inputs(T, device, dtype)
    do = torch.randn(1, T, HV, HEAD_DIM, device=device, dtype=dtype)
    for name in peers:
        try:
            row[f"{name}_fwd_ms"], row[f"{name}_bwd_ms"] = measure(name, inputs, do)
        except Exception as error:  # recorded per peer: the other peers still run
            row[f"{name}_fwd_ms"] = row[f"{name}_bwd_ms"] = None
            notes.append(f"{name}: {type(error).__name__}: {str(error).splitlines()[0][:100]}")
        if device == "cuda":
            torch.cuda.empty_cache()
    for peer in ("hf", "fla"):
        for side in ("fwd", "bwd"):
            ours, theirs = row.get(f"fusedpar_{side}_ms"), row.get(f"{peer}_{side}_ms")
            row[f"{side}_vs_{peer}"] = theirs / ours if ours and theirs else None
    row["notes"] = "; ".join(notes)
    print({k: v for k, v in row.items() if v is not None and v != ""})
    return row


def main() -> None:
    gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    device = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    tokens = (GPU_TOKENS[:2] if quick() else GPU_TOKENS) if gpu else CPU_TOKENS
    peers = PEERS if gpu else ("fusedpar", "hf")
    meta = {
        **environment(),
        "shape": f"B=1, Hk={HK}, Hv={HV}, K=V={HEAD_DIM}",
        "dtype": f"{str(dtype).removeprefix('torch.')} (g fp32)",
        "timing": "do_bench median (GPU); fastest of 3 after a warm-up (CPU)",
    }
    columns = ["T"]
    columns += [f"{p}_{side}_ms" for p in peers for side in ("fwd", "bwd")]
    columns += [f"{side}_vs_{p}" for p in ("hf", "fla") if p in peers for side in ("fwd", "bwd")]
    columns.append("notes")
    rows = []
    for T in tokens:
        rows.append(point(T, device, dtype, peers))
        write_results("linear_attention", rows, columns, meta, announce=False)

    def plot(ax):
        labels = [str(r["T"]) for r in rows]
        width = 0.8 / (2 * len(peers))
        for i, (name, side) in enumerate((p, s) for p in peers for s in ("fwd", "bwd")):
            ys = [r.get(f"{name}_{side}_ms") or 0.0 for r in rows]
            ax.bar(
                [x + (i - len(peers)) * width for x in range(len(rows))],
                ys,
                width,
                label=f"{name} {side}",
            )
        ax.set_xticks(list(range(len(rows))), labels)
        ax.set_yscale("log")
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel("ms")
        ax.set_title(f"gated delta rule, {meta['shape']}, {meta['device']}")
        ax.legend()

    write_results("linear_attention", rows, columns, meta, plot)


if __name__ == "__main__":
    main()

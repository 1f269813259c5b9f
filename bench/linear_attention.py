"""fp.gated_delta_rule (rows ``op``) and the layer fp.nn.GatedDeltaNet (rows ``layer``)
against Hugging Face's torch fallback and flash-linear-attention (the op only).

Qwen3.5-35B-A3B's GDN: Hk = 16, Hv = 32, K = V = 128, B = 1, bf16 (fp32 on a CPU), g fp32,
q, k L2-normalized in the op. Op: T = 4k, 16k, 64k on a GPU (``BENCH_QUICK=1``: 4k, 16k),
256, 1024 on a CPU. Layer (d 2048, conv 4, TP 1, projections included): T = 4k, 16k on a
GPU; 2k at a quarter of the heads on a CPU.

| peer             | what runs                                                        |
| ---------------- | ---------------------------------------------------------------- |
| `fusedpar`       | `fp.gated_delta_rule` as a user gets it (``FUSEDPAR_IMPL``); the |
|                  | layer: `GatedDeltaNet.from_dense(hf)` on x (S, B, d)             |
| `fusedpar-torch` | the same on torch's implementation (GPU only)                    |
| `hf`             | transformers' `torch_chunk_gated_delta_rule` (Qwen3-Next); the   |
|                  | layer: the `Qwen3_5GatedDeltaNet` module itself on x (B, S, d)   |
| `fla`            | flash-linear-attention's `chunk_gated_delta_rule` (GPU, the op)  |

Milliseconds of the forward and the backward (forward + backward less forward; no final
state; a CPU times the peers in turn, `CPU_ROUNDS` rounds), fusedpar's speedups over `hf`
and `fla` (H100: >= 1.0x fla both ways). A failed peer is null, its reason in ``notes``.
"""

import os
import time

import torch

import fusedpar as fp
from bench.common import environment, quick, time_ms, write_results

HK, HV, HEAD_DIM = 16, 32, 128  # Qwen3.5-35B-A3B's GDN layer
GPU_TOKENS = (4096, 16384, 65536)
CPU_TOKENS = (256, 1024)
# the layer: (d_model, Hk, Hv) by device; head dims HEAD_DIM, conv 4, B = 1, TP 1
LAYER_WIDTH = {"cuda": (2048, 16, 32), "cpu": (512, 4, 8)}  # CPU: a quarter of the heads
LAYER_GPU_TOKENS = (4096, 16384)
LAYER_CPU_TOKENS = (2048,)
PEERS = ("fusedpar", "fusedpar-torch", "hf", "fla")
# CPU timing: rounds of every peer in turn after a warm-up, the fastest of each kept
CPU_ROUNDS = 5


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


def _steps(fn, leaves, do):
    """``(forward, forward + backward)`` of ``fn() -> out`` whose backward of `do` fills
    `leaves`, as two callables."""

    def forward():
        with torch.no_grad():
            fn()

    def both():
        for t in leaves:
            t.grad = None
        fn().backward(do)

    return forward, both


def _note(notes: list, name: str, error: Exception) -> None:
    notes.append(f"{name}: {type(error).__name__}: {str(error).splitlines()[0][:100]}")


def _cpu_interleaved(row: dict, notes: list, peers: dict) -> None:
    """On a CPU: every peer's forward and forward + backward, one peer after the other
    in `CPU_ROUNDS` rounds after a warm-up, the fastest round of each (a shared CPU's
    load only ever adds time, and it comes and goes: interleaving gives every peer the
    same chances at a quiet moment). The backward: the two fastest's difference."""
    steps, best = {}, {}
    for name, (fn, leaves, do) in peers.items():
        try:  # a peer that fails is null, with its reason; the others still run
            steps[name] = _steps(fn, leaves, do)
            for step in steps[name]:
                step()
        except Exception as error:
            steps.pop(name, None)
            row[f"{name}_fwd_ms"] = row[f"{name}_bwd_ms"] = None
            _note(notes, name, error)
    for _ in range(CPU_ROUNDS):
        for name, pair in steps.items():
            for i, step in enumerate(pair):
                start = time.perf_counter()
                step()
                ms = (time.perf_counter() - start) * 1e3
                best[name, i] = min(best.get((name, i), ms), ms)
    for name in steps:
        row[f"{name}_fwd_ms"] = best[name, 0]
        row[f"{name}_bwd_ms"] = best[name, 1] - best[name, 0]


def _timed(row: dict, notes: list, peers: dict) -> None:
    """``row``'s two timings of each of `peers` (name -> (``fn() -> out``, the leaves,
    out's gradient)), or nulls and a note: interleaved on a CPU, one after the other on
    a GPU (``do_bench``)."""
    if not torch.cuda.is_available():
        _cpu_interleaved(row, notes, peers)
        return
    for name, (fn, leaves, do) in peers.items():
        forward, both = _steps(fn, leaves, do)
        try:  # recorded per peer: the other peers still run
            fwd = time_ms(forward)
            row[f"{name}_fwd_ms"], row[f"{name}_bwd_ms"] = fwd, time_ms(both) - fwd
        except Exception as error:
            row[f"{name}_fwd_ms"] = row[f"{name}_bwd_ms"] = None
            _note(notes, name, error)
        torch.cuda.empty_cache()


def _finish(row: dict, notes: list) -> dict:
    for peer in ("hf", "fla"):
        for side in ("fwd", "bwd"):
            ours, theirs = row.get(f"fusedpar_{side}_ms"), row.get(f"{peer}_{side}_ms")
            row[f"{side}_vs_{peer}"] = theirs / ours if ours and theirs else None
    row["notes"] = "; ".join(notes)
    print({k: v for k, v in row.items() if v is not None and v != ""})
    return row


def point(T: int, device: str, dtype, peers) -> dict:
    row, notes = {"what": "op", "T": T}, []
    inputs = make_inputs(T, device, dtype)
    do = torch.randn(1, T, HV, HEAD_DIM, device=device, dtype=dtype)
    runs = {}
    for name in peers:
        try:
            fn = peer_function(name)
        except Exception as error:  # not installed here: null, with its reason
            row[f"{name}_fwd_ms"] = row[f"{name}_bwd_ms"] = None
            _note(notes, name, error)
            continue
        runs[name] = (lambda fn=fn: fn(*inputs), inputs, do)
    _timed(row, notes, runs)
    return _finish(row, notes)


def hf_layer(device: str, dtype: torch.dtype) -> torch.nn.Module:
    """Hugging Face's `Qwen3_5GatedDeltaNet` at `LAYER_WIDTH`'s size (its own init)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    d_model, hk, hv = LAYER_WIDTH[device]
    config = m.Qwen3_5TextConfig(
        hidden_size=d_model,
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=HEAD_DIM,
        linear_value_head_dim=HEAD_DIM,
        linear_conv_kernel_dim=4,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    torch.manual_seed(0)
    return m.Qwen3_5GatedDeltaNet(config, 0).to(device=device, dtype=dtype)


def layer_peers(module: torch.nn.Module, x: torch.Tensor) -> dict:
    """name -> (``fn() -> out``, x's leaf): HF's module on x (B, S, d), ours (TP 1) on
    its sequence-first copy (S, B, d)."""
    layer = fp.nn.GatedDeltaNet.from_dense(module)
    x_sbd = x.detach().transpose(0, 1).contiguous().requires_grad_()  # (S, B, d)

    def ours_torch():
        with fp.implementation("torch"):
            return layer(x_sbd)

    peers = {"fusedpar": (lambda: layer(x_sbd), x_sbd), "hf": (lambda: module(x), x)}
    if x.is_cuda:
        peers["fusedpar-torch"] = (ours_torch, x_sbd)
    return peers


def layer_point(T: int, device: str, dtype) -> dict:
    """Forward and backward (x's and every parameter's gradient) of the layer and HF's."""
    row, notes = {"what": "layer", "T": T}, []
    module = hf_layer(device, dtype)
    gen = torch.Generator(device=device).manual_seed(T)
    d_model = LAYER_WIDTH[device][0]
    x = torch.randn(1, T, d_model, generator=gen, device=device, dtype=dtype)
    do = torch.randn(1, T, d_model, generator=gen, device=device, dtype=dtype)
    runs = {}
    for name, (fn, leaf) in layer_peers(module, x.requires_grad_()).items():
        grad = do if leaf is x else do.transpose(0, 1).contiguous()  # (S, B, d) for ours
        runs[name] = (fn, [leaf], grad)
    _timed(row, notes, runs)
    return _finish(row, notes)


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
        "timing": f"do_bench median (GPU); CPU: the peers interleaved, fastest of {CPU_ROUNDS} "
        "rounds after a warm-up",
    }
    columns = ["what", "T"]
    columns += [f"{p}_{side}_ms" for p in peers for side in ("fwd", "bwd")]
    columns += [f"{side}_vs_{p}" for p in ("hf", "fla") if p in peers for side in ("fwd", "bwd")]
    columns.append("notes")
    rows = []
    for T in tokens:
        rows.append(point(T, device, dtype, peers))
        write_results("linear_attention", rows, columns, meta, announce=False)
    d_model, hk, hv = LAYER_WIDTH[device]
    meta["layer_shape"] = f"B=1, d={d_model}, Hk={hk}, Hv={hv}, K=V={HEAD_DIM}, conv 4, TP 1"
    for T in LAYER_GPU_TOKENS if gpu else LAYER_CPU_TOKENS:
        rows.append(layer_point(T, device, dtype))
        write_results("linear_attention", rows, columns, meta, announce=False)

    def plot(ax):
        labels = [f"{r['what']} {r['T']}" for r in rows]
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
        ax.set_xlabel("op or layer, T (tokens)")
        ax.set_ylabel("ms")
        ax.set_title(f"gated delta rule and GatedDeltaNet, {meta['device']}")
        ax.legend()

    write_results("linear_attention", rows, columns, meta, plot)


if __name__ == "__main__":
    main()

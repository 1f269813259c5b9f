"""The gated delta rule's launchers: every caller's entry (`fusedpar.ops.linear_attention`
and the layers). They check the inputs, then run torch's implementation
(`fusedpar.kernels.linear_attention.torch_impl`) where `fusedpar.kernels.impl.runs_torch`
says so (float64, ``FUSEDPAR_IMPL=torch``, ``auto`` off CUDA), else the Triton kernels
(`fusedpar.kernels.linear_attention.chunk`).

| input           | shape                              | dtype                          |
| --------------- | ---------------------------------- | ------------------------------ |
| q, k            | (B, T, Hk, K), K <= 256            | fp16, bf16, fp32 (or float64)  |
| v               | (B, T, Hv, V), Hv % Hk == 0        | q's                            |
| g (log decay)   | (B, T, Hv) or (B, T, Hv, K)        | any of them                    |
| beta            | (B, T, Hv), any sign and size      | any of them                    |
| initial_state   | (N, Hv, K, V) or None              | any of them                    |
| cu_seqlens      | (N + 1,) int32 with B = 1, or None | N = B without it               |

float64 is all or nothing: with float64 q every float input is float64.
"""

import numbers

import torch
from fusedpar.kernels import impl
from fusedpar.kernels.attention.mask import check_cu_seqlens
from fusedpar.kernels.common import TensorCache, cdiv, check_float_dtype, device_guard
from fusedpar.kernels.linear_attention import torch_impl
from fusedpar.kernels.linear_attention.chunk import chunk_gated_delta_forward
from fusedpar.kernels.linear_attention.chunk_backward import chunk_gated_delta_backward

MAX_HEAD_DIM = 256  # K and V: the kernels hold a (K, V) fp32 state per program

# cu_seqlens tensors whose values the kernels' path has read, per length T: the kernels
# trust them (a document past T would write out of bounds), so each packed batch costs
# one host read, as attention's masks do (the same `TensorCache`), not one per layer
# and step.
_CHECKED_DOCUMENTS = TensorCache(64)


def _check_documents_once(cu_seqlens, T: int, what: str) -> None:
    if _CHECKED_DOCUMENTS.get((cu_seqlens,), (T,)) is not None:
        return
    check_cu_seqlens(cu_seqlens, T, f"{what}: cu_seqlens")
    _CHECKED_DOCUMENTS.put((cu_seqlens,), (T,), True)


def _check_int32_reach(tensors, N: int, what: str) -> None:
    """The kernels address in int32: refuse, naming the sizes, a call whose inputs, chunk
    scratch (B T Hv rows of max(K, V, 64)) or chunk states ((chunks) Hv K V) reach 2**31
    elements (at Qwen3.5's 32 value heads of 128: about 260k tokens in one call)."""
    q, v = tensors[0], tensors[2]
    B, T, _, K = q.shape
    Hv, V = v.shape[-2:]
    chunks = B * cdiv(T, 64) if N == B else cdiv(T, 64) + N  # packed: a part-chunk a document
    sizes = {
        "scratch": B * T * Hv * max(K, V, 64),
        "chunk states": chunks * Hv * K * V,
        **{
            f"input {i}": sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
            for i, t in enumerate(tensors)
        },
    }
    big = {name: size for name, size in sizes.items() if size >= 2**31}
    if big:
        raise ValueError(
            f"{what}: B {B} x T {T} with Hv {Hv}, K {K}, V {V} is past the kernels' int32 "
            f"offsets ({big} elements >= 2**31): split the call's batch or sequence"
        )


def _kernel_state(t):
    """A state (or its gradient) as the kernels read and write it: fp32, contiguous (a
    transposed, expanded or 16-bit one is copied once: (N, Hv, K, V) is small)."""
    return None if t is None else t.to(torch.float32).contiguous()


def _shape(t) -> tuple:
    return tuple(t.shape)


def check_gated_delta_inputs(
    q, k, v, g, beta, *, scale, initial_state, cu_seqlens, what: str = "gated_delta_rule"
) -> None:
    """A clear TypeError or ValueError, naming the sizes, unless the inputs meet the
    contract of the module's table. Reads no tensor's values: cu_seqlens' are read by
    torch's implementation as it runs, and checked once per tensor before the kernels,
    which trust them."""
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    if initial_state is not None:
        named["initial_state"] = initial_state
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a tensor, got {type(t).__name__}")
        check_float_dtype(f"{what}: {name}", t)
    if q.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"{what}: q, k must be (B, T, Hk, K) and v (B, T, Hv, V), got q "
            f"{_shape(q)}, v {_shape(v)}"
        )
    B, T, Hk, K = q.shape
    Hv, V = v.shape[-2:]
    if k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"{what}: k must be q's shape (B, T, Hk, K) and v (B, T, Hv, V) with the same "
            f"B and T, got q {_shape(q)}, k {_shape(k)}, v {_shape(v)}"
        )
    if Hk == 0 or Hv % Hk:
        raise ValueError(
            f"{what}: v's heads Hv = {Hv} must be a multiple of q and k's Hk = {Hk} "
            f"(v-head j reads k-head j // (Hv / Hk))"
        )
    if not (1 <= K <= MAX_HEAD_DIM and 1 <= V <= MAX_HEAD_DIM):
        raise ValueError(f"{what}: head dims K = {K} and V = {V} must be in 1..{MAX_HEAD_DIM}")
    if g.shape not in ((B, T, Hv), (B, T, Hv, K)):
        raise ValueError(
            f"{what}: g must be (B, T, Hv) = {(B, T, Hv)} (a decay per head) or "
            f"(B, T, Hv, K) = {(B, T, Hv, K)} (per channel), got {_shape(g)}"
        )
    if beta.shape != (B, T, Hv):
        raise ValueError(f"{what}: beta must be (B, T, Hv) = {(B, T, Hv)}, got {_shape(beta)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"{what}: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    wide = {name: t.dtype == torch.float64 for name, t in named.items()}
    if any(wide.values()) and not all(wide.values()):
        raise TypeError(
            f"{what}: float64 is computed in float64 throughout: every float input must "
            f"then be float64, got {', '.join(f'{n} {t.dtype}' for n, t in named.items())}"
        )
    devices = {t.device for t in named.values()}
    if cu_seqlens is not None and isinstance(cu_seqlens, torch.Tensor):
        devices.add(cu_seqlens.device)
    if len(devices) > 1:
        raise ValueError(
            f"{what}: every tensor must be on one device, got {sorted(map(str, devices))}"
        )
    N = B
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, T, f"{what}: cu_seqlens", values=False)
        if B != 1:
            raise ValueError(
                f"{what}: with cu_seqlens the documents are packed into one batch row: "
                f"q must be (1, T, Hk, K), got batch {B}"
            )
        N = cu_seqlens.shape[0] - 1
    if initial_state is not None and initial_state.shape != (N, Hv, K, V):
        raise ValueError(
            f"{what}: initial_state must be (N, Hv, K, V) = {(N, Hv, K, V)}, one state per "
            f"{'document' if cu_seqlens is not None else 'sequence'}, got "
            f"{_shape(initial_state)}"
        )
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{what}: scale must be a float, got {type(scale).__name__}")


def gated_delta_forward(q, k, v, g, beta, *, scale, initial_state=None, cu_seqlens=None):
    """``(o, final_state)``: o (B, T, Hv, V) in v's dtype; final_state (N, Hv, K, V) fp32
    (float64 for float64), N = B or the documents of `cu_seqlens`."""
    check_gated_delta_inputs(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    if impl.runs_torch(q):
        return torch_impl.forward(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
        )
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    _check_int32_reach((q, k, v, g, beta), N, "gated_delta_rule")
    if cu_seqlens is not None:
        _check_documents_once(cu_seqlens, q.shape[1], "gated_delta_rule")
    with device_guard(q):
        return chunk_gated_delta_forward(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=_kernel_state(initial_state),
            cu_seqlens=cu_seqlens,
        )


def gated_delta_backward(
    do, dfinal, q, k, v, g, beta, *, scale, initial_state=None, cu_seqlens=None
):
    """``(dq, dk, dv, dg, dbeta, dinit)`` for do (o's gradient, (B, T, Hv, V)) and dfinal
    (the final state's, (N, Hv, K, V), or None): each in its input's dtype, dinit None
    without `initial_state`."""
    what = "gated_delta_backward"
    check_gated_delta_inputs(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        what=what,
    )
    B, T, Hk, K = q.shape
    Hv, V = v.shape[-2:]
    if not isinstance(do, torch.Tensor) or do.shape != (B, T, Hv, V):
        got = _shape(do) if isinstance(do, torch.Tensor) else type(do).__name__
        raise ValueError(f"{what}: do must be o's shape {(B, T, Hv, V)}, got {got}")
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if dfinal is not None and dfinal.shape != (N, Hv, K, V):
        raise ValueError(
            f"{what}: dfinal must be the final state's shape {(N, Hv, K, V)}, got {_shape(dfinal)}"
        )
    if impl.runs_torch(q):
        return torch_impl.backward(
            do,
            dfinal,
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
        )
    _check_int32_reach((q, k, v, g, beta, do), N, what)
    if cu_seqlens is not None:
        _check_documents_once(cu_seqlens, T, what)
    with device_guard(q):
        *grads, dinit = chunk_gated_delta_backward(
            do,
            _kernel_state(dfinal),
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=_kernel_state(initial_state),
            cu_seqlens=cu_seqlens,
        )
    return (*grads, None if dinit is None else dinit.to(initial_state.dtype))

"""Checks shared by every launcher: dtypes, devices, and the interpreter/GPU split; and
`TensorCache`, what a check or a build read off a few tensors, kept for those tensors."""

import contextlib
import functools
import weakref

import torch
from fusedpar.kernels import impl

# What the ops take: Triton's kernels' dtypes (`impl.KERNEL_DTYPES`), and float64 on
# torch's implementation only (`impl.runs_torch`).
FLOAT_DTYPES = (*impl.KERNEL_DTYPES, torch.float64)


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """What the contract keeps in "fp32" for inputs of `dtype` (accumulators, LSEs, ring
    partials, reduce-scatter sums, rstd, RoPE tables, the router's math): float32 for
    fp16, bf16 and fp32; float64 for float64, which is computed in float64 throughout
    (nothing rounds it to fp32). ``torch.promote_types(dtype, torch.float32)``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host ints. Triton 3.9's `triton.cdiv` (and `next_power_of_2`)
    are constexpr functions costing ~1.7 µs of host time a call, dozens per layer."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (0 for n <= 0), as `triton.next_power_of_2`."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def is_interpreted(kernel) -> bool:
    """True when `kernel` was decorated under ``TRITON_INTERPRET=1``.

    ``@triton.jit`` reads the variable once, at decoration time, so this is the only
    reliable answer (the environment may have changed since).
    """
    return type(kernel).__name__ == "InterpretedFunction"


def check_launchable(kernel, *tensors: torch.Tensor) -> None:
    """Raise if `tensors` cannot run `kernel`: mixed devices, or CPU without the interpreter
    (reached only when Triton's kernels were asked for: ``auto`` runs torch on a CPU)."""
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        devices = sorted({str(t.device) for t in tensors})
        raise ValueError(f"all tensors must be on one device, got {devices}")
    if device.type == "cuda":
        return
    if device.type == "cpu" and not is_interpreted(kernel):
        raise RuntimeError(
            "Triton's kernels were asked for (FUSEDPAR_IMPL=triton or "
            "fusedpar.implementation('triton')) on CPU tensors: on a CPU they run in "
            "Triton's interpreter, so set TRITON_INTERPRET=1 before anything imports "
            "triton, or use the torch implementation (FUSEDPAR_IMPL=auto or torch)"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"fusedpar kernels run on CUDA or CPU tensors, got {device}")


def check_float_dtype(name: str, tensor: torch.Tensor, allowed=FLOAT_DTYPES) -> None:
    """TypeError unless `tensor`'s dtype is `allowed`; float64 also under an explicit
    ``triton`` request (`impl.refuse_float64`: its kernels do not take it)."""
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} must be one of {names}, got {tensor.dtype}")
    if tensor.dtype == torch.float64 and impl.requested() == "triton":
        impl.refuse_float64(name)


class TensorCache:
    """The last `size` values computed from tensors (packed documents' cu_seqlens: their
    values checked, their masks built), each kept for the very tensors it came from (the
    same objects, alive, not written since: their version counters) and the call's
    other facts (`key`: lengths, mask, device). A new tensor, even with equal values,
    misses; so does one written in place. So a packed batch costs one host read, not one
    per layer and step (attention's masks, the gated delta rule's documents' check)."""

    def __init__(self, size: int):
        self.size = size
        self.entries: dict[tuple, tuple] = {}

    def get(self, tensors, key: tuple = ()):
        """The value kept for `tensors` (a tuple) and `key`, or None."""
        entry = self.entries.get((*map(id, tensors), *key))
        if entry is None:
            return None
        refs, versions, value = entry
        alive = all(ref() is t for ref, t in zip(refs, tensors, strict=True))
        return value if alive and versions == tuple(t._version for t in tensors) else None

    def put(self, tensors, key: tuple, value) -> None:
        """Keep `value` for `tensors` and `key` (the oldest entry goes past `size`)."""
        full_key = (*map(id, tensors), *key)
        self.entries.pop(full_key, None)
        if len(self.entries) >= self.size:
            self.entries.pop(next(iter(self.entries)))
        refs = tuple(weakref.ref(t) for t in tensors)
        self.entries[full_key] = (refs, tuple(t._version for t in tensors), value)


def fp32_dot_precision() -> str:
    """``tl.dot`` precision for fp32 inputs, following PyTorch's own matmul setting.

    PyTorch computes fp32 matmuls in full fp32 unless the user allows TF32, and users who
    compare against ``torch.matmul`` expect the same from us.
    """
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def device_guard(tensor: torch.Tensor):
    """Make `tensor`'s GPU current while launching: Triton launches on the current device."""
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _capability(device: torch.device) -> tuple[int, int]:
    return _cuda_capability(_index(device))


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def sm_count(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (queried on first use, cached)."""
    return _sm_count(_index(device))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """Whether tiles of these tensors can be read and written through TMA descriptors
    made in the kernel: a 16-byte aligned base, and one unit stride (the last, or the
    first of a 2-D matrix: a transposed view) with 16-byte multiples for the others. On
    CUDA, Hopper or newer (an A100 has no TMA); CPU tensors qualify too, so the
    interpreter runs the TMA path of the kernels (`tl.make_tensor_descriptor` works
    there) and the compile gate builds it."""
    for t in tensors:
        strides = list(t.stride())
        if t.dim() == 2 and strides[-1] != 1 and strides[0] == 1:
            strides.reverse()  # a transposed matrix: read over its rows
        if strides[-1] != 1 or t.data_ptr() % 16:
            return False
        if any(s * t.element_size() % 16 for s in strides[:-1]):
            return False
    device = tensors[0].device
    return device.type == "cpu" or (device.type == "cuda" and _capability(device)[0] >= 9)


def tma_paths(inputs, outputs) -> tuple[bool, bool]:
    """``(inputs through TMA, outputs through TMA)`` for a launch: inputs when they are
    16-bit (fp32 is the FMA correctness path) and `tma_compatible`, outputs (any float
    dtype; none: False) when `tma_compatible`. Sets Triton's allocator when either is."""
    sixteen_bit = all(t.dtype in (torch.float16, torch.bfloat16) for t in inputs)
    reads = sixteen_bit and tma_compatible(*inputs)
    writes = bool(outputs) and tma_compatible(*outputs)
    if reads or writes:
        ensure_tma_allocator(inputs[0].device)
    return reads, writes


def ensure_tma_allocator(device: torch.device) -> None:
    """A kernel that makes TMA descriptors needs global scratch for them, which Triton
    asks of the allocator set with `triton.set_allocator`. Unless the caller set one,
    fusedpar sets one on PyTorch's caching allocator, once per thread (Triton keeps it
    in a context variable: autograd's backward thread starts without)."""
    if device.type != "cuda":
        return
    import triton
    from triton.runtime import _allocation

    current = getattr(_allocation, "_allocator", None)
    if current is None or current.get() is getattr(_allocation, "_NULL_ALLOCATOR", None):
        triton.set_allocator(_torch_scratch)


def _torch_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")

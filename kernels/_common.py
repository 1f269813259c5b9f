"""Checks shared by every launcher: dtypes, devices, and the interpreter/GPU split."""

import contextlib

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_interpreted(kernel) -> bool:
    """True when `kernel` was decorated under ``TRITON_INTERPRET=1``.

    ``@triton.jit`` reads the variable once, at decoration time, so this is the only
    reliable answer (the environment may have changed since).
    """
    return type(kernel).__name__ == "InterpretedFunction"


def check_launchable(kernel, *tensors: torch.Tensor) -> None:
    """Raise if `tensors` cannot run `kernel`: mixed devices, or CPU without the interpreter."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    (device,) = devices
    if device.type == "cpu" and not is_interpreted(kernel):
        raise RuntimeError(
            "CPU tensors run Triton kernels in Triton's interpreter: set TRITON_INTERPRET=1 "
            "before anything imports triton (or move the tensors to a GPU)"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"fusedpar kernels run on CUDA or CPU tensors, got {device}")


def check_float_dtype(name: str, tensor: torch.Tensor, allowed=FLOAT_DTYPES) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} must be one of {names}, got {tensor.dtype}")


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

"""Flash attention: the Triton kernels, their launchers, torch's implementation and the
references, as one subpackage (``fusedpar.kernels.attention``; docs/attention.md).

| module           | holds                                                                      |
| ---------------- | -------------------------------------------------------------------------- |
| `forward`        | the forward kernel (and its merge into ring partials), `attention_forward` |
| `backward`       | the split backward: the dK/dV and dQ kernels and launchers                 |
| `backward_fused` | the fused backward, and `attention_backward`: the choice of the two        |
| `mask`           | masks (`AttentionMask`) as key intervals (`Intervals`), global coordinates |
| `plan`           | the launchers' host side: checks, mask arguments, `Gradients`, the launch  |
| `merge`          | two partials merged through their LSE, and the backward's delta            |
| `torch_impl`     | torch's implementation, and SDPA's kernels as the tuner's candidates       |
| `reference`      | the plain, differentiable PyTorch references of the tests                  |

The names the rest of fusedpar (and its tests and benchmarks) uses are re-exported here;
a module's settings (``backward.SPLIT_BELOW_PROGRAMS``, ``torch_impl.CUDA_SCORES_LIMIT``)
are set on the module itself.
"""

from fusedpar.kernels.attention.backward import (
    attention_backward_dkdv,
    attention_backward_dq,
    backward_configs,
    delta_buffer,
    dq_configs,
    gqa_split,
)
from fusedpar.kernels.attention.backward_fused import (
    FUSED,
    SPLIT,
    attention_backward,
    attention_backward_fused,
    fused_configs,
    transposed_dot_miscompiles,
)
from fusedpar.kernels.attention.forward import attention_forward, forward_configs
from fusedpar.kernels.attention.mask import (
    NO_MASK,
    ORDER_CHUNK,
    AttentionMask,
    Intervals,
    check_cu_seqlens,
    check_softcap,
    check_softmax_scale,
    check_window,
    intervals,
    packed_intervals,
    visible_reference,
    window_sides,
)
from fusedpar.kernels.attention.merge import attention_delta, merge_attention
from fusedpar.kernels.attention.plan import (
    INTERPRETER_MAX_BLOCK,
    NEW_GRADIENTS,
    SOFTCAP_APPROX,
    SOFTCAP_EXACT,
    Gradients,
    check_attention_inputs,
    kernel_modes,
    mask_arguments,
    prune_configs,
    softcap_mode,
)
from fusedpar.kernels.attention.reference import (
    attention_backward_reference,
    attention_reference,
)

__all__ = [
    "FUSED",
    "INTERPRETER_MAX_BLOCK",
    "NEW_GRADIENTS",
    "NO_MASK",
    "ORDER_CHUNK",
    "SOFTCAP_APPROX",
    "SOFTCAP_EXACT",
    "SPLIT",
    "AttentionMask",
    "Gradients",
    "Intervals",
    "attention_backward",
    "attention_backward_dkdv",
    "attention_backward_dq",
    "attention_backward_fused",
    "attention_backward_reference",
    "attention_delta",
    "attention_forward",
    "attention_reference",
    "backward_configs",
    "check_attention_inputs",
    "check_cu_seqlens",
    "check_softcap",
    "check_softmax_scale",
    "check_window",
    "delta_buffer",
    "dq_configs",
    "forward_configs",
    "fused_configs",
    "gqa_split",
    "intervals",
    "kernel_modes",
    "mask_arguments",
    "merge_attention",
    "packed_intervals",
    "prune_configs",
    "softcap_mode",
    "transposed_dot_miscompiles",
    "visible_reference",
    "window_sides",
]

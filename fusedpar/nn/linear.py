"""Megatron-style tensor-parallel linears, with or without sequence parallelism.

| layer                  | weight on each rank              | x -> y, sequence-parallel    |
| ---------------------- | -------------------------------- | ---------------------------- |
| `ColumnParallelLinear` | (out/W, in)                      | (T/W, ..., in) -> (T, ..., out/W) |
| `RowParallelLinear`    | (out, in/W)                      | (T, ..., in/W) -> (T/W, ..., out) |
| `ParallelSwiGLU`       | gate, up (h/W, d); down (d, h/W) | (T/W, ..., d) -> (T/W, ..., d) |

Without sequence parallelism (classic TP) every T/W above is T: the column side takes
the full, replicated x and the row side returns the full, all-reduced y.

With sequence parallelism the column side all-gathers its input and the row side
reduce-scatters its output, in the schedule ``overlap=`` names (None: ``FUSEDPAR_OVERLAP``,
else "auto"; "serial", "ring": `fusedpar.ops.linear`), the partial sums travelling in
``reduce_dtype`` (None: fp32).
Without it (classic TP) the column side is the identity forward and all-reduces dX
backward; the row side all-reduces its output. A column-parallel bias is split like the
output features; a row-parallel bias is whole on every rank and added after the sum.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from fusedpar import checks, comm
from fusedpar.local_params import forward_params
from fusedpar.nn.specs import FromSpec, MLPSpec
from fusedpar.ops.gated_down import gated_down, kernel_activation
from fusedpar.ops.linear import (
    DEFAULT_CHUNKS_PER_RANK,
    all_gather_matmul,
    check_reduce_dtype,
    matmul_reduce_scatter,
)
from fusedpar.ops.mlp import gated_mlp
from fusedpar.ops.overlap import check_overlap
from fusedpar.placement import Placement
from fusedpar.storage import ParamLayout, local_tensor


def _check_divisible(what: str, size: int, world: int) -> None:
    if size % world:
        raise ValueError(f"{what} ({size}) is not divisible by the group size ({world})")


def _dense_init(out_features: int, in_features: int, bias: bool):
    """What ``nn.Linear(in_features, out_features)`` draws, in float32 on the CPU, from the
    current RNG state: every rank, whatever the world size, gets the same full weight."""
    weight = torch.empty(out_features, in_features)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if not bias:
        return weight, None
    bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
    return weight, nn.init.uniform_(torch.empty(out_features), -bound, bound)


def is_conv1d(t) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2 and its kin): a linear layer whose weight is
    stored transposed, (in, out). Recognised without importing transformers."""
    if not isinstance(t, nn.Module) or type(t).__name__ != "Conv1D":
        return False
    weight = getattr(t, "weight", None)
    return weight is not None and tuple(weight.shape) == (getattr(t, "nx", -1), t.nf)


def linear_parts(name: str, t, bias=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (out, in), bias (out,) or None) of a dense linear: an ``nn.Linear``, a
    Hugging Face ``Conv1D`` (its (in, out) weight transposed), or a weight tensor in
    ``nn.Linear``'s (out, in) layout with its `bias` given beside it (a module carries
    its own: a `bias` given for one is an error, never a silent choice)."""
    if isinstance(t, torch.Tensor):
        if bias is not None and (
            not isinstance(bias, torch.Tensor)
            or bias.dim() != 1
            or t.dim() != 2
            or bias.shape[0] != t.shape[0]
        ):
            got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(
                f"the bias of dense {name} must be a ({t.shape[0]},) tensor "
                f"(its {tuple(t.shape)} weight's outputs), got {got}"
            )
        return t, bias
    if isinstance(t, nn.Linear) or is_conv1d(t):
        if bias is not None:
            raise ValueError(
                f"a bias given for dense {name}, a {type(t).__name__} that has "
                f"its own (bias={t.bias is not None}): pass biases only beside "
                f"weight tensors"
            )
        return (t.weight if isinstance(t, nn.Linear) else t.weight.t()), t.bias
    raise TypeError(
        f"dense {name} must be an nn.Linear, a Hugging Face Conv1D or a weight "
        f"tensor (out, in), got {type(t).__name__}"
    )


def linear_weight(module, weight: torch.Tensor) -> torch.Tensor:
    """The inverse of `linear_parts`' weight: `weight` (out, in) as `module` (an
    ``nn.Linear``, or a ``Conv1D`` that stores it (in, out)) holds it."""
    return weight.t() if is_conv1d(module) else weight


def bias_per_weight(what: str, bias, count: int) -> tuple:
    """`from_dense`'s ``bias=``: one bias (a tensor or None) per dense weight, or None
    for none given beside them."""
    if bias is None:
        return (None,) * count
    if isinstance(bias, torch.Tensor) or len(bias) != count:
        raise ValueError(
            f"{what}: bias= takes one bias (a tensor or None) per dense weight, "
            f"{count} in all, beside weight tensors"
        )
    return tuple(bias)


class _ParallelLinear(nn.Module):
    """Shared plumbing: group, sizes, parameter creation, `from_dense`."""

    split_dim: int  # 0: the output features are split (column); 1: the input ones (row)
    GROUP_AXES = {"group": ("tp",)}  # checked by `fusedpar.distribute`
    _fusedpar_checked = False  # until the first call's checks pass (`fusedpar.checks`)

    def __init__(
        self,
        in_features,
        out_features,
        group,
        bias,
        sequence_parallel,
        chunks_per_rank,
        overlap,
        reduce_dtype,
        device,
        dtype,
    ):
        super().__init__()
        self.group = group
        self.world = comm.group_size(group)
        self.rank = comm.group_rank(group)
        split = out_features if self.split_dim == 0 else in_features
        _check_divisible(
            "out_features" if self.split_dim == 0 else "in_features", split, self.world
        )
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = sequence_parallel
        self.chunks_per_rank, self.overlap = chunks_per_rank, check_overlap(overlap)
        self.reduce_dtype = check_reduce_dtype(reduce_dtype)
        shape = [out_features, in_features]
        shape[self.split_dim] //= self.world
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        bias_size = out_features // self.world if self.split_dim == 0 else out_features
        self.bias = nn.Parameter(torch.empty(bias_size, **factory)) if bias else None
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def _shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        return full.chunk(self.world, dim=dim)[self.rank]

    def load_dense(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's part of a full (out, in) weight and (out,) bias."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(
                f"dense weight must be ({self.out_features}, {self.in_features}), "
                f"got {tuple(weight.shape)}"
            )
        if (bias is None) != (self.bias is None):
            raise ValueError("the dense layer and this one must agree on having a bias")
        with torch.no_grad():
            local_tensor(self.weight).copy_(self._shard(weight, self.split_dim))
            if bias is not None:
                local_tensor(self.bias).copy_(self._shard(bias, 0) if self.split_dim == 0 else bias)

    def param_layouts(self) -> dict:
        """For `fusedpar.distribute`: the weight split over the group; the bias split with
        the output features (column), or whole and summed over the group inside the layer
        (row)."""
        bias = (
            ParamLayout(0, self.group)
            if self.split_dim == 0
            else ParamLayout(complete_over=(self.group,))
        )
        return {"weight": ParamLayout(self.split_dim, self.group), "bias": bias}

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialization of the full layer, then this rank's part."""
        self.load_dense(*_dense_init(self.out_features, self.in_features, self.bias is not None))

    @classmethod
    def from_dense(cls, linear, group, *, bias: torch.Tensor | None = None, **kwargs):
        """Shard a dense linear: an ``nn.Linear``, a Hugging Face ``Conv1D``, or a weight
        tensor (out, in) with its `bias` (out,) beside it. The result computes exactly
        the dense layer's function."""
        w, b = linear_parts("linear", linear, bias)
        kwargs.setdefault("device", w.device)
        kwargs.setdefault("dtype", w.dtype)
        device = kwargs.pop("device")
        out_features, in_features = w.shape
        layer = cls(in_features, out_features, group, bias=b is not None, device="meta", **kwargs)
        layer.to_empty(device=device)
        layer.load_dense(w.detach(), None if b is None else b.detach())
        return layer

    def _first_call(self, x: torch.Tensor) -> None:
        """Every rank of the group has x of one shape and dtype, and its weight in one
        dtype (`fusedpar.checks`)."""
        checks.first_call(self, x, {"group": self.group}, checks.alike(x, self.weight))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"world={self.world}, bias={self.bias is not None}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ W.T + b`` with W's output features split over `group`.

    sequence_parallel=True: x (T/W, ..., in) this rank's tokens, all-gathered inside the
    GEMM; y (T, ..., out/W). False: x (T, ..., in) the same on every rank. With
    ``gather_output`` the features are gathered back: y (T, ..., out) on every rank (its
    backward keeps this rank's slice, as the downstream is then replicated).
    """

    split_dim = 0

    def __init__(
        self,
        in_features,
        out_features,
        group=None,
        *,
        bias=True,
        sequence_parallel=True,
        gather_output=False,
        chunks_per_rank=DEFAULT_CHUNKS_PER_RANK,
        overlap=None,
        reduce_dtype=None,
        device=None,
        dtype=None,
    ):
        self.gather_output = gather_output
        super().__init__(
            in_features,
            out_features,
            group,
            bias,
            sequence_parallel,
            chunks_per_rank,
            overlap,
            reduce_dtype,
            device,
            dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._fusedpar_checked:
            self._first_call(x)
        if self.sequence_parallel:
            y = all_gather_matmul(
                x,
                self.weight,
                self.group,
                bias=self.bias,
                chunks_per_rank=self.chunks_per_rank,
                overlap=self.overlap,
                reduce_dtype=self.reduce_dtype,
            )
        else:
            y = F.linear(comm.copy_to_region(x, self.group), self.weight, self.bias)
        return comm.gather_from_region(y, self.group, dim=-1) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """``y = x @ W.T + b`` with W's input features split over `group`.

    x (T, ..., in/W): this rank's slice of the features (a column-parallel output).
    sequence_parallel=True: y (T/W, ..., out), reduce-scattered inside the GEMM; False:
    y (T, ..., out), all-reduced. The bias is whole on every rank and added once.
    """

    split_dim = 1

    def __init__(
        self,
        in_features,
        out_features,
        group=None,
        *,
        bias=True,
        sequence_parallel=True,
        chunks_per_rank=DEFAULT_CHUNKS_PER_RANK,
        overlap=None,
        reduce_dtype=None,
        device=None,
        dtype=None,
    ):
        super().__init__(
            in_features,
            out_features,
            group,
            bias,
            sequence_parallel,
            chunks_per_rank,
            overlap,
            reduce_dtype,
            device,
            dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._fusedpar_checked:
            self._first_call(x)
        if self.sequence_parallel:
            # Each rank adds the bias to its own tokens: its gradient is summed over ranks.
            bias = None if self.bias is None else comm.copy_to_region(self.bias, self.group)
            return matmul_reduce_scatter(
                x,
                self.weight,
                self.group,
                bias=bias,
                chunks_per_rank=self.chunks_per_rank,
                overlap=self.overlap,
                reduce_dtype=self.reduce_dtype,
            )
        y = comm.reduce_from_region(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class ParallelSwiGLU(FromSpec, nn.Module):
    """``down(act(gate(x)) * up(x))`` with the hidden features split over `group`.

    gate and up are column-parallel and share one all-gather of x; down is row-parallel.
    ``act`` is `activation` (SiLU: SwiGLU; ``gelu(approximate="tanh")``: Gemma's GeGLU).
    With ``bias=True``, gate_bias and up_bias (d_hidden/W,) are split like their outputs
    and down_bias (d_model,) is whole, added once. Shapes: x (T/W, ..., d_model) with
    sequence parallelism, (T, ..., d_model) without; the output has x's shape.

    Kept for the backward: x, gate and up; not ``act(gate)`` nor the product fed to
    down, which the backward recomputes (`fusedpar.ops.gated_down`), as the MoE
    experts do.

    Built from these keywords, or ``from_spec(MLPSpec, Placement)`` (`fusedpar.nn.specs`;
    `group` is the placement's ``tp_group``), the same layer either way, which keeps both
    (``self.spec``, ``self.placement``).
    """

    GROUP_AXES = {"group": ("tp",)}  # checked by `fusedpar.distribute`
    READS_FORWARD_PARAMS = True  # through `fusedpar.local_params.forward_params`: no hooks
    SPEC = MLPSpec
    _fusedpar_checked = False  # until the first call's checks pass (`fusedpar.checks`)

    def __init__(
        self,
        d_model,
        d_hidden,
        group=None,
        *,
        bias=False,
        activation=F.silu,
        sequence_parallel=True,
        chunks_per_rank=DEFAULT_CHUNKS_PER_RANK,
        overlap=None,
        reduce_dtype=None,
        device=None,
        dtype=None,
    ):
        placement = Placement(
            tp_group=group,
            sequence_parallel=sequence_parallel,
            chunks_per_rank=chunks_per_rank,
            overlap=overlap,
            reduce_dtype=reduce_dtype,
        )
        spec = MLPSpec(d_model, d_hidden, bias=bias, activation=activation)
        self._build(spec, placement, device, dtype)

    def _build(self, spec: MLPSpec, placement: Placement, device, dtype) -> None:
        """The layer of `spec` on `placement`'s ``tp_group`` (`__init__` and
        `from_spec`): the hidden features over the group checked, then the parameters."""
        super().__init__()  # (cooperative: a subclass's other bases too)
        self.spec, self.placement = spec, placement
        group, self.activation = placement.tp_group, spec.activation
        self.group = group
        self.overlap, self.reduce_dtype = placement.overlap, placement.reduce_dtype
        self.world, self.rank = comm.group_size(group), comm.group_rank(group)
        d_model, d_hidden = spec.d_model, spec.d_hidden
        _check_divisible("d_hidden", d_hidden, self.world)
        self.d_model, self.d_hidden = d_model, d_hidden
        self.sequence_parallel = placement.sequence_parallel
        self.chunks_per_rank = placement.chunks_per_rank
        local, factory = d_hidden // self.world, {"device": device, "dtype": dtype}
        self.gate_weight = nn.Parameter(torch.empty(local, d_model, **factory))
        self.up_weight = nn.Parameter(torch.empty(local, d_model, **factory))
        self.down_weight = nn.Parameter(torch.empty(d_model, local, **factory))
        biases = (local, local, d_model) if spec.bias else (None, None, None)
        for name, size in zip(("gate_bias", "up_bias", "down_bias"), biases, strict=True):
            param = None if size is None else nn.Parameter(torch.empty(size, **factory))
            self.register_parameter(name, param)
        if self.gate_weight.device.type != "meta":
            self.reset_parameters()

    def load_dense(self, w_gate, w_up, w_down, *, bias=None) -> None:
        """Copy this rank's part of full weights: gate, up (d_hidden, d_model); down
        (d_model, d_hidden), as tensors (their biases in ``bias=(gate, up, down)``),
        ``nn.Linear``s or ``Conv1D``s; with biases if and only if this layer has them
        (a bias is never dropped)."""
        hidden_first = (self.d_hidden, self.d_model)
        copies = []  # (parameter, this rank's part)
        biases = bias_per_weight("ParallelSwiGLU", bias, 3)
        specs = (
            ("gate", w_gate, hidden_first, 0),
            ("up", w_up, hidden_first, 0),
            ("down", w_down, hidden_first[::-1], 1),
        )
        for (name, dense, shape, dim), given in zip(specs, biases, strict=True):
            weight, bias = linear_parts(name, dense, given)
            weight = weight.detach()
            if weight.shape != shape:
                raise ValueError(f"w_{name} must be {shape}, got {tuple(weight.shape)}")
            param_bias = getattr(self, f"{name}_bias")
            if (bias is None) != (param_bias is None):
                has = "a" if bias is not None else "no"
                raise ValueError(
                    f"dense {name} has {has} bias but this ParallelSwiGLU was built "
                    f"with bias={param_bias is not None}"
                )
            copies.append(
                (getattr(self, f"{name}_weight"), weight.chunk(self.world, dim)[self.rank])
            )
            if bias is not None:
                part = bias.detach() if dim else bias.detach().chunk(self.world)[self.rank]
                copies.append((param_bias, part))
        with torch.no_grad():
            for param, part in copies:
                local_tensor(param).copy_(part)

    def param_layouts(self) -> dict:
        """For `fusedpar.distribute`: the hidden features split over the group; the down
        bias whole, summed over the group inside the layer."""
        column, row = ParamLayout(0, self.group), ParamLayout(1, self.group)
        return {
            "gate_weight": column,
            "up_weight": column,
            "down_weight": row,
            "gate_bias": column,
            "up_bias": column,
            "down_bias": ParamLayout(complete_over=(self.group,)),
        }

    def reset_parameters(self) -> None:
        """As ``nn.Linear(d, h)`` twice then ``nn.Linear(h, d)``, with this layer's bias."""
        bias = self.gate_bias is not None
        d, h = self.d_model, self.d_hidden
        self.load_dense(
            nn.Linear(d, h, bias=bias), nn.Linear(d, h, bias=bias), nn.Linear(h, d, bias=bias)
        )

    @classmethod
    def from_dense(cls, w_gate, w_up, w_down, group, *, bias=None, **kwargs):
        """Shard dense weights: ``nn.Linear``s, ``Conv1D``s, or tensors with their biases
        in ``bias=(gate, up, down)`` (tensors or None). ``bias=True/False`` is the
        layer's own flag, read off the dense weights when left out (and then must
        agree)."""
        flag = bias if isinstance(bias, bool) else None
        biases = None if isinstance(bias, bool) else bias
        given = bias_per_weight("ParallelSwiGLU.from_dense", biases, 3)
        w_gate_t, gate_bias = linear_parts("gate", w_gate, given[0])
        kwargs["bias"] = gate_bias is not None if flag is None else flag
        kwargs.setdefault("dtype", w_gate_t.dtype)
        device = kwargs.pop("device", w_gate_t.device)
        d_hidden, d_model = w_gate_t.shape
        mlp = cls(d_model, d_hidden, group, device="meta", **kwargs)
        mlp.to_empty(device=device)
        mlp.load_dense(w_gate, w_up, w_down, bias=biases)
        return mlp

    def _one_op_activation(self) -> str | None:
        """The activation's kernel name where the forward is one op (on one rank, an
        activation with a kernel: `fusedpar.ops.mlp`), else None; kept with the
        activation and group it was worked out for (~2 µs a call otherwise)."""
        activation, group = self.activation, self.group
        kept = self.__dict__.get("_one_op_of")
        if kept is None or kept[0] is not activation or kept[1] is not group:
            one_rank = comm.active_group(group) is None
            kept = (activation, group, kernel_activation(activation) if one_rank else None)
            self.__dict__["_one_op_of"] = kept
        return kept[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._fusedpar_checked:  # one shape and dtype over the group (fusedpar.checks)
            checks.first_call(self, x, {"group": self.group}, checks.alike(x, self.gate_weight))
        activation = self._one_op_activation()
        # after fusedpar.distribute: the local tensors, or the DTensors for the one op
        params = forward_params(self, x if activation is not None else None)
        gate_weight, up_weight = params["gate_weight"], params["up_weight"]
        down_weight, down_bias = params["down_weight"], params["down_bias"]
        gate_bias, up_bias = params["gate_bias"], params["up_bias"]
        if activation is not None:  # one rank: the whole MLP as one op
            if x.shape[-1] != self.d_model:
                raise ValueError(
                    f"ParallelSwiGLU: x must be (..., {self.d_model}), got {tuple(x.shape)}"
                )
            if x.dtype != gate_weight.dtype:
                raise TypeError(
                    f"ParallelSwiGLU: x is {x.dtype} but the weights are {gate_weight.dtype}"
                )
            biases = () if gate_bias is None else (gate_bias, up_bias, down_bias)
            return gated_mlp(x, gate_weight, up_weight, down_weight, biases, activation=activation)
        weights, biases = [gate_weight, up_weight], [gate_bias, up_bias]
        down = {
            "activation": self.activation,
            "chunks_per_rank": self.chunks_per_rank,
            "overlap": self.overlap,
            "reduce_dtype": self.reduce_dtype,
        }
        if self.sequence_parallel:
            gate, up = all_gather_matmul(
                x,
                weights,
                self.group,
                bias=biases,
                chunks_per_rank=self.chunks_per_rank,
                overlap=self.overlap,
                reduce_dtype=self.reduce_dtype,
            )
            # Each rank adds the down bias to its own tokens: its gradient is summed.
            bias = None if down_bias is None else comm.copy_to_region(down_bias, self.group)
            return gated_down(gate, up, down_weight, self.group, bias=bias, **down)
        x = comm.copy_to_region(x, self.group)
        gate, up = (F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))
        partial = gated_down(gate, up, down_weight, self.group, sequence_parallel=False, **down)
        y = comm.reduce_from_region(partial, self.group)
        return y if down_bias is None else y + down_bias

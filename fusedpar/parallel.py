"""The device-mesh entry point: parallel degrees, validated once, and their groups.

    dims = fp.ParallelDims(dp=1, cp=2, tp=2, ep="tp")
    dims.validate(world_size, n_heads=8, n_kv_heads=4, num_experts=8, seq_len=256)
    mesh = dims.build_mesh("cpu")        # axes ("dp", "cp", "tp")
    groups = dims.groups(mesh)           # {"dp", "cp", "tp", "ep"; "ulysses": None}
    placement = dims.placement(mesh)     # fp.Placement: the layers' groups and cp_mode

Mesh axes, outermost first: (pp, dp, cp, ulysses, tp), "pp" and "ulysses" only with a
degree > 1. "cp" is the ring (`fusedpar.ring_attn`), "ulysses" the head all-to-all
(`fusedpar.ulysses_attn`), both > 1 the 2-D hybrid; `cp_mode` names which. Under pp a
rank's groups are its stage's, and `stage_mesh` is the sub-mesh its parameters live on.
`validate` runs no collective: a bad configuration fails on every rank, naming the
degree. `fully_shard` applies FSDP2 over "dp" (torch >= 2.12: ``dp_mesh_dims``; 2.11:
the other axes' mesh, FSDP2's TP path). EP runs over one axis or a run of them
(``("dp", "tp")``), never pp; ``ep_degree`` below their product takes the inner part of
dp, which the mesh then holds as two axes (`DP_PARTS`, "dp" their flattened mesh).
Experts split over dp ranks have their gradients scaled and reduced over the dp ranks
holding the same experts only (`fusedpar.storage`; docs/expert_parallel.md).
"""

import math
import warnings
from dataclasses import dataclass
from itertools import combinations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from fusedpar.axes import AXES, DATA_AXES, DP_PARTS, OPTIONAL_AXES, names_of, resolve_axes
from fusedpar.pipeline import check_pipeline
from fusedpar.placement import Placement
from fusedpar.storage import reduce_grad, retire_replaced

_meshes: dict[tuple, tuple] = {}  # (device type, degrees) -> (default group, mesh)
_stage_meshes: dict[int, tuple] = {}  # id(mesh) -> (mesh, its stage's sub-mesh)
_warned_dp1 = False  # `ParallelDims.fully_shard` skipped at dp = 1, said once


def _default_group():
    return dist.group.WORLD


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees (see the module doc). ``names``: fusedpar's axes -> the mesh's
    names (a dict; kept as sorted pairs, so ParallelDims stays hashable). ``ep``: the
    axes experts split over, in mesh order; ``ep_degree`` (None: their product) may be
    smaller where ``ep`` holds dp: the EP group then takes ``ep_degree / (its other
    axes)`` inner dp ranks (DeepSeek-V3: ``ParallelDims(pp=16, dp=128, ep="dp",
    ep_degree=64)``)."""

    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: str | tuple[str, ...] | None = None
    ulysses: int = 1
    pp: int = 1
    names: tuple = ()
    ep_degree: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "names", names_of(self.names))

    def mesh_name(self, axis: str) -> str:
        """The mesh's name of fusedpar's `axis` ("tp" unless ``names`` maps it)."""
        return dict(self.names).get(axis, axis)

    def axes_of(self, mesh: DeviceMesh, *, stage: bool = False) -> dict[str, str]:
        """{fusedpar's axis: the mesh's name} for `mesh` (`resolve_axes`), checked against
        these degrees: an axis of the mesh whose size is not its degree, or an axis of
        more than one rank the mesh leaves out, raises ValueError. `stage`: `mesh` may be
        a pipeline stage's sub-mesh (no "pp")."""
        whole = len(mesh.mesh_dim_names or ()) == len(self.mesh_axes) or not stage
        axes = resolve_axes(mesh, self.names, self.mesh_axes if whole else self.stage_axes)
        for axis, name in axes.items():
            size = mesh.size(mesh.mesh_dim_names.index(name))
            if size != self.degree(axis):
                raise ValueError(
                    f"the mesh's axis {name!r} ({axis}) has {size} ranks, but "
                    f"{axis} = {self.degree(axis)}: build the mesh from these "
                    "degrees (dims.build_mesh)"
                )
        missing = [
            axis
            for axis in self.mesh_axes
            if axis not in axes and self.degree(axis) > 1 and not (stage and axis == "pp")
        ]
        if missing:
            raise ValueError(
                f"the mesh's axes {tuple(mesh.mesh_dim_names)} leave out "
                f"{', '.join(f'{a} ({self.degree(a)} ranks)' for a in missing)}"
                ": build the mesh from these degrees (dims.build_mesh)"
            )
        return axes

    def degree(self, axis: str) -> int:
        """The ranks along `axis`: one of fusedpar's `AXES`, or a part of dp (`DP_PARTS`:
        "dp_mod_ep" = dp / `ep_dp`, "dp_in_ep" = `ep_dp`)."""
        if axis == "dp_in_ep":
            return self.ep_dp
        if axis == "dp_mod_ep":
            return self.dp // self.ep_dp
        return getattr(self, axis)

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The mesh's axes: "pp" and "ulysses" only with a degree > 1; dp as its two parts
        (`DP_PARTS`) where the EP groups take part of it (`splits_dp`)."""
        axes = []
        for axis in AXES:
            if axis in OPTIONAL_AXES and getattr(self, axis) == 1:
                continue
            axes.extend(DP_PARTS if axis == "dp" and self.splits_dp else (axis,))
        return tuple(axes)

    @property
    def splits_dp(self) -> bool:
        """Whether the EP groups take some but not all of dp's ranks (`ep_degree`)."""
        return 1 < self.ep_dp < self.dp

    @property
    def stage_axes(self) -> tuple[str, ...]:
        """The axes of one pipeline stage's sub-mesh: all but "pp"."""
        return tuple(axis for axis in self.mesh_axes if axis != "pp")

    @property
    def cp_mode(self) -> str:
        """How attention runs over the sequence's ranks: "ring", "ulysses" or "hybrid"."""
        if self.ulysses > 1:
            return "hybrid" if self.cp > 1 else "ulysses"
        return "ring"

    @property
    def ep_axes(self) -> tuple[str, ...]:
        if self.ep is None:
            return ()
        return (self.ep,) if isinstance(self.ep, str) else tuple(self.ep)

    @property
    def ep_size(self) -> int:
        """The ranks of an EP group: ``ep_degree``, or the product of the ep axes."""
        if self.ep_degree is not None:
            return self.ep_degree
        return math.prod(getattr(self, axis) for axis in self.ep_axes)

    @property
    def ep_dp(self) -> int:
        """The dp ranks inside one EP group: 1 where ep leaves dp out, all of dp by
        default, ``ep_degree / (the other ep axes)`` with ``ep_degree``."""
        if "dp" not in self.ep_axes:
            return 1
        others = math.prod(getattr(self, axis) for axis in self.ep_axes if axis != "dp")
        return self.ep_size // others

    def validate(
        self,
        world_size: int,
        *,
        n_heads=None,
        n_kv_heads=None,
        num_experts=None,
        seq_len=None,
        cp_layout="zigzag",
        n_layers=None,
        microbatches=None,
        schedule="1F1B",
    ) -> None:
        """Raise ValueError naming the offending degree. No communication. With pp > 1
        and `n_layers`: the pipeline too (`fusedpar.pipeline.check_pipeline`: the
        schedule, layers per stage, microbatches; None: one per stage)."""
        for axis in AXES:
            degree = getattr(self, axis)
            if not isinstance(degree, int) or degree < 1:
                raise ValueError(f"the {axis} degree must be a positive int, got {degree!r}")
        if self.pp * self.dp * self.cp * self.ulysses * self.tp != world_size:
            pp = f"pp ({self.pp}) x " if self.pp > 1 else ""
            ulysses = f" x ulysses ({self.ulysses})" if self.ulysses > 1 else ""
            raise ValueError(
                f"{pp}dp ({self.dp}) x cp ({self.cp}){ulysses} x tp ({self.tp}) = "
                f"{self.pp * self.dp * self.cp * self.ulysses * self.tp}, but the world has "
                f"{world_size} ranks"
            )
        self._validate_ep()
        if n_heads is not None and n_heads % self.tp:
            raise ValueError(f"n_heads ({n_heads}) is not divisible by the tp degree ({self.tp})")
        # KV heads split over tp, or (tp a multiple of them) each replicated on tp / n_kv_heads
        # ranks: `fusedpar.nn.attention.kv_heads_per_rank`'s rule and message
        if n_kv_heads is not None and n_kv_heads % self.tp and self.tp % n_kv_heads:
            raise ValueError(
                f"n_kv_heads ({n_kv_heads}) and the TP degree ({self.tp}): one must divide the "
                "other (KV heads split over TP, or each replicated on TP / n_kv_heads ranks)"
            )
        if n_heads is not None and (n_heads // self.tp) % self.ulysses:
            raise ValueError(
                f"n_heads ({n_heads}) is not divisible by tp ({self.tp}) x "
                f"ulysses ({self.ulysses}): each Ulysses rank needs whole "
                f"query heads"
            )
        if n_kv_heads is not None and self.ulysses > 1:
            per_tp = max(1, n_kv_heads // self.tp)  # (replicated: one KV head a tp rank)
            if per_tp % self.ulysses and self.ulysses % per_tp:
                raise ValueError(
                    f"n_kv_heads ({n_kv_heads}) / tp ({self.tp}) = {per_tp} KV heads per tp "
                    f"rank must divide by the ulysses degree ({self.ulysses}) or divide it "
                    f"(then they are replicated)"
                )
        if self.pp > 1 and n_layers is not None:
            check_pipeline(schedule, self.pp, n_layers, microbatches)
        if num_experts is not None and num_experts % self.ep_size:
            raise ValueError(
                f"num_experts ({num_experts}) is not divisible by the ep degree "
                f"({self.ep_size}, over {'x'.join(self.ep_axes)})"
            )
        if seq_len is not None:
            chunks = self.cp * (2 if cp_layout == "zigzag" else 1)
            if seq_len % chunks:
                raise ValueError(
                    f"seq_len ({seq_len}) is not divisible by {chunks} (the cp "
                    f"degree {self.cp} under the {cp_layout} layout)"
                )
            per_cp = seq_len // self.cp
            if per_cp % self.ulysses:
                raise ValueError(
                    f"each cp rank's {per_cp} tokens are not divisible by the "
                    f"ulysses degree ({self.ulysses})"
                )
            if (per_cp // self.ulysses) % self.tp:
                per_rank = per_cp // self.ulysses
                raise ValueError(
                    f"each cp{' x ulysses' if self.ulysses > 1 else ''} rank's "
                    f"{per_rank} tokens are not divisible by the tp degree "
                    f"({self.tp}) for sequence parallelism"
                )

    def _validate_ep(self) -> None:
        """The ep axes (known, in mesh order, not pp) and ``ep_degree`` (takes whole
        inner dp ranks: the other ep axes times a divisor of dp above 1)."""
        for axis in self.ep_axes:
            if axis not in AXES:
                raise ValueError(f"ep runs over mesh axes {AXES}, got {self.ep!r}")
        if "pp" in self.ep_axes:
            raise ValueError(
                "ep over pp: the pipeline stages hold different layers, so their "
                "experts cannot be one layer's: run ep over dp, cp, ulysses and/or tp"
            )
        order = sorted(self.ep_axes, key=AXES.index)
        if list(self.ep_axes) != order or len(set(order)) != len(order):
            raise ValueError(f"ep={self.ep!r}: name each axis once, in mesh order ({tuple(order)})")
        if self.ep_degree is None:
            return
        if not isinstance(self.ep_degree, int) or self.ep_degree < 1:
            raise ValueError(f"ep_degree must be a positive int, got {self.ep_degree!r}")
        product = math.prod(getattr(self, axis) for axis in self.ep_axes)
        if "dp" not in self.ep_axes:
            if self.ep_degree != product:
                raise ValueError(
                    f"ep_degree ({self.ep_degree}) below the product of ep={self.ep!r} "
                    f"({product}) takes part of dp: ep must name dp"
                )
            return
        others = product // self.dp
        if self.ep_degree % others or self.dp % (self.ep_degree // others):
            raise ValueError(
                f"ep_degree ({self.ep_degree}) must be the other ep axes' {others} ranks "
                f"times a divisor of dp ({self.dp}): an EP group takes whole inner dp ranks"
            )
        if self.ep_degree == others:
            raise ValueError(f"ep_degree ({self.ep_degree}) takes no dp rank: leave dp out of ep")

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """``init_device_mesh(device_type, degrees, mesh_dim_names=...)``: the axes
        `mesh_axes` under their mesh names (``names``), with the flattened meshes of its
        split axes (e.g. "cp_tp") made too.

        The same mesh object for the same degrees while the default process group lives:
        FSDP2 requires the parameters' mesh to *be* the mesh it is given, and DTensor's
        operator cache hands out the specs of an equal mesh built earlier in the
        process (a second model built in a test pool or a notebook failed there)."""
        self.validate(dist.get_world_size())
        degrees = tuple(self.degree(axis) for axis in self.mesh_axes)
        names = tuple(self.mesh_name(axis) for axis in self.mesh_axes)
        key = (device_type, *degrees, *names)
        cached = _meshes.get(key)
        if cached is not None and cached[0] is _default_group():
            return cached[1]
        mesh = init_device_mesh(device_type, degrees, mesh_dim_names=names)
        # DTensor sums a gradient partial over several axes (cp and tp, say) in one
        # collective, rather than one per axis, only where their flattened mesh exists.
        split = [self.mesh_name(axis) for axis in self.stage_axes if self.degree(axis) > 1]
        for count in range(2, len(split) + 1):
            for axes in combinations(split, count):
                if axes != tuple(self.mesh_name(part) for part in DP_PARTS):
                    mesh[axes]._flatten("_".join(axes))
        if self.splits_dp:  # every dp rank, as one axis: the dense parameters' data parallelism
            mesh[tuple(self.mesh_name(part) for part in DP_PARTS)]._flatten(self.mesh_name("dp"))
        _meshes[key] = (_default_group(), mesh)
        return mesh

    def stage_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The sub-mesh of this rank's pipeline stage (`mesh` without "pp"): where
        `fusedpar.distribute` and `fully_shard` put a stage's parameters. `mesh` itself
        without pipeline parallelism. The same object for the same mesh, as `build_mesh`
        (FSDP2 and DTensor's operator cache need one)."""
        axes = self.axes_of(mesh, stage=True)
        if "pp" not in axes:
            return mesh
        cached = _stage_meshes.get(id(mesh))
        if cached is None or cached[0] is not mesh:
            rest = tuple(name for axis, name in axes.items() if axis != "pp")
            cached = _stage_meshes[id(mesh)] = (mesh, mesh[rest])
        return cached[1]

    def groups(self, mesh: DeviceMesh) -> dict:
        """1-D meshes per axis, by fusedpar's names (this rank's: a stage's groups under
        pipeline parallelism), and "ep" (None without expert parallelism); None for an
        axis of one rank the mesh leaves out; "dp" every dp rank where the mesh holds dp
        as two axes (`splits_dp`; ep then takes the inner one). The mesh's axes are
        checked first (`axes_of`): unknown names or sizes other than the degrees raise
        ValueError."""
        axes = self.axes_of(mesh)
        groups = {axis: mesh[axes[axis]] if axis in axes else None for axis in AXES}
        if self.splits_dp:  # (the flattened mesh itself: slicing it from the root is deprecated)
            parts = tuple(axes[part] for part in DP_PARTS)
            groups["dp"] = mesh[parts]._flatten(self.mesh_name("dp"))
        ep_axes = [DP_PARTS[1] if a == "dp" and self.splits_dp else a for a in self.ep_axes]
        ep = tuple(axes.get(axis) for axis in ep_axes)
        if None in ep:
            groups["ep"] = None  # over an axis of one rank the mesh leaves out
        elif len(ep) == 1:
            groups["ep"] = mesh[ep[0]]
        elif ep:
            groups["ep"] = mesh[ep]._flatten("_".join(ep))
        else:
            groups["ep"] = None
        return groups

    def placement(self, mesh: DeviceMesh, **options) -> Placement:
        """The `fusedpar.Placement` of this rank's layers on `mesh`: the tp, cp, ulysses
        and ep groups of `groups` and `cp_mode`; `options` are its other fields
        (``cp_layout``, ``sequence_parallel``, ``chunks_per_rank``, ``overlap``,
        ``reduce_dtype``)."""
        groups = self.groups(mesh)
        return Placement(
            tp_group=groups["tp"],
            cp_group=groups["cp"],
            ulysses_group=groups["ulysses"],
            ep_group=groups["ep"],
            cp_mode=self.cp_mode,
            **options,
        )

    def fully_shard(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        *,
        dp_mesh_dims: bool | None = None,
        **fsdp_kwargs,
    ):
        """FSDP2 (``torch.distributed.fsdp.fully_shard``) over the "dp" axis of `mesh`, for
        a module whose parameters `fusedpar.distribute` put on `mesh`. Call it bottom-up
        like ``fully_shard`` (blocks, then the root); ``fsdp_kwargs`` go through.

        ``dp_mesh_dims`` (default: when torch has it, >= 2.12): the parameters stay on the
        full mesh. Otherwise (torch 2.11) each parameter still on the full mesh moves to
        the mesh of its other axes of more than one rank first, where FSDP2's TP path
        takes it.

        With one dp rank and no ``fsdp_kwargs`` there is nothing to shard: `module` comes
        back unchanged (not an ``FSDPModule``), with a warning once per process, and its
        gradients are reduced as without FSDP2 (`fusedpar.distribute`'s bucketed
        all-reduces, where FSDP2 would redistribute each parameter's alone). With
        ``fsdp_kwargs`` (a mixed-precision or offload policy changes the computation)
        FSDP2 is applied at dp = 1 too.

        FSDP2 puts new parameters in the place of `module`'s: those are retired
        (`fusedpar.storage.retire`), and an optimizer built before raises at its first
        step ("build the optimizer after fully_shard") where it would train nothing."""
        from torch.distributed import fsdp

        axes = self.axes_of(mesh, stage=True)
        data = tuple(axes[a] for a in DATA_AXES if a in axes)  # "dp", or its two parts
        if not data:
            if fsdp_kwargs:
                raise ValueError(
                    f"fully_shard: the mesh's axes {tuple(mesh.mesh_dim_names)} "
                    "have no dp axis for FSDP2 to run over"
                )
            mesh_dp = 1
        else:
            mesh_dp = math.prod(mesh.size(mesh.mesh_dim_names.index(name)) for name in data)
        if mesh_dp == 1 and not fsdp_kwargs:
            global _warned_dp1
            if not _warned_dp1:
                _warned_dp1 = True
                warnings.warn(
                    "ParallelDims.fully_shard with one dp rank: nothing to shard, "
                    "FSDP2 skipped (the module is returned unchanged)",
                    UserWarning,
                    stacklevel=2,
                )
            return module
        before = dict(module.named_parameters())  # replaced by FSDP2's: retired after
        ignored = _shard_experts(module, mesh, data, dp_mesh_dims, fsdp, fsdp_kwargs)
        if ignored:
            fsdp_kwargs["ignored_params"] = set(fsdp_kwargs.get("ignored_params", ())) | ignored
        sharded = self._fully_shard(module, mesh, data, dp_mesh_dims, fsdp, fsdp_kwargs)
        retire_replaced(module, before, "fully_shard")
        return sharded

    @staticmethod
    def _fully_shard(module, mesh, data, dp_mesh_dims, fsdp, fsdp_kwargs):
        """`fully_shard`'s FSDP2 call over the data axes `data` (the mesh's names): over
        the full mesh, or the TP path (torch < 2.12)."""
        fully_shard = fsdp.fully_shard
        if _full_mesh_path(dp_mesh_dims, fsdp):
            shard = data[0] if len(data) == 1 else data
            return fully_shard(
                module,
                mesh=mesh,
                dp_mesh_dims=fsdp.DataParallelMeshDims(shard=shard),
                **fsdp_kwargs,
            )
        if len(data) > 1:
            raise ValueError(
                f"FSDP2's TP path (torch < 2.12) takes one dp axis, but experts over part "
                f"of dp split it in two {data}: use torch >= 2.12 (dp_mesh_dims)"
            )
        axes = {"dp": data[0]}
        # The other axes of more than one rank (FSDP2's TP path takes a 1-D or 2-D mesh;
        # a parameter's placement on an axis of one rank is always Replicate).
        names = mesh.mesh_dim_names
        kept = [i for i, axis in enumerate(names) if axis != axes["dp"] and mesh.size(i) > 1]
        kept = kept or [len(names) - 1]
        if len(kept) > 2:
            raise ValueError(
                f"FSDP2's TP path (torch < 2.12) takes parameters on at most two "
                f"mesh axes, but {[names[i] for i in kept]} all have more than "
                f"one rank: use torch >= 2.12 (dp_mesh_dims)"
            )
        rest = tuple(names[i] for i in kept)
        dp = names.index(axes["dp"])
        ignored = fsdp_kwargs.get("ignored_params", ())
        moved: dict[int, nn.Parameter] = {}
        for sub in module.modules():
            for name, param in sub._parameters.items():
                ours = isinstance(param, DTensor) and param.device_mesh == mesh
                if not ours or param.placements[dp] != Replicate() or param in ignored:
                    continue  # not distributed, sharded by an earlier fully_shard, or experts
                if id(param) not in moved:
                    placements = tuple(param.placements[i] for i in kept)
                    local = DTensor.from_local(
                        param.to_local().detach(), mesh[rest], placements, run_check=False
                    )
                    new = nn.Parameter(local, requires_grad=param.requires_grad)
                    if new.requires_grad:  # for what FSDP2 leaves alone (ignored_params)
                        new.register_post_accumulate_grad_hook(reduce_grad)
                        new._fusedpar_order = getattr(param, "_fusedpar_order", math.inf)
                    moved[id(param)] = new
                sub._parameters[name] = moved[id(param)]
        return fully_shard(module, mesh=mesh[axes["dp"]], **fsdp_kwargs)


def _full_mesh_path(dp_mesh_dims, fsdp) -> bool:
    """Whether FSDP2 takes the parameters on the full mesh (``dp_mesh_dims``, torch >= 2.12;
    None: where torch has it); RuntimeError if asked for on an older torch."""
    has = getattr(fsdp, "DataParallelMeshDims", None) is not None
    if dp_mesh_dims and not has:
        raise RuntimeError(f"dp_mesh_dims needs torch >= 2.12 (this is {torch.__version__})")
    return has if dp_mesh_dims is None else bool(dp_mesh_dims)


def _shard_experts(module, mesh, data, dp_mesh_dims, fsdp, fsdp_kwargs) -> set:
    """FSDP2 for the parameters of `module` split over a data axis (experts over dp):
    each owning submodule (the `MoE`, its router and shared expert with it) is its own
    FSDP2 unit over the data axes where they are whole (the dp ranks that hold the same
    experts: "dp_mod_ep"); returns the split parameters with no such axis (experts over
    all of dp), for the caller to pass FSDP2 as ``ignored_params``: their gradients
    need no dp reduction. Parameters already under an FSDP2 module are left alone."""
    managed = {
        id(p)
        for sub in module.modules()
        if isinstance(sub, fsdp.FSDPModule)
        for p in sub.parameters()
    }
    names = mesh.mesh_dim_names
    ignored = set()
    for sub in module.modules():
        split = [
            p
            for p in sub._parameters.values()
            if isinstance(p, DTensor)
            and id(p) not in managed
            and p.device_mesh == mesh
            and any(p.placements[names.index(name)] != Replicate() for name in data)
        ]
        if not split:
            continue
        whole = tuple(
            name
            for name in data
            if all(p.placements[names.index(name)] == Replicate() for p in split)
            and mesh.size(names.index(name)) > 1
        )
        if not whole:
            ignored.update(split)
            # FSDP2 casts what it manages to a mixed-precision policy's param_dtype, not
            # what it ignores: the swap hook casts these for each forward instead
            policy = fsdp_kwargs.get("mp_policy")
            if policy is not None and policy.param_dtype is not None:
                name_of = {id(p): n for n, p in sub._parameters.items() if p is not None}
                cast = {name_of[id(p)]: policy.param_dtype for p in split}
                sub._fusedpar_cast = getattr(sub, "_fusedpar_cast", {}) | cast
            continue
        if not _full_mesh_path(dp_mesh_dims, fsdp):
            raise ValueError(
                f"FSDP2 of experts over part of dp ({type(sub).__name__}) needs its full-"
                f"mesh path: use torch >= 2.12 (dp_mesh_dims)"
            )
        # the whole module over them: its other parameters (router, shared expert) are
        # whole on the dp ranks of an EP group too; FSDP2 reduces them there first
        shard = whole[0] if len(whole) == 1 else whole
        fsdp.fully_shard(
            sub, mesh=mesh, dp_mesh_dims=fsdp.DataParallelMeshDims(shard=shard), **fsdp_kwargs
        )
    return ignored

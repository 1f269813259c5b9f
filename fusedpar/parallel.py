"""The device-mesh entry point: parallel degrees, validated once, and their groups.

    dims = fp.ParallelDims(dp=1, cp=2, tp=2, ep="tp")
    dims.validate(world_size, n_heads=8, n_kv_heads=4, num_experts=8, seq_len=256)
    mesh = dims.build_mesh("cpu")        # init_device_mesh with axes ("dp", "cp", "tp")
    groups = dims.groups(mesh)           # {"dp": ..., "cp": ..., "tp": ..., "ep": ...}

`validate` runs no collective: call it first, on every rank, and a bad configuration
fails everywhere with a message naming the degree that does not fit. EP runs over one
named axis (``"tp"`` or ``"cp"``) or a pair flattened into one (``("cp", "tp")``), or not
at all (``None``: every expert on every rank). Not over ``"dp"`` when dp > 1: data
parallelism averages parameters over dp, and split experts differ there.
"""

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("dp", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: str | tuple[str, ...] | None = None

    @property
    def ep_axes(self) -> tuple[str, ...]:
        if self.ep is None:
            return ()
        return (self.ep,) if isinstance(self.ep, str) else tuple(self.ep)

    @property
    def ep_size(self) -> int:
        size = 1
        for axis in self.ep_axes:
            size *= getattr(self, axis)
        return size

    def validate(self, world_size: int, *, n_heads=None, n_kv_heads=None, num_experts=None,
                 seq_len=None, cp_layout="zigzag") -> None:  # fmt: skip
        """Raise ValueError naming the offending degree. No communication."""
        for axis in AXES:
            degree = getattr(self, axis)
            if not isinstance(degree, int) or degree < 1:
                raise ValueError(f"the {axis} degree must be a positive int, got {degree!r}")
        if self.dp * self.cp * self.tp != world_size:
            raise ValueError(
                f"dp ({self.dp}) x cp ({self.cp}) x tp ({self.tp}) = "
                f"{self.dp * self.cp * self.tp}, but the world has {world_size} ranks"
            )
        for axis in self.ep_axes:
            if axis not in AXES:
                raise ValueError(f"ep runs over mesh axes {AXES}, got {self.ep!r}")
        if "dp" in self.ep_axes and self.dp > 1:
            # Data parallelism (FSDP/DDP over dp) averages every parameter over dp, but
            # experts split over dp differ from rank to rank there.
            raise ValueError(f"ep over dp (dp degree {self.dp}) would mix different experts in "
                             "data parallelism over dp: run ep over cp and/or tp")  # fmt: skip
        for name, heads in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            if heads is not None and heads % self.tp:
                raise ValueError(f"{name} ({heads}) is not divisible by the tp degree ({self.tp})")
        if num_experts is not None and num_experts % self.ep_size:
            raise ValueError(f"num_experts ({num_experts}) is not divisible by the ep degree "
                             f"({self.ep_size}, over {'x'.join(self.ep_axes)})")  # fmt: skip
        if seq_len is not None:
            chunks = self.cp * (2 if cp_layout == "zigzag" else 1)
            if seq_len % chunks:
                raise ValueError(f"seq_len ({seq_len}) is not divisible by {chunks} (the cp "
                                 f"degree {self.cp} under the {cp_layout} layout)")  # fmt: skip
            if (seq_len // self.cp) % self.tp:
                per_cp = seq_len // self.cp
                raise ValueError(f"each cp rank's {per_cp} tokens are not divisible by the tp "
                                 f"degree ({self.tp}) for sequence parallelism")  # fmt: skip

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """``init_device_mesh(device_type, (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))``."""
        self.validate(dist.get_world_size())
        return init_device_mesh(device_type, (self.dp, self.cp, self.tp), mesh_dim_names=AXES)

    def groups(self, mesh: DeviceMesh) -> dict:
        """1-D meshes per axis, and "ep" (None without expert parallelism)."""
        groups = {axis: mesh[axis] for axis in AXES}
        if len(self.ep_axes) == 1:
            groups["ep"] = mesh[self.ep_axes[0]]
        elif self.ep_axes:
            groups["ep"] = mesh[self.ep_axes]._flatten("_".join(self.ep_axes))
        else:
            groups["ep"] = None
        return groups

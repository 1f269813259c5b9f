"""The mesh's axes: fusedpar's names for them, the mesh's names, and a group's axes.

A leaf: it imports nothing from fusedpar but `fusedpar.comm`, so `fusedpar.parallel`
(the degrees and their mesh), `fusedpar.storage` (parameters placed on that mesh) and
`fusedpar.pipeline` all read the axes from here, and none of them needs another to know
them. `fusedpar.parallel` and `fusedpar.storage` re-export these names.

    resolve_axes(mesh, names)     # {fusedpar's axis: the mesh's name}, checked
    mesh_axes_of(group, mesh)     # the axes of `mesh` whose ranks are `group`'s
"""

from itertools import combinations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fusedpar import comm

AXES = ("pp", "dp", "cp", "ulysses", "tp")  # every axis a mesh may have, in mesh order
OPTIONAL_AXES = ("pp", "ulysses")  # axes a mesh has only with a degree > 1
# Where experts take part of dp (`ParallelDims.ep_degree`), the mesh holds dp as two axes,
# outer then inner, and "dp" is their flattened mesh: the dp ranks holding the same
# experts (Megatron's expert-data-parallel group), and the dp ranks of one EP group.
DP_PARTS = ("dp_mod_ep", "dp_in_ep")
DATA_AXES = ("dp", *DP_PARTS)  # averaged, as data parallelism does
TOKEN_AXES = ("cp", "ulysses", "tp")  # where fusedpar's defaults split the tokens (CP, SP)


def names_of(names) -> tuple[tuple[str, str], ...]:
    """`names` (a dict or pairs: fusedpar's axis -> the mesh's name) as sorted pairs,
    checked: known axes, distinct string names."""
    pairs = tuple(sorted(dict(names or {}).items()))
    for axis, name in pairs:
        if axis not in AXES:
            raise ValueError(f"names: {axis!r} is not one of fusedpar's axes {AXES}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"names: the mesh's name of {axis!r} must be a string, got {name!r}")
    given = [name for _, name in pairs]
    if len(set(given)) != len(given):
        raise ValueError(f"names: two axes share a mesh name in {dict(pairs)}")
    return pairs


def resolve_axes(mesh: DeviceMesh, names=None, expected=None) -> dict[str, str]:
    """{fusedpar's axis: the mesh's name} for each axis of `mesh`, in mesh order, where
    `names` maps fusedpar's axes to the mesh's (``ParallelDims.names``; an axis left out
    keeps its own name). ValueError naming the mesh's axes, fusedpar's and the mapping to
    pass when a name is neither (read off `expected`, the axes the mesh should have in
    order, where their count is the mesh's). No communication: the same answer on every
    rank."""
    if not isinstance(mesh, DeviceMesh) or mesh.mesh_dim_names is None:
        raise TypeError(
            f"a DeviceMesh with named axes is needed (ParallelDims.build_mesh), "
            f"got {type(mesh).__name__}"
        )
    to_mesh = {axis: axis for axis in AXES + DP_PARTS} | dict(names_of(names))
    to_axis = {name: axis for axis, name in to_mesh.items()}
    found = tuple(mesh.mesh_dim_names)
    unknown = [name for name in found if name not in to_axis]
    if unknown:
        mapped = {axis: name for axis, name in to_mesh.items() if axis != name}
        expected = expected or tuple(axis for axis in AXES if axis not in OPTIONAL_AXES)
        guess = (
            {axis: name for axis, name in zip(expected, found, strict=True) if axis != name}
            if len(expected) == len(found)
            else {"dp": "data", "tp": "tensor"}
        )
        raise ValueError(
            f"the mesh's axes {found} include {tuple(unknown)}, which are not fusedpar's axes "
            f"{AXES}" + (f" nor mapped to them (names={mapped})" if mapped else "") + ": name "
            f"the mesh's axes so, or map them: ParallelDims(..., names={guess}) (for a mesh "
            f"of axes {tuple(expected)} in that order), and pass names=dims.names to "
            "fusedpar.distribute"
        )
    return {to_axis[name]: name for name in found}


def mesh_axes_of(group, mesh: DeviceMesh) -> tuple[str, ...]:
    """The axes of `mesh` whose ranks, in order, are `group`'s: ``("tp",)`` for
    ``mesh["tp"]``, ``("cp", "tp")`` for ``mesh["cp", "tp"]._flatten()``, ``()`` for a
    group of one. No communication. ValueError if `group` is not on the mesh."""
    pg = comm.resolve_group(group)
    if pg is None or dist.get_world_size(pg) == 1:
        return ()
    ranks = dist.get_process_group_ranks(pg)
    names, coordinate = mesh.mesh_dim_names, mesh.get_coordinate()
    for count in range(1, mesh.ndim + 1):
        for dims in combinations(range(mesh.ndim), count):
            index = [slice(None) if d in dims else c for d, c in enumerate(coordinate)]
            if mesh.mesh[tuple(index)].flatten().tolist() == ranks:
                return tuple(names[d] for d in dims)
    raise ValueError(
        f"the group of ranks {ranks} is not an axis (or a run of axes) of the "
        f"mesh {names} {tuple(mesh.shape)}: build the layers from "
        "dims.groups(mesh)"
    )

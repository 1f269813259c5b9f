"""`HeadParts`: a layer whose parameters are the full model's named parts, each split over
TP by whole heads (dim 0), by columns (dim 1) or whole on every rank (None), as its
class's `SPLIT_DIMS` says: the linear-attention layers (`GatedDeltaNet`,
`KimiDeltaAttention`). One way to read the full shapes, load a rank's share of full
tensors and tell `fusedpar.distribute` how each is placed."""

import torch

from fusedpar.storage import ParamLayout, local_tensor


class HeadParts:
    """Mixin over `SPLIT_DIMS` (part -> the dim split over TP, or None); the class sets
    `tp`, `tp_rank`, `tp_group` and says its sizes in `sizes_text` (for errors)."""

    SPLIT_DIMS: dict = {}

    @staticmethod
    def param_name(part: str) -> str:
        """The parameter holding the full tensor `part` on this rank."""
        return part if part in ("A_log", "dt_bias") else f"{part}_weight"

    def sizes_text(self) -> str:
        raise NotImplementedError

    def full_shapes(self) -> dict:
        """part -> the shape of its full (unsplit) tensor."""
        shapes = {}
        for part, dim in self.SPLIT_DIMS.items():
            shape = list(getattr(self, self.param_name(part)).shape)
            if dim is not None:
                shape[dim] *= self.tp
            shapes[part] = tuple(shape)
        return shapes

    def load_parts(self, parts: dict) -> None:
        """Copy this rank's share of the full tensors `parts` (every name of `SPLIT_DIMS`,
        in the layer's head-major sections): ValueError naming a missing one or a shape
        that does not fit."""
        name, expected = type(self).__name__, self.full_shapes()
        if set(parts) != set(expected):
            raise ValueError(f"{name}.load_parts takes {sorted(expected)}, got {sorted(parts)}")
        for part, shape in expected.items():
            if tuple(parts[part].shape) != shape:
                raise ValueError(
                    f"{name}: {part} must be {shape} ({self.sizes_text()}), got "
                    f"{tuple(parts[part].shape)}"
                )
        with torch.no_grad():
            for part, dim in self.SPLIT_DIMS.items():
                full = parts[part].detach()
                local = full if dim is None else full.chunk(self.tp, dim)[self.tp_rank]
                local_tensor(getattr(self, self.param_name(part))).copy_(local)

    def param_layouts(self) -> dict:
        """For `fusedpar.distribute`: each part split over TP on its dim; a whole one's
        gradient on each TP rank a partial sum over its own heads."""
        whole = ParamLayout(partial_over=(self.tp_group,))
        return {
            self.param_name(part): whole if dim is None else ParamLayout(dim, self.tp_group)
            for part, dim in self.SPLIT_DIMS.items()
        }

"""The harness fusedpar's tests use, and that users get for their own parallel models.

- `World`: a persistent pool of ranks; ``world.run(fn, *args)`` runs on every rank;
  ``world.run(exception_of, fn, *args)`` returns what each rank raised.
- `assert_close`: the tolerance rule (twice PyTorch's own error against float64);
  `assert_ulps`: float64 against float64, to a few ulps.
- `strategies`: hypothesis profiles and strategies.
- `compile_gate`: compile Triton kernels for sm_80/sm_90 without a GPU and read what
  each build uses; `machine_code`: ptxas's notes and the SASS hot loop of a build.
- `HostSyncs`: record the calls that would stall the host on a GPU, on any machine.
- `Collectives`: count the collectives a piece of code runs, by kind and group size.
- `SavedActivations`: the bytes a forward keeps for its backward (checkpointing's too).
"""

from fusedpar.testing import compile_gate, machine_code, strategies
from fusedpar.testing.collectives import Collectives
from fusedpar.testing.host_syncs import HostSyncs
from fusedpar.testing.saved import SavedActivations
from fusedpar.testing.tolerance import assert_close, assert_ulps, tolerance
from fusedpar.testing.world import World, WorldError, WorldTimeout, exception_of, shared_world

__all__ = [
    "Collectives",
    "HostSyncs",
    "SavedActivations",
    "World",
    "WorldError",
    "WorldTimeout",
    "assert_close",
    "assert_ulps",
    "compile_gate",
    "exception_of",
    "machine_code",
    "shared_world",
    "strategies",
    "tolerance",
]

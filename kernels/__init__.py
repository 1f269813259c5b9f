"""Triton kernels, their launchers and plain-PyTorch references, one module per family.

Installed as ``fusedpar.kernels``. Nothing here uses autograd or ``torch.distributed``:
``fusedpar.ops`` builds the autograd Functions on top of these launchers. Import the
launchers from their modules (``from fusedpar.kernels.matmul import matmul``): the
modules are not re-exported here, so ``fusedpar.kernels.matmul`` stays the module.
"""

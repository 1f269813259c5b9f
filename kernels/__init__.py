"""Triton kernels, their launchers and plain-PyTorch references, one module per family
(attention's is a subpackage: ``fusedpar.kernels.attention``, which re-exports its
launchers, ``from fusedpar.kernels.attention import attention_forward``).

Installed as ``fusedpar.kernels``. Nothing here uses autograd or ``torch.distributed``:
``fusedpar.ops`` builds the autograd Functions on top of these launchers. Import the
launchers from their modules (``from fusedpar.kernels.matmul import matmul``): the
modules are not re-exported here, so ``fusedpar.kernels.matmul`` stays the module.
"""

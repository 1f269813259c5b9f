"""The opcheck cases' inputs (each family's `cases.opcheck_cases`; tests/test_compile.py
runs them)."""

import torch


def leaf(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)

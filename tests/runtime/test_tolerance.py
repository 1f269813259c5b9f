"""The tolerance rule of DESIGN, as `fusedpar.testing.assert_close` applies it."""

import pytest
import torch

from fusedpar.testing import assert_close
from fusedpar.testing.tolerance import FLOOR, floor


def test_the_floor_grows_with_the_dot_length_in_fp32_only():
    assert floor(torch.float32) == floor(torch.float32, 8) == FLOOR[torch.float32]
    assert floor(torch.float32, 256) == pytest.approx(4 * FLOOR[torch.float32])
    assert floor(torch.float16, 256) == FLOOR[torch.float16]


def test_twice_pytorchs_error_plus_the_floor_passes_and_more_fails():
    ref = torch.tensor([3.0, -1.0], dtype=torch.float64)
    out_torch = ref + torch.tensor([1e-6, 0.0], dtype=torch.float64)  # PyTorch's error 1e-6
    allowed = 2e-6 + 3 * floor(torch.float32, 64)  # the floor scales with max|ref| = 3
    assert_close((ref + 0.9 * allowed).float(), ref, out_torch, sum_length=64)
    with pytest.raises(AssertionError, match="max error"):
        assert_close((ref + 1.1 * allowed).float(), ref, out_torch, sum_length=64)
    with pytest.raises(AssertionError, match="max error"):  # no growth without a length
        assert_close((ref + 0.9 * allowed).float(), ref, out_torch)


def test_non_finite_values_must_match_the_reference():
    ref = torch.tensor([float("-inf"), 1.0], dtype=torch.float64)
    assert_close(ref.float(), ref, ref.float(), name="lse")
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(torch.tensor([0.0, 1.0]), ref, ref.float(), name="lse")

"""Helpers of the tests in this folder (moved from test_pipeline.py)."""

import torch


def _gathered(model, optimizer) -> dict:
    """This rank's parameters and AdamW moments, as full tensors (a stage's under PP)."""
    out = {}
    for name, param in model.named_parameters():
        out[name] = param.full_tensor().clone()
        for key, value in optimizer.state[param].items():
            out[f"{name}.{key}"] = value.full_tensor() if key != "step" else value
    return out


def _union(results: list[dict]) -> dict:
    union = {}
    for tensors in results:
        for name, tensor in tensors.items():
            assert name not in union or torch.equal(union[name], tensor), name
            union[name] = tensor
    return union


def _assert_equal(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name

"""Activation memory: the bytes a block saves for its backward, per token, measured with
``torch.autograd.graph.saved_tensors_hooks`` (each storage once: views of one tensor are
not counted twice; parameters are not activations and are left out).

The dense block of examples/tiny_llama.py (``ParallelBlock``: RMSNorm, attention, RMSNorm,
SwiGLU) must keep at most 1.05x the minimum its backward needs, computed from the shapes.
That minimum, per token, with e the activations' bytes per element (4 in fp32, 2 in
fp16), d the model width, Hq / Hkv heads of hd, h the MLP's hidden width (over a TP
group of W: heads and h divided by W, norms on this rank's T/W tokens):

| tensor                                  | why the backward needs it       | bytes        |
| --------------------------------------- | ------------------------------- | ------------ |
| attention norm: its input x, and rstd   | dx and dweight of the norm      | d e + 4      |
| attention norm's output                 | the q/k/v weights' gradient     | d e          |
| q, k (after RoPE), v                    | attention's backward            | (Hq+2Hkv) hd e |
| attention output, and its LSE (fp32)    | attention's; o's weight grad    | Hq hd e + 4 Hq |
| RoPE's cos and sin, (S, hd/2) fp32 each | the rotation's backward         | 4 hd S / T   |
| MLP norm: input, rstd, output           | as the attention norm's         | 2 d e + 4    |
| gate and up (the activation's inputs)   | dgate, dup; act(gate) * up      | 2 h e        |
|                                         | recomputed from them            |              |

Not in it (and not kept): act(gate), the product fed to the down projection, the
normalized x, fp32 copies of 16-bit tensors. At the branch point of #29 the block kept
1.53x this (fp32) and 1.70x (fp16): the norms saved x in fp32, the normalized x and
their output; the MLP, act(gate) and the product.

The MoE block (the same with ``fp.nn.MoE``: top-2 of 4 experts) has no such table here;
it must keep no more than at that branch point (5020.4 B per token in fp32, 3108.4 in
fp16), where the router kept fp32 copies of x and its weight, and the index bookkeeping
was int64. Now: 4476.4 (fp32) and 2300.4 (fp16).
"""

import pytest
import torch
import torch.distributed as dist
from tiny_llama import Block, Config, ParallelBlock

import fusedpar as fp
from fusedpar.testing import SavedActivations
from tests.support import tiny

SEQ, BATCH = 64, 2
MOE_BRANCH_POINT = {torch.float32: 5020.4375, torch.float16: 3108.4375}  # bytes per token


def _config(moe: bool) -> Config:
    return tiny.config(moe, d_model=64, d_hidden=128)


def saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages `module(x)` saves for its backward, parameters'
    storages left out."""
    with SavedActivations(module.parameters()) as saved:
        out = module(x)
    del out
    return saved.nbytes


def dense_minimum(cfg: Config, dtype: torch.dtype, world: int = 1) -> float:
    """The docstring's table, in bytes per token of the whole batch, on one of `world`
    TP ranks."""
    e, d, hd = torch.finfo(dtype).bits // 8, cfg.d_model, cfg.head_dim
    hq, hkv, h = cfg.n_heads // world, cfg.n_kv_heads // world, cfg.d_hidden // world
    norms = 2 * (2 * d * e + 4) / world  # this rank's tokens only (sequence parallel)
    attention = (hq + 2 * hkv) * hd * e + hq * hd * e + 4 * hq
    rope = 2 * 4 * (hd // 2) * SEQ / (SEQ * BATCH)
    return norms + attention + rope + 2 * h * e


def _block(moe: bool, dtype: torch.dtype, groups: dict, seed: int = 0):
    cfg = _config(moe)
    torch.manual_seed(seed)
    block = ParallelBlock(Block(cfg), cfg, groups).to(dtype)
    return cfg, block


def _per_token(moe: bool, dtype: torch.dtype, groups: dict) -> float:
    cfg, block = _block(moe, dtype, groups)
    tp = groups["tp"]
    local = SEQ // fp.comm.group_size(tp)
    x = torch.randn(SEQ, BATCH, cfg.d_model, dtype=dtype)
    x = x.chunk(fp.comm.group_size(tp))[fp.comm.group_rank(tp)].clone().requires_grad_()
    assert x.shape[0] == local
    return saved_bytes(block, x) / (SEQ * BATCH)


ONE_DEVICE = {"tp": None, "cp": None, "ep": None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_dense_block_saves_the_minimum(dtype):
    got, minimum = _per_token(False, dtype, ONE_DEVICE), dense_minimum(_config(False), dtype)
    assert minimum <= got <= 1.05 * minimum, f"{got} B per token, minimum {minimum}"


def _tp2(dtype):
    return _per_token(False, dtype, {"tp": dist.group.WORLD, "cp": None, "ep": None})


def test_dense_block_saves_the_minimum_at_tp2(world):
    """Each of 2 TP ranks keeps half the heads and hidden features (every token) and its
    own tokens' norms: no gathered input is kept (the backward re-gathers it)."""
    minimum = dense_minimum(_config(False), torch.float16, world=2)
    for got in world(2).run(_tp2, torch.float16):
        assert minimum <= got <= 1.05 * minimum, f"{got} B per token, minimum {minimum}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_moe_block_saves_no_more_than_before(dtype):
    got = _per_token(True, dtype, ONE_DEVICE)
    assert got <= MOE_BRANCH_POINT[dtype], f"{got} B per token, {MOE_BRANCH_POINT[dtype]} before"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_a_head_norm_keeps_its_input_and_one_fp32_per_head(dtype, offset):
    """Qwen3's and Gemma 3's per-head q/k RMSNorm (``qk_norm=True``, ``norm_offset``)
    adds to attention's saved bytes exactly q and k before it and one fp32 rstd per head
    and token: ``(Hq + Hkv) (hd e + 4)`` (the PyTorch formula kept fp32 copies and the
    normalized values besides: 2058 against 1674 B per token in fp16)."""
    cfg = _config(False)
    e, hd = torch.finfo(dtype).bits // 8, cfg.head_dim
    x = torch.randn(SEQ, BATCH, cfg.d_model, dtype=dtype, requires_grad=True)
    saved = []
    for qk_norm in (False, True):
        torch.manual_seed(0)
        options = dict(qk_norm=qk_norm, norm_offset=offset, dtype=dtype)
        layer = fp.nn.ParallelAttention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, **options)
        saved.append(saved_bytes(layer, x) / (SEQ * BATCH))
    assert saved[1] - saved[0] == (cfg.n_heads + cfg.n_kv_heads) * (hd * e + 4)

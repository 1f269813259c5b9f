"""The example model's tiny configs and token batches (examples/tiny_llama.py), one
builder for every test that trains it: `config`, small enough for Triton's interpreter
and the CPU, each test passing the sizes it needs; `batch`, random tokens and their
next-token labels from a seed (with `mesh`, this dp rank's share)."""

import torch
from tiny_llama import Config


def config(
    moe: bool = False,
    *,
    vocab: int = 64,
    d_model: int = 32,
    n_layers: int = 1,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    d_hidden: int = 64,
    experts: int = 4,
    top_k: int = 2,
) -> Config:
    """A tiny `Config`: dense, or with `moe` `experts` experts (top `top_k`)."""
    return Config(
        vocab=vocab,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_hidden=d_hidden,
        num_experts=experts if moe else 0,
        top_k=top_k,
    )


def batch(cfg: Config, seed: int, batch: int, seq: int, mesh=None):
    """(inputs, labels): `batch` rows of `seq` random tokens drawn from `seed` and the
    tokens after them; with `mesh`, this dp rank's rows of the whole batch."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=gen)
    if mesh is not None:
        data = data.chunk(mesh["dp"].size())[mesh["dp"].get_local_rank()]
    return data[:, :-1], data[:, 1:]

"""A small Llama-style model, twice: in plain PyTorch (the single-device reference) and
with fusedpar layers (TP x CP x EP). The parallel one is built from the reference's
weights, so both start from the same seed.

| piece      | reference (one device)          | parallel (each rank)                          |
| ---------- | ------------------------------- | --------------------------------------------- |
| embedding  | nn.Embedding                    | the same, on this rank's tokens               |
| attention  | q, k, v, o Linear; RoPE; GQA    | `fp.nn.ParallelAttention` (heads/TP, ring/CP) |
| MLP        | SwiGLU, or a loop-over-experts MoE | `fp.nn.ParallelSwiGLU` (TP), `fp.nn.MoE` (EP) |
| norms      | RMSNorm (plain PyTorch)         | `fp.nn.RMSNorm`, on this rank's tokens        |
| head       | RMSNorm, Linear, cross-entropy  | the same, on this rank's tokens               |

Activations of the parallel model are sequence-first, (S / CP / TP, B, d): each rank
holds its zigzag share of the sequence over CP, split again over TP (sequence
parallelism). Its loss on a rank is that rank's share of the mean cross-entropy, so the
losses of a TP x CP group sum to the reference's loss.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from fusedpar.kernels.attention import AttentionMask, attention_reference
from torch import nn

import fusedpar as fp
from fusedpar.nn.attention import apply_rope, rope_tables


@dataclass
class Config:
    vocab: int = 256  # bytes
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    d_hidden: int = 128
    num_experts: int = 0  # 0: dense SwiGLU MLPs
    top_k: int = 2
    rope_theta: float = 10000.0
    aux_loss_coef: float = 0.0  # the parallel model's MoE load balancing (see Transformer)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        ) * self.weight


# --- the reference --------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.n_heads * hd, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=False)
        self.o = nn.Linear(cfg.n_heads * hd, cfg.d_model, bias=False)

    def forward(self, x):  # (B, S, d)
        B, S, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q(x).view(B, S, -1, hd)
        k, v = self.k(x).view(B, S, -1, hd), self.v(x).view(B, S, -1, hd)
        cos, sin = rope_tables(torch.arange(S, device=x.device), hd, self.cfg.rope_theta)
        out, _ = attention_reference(
            apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, AttentionMask(causal=True)
        )
        return self.o(out.reshape(B, S, -1))


class SwiGLU(nn.Module):
    def __init__(self, d_model, d_hidden):
        super().__init__()
        self.gate = nn.Linear(d_model, d_hidden, bias=False)
        self.up = nn.Linear(d_model, d_hidden, bias=False)
        self.down = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LoopMoE(nn.Module):
    """Top-k softmax routing to SwiGLU experts, one expert at a time (no balancing loss:
    see `Transformer`)."""

    def __init__(self, cfg: Config):
        super().__init__()
        E, d, h = cfg.num_experts, cfg.d_model, cfg.d_hidden
        self.top_k = cfg.top_k
        self.router = nn.Parameter(torch.empty(E, d).uniform_(-1, 1) / d**0.5)
        self.w1 = nn.Parameter(torch.empty(E, h, d).uniform_(-1, 1) / d**0.5)
        self.w3 = nn.Parameter(torch.empty(E, h, d).uniform_(-1, 1) / d**0.5)
        self.w2 = nn.Parameter(torch.empty(E, d, h).uniform_(-1, 1) / h**0.5)

    def forward(self, x):
        x2d = x.reshape(-1, x.shape[-1])
        probs = (x2d.float() @ self.router.float().T).softmax(-1)
        ids = probs.detach().topk(self.top_k, -1).indices
        weights = probs.gather(1, ids)
        weights = weights / weights.sum(-1, keepdim=True)
        y = torch.zeros_like(x2d)
        for e in range(self.w1.shape[0]):
            token, slot = torch.where(ids == e)
            xe = x2d[token]
            out = (F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)) @ self.w2[e].T
            y = y.index_add(0, token, out * weights[token, slot, None].to(x.dtype))
        return y.view_as(x)


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.d_model), RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp = LoopMoE(cfg) if cfg.num_experts else SwiGLU(cfg.d_model, cfg.d_hidden)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """The single-device reference: tokens (B, S) -> mean next-token cross-entropy.

    MoE layers are trained without the load-balancing loss here, and in the parallel
    model unless ``cfg.aux_loss_coef`` is set: that loss is a product of per-rank
    statistics, so it is defined per rank and is not a function of the global batch
    (the parallel model adds its gradient where it arises, `fp.nn.add_aux_loss`)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def reference_name(name: str) -> str:
    """The reference's name of a `ParallelTransformer` parameter (``blocks.0.attn.q_weight``
    -> ``blocks.0.attn.q.weight``): how its gradient is compared with the reference's."""
    pairs = [(f".attn.{p}_weight", f".attn.{p}.weight") for p in "qkvo"]
    pairs += [(f".mlp.{p}_weight", f".mlp.{p}.weight") for p in ("gate", "up", "down")]
    pairs.append((".mlp.router_weight", ".mlp.router"))
    for ours, theirs in pairs:
        if name.endswith(ours):
            return name[: -len(ours)] + theirs
    return name


# --- the parallel model ------------------------------------------------------------------------


def _norm(norm: RMSNorm) -> fp.nn.RMSNorm:
    """The reference's norm as fusedpar's (the same state_dict): it saves x and one fp32
    per row for the backward, where the reference's autograd keeps x in fp32 and the
    normalized x as well."""
    ours = fp.nn.RMSNorm(norm.weight.shape[0], eps=norm.eps)
    ours.load_state_dict(norm.state_dict())
    return ours


class ParallelBlock(nn.Module):
    def __init__(self, block: Block, cfg: Config, groups: dict):
        super().__init__()
        self.attn_norm, self.mlp_norm = _norm(block.attn_norm), _norm(block.mlp_norm)
        a = block.attn
        self.attn = fp.nn.ParallelAttention.from_dense(
            a.q,
            a.k,
            a.v,
            a.o,
            cfg.d_model,
            cfg.n_heads,
            cfg.n_kv_heads,
            tp_group=groups["tp"],
            cp_group=groups["cp"],
            ulysses_group=groups.get("ulysses"),
            rope_theta=cfg.rope_theta,
        )
        if cfg.num_experts:
            m = block.mlp
            self.mlp = fp.nn.MoE.from_dense(
                m.router,
                m.w1,
                m.w2,
                m.w3,
                groups["ep"],
                top_k=cfg.top_k,
                aux_loss_coef=cfg.aux_loss_coef,
            )
        else:
            m = block.mlp
            self.mlp = fp.nn.ParallelSwiGLU.from_dense(m.gate, m.up, m.down, groups["tp"])

    def forward(self, x):  # (S / CP / TP, B, d)
        x = x + self.attn(self.attn_norm(x))
        mlp = self.mlp(self.mlp_norm(x))
        if isinstance(mlp, tuple):  # MoE: its auxiliary loss's gradient starts here, so
            mlp = fp.nn.add_aux_loss(*mlp)  # no loss passes between pipeline stages
        return x + mlp


class ParallelTransformer(nn.Module):
    """The reference model on a TP x CP x EP group; ``forward`` returns this rank's share
    of the loss. ``fp.distribute(model, mesh)`` makes every gradient whole: the norms,
    embedding, head and routers see this rank's tokens only, and their gradients are
    declared partial sums over cp and tp (see `fusedpar.storage`)."""

    def __init__(self, reference: Transformer, groups: dict):
        super().__init__()
        cfg = reference.cfg
        self.cfg, self.groups = cfg, groups
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.embed.load_state_dict(reference.embed.state_dict())
        self.blocks = nn.ModuleList(ParallelBlock(b, cfg, groups) for b in reference.blocks)
        self.norm = _norm(reference.norm)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.load_state_dict(reference.head.state_dict())

    def local_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """(B, S) -> this rank's (S / CP / TP, B): the zigzag CP shard (split again over
        the Ulysses group, if any), sequence-first, then this TP rank's rows."""
        t = fp.shard_sequence(t, self.groups["cp"], dim=1, ulysses_group=self.groups.get("ulysses"))
        t = t.transpose(0, 1)
        tp = self.groups["tp"]
        return t.chunk(fp.comm.group_size(tp))[fp.comm.group_rank(tp)]

    def forward(self, tokens, labels=None):
        """tokens (B, S) -> this rank's share of the mean loss over `labels` (B, S); its
        logits (S / CP / TP, B, V) without labels. A pipeline stage (`fp.pipeline.split`)
        that does not hold the embedding takes the hidden state (S / CP / TP, B, d) in
        place of the tokens, and one without the head returns the hidden state."""
        x = tokens if self.embed is None else self.embed(self.local_tokens(tokens))
        for block in self.blocks:
            x = block(x)
        if self.head is None:
            return x
        logits = self.head(self.norm(x))
        return logits if labels is None else self.loss(logits, labels)

    def loss(self, logits, labels):
        """This rank's share of the mean cross-entropy of the batch `labels` (B, S)."""
        local = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            self.local_tokens(labels).reshape(-1),
            reduction="sum",
        )
        return local / labels.numel()

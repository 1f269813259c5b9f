"""A `parallelize`d Hugging Face decoder cut into pipeline stages.

    dims = fp.ParallelDims(pp=2, tp=2)
    mesh = parallelize(model, dims)             # each stage's parameters on its sub-mesh
    pipe = fp.pipeline.split(model, dims, mesh, schedule="1F1B", microbatches=4)
    losses = pipe.step(input_ids, target=input_ids)   # labels as Hugging Face takes them

`split` runs the decoder as `DecoderStages`: the model's own modules under their own
names, with a forward that skips what a stage leaves out (Hugging Face's runs them all).

| stage holds          | forward                                                    |
| -------------------- | ---------------------------------------------------------- |
| the embeddings       | input_ids (B, S), the whole microbatch -> this rank's      |
| (first)              | tokens (`local_tokens`), embedded (+ learned positions)    |
| blocks i..j          | hidden (B, S_loc, d) -> each decoder layer in turn         |
| norm and head (last) | -> logits (B, S_loc, V), soft-capped where the model does  |

Packed ``position_ids`` go to every stage; only the hidden state is sent. Batch errors
are gathered by `Pipeline.step` (`DecoderStages.check_step`); `DecoderStages.loss` is
this rank's tokens' share of the microbatch's mean. Only ``batch="full"``.
"""

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from fusedpar import checks
from fusedpar.integrations.hf_batch import (
    check_same_batch,
    check_shards,
    check_tensors,
    global_positions,
    local_tokens,
    packed_documents,
)
from fusedpar.kernels.common import accumulator
from fusedpar.pipeline import module_at

LLAMA_TREE = ("model.embed_tokens", None, "model.layers", "model.norm", "lm_head")
TREES = {  # model_type: (embeddings, learned positions, blocks, final norm, head)
    "gpt2": ("transformer.wte", "transformer.wpe", "transformer.h", "transformer.ln_f", "lm_head"),
    "gpt_neox": (
        "gpt_neox.embed_in",
        None,
        "gpt_neox.layers",
        "gpt_neox.final_layer_norm",
        "lm_head",
    ),
}


class DecoderStages(nn.Module):
    """The modules of a converted causal LM `model`, under its names, run as a pipeline
    stage (see the module doc); ``pipeline_layout`` tells `split` where they are."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self._modules.update(model._modules)  # the model's names: checkpoints agree
        self.config, self.batch = model.config, model._fusedpar_batch
        if self.batch.kind != "full":
            raise ValueError(
                "a pipelined Hugging Face model takes the whole batch: "
                "parallelize it with batch='full'"
            )
        tree = TREES.get(self.config.model_type, LLAMA_TREE)
        self.embed, self.learned_positions, self.blocks, self.norm, self.head = tree
        first = (self.embed,) if self.learned_positions is None else tree[:2]
        self.pipeline_layout = (self.blocks, first, (self.norm, self.head))

    def _part(self, path: str | None):
        return None if path is None else module_at(self, path)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None):
        """x: input_ids (B, S) in the first stage, else the hidden state (B, S_loc, d)."""
        state, groups = self.batch, self.batch.groups
        embed = self._part(self.embed)
        if embed is None:
            seq = x.shape[1] * state.ranks()
            shape = (x.shape[0], seq)
            state.cu_seqlens = (
                None if position_ids is None else packed_documents(position_ids, shape)
            )
        else:
            # the ranks of this stage got one microbatch, one that splits, with positions
            # it takes (at the first call: a rank's refusal raised on every rank of the
            # stage, none left waiting in the gather)
            verdict = checks.Verdict()
            seq = verdict.run(_read_first, x, position_ids, state)
            taken = None if seq is None else {"tokens": x, "position_ids": position_ids}
            check_same_batch(taken, state, verdict)
            x = embed(local_tokens(x, groups))  # (B, S_loc, d)
            learned = self._part(self.learned_positions)
            if learned is not None:
                positions = (
                    global_positions(seq, x, state)
                    if state.cu_seqlens is None
                    else local_tokens(position_ids.expand(1, seq), groups)
                )
                x = x + learned(positions)
        for layer in self._part(self.blocks):
            # (Qwen3-Next's and Qwen3.5's layers require position_embeddings: fusedpar's
            # attention applies RoPE itself, and the linear attention takes none)
            needs = _needs_rope_arg(type(layer))
            out = layer(x, position_embeddings=None) if needs else layer(x)
            x = out[0] if isinstance(out, tuple) else out
        norm, head = self._part(self.norm), self._part(self.head)
        if norm is not None:
            x = norm(x)
        if head is not None:
            x = head(x)
            cap = getattr(self.config, "final_logit_softcapping", None)
            x = x if cap is None else torch.tanh(x / cap) * cap
        return x

    def check_step(self, inputs: tuple, kwargs: dict, microbatches: int) -> None:
        """`Pipeline.step`'s checks of its batch that a rank makes alone, on every rank
        before the schedule (at the first step their verdicts are gathered over the
        pipeline: a refusal raised on every rank, where the later stages would wait for
        the first): input_ids (B, S) of a length that splits into the shards, and
        position_ids that each microbatch takes (`packed_documents`)."""
        x = inputs[0] if inputs else None
        positions = kwargs.get("position_ids")
        check_tensors({"input_ids": x, "position_ids": positions})
        seq = None if x is None else _check_input(x, self.batch.groups)
        if positions is not None:
            seq = positions.shape[-1] if seq is None else seq
            for part in positions.tensor_split(microbatches):  # as the schedule splits it
                packed_documents(part, (part.shape[0], seq))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This rank's share of the microbatch's mean loss: `labels` (B, S) as Hugging
        Face takes them (shifted here, over the whole sequence), logits (B, S_loc, V)."""
        shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
        mine = local_tokens(shifted, self.batch.groups)
        total = F.cross_entropy(
            logits.flatten(0, 1).to(accumulator(logits.dtype)),
            mine.flatten(),
            ignore_index=-100,
            reduction="sum",
        )
        return total / (shifted != -100).sum().clamp(min=1)


@functools.cache
def _needs_rope_arg(kind: type) -> bool:
    """Whether a decoder layer class's forward requires ``position_embeddings`` (no
    default)."""
    param = inspect.signature(kind.forward).parameters.get("position_embeddings")
    return param is not None and param.default is inspect.Parameter.empty


def _check_input(x: torch.Tensor, groups: dict) -> int:
    """input_ids (B, S) of a length that splits into the shards; returns S."""
    if x.dim() != 2:
        raise ValueError(f"the first stage takes input_ids (B, S), got {tuple(x.shape)}")
    check_shards(x.shape[1], groups)
    return x.shape[1]


def _read_first(x, position_ids, state) -> int:
    """The first stage's checks of its microbatch, which a rank makes alone: input_ids
    (B, S) of a length that splits into the shards, position_ids (a tensor, or None)
    that give whole sequences or packed documents (`packed_documents`, kept in the
    state). Returns S."""
    check_tensors({"input_ids": x, "position_ids": position_ids})
    seq = _check_input(x, state.groups)
    shape = (x.shape[0], seq)
    state.cu_seqlens = None if position_ids is None else packed_documents(position_ids, shape)
    return seq

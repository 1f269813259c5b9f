"""The heads `fusedpar.integrations.hf.parallelize` takes on a decoder, and what each
needs beyond the causal LM's (Hugging Face's own head modules stay, on every rank):

| model (class name ends in) | ``out.logits``                   | ``labels=`` and ``out.loss``     |
| -------------------------- | -------------------------------- | -------------------------------- |
| ForCausalLM, LMHeadModel   | this rank's tokens' (B, S_loc, V) | (B, S), shifted; global mean    |
| ForSequenceClassification  | (B, num_labels) pooled at each   | Hugging Face's own loss of the   |
|                            | row's last non-pad token, every  | pooled logits (``problem_type``) |
|                            | rank alike                       |                                  |
| ForTokenClassification     | this rank's tokens' (B, S_loc,   | (B, S), unshifted; cross entropy,|
|                            | num_labels)                      | -100 ignored, the global mean    |

Any other head is refused. The pooled token lives on one rank of the cp x ulysses x tp
group: each rank takes it where it holds it (zeros elsewhere) and the ranks sum that,
detached, so its gradient reaches the owner's token only. The classification heads take
right padding (``padding_side="right"``): real tokens are computed exactly, padded
positions differ from Hugging Face's and nothing may read them (a real pooled token,
labels -100 there). Left padding, rows without a real token and padding inside packed
documents are refused; the causal LM refuses any padding. docs/dropin.md.
"""

import torch
from torch import nn

from fusedpar.integrations.hf_families import refuse

HEADS = (
    ("ForCausalLM", "causal"),
    ("LMHeadModel", "causal"),  # class name suffix, kind
    ("ForSequenceClassification", "sequence"),
    ("ForTokenClassification", "token"),
)
SUPPORTED = "*ForCausalLM, *ForSequenceClassification, *ForTokenClassification"


def head_of(model: nn.Module) -> str:
    """ "causal", "sequence" or "token", by the model's class (or the Hugging Face class
    it derives from); ValueError for any other head."""
    for cls in type(model).__mro__:
        for suffix, kind in HEADS:
            if cls.__name__.endswith(suffix):
                return kind
    raise ValueError(
        f"parallelize: {type(model).__name__}'s head is not supported (supported: "
        f"{SUPPORTED}); the result would not compute what the model does"
    )


def check_head(model: nn.Module, kind: str, batch: str, pp: int) -> None:
    """The refusals of a classification head, before anything is built."""
    if kind == "causal":
        return
    name = type(model).__name__
    head = (
        getattr(model, "score", None)
        if kind == "sequence"
        else (getattr(model, "score", None) or getattr(model, "classifier", None))
    )
    refuse(not isinstance(head, nn.Linear), f"{name} without an nn.Linear score/classifier")
    refuse(pp > 1, f"{name} under pipeline parallelism (pp={pp}; a causal LM's head only)")
    refuse(
        kind == "sequence" and batch == "local",
        f"{name} with batch='local' (pooling reads the whole sequence's input_ids: "
        "pass batch='full')",
    )


def pooled_positions(input_ids, tokens: torch.Tensor, pad_token_id) -> torch.Tensor:
    """(B,) int64: where Hugging Face's sequence classification pools each row of a
    (B, S) batch: the rightmost token that is not `pad_token_id` (token 0 for a row of
    pads), the last token without a pad id or without input_ids (inputs_embeds)."""
    batch, seq = tokens.shape[:2]
    if pad_token_id is None and batch != 1:
        raise ValueError(
            f"sequence classification of a batch of {batch} rows needs "
            "config.pad_token_id (Hugging Face's: cannot handle batch sizes > 1 "
            "if no padding token is defined)"
        )
    if pad_token_id is None or input_ids is None:
        return torch.full((batch,), seq - 1, dtype=torch.long, device=tokens.device)
    real = (input_ids != pad_token_id).to(torch.int32)
    index = torch.arange(seq, device=input_ids.device, dtype=torch.int32)
    return (index * real).argmax(-1)


def check_padding(
    mask: torch.Tensor, shape, kind: str, *, labels=None, pooled=None, packed: bool = False
) -> None:
    """ValueError unless `mask` (B, S) is a right padding the head `kind` computes exactly
    (see the module doc); `labels` (token classification) and `pooled` (sequence
    classification's positions) are checked against it."""
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask must be (B, S) = {tuple(shape)}, got {tuple(mask.shape)}")
    if bool(mask.all()):
        return
    if kind == "causal":
        raise ValueError(
            "a causal LM converted by fusedpar is causal over whole sequences: "
            "no padding (attention_mask may be left out or all ones)"
        )
    if packed:
        raise ValueError(
            "padding (an attention_mask with zeros) and packed documents "
            "(position_ids that restart) together are not supported"
        )
    real = mask != 0
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (real tokens)")
    if not bool((real[:, 1:] <= real[:, :-1]).all()):
        raise ValueError(
            "attention_mask: only right padding is taken (each row's real tokens, "
            "then its pads; padding_side='right'): under left padding fusedpar's "
            "causal attention would let the real tokens see the pads"
        )
    empty = (~real[:, 0]).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask: rows {empty} have no real token")
    if pooled is not None:
        rows = torch.arange(len(pooled), device=pooled.device)
        padded = (~real[rows, pooled]).nonzero().flatten().tolist()
        if padded:
            raise ValueError(
                f"rows {padded}: the token sequence classification pools at (the "
                "last one that is not config.pad_token_id; the last one given "
                "inputs_embeds or no pad id) is padding by attention_mask; pad "
                "with config.pad_token_id and pass input_ids"
            )
    if labels is not None and bool((labels[~real] != -100).any()):
        raise ValueError(
            "token classification over a padded batch: labels must be -100 at "
            "the padded positions (their logits are not Hugging Face's)"
        )

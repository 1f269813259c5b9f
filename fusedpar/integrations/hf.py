"""Hugging Face decoder models in one call: `parallelize(model, dims)`.

    dims = fp.ParallelDims(cp=2, tp=2, ep="tp")
    mesh = parallelize(model, dims)              # in place; returns the mesh
    out = model(input_ids=ids, labels=ids)       # the whole batch, as for the original
    out.loss.backward()                          # the original's loss, on every rank
    out.logits                                   # this rank's tokens: (B, S/CP/TP, V)

Each decoder layer's attention becomes a `ParallelAttention` (heads over tp, the
sequence over cp, RoPE from the model's own rotary module at the global positions of the
local tokens), its MLP a `ParallelSwiGLU` or, in MoE layers, a `MoE` (experts over the
ep axes, the shared expert and its gate where the model has them). Embeddings, norms and
the LM head stay as they are; then `fusedpar.distribute` puts every parameter on the
mesh.

The batch (``batch=`` of `parallelize`):

| batch     | the model takes                                  | loss                      |
| --------- | ------------------------------------------------ | ------------------------- |
| "full"    | `input_ids` / `inputs_embeds` (B, S), `labels`   | ``labels=``: Hugging      |
| (default) | (B, S), the same on every rank of a cp x tp      | Face's, shifted over the  |
|           | group (checked at the first call: one all-gather | whole sequence; its value |
|           | of a fingerprint); it takes this rank's share    | the global mean           |
| "local"   | this rank's share, `local_tokens(ids, groups)`   | yours, from `local_tokens`|
|           | (B, S/CP/U/TP): the zigzag CP shard, its Ulysses | of `next_token_labels`    |
|           | part, then its TP chunk (checked at the first    |                           |
|           | call: ranks holding the same tokens raise)       |                           |

Either way the logits are this rank's tokens', (B, S/CP/U/TP, V); `full_logits` gathers
them. Under "full", ``attention_mask`` may be left out or all ones (what a tokenizer
returns for unpadded text) and ``position_ids`` left out, ``0..S-1``, or packed
documents (B = 1, positions restarting at 0 at each document's start, as Hugging Face's
``DataCollatorWithFlattening`` makes them): each token then attends within its own
document, RoPE (or learned positions) restarting there; under "local" both are refused,
as are ``labels``.

Besides causal LMs, `*ForSequenceClassification` (logits pooled at each row's last real
token, (B, num_labels) on every rank; Hugging Face's own loss) and
`*ForTokenClassification` (unshifted labels) are taken, the two with right padding: see
`hf_heads`.

Supported: the families of `hf_families.FAMILIES` (Llama, Mistral, Qwen2/3, Mixtral,
Qwen2-MoE, Gemma 2, Gemma 3 text, Phi-3, OLMo 2, GPT-NeoX, GPT-2, gpt-oss) with the
heads of `hf_heads.HEADS`, training over whole sequences, with any of ParallelDims'
context-parallel modes (the ring over cp, Ulysses, the hybrid): the sequence is sharded
zigzag over cp, then contiguously over ulysses, then over tp. Anything the converted
model would not compute exactly (attention dropout, router jitter, another activation,
RoPE whose tables depend on the sequence length, a module of an unknown kind, another
head) raises ValueError naming it, on every rank, before any collective; so do, at
call time, padding (but a classification head's right padding), position_ids with
offsets and use_cache.

Back to Hugging Face: `save_pretrained(model, dir)` (`hf_export`; ``model.save_pretrained``
calls it), on every rank, writes the converted model as the original's checkpoint, for
``AutoModelForCausalLM.from_pretrained(dir)``.
"""

import functools
import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from fusedpar import checks, comm
from fusedpar.integrations import hf_export
from fusedpar.integrations import hf_families as families
from fusedpar.integrations import hf_heads as heads
from fusedpar.integrations.hf_export import save_pretrained  # noqa: F401 (public here)
from fusedpar.integrations.hf_families import refuse
from fusedpar.kernels._common import accumulator
from fusedpar.nn import (
    ColumnParallelLinear,
    MoE,
    ParallelAttention,
    ParallelMLA,
    ParallelSwiGLU,
    RowParallelLinear,
)
from fusedpar.nn.mla import CP_RINGS
from fusedpar.ops.linear import check_reduce_dtype
from fusedpar.ops.overlap import check_overlap
from fusedpar.ops.sequence import gather_sequence, shard_sequence
from fusedpar.storage import distribute, retire_replaced


def __getattr__(name: str):
    """``hf.Trainer`` and ``hf.ParallelTrainerMixin`` (`hf_trainer`), imported at first
    use: Hugging Face's Trainer takes a second to import and needs accelerate, which
    `parallelize` does not."""
    if name in ("Trainer", "ParallelTrainerMixin"):
        from fusedpar.integrations import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


BATCHES = ("full", "local")
SEQUENCE_AXES = ("cp", "ulysses", "tp")  # the mesh axes a sequence is sharded over, in order


class _HFAttentionCall:
    """Called as a Hugging Face attention module: hidden_states (B, S_loc, d)
    batch-first in, ``(output, None)`` out; HF's mask and position embeddings are
    ignored (causal, RoPE at global positions inside; the documents of a packed batch
    from the model's `_Batch`, set by `parallelize`)."""

    @classmethod
    def from_dense(cls, *args, **kwargs):
        """The layer, its RoPE tables' layout checked now (on its weights' device, the
        model's rotary module's), not only at its first eager call, which a model
        compiled before any eager call skips."""
        layer = super().from_dense(*args, **kwargs)
        device = next(layer.parameters()).device
        if device.type != "meta":
            layer.check_rope_layout(device)
        return layer

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, **kwargs):
        if past_key_values is not None:
            raise ValueError("fusedpar's attention keeps no KV cache: call with use_cache=False")
        batch = getattr(self, "_fusedpar_batch", None)
        cu_seqlens = None if batch is None else batch.cu_seqlens
        x = hidden_states.transpose(0, 1)  # (S_loc, B, d)
        return super().forward(x, cu_seqlens=cu_seqlens).transpose(0, 1), None


class HFParallelAttention(_HFAttentionCall, ParallelAttention):
    """`ParallelAttention` as a Hugging Face attention module (`_HFAttentionCall`)."""


class HFParallelMLA(_HFAttentionCall, ParallelMLA):
    """`ParallelMLA` as a Hugging Face attention module (DeepSeek-V3's)."""


class HFParallelSwiGLU(ParallelSwiGLU):
    """`ParallelSwiGLU` on batch-first hidden states (B, S_loc, d)."""

    def forward(self, hidden_states):
        return super().forward(hidden_states.transpose(0, 1)).transpose(0, 1)


class HFParallelMLP(nn.Module):
    """A plain MLP, ``proj(act(fc(x)))`` (GPT-2, GPT-NeoX): fc column-parallel, proj
    row-parallel, under the original's attribute names; batch-first (B, S_loc, d)."""

    def __init__(self, mlp: nn.Module, names: tuple[str, str], group, activation, tp: dict):
        super().__init__()
        self.names, self.activation = names, activation
        fc, proj = (getattr(mlp, name) for name in names)
        setattr(self, names[0], ColumnParallelLinear.from_dense(fc, group, **tp))
        setattr(self, names[1], RowParallelLinear.from_dense(proj, group, **tp))

    def forward(self, hidden_states):
        fc, proj = (getattr(self, name) for name in self.names)
        x = hidden_states.transpose(0, 1)  # (S_loc, B, d): the layers' layout
        return proj(self.activation(fc(x))).transpose(0, 1)


class HFMoE(MoE):
    """`MoE` returning only y, as HF's sparse blocks do (``(y, None)`` where the block
    returns its router scores beside y: gpt-oss's); its aux loss is kept in
    ``last_aux_loss`` (0 unless ``aux_loss_coef`` is set)."""

    returns_scores = False

    def forward(self, hidden_states):
        y, self.last_aux_loss = super().forward(hidden_states)
        return (y, None) if self.returns_scores else y


def _attention(
    i: int, attn: nn.Module, config, groups, rotary_emb, tp: dict, cp_ring: str
) -> nn.Module:
    cp = dict(tp_group=groups["tp"], cp_group=groups["cp"], ulysses_group=groups.get("ulysses"))
    if families.is_mla(attn):
        options = families.mla_options(attn, config, rotary_emb)
        parts = options.pop("parts")
        return HFParallelMLA.from_dense(
            *parts,
            config.hidden_size,
            config.num_attention_heads,
            **cp,
            **options,
            **tp,
            cp_ring=cp_ring,
        )
    options = families.attention_options(i, attn, config, rotary_emb)
    return HFParallelAttention.from_dense(
        *options.pop("parts"), config.hidden_size, config.num_attention_heads,
        families.kv_heads(config), tp_group=groups["tp"], cp_group=groups["cp"],
        ulysses_group=groups.get("ulysses"), **options, **tp,
    )  # fmt: skip


def _mlp(mlp: nn.Module, config, groups, tp: dict) -> nn.Module:
    if config.model_type in families.PLAIN_MLPS:
        act = families.ACTIVATIONS[families.activation_name(config)]
        return HFParallelMLP(mlp, families.PLAIN_MLPS[config.model_type], groups["tp"], act, tp)
    if not hasattr(mlp, "experts"):
        *parts, bias = families.mlp_parts(mlp)
        act = families.ACTIVATIONS[families.activation_name(config)]
        return HFParallelSwiGLU.from_dense(*parts, groups["tp"], bias=bias, activation=act,
                                           **tp)  # fmt: skip
    if config.model_type == "gpt_oss":
        return _gpt_oss_moe(mlp, config, groups)
    extra = families.router_options(mlp)
    shared = families.shared_expert(mlp)
    if shared is not None:
        extra["shared"] = (shared.gate_proj.weight, shared.down_proj.weight,
                           shared.up_proj.weight)  # fmt: skip
        if getattr(mlp, "shared_expert_gate", None) is not None:
            extra["shared_gate_weight"] = mlp.shared_expert_gate.weight
    stacks, _, _ = families.expert_stacks(mlp, config)  # (E, 2h, d): gate rows, then up
    return HFMoE.from_dense(
        *stacks, groups["ep"], top_k=config.num_experts_per_tok, aux_loss_coef=0.0, **extra
    )


def _gpt_oss_moe(mlp: nn.Module, config, groups) -> "HFMoE":
    """gpt-oss's experts: gate and up interleaved in one (E, d, 2h) tensor (gate the even
    columns), weights stored (in, out), biases on every projection, the clamped SwiGLU;
    its router has a bias and takes the softmax of the top-k logits (= the softmax over
    all, top-k, renormalized)."""
    experts = mlp.experts
    stacks, bias, router_bias = families.expert_stacks(mlp, config)
    layer = HFMoE.from_dense(
        *stacks, groups["ep"], top_k=config.num_experts_per_tok, aux_loss_coef=0.0,
        norm_topk_prob=True, bias=bias, router_bias=router_bias, activation="clamped_swiglu",
        swiglu_alpha=experts.alpha, swiglu_limit=experts.limit,
    )  # fmt: skip
    layer.returns_scores = True  # the decoder layer unpacks (hidden_states, router_scores)
    return layer


def parallelize(
    model: nn.Module,
    dims,
    mesh=None,
    *,
    batch: str = "full",
    overlap=None,
    reduce_dtype=None,
    cp_ring: str = "auto",
):
    """Convert a Hugging Face causal LM, sequence or token classifier of a supported
    family in place (see the module doc and `hf_heads`) and put its parameters on `mesh`
    (``dims.build_mesh`` on the model's device type if None); returns the mesh. Checks
    everything before any collective. `batch`: "full" (the model takes the whole batch
    on every rank) or "local" (this rank's share), see the module doc. `overlap` and
    `reduce_dtype`: the tensor-parallel projections' schedule and the dtype their partial
    sums travel in (`fusedpar.ops.linear`; None: ``FUSEDPAR_OVERLAP`` or "auto", fp32).
    `cp_ring`: what latent attention's (DeepSeek-V3's MLA) ring over cp moves,
    `ParallelMLA`'s ``cp_ring``: "auto" (the latent where it is fewer values a token than
    the expanded heads, on a GPU), "latent" (the ring alone: refused with Ulysses) or
    "expanded" (each rank's heads' K and V). A family without latent attention takes
    "auto" and "expanded" (what its ring moves) and refuses "latent".

    The model's parameters that converted layers copy, and those `distribute` puts on
    the mesh, are replaced: an optimizer built before raises at its first step, on every
    rank ("build the optimizer after parallelize"; `fusedpar.storage.retire`).
    ``model.generate`` raises ValueError at the call (generation needs the Hugging Face
    model back: `save_pretrained`).

    ``dims=None``: one process, every group None, plain parameters (no mesh, no
    ``torch.distributed``): the same layers, for tests and debugging; returns None."""
    import torch.distributed as dist

    if batch not in BATCHES:
        raise ValueError(f"parallelize: batch must be one of {BATCHES}, got {batch!r}")
    if cp_ring not in CP_RINGS:
        raise ValueError(f"parallelize: cp_ring must be one of {CP_RINGS}, got {cp_ring!r}")
    tp = {"overlap": check_overlap(overlap), "reduce_dtype": check_reduce_dtype(reduce_dtype)}
    config = model.config
    families.check_config(config)
    head = heads.head_of(model)
    heads.check_head(model, head, batch, 1 if dims is None else dims.pp)
    if dims is not None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
        dims.validate(world, n_heads=config.num_attention_heads,
                      n_kv_heads=families.kv_heads(config), num_experts=experts)  # fmt: skip
    decoder, layers, attention = families.tree(model, config)
    for i, layer in enumerate(layers):
        families.check_layer(i, layer, config)
    _check_cp_ring(cp_ring, dims, [getattr(layer, attention) for layer in layers], config)
    before = dict(model.named_parameters())  # those replaced are retired
    if dims is None:
        refuse(mesh is not None, "a mesh without dims")
        groups = dict.fromkeys(("dp", "cp", "ulysses", "tp", "ep"))
    else:
        mesh = mesh if mesh is not None else dims.build_mesh(next(model.parameters()).device.type)
        groups = dims.groups(mesh)
    stage_mesh = None if dims is None else dims.stage_mesh(mesh)  # mesh without "pp"
    rotary_emb = getattr(decoder, "rotary_emb", None)  # None: learned absolute positions
    forward_args = list(inspect.signature(model.forward).parameters)
    state = _Batch(batch, stage_mesh, groups, forward_args, head)
    if head == "sequence":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        state.pad_token_id = text.pad_token_id
        model.score.register_forward_hook(functools.partial(_pool, state))
    for i, layer in enumerate(layers):
        attn = _attention(i, getattr(layer, attention), config, groups, rotary_emb, tp, cp_ring)
        attn._fusedpar_batch = state  # the call's packed documents
        setattr(layer, attention, attn)
        layer.mlp = _mlp(layer.mlp, config, groups, tp)
    hf_export.install(model, dims)  # model.save_pretrained: the original's checkpoint
    config.use_cache = False  # training: the converted attention keeps no KV cache
    model._fusedpar_batch = state
    model.register_forward_pre_hook(_take_batch, with_kwargs=True)
    model.register_forward_hook(_add_loss, with_kwargs=True, always_call=True)
    if hasattr(model, "generate"):
        model.generate = _no_generation
    retire_replaced(model, before, "parallelize")
    if dims is None:
        return None
    distribute(model, stage_mesh, names=dims.names)  # a stage's parameters: its sub-mesh under pp
    retire_replaced(model, before, "parallelize")  # distribute's too, under parallelize's name
    return mesh


def _check_cp_ring(cp_ring: str, dims, attentions: list, config) -> None:
    """`parallelize`'s `cp_ring`: "latent" needs latent attention and a plain ring."""
    if cp_ring != "latent":
        return
    if not any(families.is_mla(attn) for attn in attentions):
        raise ValueError(
            f"parallelize: cp_ring='latent' is latent attention's ring, and "
            f"{config.model_type} has none: leave cp_ring out ('auto')"
        )
    if dims is not None and dims.ulysses > 1:
        raise ValueError(
            f"parallelize: cp_ring='latent' moves the latent around the cp ring "
            f"alone, but ulysses = {dims.ulysses}: use 'auto' or 'expanded'"
        )


def _no_generation(*args, **kwargs):
    """A converted model's ``generate``: refused at the call, on every rank."""
    raise ValueError(
        "generate() is not supported on a parallelized model (converted by "
        "fusedpar.integrations.hf.parallelize: its attention keeps no KV cache "
        "and its logits are each rank's tokens'): export it with "
        "fusedpar.integrations.hf.save_pretrained(model, dir) and generate with "
        "the Hugging Face model loaded from dir"
    )


class _Batch:
    """How a converted model takes its batch, and the labels of the call in flight."""

    def __init__(self, kind: str, mesh, groups: dict, forward_args: list, head="causal"):
        self.kind, self.mesh, self.groups, self.head = kind, mesh, groups, head
        self.forward_args = forward_args  # the model's forward, positionally
        self.pending: list = []  # (local labels (shifted: causal), num_items_in_batch) per call
        self.cu_seqlens: torch.Tensor | None = None  # the call's packed documents (int32)
        # sequence classification: each row's pooled position, this rank's tokens' positions
        self.pad_token_id = None
        self.pooled: torch.Tensor | None = None  # (B,) int64
        self.token_positions: torch.Tensor | None = None  # (1, S_loc) int64
        # (fixed: read as plain ints where torch.compile traces the hooks)
        self.sequence_ranks = math.prod(comm.group_size(groups.get(a)) for a in SEQUENCE_AXES)
        self.gathers = mesh is not None and mesh.size() > 1  # the first call's batch check

    def ranks(self) -> int:
        """The ranks that share one sequence: cp x ulysses x tp."""
        return self.sequence_ranks


def _take_batch(module, args, kwargs):
    """Forward pre-hook: refuse what the converted model would get wrong; under "full",
    check the ranks got the same batch and keep this rank's share of it. This rank's
    checks run first, into a `checks.Verdict` gathered with the batch's fingerprints at
    the first call: a refusal is the same ValueError on every rank."""
    state = module._fusedpar_batch
    state.cu_seqlens = None
    kwargs = {**dict(zip(state.forward_args, args, strict=False)), **kwargs}
    verdict = checks.Verdict()
    if state.kind == "local":
        tokens = verdict.run(_read_local, kwargs, state)
        _check_local(tokens, state, verdict)
        kwargs["position_ids"] = _positions(tokens.shape[1] * state.ranks(), tokens, state)
        state.pending.append(None)
        return (), kwargs
    taken = verdict.run(_read_full, kwargs, state)
    _check_same_batch(taken, state, verdict)
    tokens, shifted, positions = taken["tokens"], taken["labels"], taken["position_ids"]
    seq = tokens.shape[1]
    for name in ("input_ids", "inputs_embeds"):
        if kwargs.get(name) is not None:
            kwargs[name] = local_tokens(kwargs[name], state.groups)
    state.token_positions = _positions(seq, tokens, state)
    if state.cu_seqlens is None:
        kwargs["position_ids"] = state.token_positions
    else:  # positions restart in each document (learned positions are looked up there)
        kwargs["position_ids"] = local_tokens(positions.expand(1, seq), state.groups)
    local = None if shifted is None else local_tokens(shifted, state.groups)
    # Hugging Face's classifiers take the mean, whatever num_items_in_batch says
    items = kwargs.pop("num_items_in_batch", None) if state.head == "causal" else None
    kwargs.pop("num_items_in_batch", None)
    state.pending.append((local, items) if local is not None else None)
    return (), kwargs


BATCH_TENSORS = ("tokens", "labels", "position_ids", "attention_mask", "sequence labels")


def _read_call(kwargs) -> torch.Tensor:
    """The checks of a call under either batch mode; returns its input_ids or
    inputs_embeds."""
    if kwargs.get("use_cache"):
        raise ValueError("a model converted by fusedpar keeps no KV cache: use_cache=False")
    if kwargs.get("past_key_values") is not None:
        raise ValueError("a model converted by fusedpar keeps no KV cache: no past_key_values")
    if kwargs.get("logits_to_keep", 0) not in (0, None):
        raise ValueError("logits_to_keep: a converted model's logits are this rank's tokens")
    tokens = kwargs.get("input_ids")
    tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
    if tokens is None or tokens.dim() < 2:
        raise ValueError("a converted model takes input_ids (B, S) or inputs_embeds (B, S, d)")
    if kwargs.get("token_type_ids") is not None:
        raise ValueError("token_type_ids are not sharded by a converted model: leave them out")
    return tokens


def _read_full(kwargs, state) -> dict:
    """batch="full": this rank's checks of the call (`kwargs`: its mask, positions and
    labels popped, the model's own kwargs left); returns {`BATCH_TENSORS` name: tensor or
    None}, the labels shifted (a causal LM's), as every rank of a cp x tp group must
    hold them. Sets the state's packed documents and pooled positions."""
    tokens = _read_call(kwargs)
    seq = tokens.shape[1]
    check_shards(seq, state.groups)
    mask, positions = kwargs.pop("attention_mask", None), kwargs.pop("position_ids", None)
    if torch.compiler.is_compiling():  # no host read in a graph: asserted inside it
        _assert_whole(mask, positions, tokens.shape[:2])
        mask = positions = None
    if positions is not None:
        state.cu_seqlens = packed_documents(positions, tokens.shape[:2])
    # sequence classification: Hugging Face's own loss of the pooled logits takes labels
    pooled_labels = kwargs.get("labels") if state.head == "sequence" else None
    labels = None if state.head == "sequence" else kwargs.pop("labels", None)
    shifted = kwargs.pop("shift_labels", None)
    if shifted is not None and state.head != "causal":
        raise ValueError("shift_labels are a causal LM's: pass labels")
    if labels is not None and shifted is not None:
        raise ValueError("pass labels or shift_labels, not both")
    if labels is not None:  # Hugging Face shifts inside a causal LM: over the whole sequence
        shifted = F.pad(labels[:, 1:], (0, 1), value=-100) if state.head == "causal" else labels
    if shifted is not None and tuple(shifted.shape) != tuple(tokens.shape[:2]):
        raise ValueError(
            f"labels must be (B, S) = {tuple(tokens.shape[:2])}, like the input, "
            f"got {tuple(shifted.shape)}"
        )
    if pooled_labels is not None and (
        pooled_labels.dim() == 0 or pooled_labels.shape[0] != tokens.shape[0]
    ):
        raise ValueError(
            f"sequence classification labels must be one per row, (B,) or "
            f"(B, num_labels) with B = {tokens.shape[0]}, got {tuple(pooled_labels.shape)}"
        )
    if state.head == "sequence":
        state.pooled = heads.pooled_positions(kwargs.get("input_ids"), tokens, state.pad_token_id)
    if mask is not None:
        pooled = state.pooled if state.head == "sequence" else None
        packed = state.cu_seqlens is not None
        heads.check_padding(
            mask, tokens.shape[:2], state.head, labels=shifted, pooled=pooled, packed=packed
        )
    given = (tokens, shifted, positions, mask, pooled_labels)
    return dict(zip(BATCH_TENSORS, given, strict=True))


def _assert_whole(mask, positions, shape) -> None:
    """While torch.compile traces: the mask and positions a compiled call takes, those of
    whole sequences (a tokenizer's all-ones mask, position_ids 0..S-1), asserted inside
    the graph (a RuntimeError when it runs otherwise), as reading them on the host (the
    eager checks) would break the graph: padding and packed documents need eager calls."""
    batch, seq = shape
    if mask is not None:
        if tuple(mask.shape) != (batch, seq):
            raise ValueError(
                f"attention_mask must be (B, S) = {(batch, seq)}, got {tuple(mask.shape)}"
            )
        torch._assert_async(
            (mask == 1).all(),
            "a compiled model converted by fusedpar "
            "takes no padding: attention_mask all ones, or left out",
        )
    if positions is not None:
        if positions.shape[-1] != seq or positions.dim() > 2:
            raise ValueError(
                f"position_ids must be (B, S) = {(batch, seq)}, got {tuple(positions.shape)}"
            )
        whole = (positions == torch.arange(seq, device=positions.device)).all()
        torch._assert_async(
            whole,
            "a compiled model converted by fusedpar takes "
            "position_ids 0..S-1, or none: packed documents need eager calls",
        )


def _check_same_batch(taken: dict | None, state, verdict) -> None:
    """The same ValueError on every rank unless every rank passed its checks (`verdict`)
    and the ranks of each cp x tp group (all but dp) hold equal tensors (`taken`, None
    where this rank refused): one all-gather of the verdicts and the tensors' shapes and
    fingerprints over the stage's mesh, at the first call (every call under
    FUSEDPAR_CHECKS=all, `fusedpar.checks`), where the mesh has more than one rank (dp
    alone too: a refusal stops every rank); otherwise this rank's refusal, alone."""
    given = [t for t in (taken or {}).values() if t is not None]
    if not state.gathers or not checks.due(state, *given):
        verdict.reraise()
        return
    fields = {name: checks.Content((taken or {}).get(name)) for name in BATCH_TENSORS}
    hint = (
        "The ranks of a cp x tp group got different batches: each takes the whole batch, "
        "the same on every rank of its group (the model shards it), or parallelize with "
        "batch='local' and pass local_tokens(input_ids, groups)"
    )
    checks.agree_on_mesh(
        "batch='full'", state.mesh, fields, verdict, apart=_dp_axis(state), hint=hint
    )
    checks.passed(state)


def packed_documents(positions: torch.Tensor, shape) -> torch.Tensor | None:
    """The documents of a packed batch, as Hugging Face's packing collators give them
    (``DataCollatorWithFlattening``): position_ids (1, S) that restart at 0 at each
    document's start and rise by 1 within it. Returns cu_seqlens (int32; None for one
    whole sequence, ``0..S-1``), for a batch of `shape` (B, S). Anything else (offsets,
    padding) raises."""
    batch, seq = shape
    if positions.shape[-1] != seq or positions.dim() > 2:
        raise ValueError(f"position_ids must be (B, S) = {(batch, seq)}, got "
                         f"{tuple(positions.shape)}")  # fmt: skip
    expected = torch.arange(seq, device=positions.device)
    positions = positions.reshape(-1, seq)
    if bool((positions == expected).all()):
        return None
    starts = positions == 0
    rises = positions[:, 1:] == positions[:, :-1] + 1
    if not bool(starts[:, 0].all()) or not bool((rises | starts[:, 1:]).all()):
        raise ValueError("position_ids must be 0..S-1, or restart at 0 at each packed "
                         "document's start and rise by 1 within it (no offsets, no "
                         "padding)")  # fmt: skip
    if positions.shape[0] != 1 or batch != 1:
        raise ValueError("packed documents (position_ids that restart) take one sequence "
                         f"(B = 1), as Hugging Face's flattening collator makes; got B = "
                         f"{batch}")  # fmt: skip
    p = positions[0]
    bounds = torch.cat([starts[0].nonzero().flatten(), p.new_tensor([seq])])
    return bounds.to(torch.int32)


def _positions(full_len: int, tokens, state) -> torch.Tensor:
    """(1, S_loc): the global positions of this rank's tokens of a `full_len` sequence,
    given to the model as its position_ids: learned absolute positions (GPT-2) are
    looked up there; fusedpar's attention applies RoPE itself."""
    positions = torch.arange(full_len, device=tokens.device)[None]
    return local_tokens(positions, state.groups)


def _read_local(kwargs, state) -> torch.Tensor:
    """batch="local": this rank's checks of the call: what only the caller can shard is
    refused, and its share must make a whole sequence that splits into the shards.
    Returns the tokens."""
    tokens = _read_call(kwargs)
    if kwargs.get("attention_mask") is not None:
        raise ValueError(
            "a model converted by fusedpar is causal over whole sequences: "
            "pass attention_mask=None (batch='local')"
        )
    if kwargs.get("position_ids") is not None:
        raise ValueError(
            "a converted model takes no position_ids: RoPE is applied at the "
            "global positions of the local tokens"
        )
    if kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None:
        if state.head == "token":
            raise ValueError(
                "labels= under batch='local': compute the loss of the logits "
                "with local_tokens(labels, groups), or parallelize with batch='full'"
            )
        raise ValueError(
            "labels= would shift within each rank's shard (batch='local'): compute the loss "
            "with next_token_labels and local_tokens, or parallelize with batch='full'"
        )
    share, ranks = tokens.shape[1], state.ranks()
    what = f"batch='local': this rank's {share} tokens (x {ranks} ranks = {share * ranks})"
    check_shards(share * ranks, state.groups, what)
    return tokens


def _check_local(tokens: torch.Tensor | None, state, verdict) -> None:
    """batch="local", at the first call (every call under FUSEDPAR_CHECKS=all): the same
    ValueError on every rank where a rank refused its call (`verdict`; `tokens` None
    there), where the ranks sharing a sequence (all but dp) hold shares of different
    shapes, or where a batch looks unsharded (the same tokens on the ranks of tp, or of
    cp): one all-gather over the stage's mesh of the verdicts, the shapes and the
    tokens' fingerprints, where the mesh has more than one rank; otherwise this rank's
    refusal, alone."""
    if not state.gathers or not checks.due(state, *([] if tokens is None else [tokens])):
        verdict.reraise()
        return
    mesh, dp = state.mesh, _dp_axis(state)
    shape = () if tokens is None else tokens.shape
    fingerprint = [0, 0, 0] if tokens is None else comm.fingerprint(tokens).tolist()
    hint = (
        "Each rank takes its own share of one batch, local_tokens(input_ids, groups), of "
        "one shape on the ranks of a cp x tp group"
    )
    shares = checks.agree_on_mesh(
        "batch='local'", mesh, {"tokens": shape}, verdict, apart=dp, hint=hint, carried=fingerprint
    )
    table = torch.tensor([shares[rank] for rank in mesh.mesh.flatten().tolist()])
    table = table.view(*mesh.shape, 3)
    for axis, name in enumerate(mesh.mesh_dim_names):
        if axis == dp or mesh.size(axis) == 1:
            continue
        same = (table.amax(axis) == table.amin(axis)).all(-1)  # the mesh without `axis`
        if bool(same.any()):
            where = tuple(int(i) for i in same.nonzero()[0])
            alike = mesh.mesh.movedim(axis, -1)[where].tolist()  # the ranks along `axis` there
            raise ValueError(
                f"batch='local': the ranks of mesh axis {name!r} hold the same tokens "
                f"({checks.ranks_text(alike)}, for one); each takes its own share, "
                "local_tokens(input_ids, groups) (or parallelize with batch='full' and "
                "pass the whole batch)"
            )
    checks.passed(state)


def _dp_axis(state) -> int | None:
    """The index of the mesh's dp axis (whatever its name), None without one."""
    from fusedpar.storage import mesh_axes_of

    names = mesh_axes_of(state.groups.get("dp"), state.mesh)
    return state.mesh.mesh_dim_names.index(names[0]) if names else None


def _pool(state, module, args, output):
    """Forward hook on a sequence classifier's score: its logits (B, S_loc, L) of this
    rank's tokens -> each row's logits at its pooled token (`_Batch.pooled`), wherever
    that token lives, the same on every rank; returned repeated over the S_loc positions,
    where Hugging Face's forward picks one of them per row. The sum over the ranks enters
    detached: the gradient reaches the owner's token only, once."""
    mine = state.token_positions == state.pooled[:, None]  # (B, S_loc): at most one per row
    local = torch.where(mine[..., None], output, output.new_zeros(())).sum(1)  # (B, L)
    total = local.detach()
    for axis in SEQUENCE_AXES:  # one rank holds the token, the others add zeros: exact
        total = comm.all_reduce(total, state.groups.get(axis))
    pooled = total + (local - local.detach())  # the value: total's; the gradient: local's
    return pooled[:, None].expand_as(output)


def _add_loss(module, args, kwargs, output):
    """Forward hook: under "full" with labels (a causal LM's, or a token classifier's),
    the loss over the whole sequence. Its value is the global mean (Hugging Face's, or the
    sum over `num_items_in_batch`); its gradient is this rank's tokens' share, which
    `distribute` sums over cp and tp."""
    state = module._fusedpar_batch
    pending = state.pending.pop() if state.pending else None
    if pending is None or output is None:
        return output
    labels, num_items = pending
    logits = output.logits if hasattr(output, "logits") else output[0]
    wide = accumulator(logits.dtype)  # fp32 (Hugging Face's upcast); float64 stays float64
    local_sum = F.cross_entropy(logits.flatten(0, 1).to(wide), labels.flatten(),
                                ignore_index=-100, reduction="sum")  # fmt: skip
    totals = torch.stack([local_sum.detach(), (labels != -100).sum().to(local_sum.dtype)])
    for axis in SEQUENCE_AXES:
        totals = comm.all_reduce(totals, state.groups.get(axis))
    denominator = totals[1] if num_items is None else num_items
    # the total's value on every rank, bit for bit (x - x is 0: local + (total - local)
    # would round differently per rank); the gradient this rank's tokens'
    loss = (totals[0] + (local_sum - local_sum.detach())) / denominator
    if hasattr(output, "logits"):
        output.loss = loss
        return output
    return (loss, *output)


def check_shards(seq: int, groups: dict, what: str | None = None) -> None:
    """ValueError unless a sequence of `seq` tokens splits into this sharding's chunks:
    2 x CP (zigzag), each CP shard into ULYSSES parts, each of those into TP chunks.
    `what`: the tokens' name in the message (the batch's `seq` tokens)."""
    cp, ulysses, tp = (comm.group_size(groups.get(axis)) for axis in SEQUENCE_AXES)
    chunks = 2 * cp if cp > 1 else 1
    per_rank = seq // chunks // ulysses
    what = what or f"the batch's {seq} tokens"
    if seq % chunks or (seq // chunks) % ulysses or per_rank % tp:
        raise ValueError(
            f"{what} do not split into its shards: "
            f"zigzag over cp ({chunks} chunks), then ulysses ({ulysses}), then tp ({tp}); "
            f"pad or cut the sequences to a multiple of {chunks * ulysses * tp}"
        )


def local_tokens(t: torch.Tensor, groups: dict) -> torch.Tensor:
    """(B, S, ...) on every rank -> this rank's (B, S / CP / ULYSSES / TP, ...): the zigzag
    CP shard of the sequence, its contiguous part over the Ulysses group (the hybrid
    layout), then this TP rank's chunk of it."""
    check_shards(t.shape[1], groups)
    t = shard_sequence(t, groups["cp"], dim=1, ulysses_group=groups.get("ulysses"))
    tp = comm.group_size(groups["tp"])
    return t.chunk(tp, dim=1)[comm.group_rank(groups["tp"])]


def full_logits(logits: torch.Tensor, groups: dict) -> torch.Tensor:
    """The inverse of `local_tokens` (differentiable): (B, S / CP / ULYSSES / TP, V) ->
    (B, S, V)."""
    logits = comm.gather_from_region(logits, groups["tp"], dim=1)
    return gather_sequence(logits, groups["cp"], dim=1, ulysses_group=groups.get("ulysses"))


def next_token_labels(input_ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """(B, S) -> labels (B, S): token i+1 at i, `ignore_index` last. Shift before sharding:
    a shard's last token's label lives on another rank."""
    labels = torch.full_like(input_ids, ignore_index)
    labels[:, :-1] = input_ids[:, 1:]
    return labels

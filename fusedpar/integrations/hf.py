"""Hugging Face decoder models in one call: `parallelize(model, dims)`.

    dims = fp.ParallelDims(cp=2, tp=2, ep="tp")
    mesh = parallelize(model, dims)              # in place; returns the mesh
    out = model(input_ids=ids, labels=ids)       # the whole batch, as for the original
    out.loss.backward()                          # the original's loss, on every rank
    out.logits                                   # this rank's tokens: (B, S/CP/U/TP, V)

Each decoder layer's attention becomes a `ParallelAttention` (heads over tp, sequence
over cp and ulysses; a hybrid's linear attention a `GatedDeltaNet`, Kimi Linear's a
`KimiDeltaAttention`), its MLP a
`ParallelSwiGLU` or a `MoE` (experts over ep); embeddings, norms and the head stay
Hugging Face's; `fusedpar.distribute` puts every
parameter on the mesh. ``batch="full"`` (default): every rank of a cp x tp group takes
the same (B, S) batch (unpadded but for `hf_heads`' right padding, or packed documents
by ``position_ids``), its share cut zigzag over cp, then over ulysses, then tp;
``batch="local"``: this rank's share (`local_tokens`). `full_logits` gathers the logits.
Families: `hf_families.FAMILIES`; heads: `hf_heads.HEADS`. Anything the converted model
would not compute exactly raises ValueError naming it, on every rank, before any
collective. Back to Hugging Face: `save_pretrained` (`hf_export`). docs/dropin.md.
"""

import dataclasses
import functools
import inspect

import torch
from torch import nn

from fusedpar.integrations import hf_export
from fusedpar.integrations import hf_families as families
from fusedpar.integrations import hf_heads as heads
from fusedpar.integrations import hf_specs as specs
from fusedpar.integrations.hf_batch import (  # noqa: F401 (public here: the users' helpers)
    BATCHES,
    Batch,
    add_loss,
    check_shards,
    full_logits,
    local_tokens,
    next_token_labels,
    packed_documents,
    pool,
    take_batch,
)
from fusedpar.integrations.hf_export import save_pretrained  # noqa: F401 (public here)
from fusedpar.integrations.hf_families import refuse
from fusedpar.integrations.hf_pipeline import DecoderStages
from fusedpar.nn import (
    ColumnParallelLinear,
    GatedDeltaNet,
    KimiDeltaAttention,
    MoE,
    ParallelAttention,
    ParallelMLA,
    ParallelSwiGLU,
    RowParallelLinear,
)
from fusedpar.nn.linear import linear_parts
from fusedpar.nn.specs import CP_RINGS
from fusedpar.placement import Placement
from fusedpar.storage import distribute, retire_replaced


def __getattr__(name: str):
    """``hf.Trainer`` and ``hf.ParallelTrainerMixin`` (`hf_trainer`), imported at first
    use: Hugging Face's Trainer takes a second to import and needs accelerate, which
    `parallelize` does not."""
    if name in ("Trainer", "ParallelTrainerMixin"):
        from fusedpar.integrations import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _HFAttentionCall:
    """Called as a Hugging Face attention module: hidden_states (B, S_loc, d)
    batch-first in, ``(output, None)`` out; HF's mask and position embeddings are
    ignored (causal, RoPE at global positions inside; the documents of a packed batch
    from the model's `Batch`, set by `parallelize`)."""

    @classmethod
    def from_dense(cls, *args, **kwargs):
        """The layer, its RoPE tables' layout checked now (on its weights' device, the
        model's rotary module's), not only at its first eager call, which a model
        compiled before any eager call skips."""
        return _rope_checked(super().from_dense(*args, **kwargs))

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


class HFGatedDeltaNet(GatedDeltaNet):
    """`GatedDeltaNet` called as a Hugging Face hybrid's linear attention: hidden_states
    (B, S_loc, d) batch-first in, the output alone out (as Hugging Face's decoder layers
    take it); no cache; the documents of a packed batch from the model's `Batch`: the
    conv and the recurrent state restart at each."""

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        if cache_params is not None:
            raise ValueError("fusedpar's GatedDeltaNet keeps no cache: call with use_cache=False")
        batch = getattr(self, "_fusedpar_batch", None)
        cu_seqlens = None if batch is None else batch.cu_seqlens
        x = hidden_states.transpose(0, 1)  # (S_loc, B, d)
        return super().forward(x, cu_seqlens=cu_seqlens).transpose(0, 1)


class HFKimiDeltaAttention(KimiDeltaAttention):
    """`KimiDeltaAttention` called as Kimi Linear's KDA module, as `HFGatedDeltaNet` is."""

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        if cache_params is not None:
            raise ValueError("fusedpar's KDA keeps no cache: call with use_cache=False")
        batch = getattr(self, "_fusedpar_batch", None)
        cu_seqlens = None if batch is None else batch.cu_seqlens
        x = hidden_states.transpose(0, 1)  # (S_loc, B, d)
        return super().forward(x, cu_seqlens=cu_seqlens).transpose(0, 1)


class HFParallelSwiGLU(ParallelSwiGLU):
    """`ParallelSwiGLU` on batch-first hidden states (B, S_loc, d)."""

    def forward(self, hidden_states):
        return super().forward(hidden_states.transpose(0, 1)).transpose(0, 1)


class HFParallelMLP(nn.Module):
    """A plain MLP, ``proj(act(fc(x)))`` (GPT-2, GPT-NeoX): fc column-parallel, proj
    row-parallel over the placement's TP group, under the original's attribute names;
    batch-first (B, S_loc, d)."""

    def __init__(self, mlp: nn.Module, names: tuple[str, str], activation, placement: Placement):
        super().__init__()
        self.names, self.activation = names, activation
        fc, proj = (getattr(mlp, name) for name in names)
        group, overlap, reduce_dtype = (
            placement.tp_group,
            placement.overlap,
            placement.reduce_dtype,
        )
        column = ColumnParallelLinear.from_dense(
            fc, group, overlap=overlap, reduce_dtype=reduce_dtype
        )
        row = RowParallelLinear.from_dense(proj, group, overlap=overlap, reduce_dtype=reduce_dtype)
        setattr(self, names[0], column)
        setattr(self, names[1], row)

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


def _rope_checked(layer: nn.Module) -> nn.Module:
    """`layer` (an attention), its RoPE tables' layout checked now (on its weights'
    device, the model's rotary module's), not only at its first eager call, which a
    model compiled before any eager call skips."""
    device = next(layer.parameters()).device
    if device.type != "meta":
        layer.check_rope_layout(device)
    return layer


def _empty(cls, spec, placement: Placement, like: torch.Tensor) -> nn.Module:
    """``cls.from_spec(spec, placement)`` uninitialized, on `like`'s device in its dtype
    (as `from_dense` builds a layer, to load the dense weights into)."""
    layer = cls.from_spec(spec, placement, device="meta", dtype=like.dtype)
    return layer.to_empty(device=like.device)


def _attention(
    i: int, attn: nn.Module, config, placement: Placement, rotary_emb, cp_ring: str
) -> nn.Module:
    if families.is_gdn(attn):  # a hybrid's linear attention: its layout read off the module
        return HFGatedDeltaNet.from_dense(attn, placement)
    if families.is_kda(attn):  # Kimi Linear's
        return HFKimiDeltaAttention.from_dense(attn, placement)
    if families.is_mla(attn):
        spec = dataclasses.replace(specs.mla_spec(attn, config, rotary_emb), cp_ring=cp_ring)
        weights, cls = specs.mla_weights(attn, config), HFParallelMLA
    else:
        spec = specs.attention_spec(i, attn, config, rotary_emb)
        weights, cls = specs.attention_weights(attn, config), HFParallelAttention
    layer = _empty(cls, spec, placement, weights.like)
    weights.load_into(layer)
    return _rope_checked(layer)


def _mlp(mlp: nn.Module, config, placement: Placement) -> nn.Module:
    if config.model_type in families.PLAIN_MLPS:
        act = families.ACTIVATIONS[families.activation_name(config)]
        return HFParallelMLP(mlp, families.PLAIN_MLPS[config.model_type], act, placement)
    if not hasattr(mlp, "experts"):
        gate, up, down, bias = families.mlp_parts(mlp)
        like = linear_parts("gate", gate, None if bias is None else bias[0])[0]
        layer = _empty(HFParallelSwiGLU, specs.mlp_spec(mlp, config), placement, like)
        layer.load_dense(gate, up, down, bias=bias)
        return layer
    # Hugging Face's experts: gate and up in one (E, 2h, d), gate rows first; gpt-oss's
    # interleaved in one (E, d, 2h) (gate the even columns), stored (in, out), biases on
    # every projection, the clamped SwiGLU, a router with a bias taking the softmax of
    # the top-k logits (= the softmax over all, top-k, renormalized)
    weights = specs.expert_weights(mlp, config)
    layer = _empty(HFMoE, specs.moe_spec(mlp, config), placement, weights.w1)
    if layer.expert_bias is not None:
        layer.expert_bias.zero_()
    weights.load_into(layer)
    # gpt-oss's decoder layer unpacks (hidden_states, router_scores)
    layer.returns_scores = config.model_type == "gpt_oss"
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
    one_rank = Placement(overlap=overlap, reduce_dtype=reduce_dtype)  # checked: no collective
    config = model.config
    families.check_config(config)
    head = heads.head_of(model)
    heads.check_head(model, head, batch, 1 if dims is None else dims.pp)
    if dims is not None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
        dims.validate(
            world,
            n_heads=config.num_attention_heads,
            n_kv_heads=families.kv_heads(config),
            num_experts=experts,
        )
        families.check_dims(config, dims.cp, dims.ulysses, dims.tp)
    decoder, layers, _ = families.tree(model, config)
    for i, layer in enumerate(layers):
        families.check_layer(i, layer, config)
    mixers = [families.mixer_name(layer, config) for layer in layers]  # attention's attribute
    attentions = [getattr(layer, name) for layer, name in zip(layers, mixers, strict=True)]
    _check_cp_ring(cp_ring, dims, attentions, config)
    before = dict(model.named_parameters())  # those replaced are retired
    if dims is None:
        refuse(mesh is not None, "a mesh without dims")
        groups, placement = dict.fromkeys(("dp", "cp", "ulysses", "tp", "ep")), one_rank
    else:
        mesh = mesh if mesh is not None else dims.build_mesh(next(model.parameters()).device.type)
        groups = dims.groups(mesh)
        placement = dims.placement(mesh, overlap=overlap, reduce_dtype=reduce_dtype)
    stage_mesh = None if dims is None else dims.stage_mesh(mesh)  # mesh without "pp"
    rotary_emb = getattr(decoder, "rotary_emb", None)  # None: learned absolute positions
    forward_args = list(inspect.signature(model.forward).parameters)
    state = Batch(batch, stage_mesh, groups, forward_args, head)
    if head == "sequence":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        state.pad_token_id = text.pad_token_id
        model.score.register_forward_hook(functools.partial(pool, state))
    for i, (layer, name) in enumerate(zip(layers, mixers, strict=True)):
        attn = _attention(i, getattr(layer, name), config, placement, rotary_emb, cp_ring)
        attn._fusedpar_batch = state  # the call's packed documents
        setattr(layer, name, attn)
        layer.mlp = _mlp(layer.mlp, config, placement)
    hf_export.install(model, dims)  # model.save_pretrained: the original's checkpoint
    config.use_cache = False  # training: the converted attention keeps no KV cache
    model._fusedpar_batch = state
    # what fp.pipeline.split runs as the stages (the core imports no integration)
    model.fusedpar_pipeline_stages = functools.partial(DecoderStages, model)
    model.register_forward_pre_hook(take_batch, with_kwargs=True)
    model.register_forward_hook(add_loss, with_kwargs=True, always_call=True)
    if hasattr(model, "generate"):
        model.generate = _no_generation
    if dims is not None:  # a stage's parameters: its sub-mesh under pp
        distribute(model, stage_mesh, names=dims.names)
    retire_replaced(model, before, "parallelize")  # distribute's too, under parallelize's name
    return mesh  # (None without dims)


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

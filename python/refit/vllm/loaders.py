"""Loader rules of a vLLM model, derived from its layers (no rules written by hand).

:func:`loader_rules` walks a vLLM model (the ``torch.nn.Module`` a worker holds) and returns the
:class:`refit.Loader` rules that map the trainer's canonical (Hugging Face) tensors onto this
worker's tensor-parallel shard, from vLLM's own layer objects:

==================================  ===========================================================
vLLM layer (``model_executor``)     rule
==================================  ===========================================================
``QKVParallelLinear``               ``qkv`` from the canonical ``q_proj``, ``k_proj``, ``v_proj``
                                    (weight and bias), with the layer's ``total_num_heads`` and
                                    ``total_num_kv_heads`` (kv heads replicated when fewer than
                                    the TP ranks, as vLLM does)
``MergedColumnParallelLinear``      ``gate_up`` from ``gate_proj`` and ``up_proj`` (two equal
                                    outputs, per the model's ``packed_modules_mapping``)
``ColumnParallelLinear``            ``row`` (dim 0 split)
``RowParallelLinear``               ``column`` (dim 1 split); its bias is replicated
``VocabParallelEmbedding``,         ``vocab`` with the layer's ``org_vocab_size``, and as
``ParallelLMHead``                  ``pad_to`` its rows per rank (vLLM pads V to a multiple of
                                    ``padding_size``, then splits it evenly; refit's rule pads to
                                    pad_to × TP); a head tied to the embedding is ``skip``
                                    (vLLM loads the tied tensor once, under the embedding's name)
``RoutedExperts`` (``FusedMoE``'s    ``expert_gate_up`` / ``expert_down`` for the per-expert
expert stacks ``w13_weight``,       checkpoint names (``experts.{e}.gate_proj.weight``, …) and
``w2_weight``)                      ``stacked_gate_up`` / ``stacked_down`` for the stacked ones
                                    (transformers ≥ 5: ``experts.gate_up_proj`` [E, 2I, H],
                                    ``experts.down_proj`` [E, H, I]), with the layer's expert map
                                    (expert parallelism: which global expert each local slot
                                    holds) and the MoE layer's own TP coordinates (1 under EP)
``ReplicatedLinear``, norms, and    identity
parameters of plain modules
==================================  ===========================================================

The canonical names are the local ones with the packed module names unpacked (``qkv_proj`` →
``q_proj`` / ``k_proj`` / ``v_proj``), which is what vLLM's ``hf_to_vllm_mapper`` inverts for
the supported architectures (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Gemma-style tied heads).
Any other vLLM parallel layer raises InvalidArgument naming the parameter it could not map, and so
do expert layers that are not a plain slice of the checkpoint (quantized, biased, non-gated,
padded, with fused shared or EPLB-redundant experts). The rules are checked element by element against vLLM's own
``load_weights`` by python/tests/test_vllm_probe.py.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List

from refit.errors import InvalidArgument

__all__ = ["loader_rules"]

#: vLLM layer classes whose parameters a rule below maps (class names, so that this module imports
#: without vLLM). Subclasses count by their nearest known base.
_QKV = "QKVParallelLinear"
_GATE_UP = "MergedColumnParallelLinear"
_COLUMN_PARALLEL = "ColumnParallelLinear"
_ROW_PARALLEL = "RowParallelLinear"
_VOCAB = "VocabParallelEmbedding"
_REPLICATED = "ReplicatedLinear"
_EXPERTS = "RoutedExperts"
_KNOWN = (_QKV, _GATE_UP, _COLUMN_PARALLEL, _ROW_PARALLEL, _VOCAB, _REPLICATED, _EXPERTS)

#: Where vLLM's tensor- and expert-parallel layers live: a layer from these modules that is none
#: of the known classes is one whose sharding refit does not know.
_PARALLEL_LAYER_MODULES = (
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.vocab_parallel_embedding",
    "vllm.model_executor.layers.fused_moe",
)

#: The packed modules of the supported architectures (vLLM's ``packed_modules_mapping``).
_DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _kind_of(module: Any) -> str:
    """The nearest known vLLM layer class in ``module``'s MRO, "" for none, "?" for an unknown
    vLLM parallel layer (one this module cannot map)."""
    for cls in type(module).__mro__:
        if cls.__name__ in _KNOWN:
            return cls.__name__
    for cls in type(module).__mro__:
        if cls.__module__.startswith(_PARALLEL_LAYER_MODULES) or "MoE" in cls.__name__ or "Experts" in cls.__name__:
            return "?"
    return ""


def _exact(name: str) -> str:
    return re.escape(name)


def _expert_rules(module: Any, prefix: str) -> List[Dict[str, Any]]:
    """The rules of one ``RoutedExperts`` layer (its ``w13_weight`` and ``w2_weight``).

    The canonical names are those vLLM's ``RoutedExperts.load_weights`` accepts: per expert
    (``{layer}.{e}.{gate}.weight``, ``…{up}…``, ``…{down}…`` with the layer's checkpoint names)
    and stacked (``{layer}.gate_up_proj`` / ``{layer}.down_proj``, or ``w13`` / ``w2`` for
    Mixtral-style names).
    """
    config = module.moe_config
    parameters = [n for n, _ in module.named_parameters(prefix="", recurse=False)]
    where = f"refit.vllm: expert layer '{prefix}' ({type(module).__name__})"
    if sorted(parameters) != ["w13_weight", "w2_weight"]:
        extra = sorted(set(parameters) - {"w13_weight", "w2_weight"})
        raise InvalidArgument(
            f"{where}: parameter '{prefix}.{extra[0] if extra else parameters}' is not a plain expert "
            "stack (only the unquantized, bias-free w13_weight and w2_weight are mapped); pass "
            "loader_rules"
        )
    if not config.is_act_and_mul or module.ckpt_up_proj_name is None:
        raise InvalidArgument(f"{where}: parameter '{prefix}.w13_weight': a non-gated MoE is not mapped")
    if module.is_fused_checkpoint_transposed:
        raise InvalidArgument(f"{where}: parameter '{prefix}.w13_weight': transposed fused checkpoints are not mapped")
    num_experts = int(config.num_experts)
    if num_experts != int(config.num_logical_experts) or module.expert_map_manager.num_fused_shared_experts:
        raise InvalidArgument(
            f"{where}: parameter '{prefix}.w13_weight': EPLB-redundant or fused shared experts "
            f"({config.num_experts} physical, {config.num_logical_experts} logical) are not mapped"
        )
    if config.hidden_dim_unpadded is not None and int(config.hidden_dim_unpadded) != int(module.hidden_size):
        raise InvalidArgument(
            f"{where}: parameter '{prefix}.w13_weight': the hidden size is padded "
            f"({config.hidden_dim_unpadded} → {module.hidden_size}) by the MoE backend"
        )
    slots = int(module.local_num_experts)
    expert_map = module.expert_map
    if expert_map is None:
        experts = list(range(slots))
    else:
        experts = [-1] * slots
        for expert, slot in enumerate(expert_map.tolist()):
            if slot >= 0:
                experts[slot] = expert
        if -1 in experts:
            raise InvalidArgument(f"{where}: its expert map {expert_map.tolist()} leaves slot {experts.index(-1)} empty")
    parallel = config.moe_parallel_config
    common = {
        "num_experts": num_experts,
        "experts": experts,
        "expert_tp_rank": int(parallel.tp_rank),
        "expert_tp_size": int(parallel.tp_size),
    }
    layer = _exact(module.layer_name)
    gate, up, down = (_exact(n) for n in (module.ckpt_gate_proj_name, module.ckpt_up_proj_name, module.ckpt_down_proj_name))
    w13, w2 = f"{prefix}.w13_weight", f"{prefix}.w2_weight"
    # vLLM's own names of a stacked gate/up (build_expert_params_mapping); down keeps its name.
    checkpoint_names = (module.ckpt_gate_proj_name, module.ckpt_up_proj_name)
    stacked_gate_up = "gate_up_proj" if checkpoint_names == ("gate_proj", "up_proj") else "w13"
    stacked_down = down
    return [
        dict(common, kind="expert_gate_up", gate=rf"{layer}\.(\d+)\.{gate}\.weight",
             up=rf"{layer}\.(\d+)\.{up}\.weight", to=w13, expert_group=1),
        dict(common, kind="expert_down", match=rf"{layer}\.(\d+)\.{down}\.weight", to=w2, expert_group=1),
        dict(common, kind="stacked_gate_up", match=rf"{layer}\.{stacked_gate_up}", to=w13),
        dict(common, kind="stacked_down", match=rf"{layer}\.{stacked_down}", to=w2),
    ]


def loader_rules(model: Any) -> List[Dict[str, Any]]:
    """Return the loader rules of ``model`` (a vLLM model on one TP rank), in module order.

    Raises InvalidArgument naming the first parameter no rule can map (an unsupported vLLM
    layer, or a packed layer whose parts the model's ``packed_modules_mapping`` does not name).
    """
    packed = dict(_DEFAULT_PACKED)
    packed.update(getattr(type(model), "packed_modules_mapping", None) or {})
    rules: List[Dict[str, Any]] = []
    first_name_of: Dict[int, str] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        kind = _kind_of(module)
        direct = list(module.named_parameters(prefix="", recurse=False, remove_duplicate=False))
        if not direct:
            continue
        if kind == _EXPERTS:
            rules.extend(_expert_rules(module, prefix))
            continue
        base = f"{prefix}." if prefix else ""
        head, _, leaf = prefix.rpartition(".")
        head = f"{head}." if head else ""
        for pname, param in direct:
            name = base + pname
            first = first_name_of.setdefault(id(param), name)
            if first != name:  # a tied alias: vLLM loads the tensor once, under its first name
                rules.append({"kind": "skip", "match": _exact(name)})
                continue
            if kind in ("", _REPLICATED):
                continue  # identity (a name no rule matches)
            if kind == "?":
                raise InvalidArgument(
                    f"refit.vllm: parameter '{name}' belongs to {type(module).__name__}, a vLLM "
                    "layer refit cannot map yet (supported: QKVParallelLinear, "
                    "MergedColumnParallelLinear, ColumnParallelLinear, RowParallelLinear, "
                    "VocabParallelEmbedding/ParallelLMHead, ReplicatedLinear, RoutedExperts); "
                    "pass loader_rules"
                )
            if pname not in ("weight", "bias"):
                raise InvalidArgument(
                    f"refit.vllm: parameter '{name}' of {type(module).__name__}: only the "
                    "unquantized 'weight' and 'bias' of vLLM's parallel layers are mapped (a "
                    "quantized or repacked parameter is not a slice of a checkpoint tensor); "
                    "pass loader_rules"
                )
            if kind == _QKV:
                parts = packed.get(leaf)
                if not parts or len(parts) != 3:
                    raise InvalidArgument(
                        f"refit.vllm: parameter '{name}': QKVParallelLinear '{prefix}' is not in the "
                        f"model's packed_modules_mapping as three parts (got {parts})"
                    )
                q, k, v = (_exact(f"{head}{part}.{pname}") for part in parts)
                rules.append(
                    {
                        "kind": "qkv", "q": q, "k": k, "v": v, "to": name,
                        "num_heads": int(module.total_num_heads),
                        "num_kv_heads": int(module.total_num_kv_heads),
                    }
                )
            elif kind == _GATE_UP:
                parts = packed.get(leaf)
                sizes = list(getattr(module, "output_sizes", []))
                if not parts or len(parts) != 2 or len(sizes) != 2 or sizes[0] != sizes[1]:
                    raise InvalidArgument(
                        f"refit.vllm: parameter '{name}': MergedColumnParallelLinear '{prefix}' with "
                        f"outputs {sizes} and packed parts {parts} is not a gate/up pair"
                    )
                gate, up = (_exact(f"{head}{part}.{pname}") for part in parts)
                rules.append({"kind": "gate_up", "gate": gate, "up": up, "to": name})
            elif kind == _COLUMN_PARALLEL:
                rules.append({"kind": "row", "match": _exact(name)})
            elif kind == _ROW_PARALLEL:
                if pname != "bias":  # RowParallelLinear's bias is whole on every rank
                    rules.append({"kind": "column", "match": _exact(name)})
            elif kind == _VOCAB:
                added = int(module.num_embeddings) - int(module.org_vocab_size)
                if added:
                    raise InvalidArgument(
                        f"refit.vllm: parameter '{name}': {added} added (LoRA) vocabulary rows are "
                        "not mapped"
                    )
                # vLLM pads V to a multiple of padding_size and splits that evenly; refit's vocab
                # rule pads to a multiple of pad_to × TP. With pad_to = the rows per rank both
                # give the same Vp (checked by the probe).
                rules.append(
                    {
                        "kind": "vocab", "match": _exact(name),
                        "vocab_size": int(module.org_vocab_size),
                        "pad_to": int(module.num_embeddings_per_partition),
                    }
                )
    return rules

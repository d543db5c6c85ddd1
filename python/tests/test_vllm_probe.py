"""The index probe: refit's loaders against vLLM's own weight loaders, element by element.

For each architecture and TP size, every canonical (Hugging Face) tensor is filled with its own
elements' canonical indices (a float32 model whose bits are int32 indices 1, 2, 3, … over all
tensors), and then:

- vLLM loads it: rank r's model is built from vLLM's real parallel layers (``QKVParallelLinear``,
  ``MergedColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``,
  ``ParallelLMHead``, ``RMSNorm``; for Qwen3-MoE a router and ``FusedMoEFactory``'s MoE runner
  with its ``RoutedExperts`` stacks, with or without expert parallelism), with vLLM's parallel
  state reporting rank r of the TP size,
  and the model class's own ``load_weights`` (``AutoWeightsLoader`` with the model's
  ``hf_to_vllm_mapper``, which drives each parameter's ``weight_loader``) loads the canonical
  tensors;
- refit loads it: a second copy of each rank's model, registered with a refit receiver whose
  loader is ``refit.vllm.loader_rules`` of that model, receives the same canonical tensors from a
  refit ``Publisher`` (one shard group of TP receivers);

and every local tensor must be bit-identical between the two: each element names the canonical
element it holds, so equality is "every canonical element lands in the same local tensor and
element". Elements neither loader writes (vocabulary padding) keep a sentinel on refit's side.
A deliberately wrong rule must make the probe fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace
from typing import Dict, List, Tuple

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.model_executor.layers.linear")

import vllm.distributed.parallel_state as parallel_state  # noqa: E402
import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as unquantized_moe  # noqa: E402
from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory  # noqa: E402
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from vllm.model_executor.layers.linear import (  # noqa: E402
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (  # noqa: E402
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.llama import LlamaForCausalLM, LlamaModel  # noqa: E402
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM, Qwen2Model  # noqa: E402
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM, Qwen3Model  # noqa: E402
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeModel  # noqa: E402

import refit  # noqa: E402
import refit.torch as rt  # noqa: E402
from refit.vllm.loaders import loader_rules  # noqa: E402

#: The bits of an element no loader wrote (int32 -1: a NaN no index can equal).
SENTINEL = -1


@dataclasses.dataclass(frozen=True)
class Arch:
    """A tiny model of one architecture, as vLLM's model class builds it."""

    name: str
    causal_lm: type  # vLLM's *ForCausalLM: its load_weights and packed_modules_mapping
    model: type  # vLLM's *Model: its load_weights and hf_to_vllm_mapper
    vocab: int = 100  # not a multiple of 64: vLLM pads it (64 rows per pad) before splitting
    hidden: int = 16
    intermediate: int = 32
    heads: int = 8
    kv_heads: int = 2  # fewer than TP=4: vLLM replicates kv heads
    head_dim: int = 4
    layers: int = 2
    qkv_bias: bool = False
    qk_norm: bool = False
    tied: bool = False
    experts: int = 0  # > 0: a MoE MLP (router + routed experts) instead of the dense one
    moe_intermediate: int = 8
    stacked_experts: bool = False  # the experts as transformers ≥ 5 exports them: [E, 2I, H], [E, H, I]


ARCHS = [
    Arch("llama", LlamaForCausalLM, LlamaModel),
    Arch("qwen2", Qwen2ForCausalLM, Qwen2Model, qkv_bias=True),
    Arch("qwen3-tied", Qwen3ForCausalLM, Qwen3Model, qk_norm=True, tied=True, vocab=136),
]

#: Qwen3-MoE, its experts exported per expert (HF checkpoints, transformers < 5) or stacked.
MOE_ARCHS = [
    Arch("qwen3-moe", Qwen3MoeForCausalLM, Qwen3MoeModel, qk_norm=True, experts=8),
    Arch("qwen3-moe-stacked", Qwen3MoeForCausalLM, Qwen3MoeModel, qk_norm=True, experts=8, stacked_experts=True),
]


@dataclasses.dataclass(frozen=True)
class Parallel:
    """How vLLM splits the model: TP ranks, and whether the MoE layers use expert parallelism."""

    tp_size: int
    expert_parallel: bool = False
    placement: str = "linear"  # vLLM's expert_placement_strategy: linear or round_robin

    @property
    def id(self) -> str:
        return f"tp{self.tp_size}" + (f"-ep-{self.placement}" if self.expert_parallel else "")


# --------------------------------------------------------------------------------------------
# The canonical (Hugging Face) tensors, each element its own index


def canonical_shapes(arch: Arch) -> Dict[str, Tuple[int, ...]]:
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    shapes = {"model.embed_tokens.weight": (arch.vocab, arch.hidden)}
    for i in range(arch.layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.self_attn.q_proj.weight"] = (q, arch.hidden)
        shapes[f"{p}.self_attn.k_proj.weight"] = (kv, arch.hidden)
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv, arch.hidden)
        if arch.qkv_bias:
            shapes[f"{p}.self_attn.q_proj.bias"] = (q,)
            shapes[f"{p}.self_attn.k_proj.bias"] = (kv,)
            shapes[f"{p}.self_attn.v_proj.bias"] = (kv,)
        if arch.qk_norm:
            shapes[f"{p}.self_attn.q_norm.weight"] = (arch.head_dim,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (arch.head_dim,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (arch.hidden, q)
        if arch.experts and arch.stacked_experts:
            shapes[f"{p}.mlp.gate.weight"] = (arch.experts, arch.hidden)
            shapes[f"{p}.mlp.experts.gate_up_proj"] = (arch.experts, 2 * arch.moe_intermediate, arch.hidden)
            shapes[f"{p}.mlp.experts.down_proj"] = (arch.experts, arch.hidden, arch.moe_intermediate)
        elif arch.experts:
            shapes[f"{p}.mlp.gate.weight"] = (arch.experts, arch.hidden)
            for e in range(arch.experts):
                shapes[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (arch.moe_intermediate, arch.hidden)
                shapes[f"{p}.mlp.experts.{e}.up_proj.weight"] = (arch.moe_intermediate, arch.hidden)
                shapes[f"{p}.mlp.experts.{e}.down_proj.weight"] = (arch.hidden, arch.moe_intermediate)
        else:
            shapes[f"{p}.mlp.gate_proj.weight"] = (arch.intermediate, arch.hidden)
            shapes[f"{p}.mlp.up_proj.weight"] = (arch.intermediate, arch.hidden)
            shapes[f"{p}.mlp.down_proj.weight"] = (arch.hidden, arch.intermediate)
        shapes[f"{p}.input_layernorm.weight"] = (arch.hidden,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (arch.hidden,)
    shapes["model.norm.weight"] = (arch.hidden,)
    shapes["lm_head.weight"] = (arch.vocab, arch.hidden)
    return shapes


def index_tensors(arch: Arch) -> Dict[str, torch.Tensor]:
    """Every canonical tensor, its elements the int32 indices 1, 2, … as float32 bits.

    A tied head is the embedding tensor itself under its second name, as a tied HF model's
    state_dict exports it.
    """
    tensors, start = {}, 1
    for name, shape in canonical_shapes(arch).items():
        if arch.tied and name == "lm_head.weight":
            tensors[name] = tensors["model.embed_tokens.weight"]
            continue
        count = int(torch.Size(shape).numel())
        tensors[name] = torch.arange(start, start + count, dtype=torch.int32).view(torch.float32).reshape(shape)
        start += count
    return tensors


# --------------------------------------------------------------------------------------------
# vLLM's model on one TP rank, from its real layers


class _Layer(torch.nn.Module):
    pass


@contextlib.contextmanager
def vllm_parallel_state(tp_rank: int, parallel: Parallel):
    """vLLM's parallel state as rank ``tp_rank`` of ``parallel`` reports it (one engine: no DP).

    The MoE layers read the TP group (their TP or EP coordinates derive from it, as in vLLM's
    FusedMoEParallelConfig.make), the DP and PCP groups and the EP group. And on this machine
    vLLM's platform is not a CUDA one, so its unquantized MoE method finds no kernel backend:
    the probe names the CPU one. That choice only picks the forward kernel; the weight layout
    and the weight_loader are the platform-independent code under test.
    """
    group = SimpleNamespace(rank_in_group=tp_rank, world_size=parallel.tp_size, rank=tp_rank, local_rank=tp_rank)
    single = SimpleNamespace(rank_in_group=0, world_size=1, rank=0, local_rank=0)
    names = ("_TP", "_DP", "_PCP", "_EP")
    saved = {name: getattr(parallel_state, name, None) for name in names}
    saved_backend = unquantized_moe.select_unquantized_moe_backend
    parallel_state._TP, parallel_state._DP, parallel_state._PCP, parallel_state._EP = group, single, single, group
    unquantized_moe.select_unquantized_moe_backend = lambda moe_config: (UnquantizedMoeBackend.CPU, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(parallel_state, name, value)
        unquantized_moe.select_unquantized_moe_backend = saved_backend


def build_rank_model(arch: Arch, tp_rank: int, tp_size: int, parallel: Parallel = None) -> torch.nn.Module:
    """Rank ``tp_rank``'s model: vLLM's layers under vLLM's names, the model classes' loaders."""
    parallel = parallel or Parallel(tp_size)
    assert parallel.tp_size == tp_size
    with vllm_parallel_state(tp_rank, parallel):
        return _build_rank_model(arch, parallel)


def _build_rank_model(arch: Arch, parallel: Parallel) -> torch.nn.Module:
    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(
            tensor_parallel_size=parallel.tp_size,
            enable_expert_parallel=parallel.expert_parallel,
            expert_placement_strategy=parallel.placement,
        ),
    )
    with set_current_vllm_config(config):
        inner_class = type(f"{arch.model.__name__}OnCpu", (torch.nn.Module,), {
            "load_weights": arch.model.load_weights, "hf_to_vllm_mapper": arch.model.hf_to_vllm_mapper,
        })
        inner = inner_class()
        inner.embed_tokens = VocabParallelEmbedding(arch.vocab, arch.hidden, prefix="model.embed_tokens")
        inner.layers = torch.nn.ModuleList()
        for i in range(arch.layers):
            p = f"model.layers.{i}"
            layer = _Layer()
            layer.self_attn = _Layer()
            layer.self_attn.qkv_proj = QKVParallelLinear(
                arch.hidden, arch.head_dim, arch.heads, arch.kv_heads, bias=arch.qkv_bias, prefix=f"{p}.self_attn.qkv_proj"
            )
            layer.self_attn.o_proj = RowParallelLinear(
                arch.heads * arch.head_dim, arch.hidden, bias=False, prefix=f"{p}.self_attn.o_proj"
            )
            if arch.qk_norm:
                layer.self_attn.q_norm = RMSNorm(arch.head_dim)
                layer.self_attn.k_norm = RMSNorm(arch.head_dim)
            layer.mlp = _Layer()
            if arch.experts:
                # Qwen3MoeSparseMoeBlock's parts: a replicated router and vLLM's FusedMoE
                # (a MoERunner holding RoutedExperts: w13_weight, w2_weight).
                layer.mlp.gate = ReplicatedLinear(arch.hidden, arch.experts, bias=False, prefix=f"{p}.mlp.gate")
                # vLLM places experts round-robin only for grouped routing (DeepSeek-style
                # expert groups); otherwise it falls back to linear placement.
                grouped = parallel.placement == "round_robin"
                layer.mlp.experts = FusedMoEFactory(
                    num_experts=arch.experts, top_k=2, hidden_size=arch.hidden,
                    intermediate_size=arch.moe_intermediate, params_dtype=torch.float32,
                    prefix=f"{p}.mlp.experts", use_grouped_topk=grouped,
                    num_expert_group=2 if grouped else None, topk_group=1 if grouped else None,
                )
            else:
                layer.mlp.gate_up_proj = MergedColumnParallelLinear(
                    arch.hidden, [arch.intermediate] * 2, bias=False, prefix=f"{p}.mlp.gate_up_proj"
                )
                layer.mlp.down_proj = RowParallelLinear(
                    arch.intermediate, arch.hidden, bias=False, prefix=f"{p}.mlp.down_proj"
                )
            layer.input_layernorm = RMSNorm(arch.hidden)
            layer.post_attention_layernorm = RMSNorm(arch.hidden)
            inner.layers.append(layer)
        inner.norm = RMSNorm(arch.hidden)
        outer_class = type(f"{arch.causal_lm.__name__}OnCpu", (torch.nn.Module,), {
            "load_weights": arch.causal_lm.load_weights,
            "packed_modules_mapping": arch.causal_lm.packed_modules_mapping,
        })
        outer = outer_class()
        outer.config = SimpleNamespace(tie_word_embeddings=arch.tied)
        outer.model = inner
        lm_head = ParallelLMHead(arch.vocab, arch.hidden, prefix="lm_head")
        outer.lm_head = lm_head.tie_weights(inner.embed_tokens) if arch.tied else lm_head
    with torch.no_grad():
        for tensor in outer.parameters():
            tensor.view(torch.int32).fill_(SENTINEL)
    return outer


def local_bits(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {name: t.detach().view(torch.int32).clone() for name, t in model.named_parameters()}


def vllm_loaded(arch: Arch, tp_size: int, parallel: Parallel = None) -> List[Dict[str, torch.Tensor]]:
    """Every rank's local tensors after vLLM's own load_weights of the index tensors."""
    out = []
    for rank in range(tp_size):
        model = build_rank_model(arch, rank, tp_size, parallel)
        model.load_weights(iter(index_tensors(arch).items()))
        out.append(local_bits(model))
    return out


def refit_loaded(
    arch: Arch, tp_size: int, edit_rules=None, parallel: Parallel = None
) -> Tuple[List[Dict[str, torch.Tensor]], List[torch.nn.Module]]:
    """Every rank's local tensors after a refit transfer of the index tensors through the loaders."""
    models = [build_rank_model(arch, rank, tp_size, parallel) for rank in range(tp_size)]
    peers = [f"127.0.0.1:{port}" for port in refit.free_ports(len(models))]
    receivers = []
    try:
        for rank, model in enumerate(models):
            rules = loader_rules(model)
            if edit_rules is not None:
                rules = edit_rules(rules)
            loader = refit.Loader(tp_rank=rank, tp_size=tp_size, rules=rules)
            receiver = rt.Receiver(replica="probe", shard=rank, data_endpoint=peers[rank], peers=peers)
            receivers.append(receiver.attach(model, loader=loader).start())
        publisher = rt.Publisher(receivers, transfer_timeout=10.0)
        publisher.sync(index_tensors(arch))
    finally:
        for receiver in receivers:
            receiver.stop()
    return [local_bits(model) for model in models], models


def padding_rows(arch: Arch, rank: int, tp_size: int) -> Dict[str, slice]:
    """The local rows of each vocabulary tensor that hold padding (vLLM's layout)."""
    padded = -(-arch.vocab // 64) * 64
    per_rank = padded // tp_size
    first_pad = max(0, min(per_rank, arch.vocab - rank * per_rank))
    rows = slice(first_pad, per_rank)
    names = {"model.embed_tokens.weight": rows}
    if not arch.tied:
        names["lm_head.weight"] = rows
    return names


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("arch", ARCHS, ids=[a.name for a in ARCHS])
def test_refit_loaders_place_every_element_where_vllm_does(arch: Arch, tp_size: int):
    expect_same_placement(arch, Parallel(tp_size))


#: TP alone splits every expert's matrices; EP gives each rank whole experts (vLLM's linear or
#: round-robin placement) and the MoE layers' TP becomes 1.
MOE_PARALLEL = [
    Parallel(1), Parallel(2), Parallel(4),
    Parallel(2, True), Parallel(4, True), Parallel(4, True, "round_robin"),
]


@pytest.mark.parametrize("parallel", MOE_PARALLEL, ids=[p.id for p in MOE_PARALLEL])
@pytest.mark.parametrize("arch", MOE_ARCHS, ids=[a.name for a in MOE_ARCHS])
def test_refit_moe_loaders_place_every_element_where_vllm_does(arch: Arch, parallel: Parallel):
    expect_same_placement(arch, parallel)


def expect_same_placement(arch: Arch, parallel: Parallel):
    tp_size = parallel.tp_size
    want = vllm_loaded(arch, tp_size, parallel)
    got, _ = refit_loaded(arch, tp_size, parallel=parallel)
    covered = set()
    for rank in range(tp_size):
        assert set(got[rank]) == set(want[rank])
        padding = padding_rows(arch, rank, tp_size)
        for name, rows in padding.items():
            # vLLM's VocabParallelEmbedding.weight_loader zero-fills the padding rows at load;
            # refit never writes them, so they keep what the model had (here the sentinel).
            assert bool((want[rank][name][rows] == 0).all()), f"vLLM left '{name}' padding unwritten"
            assert bool((got[rank][name][rows] == SENTINEL).all()), f"rank {rank} '{name}': padding rows written"
            want[rank][name][rows] = SENTINEL
        for name, bits in want[rank].items():
            differ = (got[rank][name] != bits).nonzero()
            assert differ.numel() == 0, (
                f"{arch.name} TP={tp_size} rank {rank} '{name}': {differ.shape[0]} of {bits.numel()} "
                f"elements differ, first at {differ[0].tolist()}: refit holds canonical index "
                f"{int(got[rank][name][tuple(differ[0])])}, vLLM {int(bits[tuple(differ[0])])}"
            )
            covered.update(bits[bits != SENTINEL].tolist())
    # Every canonical element reached some rank (the tied head is the embedding itself).
    total = sum(
        int(torch.Size(shape).numel())
        for name, shape in canonical_shapes(arch).items()
        if not (arch.tied and name == "lm_head.weight")
    )
    assert covered == set(range(1, total + 1))


def _kv_heads_not_replicated(rules):
    return [dict(rule, num_kv_heads=rule["num_heads"]) if rule["kind"] == "qkv" else rule for rule in rules]


def _gate_up_swapped(rules):
    return [dict(rule, gate=rule["up"], up=rule["gate"]) if rule["kind"] == "gate_up" else rule for rule in rules]


@pytest.mark.parametrize(
    "edit", [_kv_heads_not_replicated, _gate_up_swapped], ids=["kv-heads-not-replicated", "gate-up-swapped"]
)
def test_a_wrong_rule_fails_the_probe(edit):
    arch, tp_size = ARCHS[0], 4
    want = vllm_loaded(arch, tp_size)
    try:
        got, _ = refit_loaded(arch, tp_size, edit_rules=edit)
    except refit.Error:
        return  # refused outright (a shape the wrong rule cannot place): the probe fails too
    assert any(
        not torch.equal(got[rank][name], want[rank][name]) for rank in range(tp_size) for name in want[rank]
    ), "a wrong rule went unnoticed"


def test_an_unsupported_layer_is_named():
    from vllm.model_executor.layers.linear import LinearBase  # noqa: PLC0415

    class ExpertStack(LinearBase):  # a vLLM parallel layer loader_rules has no rule for
        pass

    ExpertStack.__name__ = "UnknownParallelStandIn"
    model = torch.nn.Module()
    model.experts = torch.nn.Module.__new__(ExpertStack)
    torch.nn.Module.__init__(model.experts)
    model.experts.w13_weight = torch.nn.Parameter(torch.zeros(2, 4, 4), requires_grad=False)
    with pytest.raises(refit.InvalidArgument, match="'experts.w13_weight'.*UnknownParallelStandIn"):
        loader_rules(model)


def test_a_quantized_parameter_is_named():
    model = build_rank_model(ARCHS[0], 0, 2)
    qkv = model.model.layers[0].self_attn.qkv_proj
    qkv.register_parameter("weight_scale", torch.nn.Parameter(torch.ones(1), requires_grad=False))
    with pytest.raises(refit.InvalidArgument, match="'model.layers.0.self_attn.qkv_proj.weight_scale'"):
        loader_rules(model)


def _expert_tp_ignored(rules):
    return [{k: v for k, v in rule.items() if not k.startswith("expert_tp")} for rule in rules]


def _experts_placed_linearly(rules):
    def linear(rule):
        if "experts" not in rule:
            return rule
        n = len(rule["experts"])
        first = min(rule["experts"]) // n * n
        return dict(rule, experts=list(range(first, first + n)))

    return [linear(rule) for rule in rules]


def _expert_gate_up_swapped(rules):
    return [dict(rule, gate=rule["up"], up=rule["gate"]) if rule["kind"] == "expert_gate_up" else rule for rule in rules]


@pytest.mark.parametrize(
    "edit,parallel",
    [
        (_expert_tp_ignored, Parallel(2, True)),
        (_experts_placed_linearly, Parallel(4, True, "round_robin")),
        (_expert_gate_up_swapped, Parallel(2)),
    ],
    ids=["expert-tp-ignored-under-ep", "round-robin-read-as-linear", "expert-gate-up-swapped"],
)
def test_a_wrong_expert_rule_fails_the_probe(edit, parallel):
    arch = MOE_ARCHS[0]
    want = vllm_loaded(arch, parallel.tp_size, parallel)
    try:
        got, _ = refit_loaded(arch, parallel.tp_size, edit_rules=edit, parallel=parallel)
    except refit.Error:
        return  # refused outright (a shape the wrong rule cannot place): the probe fails too
    assert any(
        not torch.equal(got[rank][name], want[rank][name]) for rank in range(parallel.tp_size) for name in want[rank]
    ), "a wrong rule went unnoticed"


def test_an_expert_layer_refit_cannot_map_is_named():
    model = build_rank_model(MOE_ARCHS[0], 0, 2)
    experts = model.model.layers[0].mlp.experts.routed_experts
    experts.register_parameter("w13_bias", torch.nn.Parameter(torch.zeros(1), requires_grad=False))
    with pytest.raises(refit.InvalidArgument, match="'model.layers.0.mlp.experts.routed_experts.w13_bias'"):
        loader_rules(model)

"""Megatron-style sharded publishing: plain local tensors described by loader rules.

Four gloo processes (this file run as a script, one per rank) form TP 2 x DP 2 (rank = dp * 2 +
tp). Every rank trains the same small Llama-like model (Hugging Face names) with AdamW on the
same data, so the two data-parallel replicas agree, and after each step slices its tensor-parallel
shard into Megatron-Core's own layouts by plain loops: ``linear_qkv`` interleaved per query group
(the group's q heads, then its k head, then its v head), ``linear_fc1`` = [gate rows; up rows],
row-parallel projections split by columns, the vocabulary split by rows, norms whole. It states
that layout only as loader rules (``refit.layout.layout_from_loader``) and publishes its plain
local tensors with ``Publisher.sync(local, layout=...)``. Rank 0 hosts an unsharded receiver and
a vLLM-style TP = 2 pair (fused, *not* interleaved qkv) and checks every element after every
step; the DP replicas' copies are sent once.
"""

import json
import sys

import pytest
from conftest import run_ranks

torch = pytest.importorskip("torch")

STEPS = 3
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 8, 4, 2, 2, 12, 10
ATTN = "model.layers.0.self_attn."
FFN = "model.layers.0.mlp."


class Tiny(torch.nn.Module):
    """One Llama-like layer under Hugging Face names (q/k/v/o, gate/up/down, norms, head)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.q = torch.nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k = torch.nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v = torch.nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.gate = torch.nn.Linear(HIDDEN, MLP, bias=False)
        self.up = torch.nn.Linear(HIDDEN, MLP, bias=False)
        self.down = torch.nn.Linear(MLP, HIDDEN, bias=False)
        self.norm = torch.nn.Parameter(torch.ones(HIDDEN))
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) * self.norm
        q, k, v = self.q(x), self.k(x), self.v(x)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=-1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=-1)
        x = x + self.o(torch.softmax(q * k, dim=-1) * v)
        x = x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))
        return self.head(x)

    def canonical(self):
        """The Hugging Face names and tensors, bf16."""
        names = {
            "model.embed_tokens.weight": self.embed.weight, ATTN + "q_proj.weight": self.q.weight,
            ATTN + "k_proj.weight": self.k.weight, ATTN + "v_proj.weight": self.v.weight,
            ATTN + "o_proj.weight": self.o.weight, FFN + "gate_proj.weight": self.gate.weight,
            FFN + "up_proj.weight": self.up.weight, FFN + "down_proj.weight": self.down.weight,
            "model.layers.0.input_layernorm.weight": self.norm, "lm_head.weight": self.head.weight,
        }
        return {n: t.detach().to(torch.bfloat16).contiguous() for n, t in names.items()}


def megatron_locals(canonical, tp):
    """Rank ``tp`` of 2's tensors in Megatron-Core's layouts, sliced by plain loops."""
    groups = KV_HEADS // 2
    per_group = HEADS // KV_HEADS
    rows = []
    for g in range(tp * groups, (tp + 1) * groups):
        rows.append(canonical[ATTN + "q_proj.weight"][g * per_group * HEAD_DIM:(g + 1) * per_group * HEAD_DIM])
        rows.append(canonical[ATTN + "k_proj.weight"][g * HEAD_DIM:(g + 1) * HEAD_DIM])
        rows.append(canonical[ATTN + "v_proj.weight"][g * HEAD_DIM:(g + 1) * HEAD_DIM])
    half_mlp, half_vocab, half_hidden = MLP // 2, VOCAB // 2, HEADS * HEAD_DIM // 2
    return {
        "embedding.word_embeddings.weight":
            canonical["model.embed_tokens.weight"][tp * half_vocab:(tp + 1) * half_vocab],
        "decoder.layers.0.self_attention.linear_qkv.weight": torch.cat(rows),
        "decoder.layers.0.self_attention.linear_proj.weight":
            canonical[ATTN + "o_proj.weight"][:, tp * half_hidden:(tp + 1) * half_hidden],
        "decoder.layers.0.mlp.linear_fc1.weight": torch.cat([
            canonical[FFN + "gate_proj.weight"][tp * half_mlp:(tp + 1) * half_mlp],
            canonical[FFN + "up_proj.weight"][tp * half_mlp:(tp + 1) * half_mlp]]),
        "decoder.layers.0.mlp.linear_fc2.weight":
            canonical[FFN + "down_proj.weight"][:, tp * half_mlp:(tp + 1) * half_mlp],
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight":
            canonical["model.layers.0.input_layernorm.weight"],
        "output_layer.weight": canonical["lm_head.weight"][tp * half_vocab:(tp + 1) * half_vocab],
    }


def megatron_rules():
    """The trainer's layout as loader rules (Megatron-Core's names on the local side)."""
    return [
        {"kind": "vocab", "match": r"model\.embed_tokens\.weight", "to": "embedding.word_embeddings.weight",
         "vocab_size": VOCAB, "pad_to": 1},
        {"kind": "vocab", "match": r"lm_head\.weight", "to": "output_layer.weight", "vocab_size": VOCAB,
         "pad_to": 1},
        {"kind": "qkv_interleaved", "q": r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight",
         "k": r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight",
         "v": r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight",
         "to": "decoder.layers.$1.self_attention.linear_qkv.weight", "num_heads": HEADS,
         "num_kv_heads": KV_HEADS},
        {"kind": "column", "match": r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight",
         "to": "decoder.layers.$1.self_attention.linear_proj.weight"},
        {"kind": "gate_up", "gate": r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight",
         "up": r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "to": "decoder.layers.$1.mlp.linear_fc1.weight"},
        {"kind": "column", "match": r"model\.layers\.(\d+)\.mlp\.down_proj\.weight",
         "to": "decoder.layers.$1.mlp.linear_fc2.weight"},
        {"kind": "rename", "match": r"model\.layers\.(\d+)\.input_layernorm\.weight",
         "to": "decoder.layers.$1.self_attention.linear_qkv.layer_norm_weight"},
    ]


def vllm_slice(name, full, shard):
    """What a vLLM-style TP shard of 2 holds: fused qkv [q | k | v] per rank, gate_up fused."""
    if name == "qkv":
        return torch.cat([full[ATTN + "q_proj.weight"].chunk(2)[shard], full[ATTN + "k_proj.weight"].chunk(2)[shard],
                          full[ATTN + "v_proj.weight"].chunk(2)[shard]])
    if name == "gate_up":
        return torch.cat([full[FFN + "gate_proj.weight"].chunk(2)[shard], full[FFN + "up_proj.weight"].chunk(2)[shard]])
    if name in (ATTN + "o_proj.weight", FFN + "down_proj.weight"):
        return full[name].chunk(2, dim=1)[shard]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return full[name].chunk(2)[shard]
    return full[name]


VLLM_NAMES = ["qkv", "gate_up", ATTN + "o_proj.weight", FFN + "down_proj.weight", "model.embed_tokens.weight",
              "lm_head.weight", "model.layers.0.input_layernorm.weight"]


def vllm_rules():
    return [
        {"kind": "qkv", "q": r".*q_proj\.weight", "k": r".*k_proj\.weight", "v": r".*v_proj\.weight", "to": "qkv",
         "num_heads": HEADS, "num_kv_heads": KV_HEADS},
        {"kind": "gate_up", "gate": r".*gate_proj\.weight", "up": r".*up_proj\.weight", "to": "gate_up"},
        {"kind": "column", "match": r".*(o_proj|down_proj)\.weight"},
        {"kind": "vocab", "match": r"model\.embed_tokens\.weight|lm_head\.weight", "vocab_size": VOCAB, "pad_to": 1},
    ]


def rank_main(rank, world, init, out, memory):
    import torch.distributed as dist

    import refit
    import refit.torch as rt
    from refit.layout import layout_from_loader

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    tp = rank % 2
    torch.manual_seed(0)
    model = Tiny()
    canonical = model.canonical()

    receivers, held = [], []
    if rank == 0:
        endpoints = [f"127.0.0.1:{port}" for port in refit.free_ports(3)]
        for index in range(3):
            shard = index if index < 2 else None
            if shard is None:
                arrays = {n: t.clone() for n, t in canonical.items()}
                options = dict(data_endpoint=endpoints[index], peers=endpoints, version=0)
            else:
                arrays = {n: vllm_slice(n, canonical, shard).contiguous().clone() for n in VLLM_NAMES}
                options = dict(data_endpoint=endpoints[index], peers=endpoints, version=0, replica="tp",
                               shard=shard, loader=refit.Loader(rules=vllm_rules(), tp_rank=shard, tp_size=2))
            receiver = refit.Receiver(**options)
            for name, tensor in arrays.items():
                receiver.register(name, tensor)
            receivers.append(receiver.start())
            held.append((shard, arrays))

    loader = refit.Loader(rules=megatron_rules(), tp_rank=tp, tp_size=2)
    # memory="device": the ranks' local tensors are read through the device boundary and staged
    # (the GPU path, forced on CPU tensors), the DP replicas' copies digested through it too.
    publisher = rt.Publisher(receivers=receivers if rank == 0 else None, transfer_timeout=120, memory=memory)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(7)  # the same data on every rank: replicas agree
    reports = []
    for step in range(1, STEPS + 1):
        tokens = torch.randint(0, VOCAB, (4, 5), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        canonical = model.canonical()
        local = {n: t.contiguous() for n, t in megatron_locals(canonical, tp).items()}
        layout = layout_from_loader(loader, local, list(canonical))
        report = publisher.sync(local, layout=layout)
        # DP replica 1 (ranks 2, 3) holds copies: it reports their digests and sends nothing. (A
        # rank's report counts its own payloads; rank 0's the whole transfer's.)
        assert (report.payloads > 0) == (rank < 2), (rank, step, report.payloads)
        if rank == 0:
            for shard, arrays in held:
                for name, tensor in arrays.items():
                    want = canonical[name] if shard is None else vllm_slice(name, canonical, shard)
                    assert torch.equal(tensor.view(torch.int16), want.contiguous().view(torch.int16)), (
                        f"step {step}: receiver {shard} tensor {name} differs")
            reports.append({"step": step, "anchor": report.anchor, "staged_bytes": report.staged_bytes})
    if rank == 0:
        for receiver in receivers:
            receiver.stop()
        with open(out, "w") as f:
            json.dump(reports, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("memory", ["auto", "device"])
def test_megatron_ranks_state_their_layout_as_loader_rules_and_refit_vllm_style_receivers(tmp_path, memory):
    out = tmp_path / "reports.json"
    run_ranks(__file__, 4, [4, f"file://{tmp_path}/rendezvous", out, memory])
    reports = json.loads(out.read_text())
    assert [r["anchor"] for r in reports] == [True] + [False] * (STEPS - 1)
    assert all((r["staged_bytes"] > 0) == (memory == "device") for r in reports), reports


def test_layout_from_loader_names_what_does_not_fit():
    import refit
    from refit.layout import layout_from_loader

    torch.manual_seed(0)
    canonical = Tiny().canonical()
    local = megatron_locals(canonical, 0)
    loader = refit.Loader(rules=megatron_rules(), tp_rank=0, tp_size=2)
    pieces = layout_from_loader(loader, local, list(canonical))
    # One piece per query group of the rank for q, k and v; the norm whole.
    qkv = [p for p in pieces if p["local"] == "decoder.layers.0.self_attention.linear_qkv.weight"]
    assert sorted(p["tensor"].split(".")[-2] for p in qkv) == ["k_proj", "q_proj", "v_proj"]
    assert refit.plan_layouts([pieces, layout_from_loader(
        refit.Loader(rules=megatron_rules(), tp_rank=1, tp_size=2), megatron_locals(canonical, 1),
        list(canonical))])["tensors"]
    with pytest.raises(refit.errors.InvalidArgument, match="output_layer.weight"):
        layout_from_loader(loader, local, [n for n in canonical if n != "lm_head.weight"])
    with pytest.raises(refit.errors.InvalidArgument, match="qkv_interleaved"):
        refit.Loader(rules=megatron_rules(), tp_rank=0, tp_size=4)
    with pytest.raises(refit.errors.InvalidArgument, match="refit.Loader"):
        layout_from_loader({"rules": []}, local, list(canonical))


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])

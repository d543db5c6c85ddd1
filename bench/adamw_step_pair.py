#!/usr/bin/env python3
"""Generate a step pair of a small GPT trained with real torch AdamW, for context_bench.

Trains a small decoder-only transformer on fp32 master weights: a warm-up at a normal learning
rate (so the weights and Adam's moments look trained, not freshly initialised), then steps at
lr 1e-6, the regime of RL fine-tuning. Writes the weights before and after the last step as
bfloat16 and float16 (cast from the fp32 masters, as a trainer exports them for inference):

    OUT/old_bf16.bin OUT/new_bf16.bin OUT/old_fp16.bin OUT/new_fp16.bin
    OUT/index.txt   one line per tensor: "name numel element_offset"
    OUT/old_bf16.safetensors OUT/new_bf16.safetensors   the same bf16 checkpoints, for
                    `refit encode` / `refit push` as a user runs them

Usage: adamw_step_pair.py OUT [--layers 4] [--dim 384] [--warmup 30] [--steps 4] [--seed 0]
"""

import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab, dim, layers, heads, context):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        x = self.tok(idx) + self.pos(torch.arange(t))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def batches(vocab, context, batch, generator):
    """Token streams with structure a model can learn: a noisy order-1 Markov chain (Zipf-like)."""
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    zipf = 1.0 / ranks
    while True:
        start = torch.multinomial(zipf, batch, replacement=True, generator=generator)
        seq = [start]
        for _ in range(context):
            step = torch.multinomial(zipf[:64], batch, replacement=True, generator=generator)
            seq.append((seq[-1] * 7 + step) % vocab)
        yield torch.stack(seq, dim=1)


def export(model, dtype):
    return [(name, p.detach().to(dtype).contiguous()) for name, p in model.named_parameters()]


def write_pair(out, tag, old, new):
    with open(os.path.join(out, f"old_{tag}.bin"), "wb") as f:
        for _, t in old:
            f.write(t.view(torch.int16).numpy().tobytes())
    with open(os.path.join(out, f"new_{tag}.bin"), "wb") as f:
        for _, t in new:
            f.write(t.view(torch.int16).numpy().tobytes())


def write_safetensors(out, tag, old, new):
    from safetensors.torch import save_file

    for which, tensors in (("old", old), ("new", new)):
        save_file({name: t for name, t in tensors}, os.path.join(out, f"{which}_{tag}.safetensors"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    model = TinyGPT(args.vocab, args.dim, args.layers, max(1, args.dim // 64), args.context)
    data = batches(args.vocab, args.context, args.batch, generator)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def step():
        idx = next(data)
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), idx[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    for i in range(args.warmup):
        loss = step()
        if i % 10 == 0:
            print(f"warmup {i} loss {loss:.3f}", flush=True)
    for group in opt.param_groups:
        group["lr"] = 1e-6
    for _ in range(args.steps - 1):
        step()
    old = {tag: export(model, dt) for tag, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16))}
    loss = step()
    new = {tag: export(model, dt) for tag, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16))}
    for tag in old:
        write_pair(args.out, tag, old[tag], new[tag])
    write_safetensors(args.out, "bf16", old["bf16"], new["bf16"])
    offset = 0
    with open(os.path.join(args.out, "index.txt"), "w") as f:
        for name, t in old["bf16"]:
            f.write(f"{name} {t.numel()} {offset}\n")
            offset += t.numel()
    changed = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum())
                  for (_, a), (_, b) in zip(old["bf16"], new["bf16"]))
    print(f"params {offset} last loss {loss:.3f} bf16 changed {changed} "
          f"({100.0 * changed / offset:.2f} %)")


if __name__ == "__main__":
    main()

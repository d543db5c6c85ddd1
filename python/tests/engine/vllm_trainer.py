"""The trainer process of test_vllm_cpu_engine.py: AdamW on fp32 master weights, published with refit.

``python vllm_trainer.py CHECKPOINT DTYPE``: reads one JSON command per line on stdin and answers
each with one line on stdout that starts with ``@@ `` (anything else on stdout is a log line):

- ``{"cmd": "connect", "receivers": [[control, data], ...], "prompts": [[ids], ...],
  "max_tokens": n}``: make the Publisher; answer transformers' greedy generations of the prompts
  with the weights the engine loaded (the checkpoint, exported to DTYPE);
- ``{"cmd": "step", "seed": s, "fault": bool}``: one AdamW step on a batch drawn from ``seed``,
  export the master weights to DTYPE, publish them (``fault``: through ``fault+zmq://`` that cuts
  the stream after eight payloads, so the transfer aborts mid-stream), and answer the version,
  the sync's seconds and report, and transformers' generations (with each token's top-two logit
  margin) with the exported weights — or, for a failed sync, its error.

Transformers generates with the exported weights in DTYPE, as the engine holds them; the master
weights stay float32 and keep every step, published or not.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import transformers

import refit
import refit.torch


def answer(message: dict) -> None:
    sys.stdout.write("@@ " + json.dumps(message) + "\n")
    sys.stdout.flush()


def exported(master: torch.nn.Module, dtype: torch.dtype):
    """The master weights as the engine holds them: its dtype, the checkpoint's names."""
    return {name: tensor.detach().to(dtype, copy=True).contiguous() for name, tensor in master.state_dict().items()}


def generations(serving: transformers.PreTrainedModel, weights, prompts, max_tokens: int):
    """Greedy generations of ``serving`` loaded with ``weights``: (tokens, top-two margins) per prompt."""
    with torch.no_grad():
        serving.load_state_dict(weights, strict=True)
        out = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = serving.generate(
                ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                output_scores=True, return_dict_in_generate=True, pad_token_id=0,
            )
            tokens = generated.sequences[0, ids.shape[1]:].tolist()
            margins = []
            for scores in generated.scores:
                top = torch.topk(scores[0].float(), 2).values
                margins.append(float(top[0] - top[1]))
            out.append({"tokens": tokens, "margins": margins})
        return out


def main() -> None:
    checkpoint, dtype_name = sys.argv[1], sys.argv[2]
    dtype = getattr(torch, dtype_name)
    master = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    serving = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()
    optimizer = torch.optim.AdamW(master.parameters(), lr=2e-2)
    vocab = master.config.vocab_size
    publisher = None
    receivers = prompts = None
    max_tokens = 0
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "connect":
            receivers = [tuple(pair) for pair in command["receivers"]]
            prompts, max_tokens = command["prompts"], int(command["max_tokens"])
            publisher = refit.torch.Publisher(receivers=receivers)
            publisher.adopt_baseline(exported(master, dtype), version=0)
            answer({"generations": generations(serving, exported(master, dtype), prompts, max_tokens)})
        elif command["cmd"] == "step":
            before = exported(master, dtype)
            generator = torch.Generator().manual_seed(int(command["seed"]))
            batch = torch.randint(0, vocab, (4, 24), generator=generator)
            master.train()
            loss = master(batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            after = exported(master, dtype)
            sender = publisher
            if command.get("fault"):
                # A second publisher whose data plane fails after its eighth payload (each sent
                # 20 ms apart, so the receiver has applied some): the transfer aborts and rolls
                # back. Small buckets, so that the delta is many payloads.
                # It is a restart of the trainer (it resumes the run, which fences the publisher
                # before it: docs/protocol.md "Lineage and fencing"), so the trainer after it is
                # another restart that adopts what the fleet holds then.
                sender = refit.torch.Publisher(
                    receivers=receivers, transport="fault+zmq://?disconnect_after=8&delay_ms=20", bucket_bytes=4096,
                    resume=True,
                )
                sender.adopt_baseline(before, version=publisher.version)
            held = publisher.version
            started = time.perf_counter()
            try:
                report = sender.sync(after)
            except refit.Error as error:
                if sender is not publisher:
                    publisher = refit.torch.Publisher(receivers=receivers, resume=True)
                    publisher.adopt_baseline(before, version=held)
                answer({"error": f"{type(error).__name__}: {error}", "loss": float(loss)})
                continue
            if sender is not publisher:
                publisher = refit.torch.Publisher(receivers=receivers, resume=True)
                publisher.adopt_baseline(after, version=int(report.version))
            seconds = time.perf_counter() - started
            answer({
                "version": int(report.version),
                "seconds": seconds,
                "changed_elements": int(report.changed_elements),
                "total_elements": int(report.total_elements),
                "anchor": bool(report.anchor),
                "loss": float(loss),
                "generations": generations(serving, after, prompts, max_tokens),
            })
        elif command["cmd"] == "exit":
            break


if __name__ == "__main__":
    main()

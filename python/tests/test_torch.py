"""refit.torch: modules in place, failures that leave them untouched, TP loaders, Ctrl-C."""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import refit
import refit.torch as rt


class Tiny(torch.nn.Module):
    """Embedding, a linear layer with bias, a norm with a buffer, and a tied LM head."""

    def __init__(self, vocab=50, hidden=24):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.register_buffer("scale", torch.ones(hidden))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens):
        return self.head(self.norm(self.proj(self.embed(tokens))) * self.scale)


def bf16_model(seed):
    torch.manual_seed(seed)
    return Tiny().to(torch.bfloat16)


def step(model, seed, fraction=0.05):
    """A sparse optimizer-like step on every tensor of `model` (in place)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            flat = tensor.view(-1)
            mask = torch.rand(flat.shape, generator=generator) < fraction
            flat[mask] += flat[mask].abs().clamp(min=1e-2) * 0.1


def bits(model):
    return {name: tensor.view(torch.uint8).clone() if tensor.dtype != torch.bool else tensor.clone()
            for name, tensor in ((n, t.detach().reshape(-1)) for n, t in model.state_dict().items())}


#: How a receiver reaches the module: "auto" (host tensors zero-copy, here) and "device" (every
#: tensor through the device boundary, the torch backend on CPU tensors: the GPU path, forced).
MEMORIES = ["auto", "device"]


@pytest.mark.parametrize("memory", MEMORIES)
def test_attach_writes_the_modules_own_tensors_in_place(memory):
    trainer = bf16_model(0)
    worker = bf16_model(0)
    pointers = {name: t.data_ptr() for name, t in worker.state_dict().items()}
    receiver = rt.Receiver().attach(worker, memory=memory).start()
    with receiver:
        publisher = rt.Publisher([receiver])
        publisher.adopt_baseline(trainer, version=0)
        tokens = torch.arange(20).reshape(2, 10)
        for s in range(1, 4):
            step(trainer, s)
            report = publisher.sync(trainer)
            assert not report.anchor and 0 < report.changed_elements < report.total_elements
            assert bits(worker).keys() == bits(trainer).keys()
            for name, expected in bits(trainer).items():
                assert torch.equal(bits(worker)[name], expected), name
            assert {n: t.data_ptr() for n, t in worker.state_dict().items()} == pointers
            assert torch.equal(worker(tokens), trainer(tokens))
        # The tied head is the embedding's memory, updated once (an XOR applied twice reverts).
        assert worker.head.weight.data_ptr() == worker.embed.weight.data_ptr()


def test_the_trainer_export_is_viewed_not_copied():
    model = bf16_model(1)
    for name, tensor in rt.state_tensors(model):
        _, dtype, shape, buffer = refit._tensors.as_buffer_tensor(name, tensor)
        assert dtype == "torch.bfloat16" and shape == list(tensor.shape)
        assert buffer.__array_interface__["data"][0] == tensor.data_ptr()
    weight = torch.nn.Parameter(torch.ones(3, 3))  # requires_grad: detached, same memory
    assert refit._tensors.as_buffer_tensor("w", weight)[3].__array_interface__["data"][0] == weight.data_ptr()
    with pytest.raises(ValueError, match="not contiguous"):
        refit._tensors.as_buffer_tensor("t", torch.ones(4, 4).t())


@pytest.mark.parametrize("memory", MEMORIES)
def test_an_aborted_sync_leaves_the_module_bit_identical(memory):
    trainer = bf16_model(2)
    worker = bf16_model(2)
    with rt.Receiver().attach(worker, memory=memory).start() as receiver:
        faulty = rt.Publisher([receiver], transport="fault+zmq://?disconnect_after=1", bucket_bytes=256)
        faulty.adopt_baseline(trainer, version=0)
        before = bits(worker)
        step(trainer, 7, fraction=0.5)
        with pytest.raises(refit.Unavailable):
            faulty.sync(trainer)
        assert receiver.status().state == "idle" and receiver.version == 0
        for name, expected in before.items():
            assert torch.equal(bits(worker)[name], expected), name


def test_mirror_mode_copies_into_the_module_only_after_commit():
    trainer = bf16_model(3)
    worker = bf16_model(3)
    events = []
    receiver = rt.Receiver(pause=lambda: events.append(("pause", bits(worker)["proj.weight"].clone())),
                           resume=lambda committed, version: events.append(("resume", (committed, version))))
    with receiver.attach(worker, mirror=True).start():
        publisher = rt.Publisher([receiver])
        publisher.adopt_baseline(trainer, version=0)
        before = bits(worker)["proj.weight"].clone()
        step(trainer, 9)
        publisher.sync(trainer)
        assert [kind for kind, _ in events] == ["pause", "resume"] and events[1][1] == (True, 1)
        assert torch.equal(events[0][1], before)  # paused before anything changed
        assert torch.equal(bits(worker)["proj.weight"], bits(trainer)["proj.weight"])


def test_wait_for_version_returns_only_once_the_module_holds_the_version():
    """Regression: in mirror mode the version was visible before the after_commit hook had copied
    the mirror into the module, so a reader woken by wait_for_version saw the old weights. The
    module is large enough (48 MiB) that the copy takes milliseconds, several 5 ms polls."""
    torch.manual_seed(12)
    trainer = torch.nn.Linear(4096, 6144, bias=False).to(torch.bfloat16)
    worker = torch.nn.Linear(4096, 6144, bias=False).to(torch.bfloat16)
    worker.load_state_dict(trainer.state_dict())
    with rt.Receiver().attach(worker, memory="mirror").start() as receiver:
        publisher = rt.Publisher([receiver])
        publisher.adopt_baseline(trainer, version=0)
        for version in range(1, 4):
            step(trainer, 100 + version, fraction=0.02)
            expected = trainer.weight.detach().view(torch.int16).clone()
            seen = {}

            def reader():
                seen["version"] = receiver.wait_for_version(version, timeout=120)
                seen["weight"] = worker.weight.detach().view(torch.int16).clone()

            thread = threading.Thread(target=reader)
            thread.start()
            publisher.sync(trainer)
            thread.join()
            assert seen["version"] == version
            assert torch.equal(seen["weight"], expected), f"version {version}: the module still held an older version"


def test_the_device_path_moves_o_changes_and_no_copy_of_the_model_after_a_commit():
    """A model trained with real torch AdamW, received through the device boundary (forced on CPU
    tensors): every step bit-identical, in place, and what crosses the boundary per step is about
    4 + 2 + 2 bytes per changed element — no model-sized copy after the commit."""
    torch.manual_seed(11)
    trainer = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    worker = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    worker.load_state_dict(trainer.state_dict())
    export = {n: t.detach().to(torch.bfloat16).contiguous() for n, t in trainer.state_dict().items()}
    worker = worker.to(torch.bfloat16)
    model_bytes = sum(t.numel() * t.element_size() for t in export.values())
    # A small learning rate: the bf16 export changes in a fraction of its elements, as late in RL.
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    pointers = {n: t.data_ptr() for n, t in worker.state_dict().items()}
    with rt.Receiver().attach(worker, memory="device").start() as receiver:
        registered = receiver.status()
        assert registered.device_from_bytes == model_bytes  # each tensor read once: its digest
        publisher = rt.Publisher([receiver])
        publisher.adopt_baseline(export, version=0)
        for s in range(3):
            optimizer.zero_grad()
            loss = trainer(torch.randn(32, 64)).pow(2).mean()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                for name, tensor in trainer.state_dict().items():
                    export[name].copy_(tensor.to(torch.bfloat16))
            before = receiver.status()
            report = publisher.sync(export)
            after = receiver.status()
            assert 0 < report.changed_elements < report.total_elements
            moved = (after.device_to_bytes - before.device_to_bytes) + (after.device_from_bytes - before.device_from_bytes)
            assert moved == 8 * report.changed_elements, (moved, report.changed_elements)
            # Below a quarter of the elements changed, that is less than the model's bytes (the
            # mirror path copies the whole model into the module after every commit).
            assert report.changed_elements < report.total_elements // 4, report.changed_elements
            assert moved < model_bytes
            for name, tensor in worker.state_dict().items():
                assert torch.equal(tensor.view(torch.int16), export[name].view(torch.int16)), name
            assert {n: t.data_ptr() for n, t in worker.state_dict().items()} == pointers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: scripts/gpu-tests.sh runs it")
def test_the_device_path_on_a_cuda_device_applies_and_rolls_back_in_place():
    trainer = bf16_model(5)
    worker = bf16_model(5).to("cuda")
    pointers = {name: t.data_ptr() for name, t in worker.state_dict().items()}
    with rt.Receiver().attach(worker).start() as receiver:  # "auto": CUDA tensors via the boundary
        publisher = rt.Publisher([receiver])
        publisher.adopt_baseline(trainer, version=0)
        for s in range(1, 4):
            step(trainer, s)
            before = receiver.status()
            report = publisher.sync(trainer, force_anchor=(s == 3))
            after = receiver.status()
            moved = (after.device_to_bytes - before.device_to_bytes) + (after.device_from_bytes - before.device_from_bytes)
            if not report.anchor:
                assert moved == 8 * report.changed_elements, (moved, report.changed_elements)
            for name, expected in bits(trainer).items():
                assert torch.equal(bits(worker)[name].cpu(), expected), name
            assert {n: t.data_ptr() for n, t in worker.state_dict().items()} == pointers
        # A second trainer of the run (a restart, with a lossy link) resumes it.
        faulty = rt.Publisher([receiver], transport="fault+zmq://?disconnect_after=1", bucket_bytes=256, resume=True)
        faulty.adopt_baseline(trainer, version=receiver.version)
        held = {name: t.cpu() for name, t in bits(worker).items()}
        step(trainer, 9, fraction=0.5)
        with pytest.raises(refit.Unavailable):
            faulty.sync(trainer)
        for name, expected in held.items():
            assert torch.equal(bits(worker)[name].cpu(), expected), name


def test_attach_refuses_a_bad_memory_option_and_meta_tensors():
    with pytest.raises(refit.InvalidArgument, match="memory='gpu' is not one of"):
        rt.Receiver().attach(bf16_model(0), memory="gpu")
    meta = torch.nn.Linear(4, 4, device="meta")
    with pytest.raises(refit.InvalidArgument, match="'weight' is on the meta device"):
        rt.Receiver().attach(meta)


class Attention(torch.nn.Module):
    """Canonical (trainer) layout: separate q, k, v; GQA with 4 heads and 2 kv heads."""

    def __init__(self, hidden=16, heads=4, kv_heads=2):
        super().__init__()
        head_dim = hidden // heads
        self.q_proj = torch.nn.Linear(hidden, heads * head_dim)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * head_dim)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * head_dim)
        self.o_proj = torch.nn.Linear(heads * head_dim, hidden, bias=False)
        self.norm = torch.nn.LayerNorm(hidden)


class ShardedAttention(torch.nn.Module):
    """One TP rank: fused qkv (its heads), o_proj split by columns, the norm replicated."""

    def __init__(self, tp, hidden=16, heads=4, kv_heads=2):
        super().__init__()
        head_dim = hidden // heads
        rows = (heads // tp + max(1, kv_heads // tp) * 2) * head_dim
        self.qkv_proj = torch.nn.Linear(hidden, rows)
        self.o_proj = torch.nn.Linear(heads * head_dim // tp, hidden, bias=False)
        self.norm = torch.nn.LayerNorm(hidden)


@pytest.mark.parametrize("memory", MEMORIES)
def test_tp_loader_shards_a_fused_qkv_module_across_two_receivers(memory):
    torch.manual_seed(4)
    trainer = Attention().to(torch.bfloat16)
    canonical = {n: tuple(t.shape) for n, t in trainer.state_dict().items()}
    fused = [{"kind": "qkv", "q": r"q_proj\.(weight|bias)", "k": r"k_proj\.(weight|bias)",
              "v": r"v_proj\.(weight|bias)", "to": "qkv_proj.$1", "num_heads": 4, "num_kv_heads": 2}]
    shards = [ShardedAttention(2).to(torch.bfloat16) for _ in range(2)]
    # Two zmq receivers form one relay tree: each names every relay, in the same order.
    peers = [f"127.0.0.1:{port}" for port in refit.free_ports(len(shards))]
    receivers = []
    for rank, shard in enumerate(shards):
        loader = rt.tp_loader(shard, canonical, tp_rank=rank, tp_size=2, fused=fused)
        assert {"kind": "column", "match": r"o_proj\.weight"} in loader.rules
        receiver = rt.Receiver(replica="tp", shard=rank, data_endpoint=peers[rank], peers=peers)
        receivers.append(receiver.attach(shard, loader=loader, memory=memory).start())
    try:
        publisher = rt.Publisher(receivers)
        for s in range(2):
            step(trainer, 20 + s)
            report = publisher.sync(trainer)  # no baseline: the first is an anchor
            assert report.anchor == (s == 0)
            sd = trainer.state_dict()
            for rank, shard in enumerate(shards):
                q, k, v = (sd[f"{p}_proj.weight"] for p in "qkv")
                expected = torch.cat([q[rank * 8:(rank + 1) * 8], k[rank * 4:(rank + 1) * 4], v[rank * 4:(rank + 1) * 4]])
                assert torch.equal(shard.qkv_proj.weight, expected)
                assert torch.equal(shard.o_proj.weight, sd["o_proj.weight"][:, rank * 8:(rank + 1) * 8])
                assert torch.equal(shard.norm.weight, sd["norm.weight"])
    finally:
        for receiver in receivers:
            receiver.stop()


def test_tp_loader_names_a_shape_it_cannot_place():
    local = {"w": (3, 7)}
    with pytest.raises(ValueError, match=r"'w' is \[3, 7\] locally and \[8, 8\]"):
        rt.tp_loader(local, {"w": (8, 8)}, tp_rank=0, tp_size=2)


INTERRUPTED_SYNC = textwrap.dedent(
    """
    import os, signal, threading, sys
    import torch, refit, refit.torch as rt
    torch.manual_seed(0)
    trainer = {f"w{i}": torch.randn(2048).to(torch.bfloat16) for i in range(48)}
    worker = torch.nn.Module()
    for name, tensor in trainer.items():
        worker.register_buffer(name, tensor.clone())
    receiver = rt.Receiver().attach(worker).start()
    # 48 payloads of 400 ms each (a few in flight at once): Ctrl-C lands in the middle of the stream.
    slow = rt.Publisher([receiver], transport="fault+zmq://?delay_ms=400", bucket_bytes=2048)
    slow.adopt_baseline(trainer, version=0)
    before = {n: t.clone() for n, t in worker.state_dict().items()}
    for tensor in trainer.values():
        tensor += 1
    threading.Timer(0.8, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        slow.sync(trainer)
        sys.exit("the sync was not interrupted")
    except KeyboardInterrupt:
        pass
    status = receiver.status()
    assert (status.state, status.version) == ("idle", 0), status
    assert all(torch.equal(worker.state_dict()[n], t) for n, t in before.items()), "module changed"
    fast = rt.Publisher([receiver])
    fast.adopt_baseline(before, version=0)
    assert fast.sync(trainer).version == 1
    assert all(torch.equal(worker.state_dict()[n], t) for n, t in trainer.items())
    receiver.stop()
    print("interrupted cleanly")
    """
)


def test_ctrl_c_during_sync_aborts_cleanly_and_the_next_sync_works():
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_SYNC], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "interrupted cleanly" in done.stdout


def test_refit_imported_before_torch_leaves_torch_importable():
    # A core built with CUDA links the system's libnccl.so.2 / libcudart.so.13; loaded first, they
    # stood in for the newer copies PyPI's torch needs ("libtorch_cuda.so: undefined symbol:
    # ncclCommResume"). refit loads the nvidia wheels' copies first (refit/_cuda_libraries.py).
    code = "import refit\nimport torch\nprint(torch.zeros(2).add(1).sum().item())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("2.0")


def test_a_dtensor_state_dict_publishes_its_shard_and_a_receiver_refuses_one_by_name(tmp_path):
    # A one-rank gloo world: enough to make a real DTensor. A publisher sends the shard through
    # its layout (no collective gathers it); a receiver cannot hold a DTensor in place.
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh  # noqa: PLC0415

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = distribute_tensor(torch.arange(8, dtype=torch.float32).reshape(4, 2), mesh, [Shard(0)])
        held = torch.zeros(4, 2)
        endpoint = f"127.0.0.1:{refit.free_ports(1)[0]}"
        receiver = refit.Receiver(data_endpoint=endpoint, peers=[endpoint], version=0)
        receiver.register("w", held)
        receiver.start()
        try:
            publisher = rt.Publisher(receivers=[receiver])
            report = publisher.sync({"w": weight})
            assert report.anchor and report.version == 1
            assert torch.equal(held, weight.full_tensor())
        finally:
            receiver.stop()
        with pytest.raises(refit.InvalidArgument, match=r"tensor 'w': it is a DTensor"):
            refit.Receiver().register("w", weight)
    finally:
        dist.destroy_process_group()


class RepackedLinear(torch.nn.Module):
    """A layer that transforms its weight after loading, as vLLM's CPU backend does: the forward
    reads a packed copy, and ``weight`` is emptied (writing it in place would change nothing)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        self.packed = weight.detach().t().contiguous() * 1  # the "kernel layout"

    def forward(self, x):
        return x @ self.packed


class Engine(torch.nn.Module):
    def __init__(self, up, gate, norm):
        super().__init__()
        self.fused = RepackedLinear(torch.cat([up, gate]))
        self.norm = torch.nn.Parameter(norm.clone(), requires_grad=False)


def test_the_reload_path_hands_only_changed_tensors_to_the_engine_and_rolls_back_exactly():
    """A module whose engine repacked a fused layer: refit keeps the checkpoint-format parts,
    applies deltas to them and, inside the commit, hands the changed ones (with their fused
    sibling) to the engine's loading path; the norm stays in place; an aborted sync hands
    nothing over and leaves the copies bit-identical."""
    torch.manual_seed(3)
    trainer = {"up": torch.randn(8, 6), "gate": torch.randn(8, 6), "norm": torch.randn(6), "other": torch.randn(4, 6)}
    engine = Engine(trainer["up"], trainer["gate"], trainer["norm"])
    other = RepackedLinear(trainer["other"])
    loads = []

    def load(weights):
        loads.append([name for name, _ in weights])
        parts = dict(weights)
        if "up" in parts:
            assert "gate" in parts, "a fused layer's parts are handed over together"
            engine.fused.packed.copy_(torch.cat([parts["up"], parts["gate"]]).t())
        if "other" in parts:
            other.packed.copy_(parts["other"].t())

    copies = [(name, trainer[name].clone()) for name in ("up", "gate", "other")]
    reload = rt.ReloadPath(["fused.weight"], copies, load, group_of=lambda name: "fused" if name in ("up", "gate") else name)
    with rt.Receiver().attach(engine, reload=reload).start() as receiver:
        assert receiver.paths == {"up": "reload", "gate": "reload", "other": "reload", "norm": "in_place"}
        publisher = rt.Publisher([receiver])
        publisher.adopt_baseline(trainer, version=0)
        # Step 1: only `up` and the norm change: `up` and its sibling `gate` are loaded, `other`
        # is not handed over.
        trainer["up"][2, 3] += 1.0
        trainer["norm"][1] += 1.0
        publisher.sync(trainer)
        assert [sorted(names) for names in loads] == [["gate", "up"]] and receiver.last_reload["changed"] == ["up"]
        assert torch.equal(engine.fused.packed, torch.cat([trainer["up"], trainer["gate"]]).t())
        assert torch.equal(engine.norm, trainer["norm"])
        # An aborted sync: nothing is handed over; the copies and the norm are rolled back.
        before = {name: tensor.clone() for name, tensor in copies}
        packed = engine.fused.packed.clone()
        # The trainer restarts (resuming its run) over a lossy link; the one before is fenced.
        faulty = rt.Publisher([receiver], transport="fault+zmq://?disconnect_after=1", bucket_bytes=64, resume=True)
        faulty.adopt_baseline(trainer, version=1)
        changed = {name: tensor + 0.5 for name, tensor in trainer.items()}
        with pytest.raises(refit.Unavailable):
            faulty.sync(changed)
        assert receiver.version == 1 and len(loads) == 1
        for name, tensor in copies:
            assert torch.equal(tensor.view(torch.int32), before[name].view(torch.int32)), name
        assert torch.equal(engine.fused.packed, packed) and torch.equal(engine.norm, trainer["norm"])
        # Step 2, from the trainer restarted again (the lossy one's epoch fenced the first):
        # only `other` changed since the last commit: it alone is loaded.
        publisher = rt.Publisher([receiver], resume=True)
        publisher.adopt_baseline(trainer, version=1)
        trainer["other"][0, 0] -= 1.0
        publisher.sync(trainer)
        assert loads[-1] == ["other"] and torch.equal(other.packed, trainer["other"].t())
    with pytest.raises(refit.InvalidArgument, match="reload.skip names no tensor"):
        rt.Receiver().attach(Engine(trainer["up"], trainer["gate"], trainer["norm"]),
                             reload=rt.ReloadPath(["nope.weight"], [], load))

"""refit.torch.Publisher over tensors in device memory: the chunks a rank sends are staged through
a bounded pool of host buffers (the device path forced on CPU tensors with ``memory="device"``:
the torch backend's reads, the core's pool and sources, exactly as on a GPU)."""

import threading

import pytest
import torch

import refit
import refit.torch as rt


def trainer_model(layers=16, width=192, seed=3):
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks)


def bf16_export(model):
    return {n: t.detach().to(torch.bfloat16).contiguous() for n, t in model.state_dict().items()}


def train_step(model, optimizer, export, width=192):
    optimizer.zero_grad()
    model(torch.randn(16, width)).pow(2).mean().backward()
    optimizer.step()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            export[name].copy_(tensor.to(torch.bfloat16))


def host_receiver(export):
    held = {n: t.clone() for n, t in export.items()}
    receiver = refit.Receiver(version=0)
    for name, tensor in held.items():
        receiver.register(name, tensor)
    return receiver.start(), held


def assert_holds(held, export):
    for name, tensor in export.items():
        assert torch.equal(held[name].view(torch.int16), tensor.view(torch.int16)), name


def test_a_trainer_on_the_device_path_refits_within_a_staging_budget_far_below_the_model():
    """Real AdamW steps, the export read through the device boundary: a 64 KiB chunk target, a
    256 KiB staging budget and a model of about 1.2 MiB. Every step bit-identical; the pool never
    holds more than its budget; a rank of one reads each tensor once per sync."""
    trainer = trainer_model()
    export = bf16_export(trainer)
    model_bytes = sum(t.numel() * t.element_size() for t in export.values())
    budget = 256 << 10
    assert model_bytes > 4 * budget
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
    receiver, held = host_receiver(export)
    with receiver:
        publisher = rt.Publisher([receiver], memory="device", chunk_bytes=64 << 10, staging_bytes=budget)
        publisher.adopt_baseline(export, version=0)
        for step in range(3):
            train_step(trainer, optimizer, export)
            report = publisher.sync(export)
            assert not report.anchor and 0 < report.changed_elements < report.total_elements
            assert report.staged_bytes == model_bytes, (report.staged_bytes, model_bytes)
            assert report.staging_budget_bytes == budget
            assert 0 < report.staging_peak_bytes <= budget
            assert_holds(held, export)


def test_w_ranks_on_the_device_path_read_only_the_chunks_they_send():
    trainer = trainer_model(layers=6, width=96, seed=4)
    export = bf16_export(trainer)
    model_bytes = sum(t.numel() * t.element_size() for t in export.values())
    receiver, held = host_receiver(export)
    with receiver:
        groups = refit.in_process_group(3)
        publishers = [rt.Publisher([receiver], group=g, memory="device", chunk_bytes=16 << 10) for g in groups]
        for publisher in publishers:
            publisher.adopt_baseline(export, version=0)
        optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
        train_step(trainer, optimizer, export, width=96)
        reports = [None] * 3

        def run(rank):
            reports[rank] = publishers[rank].sync(export)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert all(r is not None for r in reports)
        staged = [r.staged_bytes for r in reports]
        assert all(0 < s < model_bytes for s in staged), staged
        assert sum(staged) == model_bytes, staged  # each chunk read by its owner only
        assert_holds(held, export)


def test_a_chunk_larger_than_the_staging_budget_fails_the_sync_by_name_and_changes_nothing():
    trainer = trainer_model(layers=2)
    export = bf16_export(trainer)
    receiver, held = host_receiver(export)
    with receiver:
        publisher = rt.Publisher([receiver], memory="device", chunk_bytes=64 << 10, staging_bytes=4096)
        with pytest.raises(refit.InvalidArgument, match=r"tensor '0\.weight' holds 73728 bytes.*staging budget of 4096"):
            publisher.adopt_baseline(export, version=0)
        before = {n: t.clone() for n, t in held.items()}
        train_step(trainer, torch.optim.AdamW(trainer.parameters(), lr=1e-3), export)
        with pytest.raises(refit.InvalidArgument, match=r"tensor '0\.weight'.*staging budget of 4096 bytes"):
            publisher.sync(export)  # an anchor (no baseline), refused before a payload is sent
        assert receiver.version == 0
        assert_holds(held, before)


def test_auto_stages_only_tensors_in_device_memory_and_host_refuses_them():
    export = bf16_export(trainer_model(layers=1))
    receiver, _ = host_receiver(export)
    with receiver:
        report = rt.Publisher([receiver]).sync(export, force_anchor=True)  # "auto": CPU tensors in place
        assert report.staged_bytes == 0 and report.staging_budget_bytes == 0
        meta = {n: torch.empty_like(t, device="meta") for n, t in export.items()}
        with pytest.raises(refit.InvalidArgument, match="meta device"):
            rt.Publisher([receiver]).sync(meta)
        with pytest.raises(refit.InvalidArgument, match="memory='gpu' is not one of"):
            rt.Publisher([receiver], memory="gpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: scripts/gpu-tests.sh runs it")
def test_a_trainer_on_a_cuda_device_publishes_through_the_staging_pool():
    trainer = trainer_model().to("cuda")
    export = {n: t.detach().to(torch.bfloat16).contiguous() for n, t in trainer.state_dict().items()}
    host_export = {n: t.cpu() for n, t in export.items()}
    receiver, held = host_receiver(host_export)
    with receiver:
        publisher = rt.Publisher([receiver], chunk_bytes=64 << 10, staging_bytes=256 << 10)  # "auto"
        publisher.adopt_baseline(export, version=0)
        optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
        for _ in range(2):
            optimizer.zero_grad()
            trainer(torch.randn(16, 192, device="cuda")).pow(2).mean().backward()
            optimizer.step()
            with torch.no_grad():
                for name, tensor in trainer.state_dict().items():
                    export[name].copy_(tensor.to(torch.bfloat16))
            report = publisher.sync(export)
            assert report.staged_bytes == sum(t.numel() * 2 for t in export.values())
            assert_holds(held, {n: t.cpu() for n, t in export.items()})

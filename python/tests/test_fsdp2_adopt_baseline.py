"""A restarted sharded trainer resumes with a delta: W = 2 gloo processes shard a small model with
FSDP2, sync twice, then "restart": every rank drops its publisher and makes a new one, which
adopts its own shards of the checkpoint the fleet holds (``refit.torch.Publisher.adopt_baseline``
of the DTensor module). The next sync is a delta for the receiver, which stays bit-identical to
the all-gathered weights. Then rank 1 alone restarts the same way, and the sync after it is a
delta too. Rank 0 hosts the receiver (an unsharded one, real loopback sockets).

This file run as a script is one rank.
"""

import json
import sys

import pytest
from conftest import run_ranks

torch = pytest.importorskip("torch")

HIDDEN, MLP = 8, 12


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, MLP)
        self.down = torch.nn.Linear(MLP, HIDDEN)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def rank_main(rank, world, init, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import refit
    import refit.torch as rt

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Small().to(torch.bfloat16)
    canonical = {n: t.detach().clone() for n, t in model.state_dict().items()}
    mesh = DeviceMesh("cpu", list(range(world)))
    fully_shard(model, mesh=mesh)

    receivers, held = [], None
    if rank == 0:
        endpoint = f"127.0.0.1:{refit.free_ports(1)[0]}"
        held = {n: t.contiguous().clone() for n, t in canonical.items()}
        receiver = refit.Receiver(data_endpoint=endpoint, peers=[endpoint], version=0)
        for name, tensor in held.items():
            receiver.register(name, tensor)
        receivers.append(receiver.start())

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(rank)

    def train_step():
        loss = model(torch.randn(4, HIDDEN, generator=generator).to(torch.bfloat16)).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def check_fleet(step):
        full = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()
                for n, t in model.state_dict().items()}
        if rank == 0:
            for name, tensor in held.items():
                assert torch.equal(tensor.view(torch.int16), full[name].contiguous().view(torch.int16)), (
                    f"step {step}: tensor {name} differs")

    group = rt.TorchGroup(timeout=120)

    def new_publisher(resume=False):
        # A restarted process makes a new publisher; here it reuses the gloo group (making one
        # is collective, and a rank that restarts alone cannot ask the others to join in). A
        # restarted trainer resumes its run (docs/protocol.md "Lineage and fencing").
        return rt.Publisher(receivers=receivers if rank == 0 else None, transfer_timeout=120, group=group,
                            run_id="fsdp2-adopt", resume=resume)

    reports = []
    publisher = new_publisher()
    publisher.adopt_baseline(model, version=0)
    for step in (1, 2):
        train_step()
        report = publisher.sync(model)
        check_fleet(step)
        reports.append({"step": step, "anchor": report.anchor, "version": report.version,
                        "catch_ups": [c["caught_up_by"] for c in report.catch_ups]})

    # Every rank restarts from the checkpoint of version 2 (its model as it is now).
    del publisher
    publisher = new_publisher(resume=True)
    publisher.adopt_baseline(model, version=2)
    train_step()
    report = publisher.sync(model)
    check_fleet(3)
    reports.append({"step": 3, "anchor": report.anchor, "version": report.version,
                    "catch_ups": [c["caught_up_by"] for c in report.catch_ups]})

    # Rank 1 alone restarts (its publisher is new; rank 0 keeps its own).
    if rank == 1:
        del publisher
        publisher = new_publisher(resume=True)
        publisher.adopt_baseline(model, version=3)
    train_step()
    report = publisher.sync(model)
    check_fleet(4)
    reports.append({"step": 4, "anchor": report.anchor, "version": report.version,
                    "catch_ups": [c["caught_up_by"] for c in report.catch_ups]})

    del publisher
    if rank == 0:
        for receiver in receivers:
            receiver.stop()
        with open(out, "w") as f:
            json.dump(reports, f)
    dist.destroy_process_group()


def test_a_restarted_fsdp2_trainer_adopts_its_shards_and_the_next_sync_is_a_delta(tmp_path):
    out = tmp_path / "reports.json"
    run_ranks(__file__, 2, [2, f"file://{tmp_path}/rendezvous", out])
    reports = json.loads(out.read_text())
    assert [r["anchor"] for r in reports] == [False] * 4, reports
    assert [r["version"] for r in reports] == [1, 2, 3, 4], reports
    assert all(r["catch_ups"] == ["delta"] for r in reports), reports


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])

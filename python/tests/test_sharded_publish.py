"""Sharded publishing from FSDP2: W gloo processes, each sending only its own shards.

Each world (W = 2, 3, 4 on a 1-D mesh, and FSDP over tensor parallelism on a 2 x 2 mesh; this
file run as a script, one process per rank) trains a small model sharded with FSDP2's
``fully_shard`` for 5 AdamW steps and calls nothing but
``refit.torch.Publisher.sync(module)`` after each. Rank 0 also hosts the fleet, as threads of
its process on real loopback sockets: an unsharded receiver and a tensor-parallel pair (TP = 2,
row- and column-parallel projections), all in one relay tree. After every sync rank 0 compares
every receiver's bytes with the all-gathered weights (``full_tensor()``), and every rank checks
that its tracker keeps only its own shards.

The model's row counts are not divisible by W, one tensor has fewer rows than W and one a
single element (empty shards), and the 0-d buffer is a plain tensor every rank holds: a replica,
sent by rank 0 and checked on the others.
"""

import json
import sys

import pytest
from conftest import run_ranks

torch = pytest.importorskip("torch")

STEPS = 5
HIDDEN, VOCAB, MLP = 8, 11, 12


class Small(torch.nn.Module):
    """An embedding of 11 rows, a norm, an MLP, a head, a 2-row gate and a 0-d buffer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, MLP)
        self.down = torch.nn.Linear(MLP, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.gate = torch.nn.Parameter(torch.randn(2, HIDDEN) * 0.1)
        self.temperature = torch.nn.Parameter(torch.ones(1))
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, tokens):
        hidden = self.norm(self.embed(tokens)) * (1 + self.gate.sum(0))
        return self.head(hidden + self.down(torch.relu(self.up(hidden)))) * self.scale * self.temperature


def tp_slice(name, full, shard):
    """What TP shard ``shard`` of 2 holds of ``full``: up row-parallel, down column-parallel."""
    if name in ("up.weight", "up.bias"):
        half = full.shape[0] // 2
        return full[shard * half:(shard + 1) * half]
    if name == "down.weight":
        half = full.shape[1] // 2
        return full[:, shard * half:(shard + 1) * half]
    return full


def rank_main(rank, world, mesh_kind, init, out, memory):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import refit
    import refit.torch as rt

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Small().to(torch.bfloat16)
    canonical = {n: t.detach().clone() for n, t in model.state_dict().items()}
    if mesh_kind == "2x2":
        # FSDP over tensor parallelism: up column-, down row-parallel on the TP mesh dimension,
        # then every parameter sharded over the data-parallel one (nested shards, and TP ranks
        # holding copies of what TP leaves alone).
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        data_rank = mesh.get_coordinate()[0]
    else:
        mesh = DeviceMesh("cpu", list(range(world)))
        fully_shard(model.up, mesh=mesh)
        fully_shard(model, mesh=mesh)
        data_rank = rank

    receivers, held = [], []
    if rank == 0:
        # The fleet starts from the same checkpoint the trainer does.
        endpoints = [f"127.0.0.1:{port}" for port in refit.free_ports(3)]
        rules = [{"kind": "row", "match": r"up\.(weight|bias)"},
                 {"kind": "column", "match": r"down\.weight"}]
        for index in range(3):
            shard = index if index < 2 else None
            arrays = {n: (tp_slice(n, t, shard) if shard is not None else t).contiguous().clone()
                      for n, t in canonical.items()}
            options = dict(data_endpoint=endpoints[index], peers=endpoints, version=0)
            if shard is not None:
                options.update(replica="tp", shard=shard,
                               loader=refit.Loader(rules=rules, tp_rank=shard, tp_size=2))
            receiver = refit.Receiver(**options)
            for name, tensor in arrays.items():
                receiver.register(name, tensor)
            receivers.append(receiver.start())
            held.append(arrays)

    # memory="device": each rank's shards are read through the device boundary and staged (the
    # GPU path, forced on CPU tensors).
    publisher = rt.Publisher(receivers=receivers if rank == 0 else None, transfer_timeout=120, memory=memory)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(data_rank)  # TP ranks see the same tokens
    reports = []
    for step in range(1, STEPS + 1):
        tokens = torch.randint(0, VOCAB, (4, 5), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(tokens).float().reshape(-1, VOCAB),
                                                 tokens.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        report = publisher.sync(model)
        full = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()
                for n, t in model.state_dict().items()}
        # This rank's tracker keeps the boxes it sends: at most its shards, never the model.
        local_bytes = sum(
            (t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
            for t in model.state_dict().values())
        assert publisher.baseline_bytes <= local_bytes, (rank, publisher.baseline_bytes, local_bytes)
        # Every rank sends its own shards straight to the fleet (a rank's report counts its own
        # payloads; rank 0's the whole transfer's).
        assert report.payloads > 0, (rank, step)
        if rank == 0:
            for index, arrays in enumerate(held):
                shard = index if index < 2 else None
                for name, tensor in arrays.items():
                    want = tp_slice(name, full[name], shard) if shard is not None else full[name]
                    assert torch.equal(tensor.view(torch.int16), want.contiguous().view(torch.int16)), (
                        f"step {step}: receiver {index} tensor {name} differs")
            reports.append({"step": step, "anchor": report.anchor, "wire_bytes": report.wire_bytes,
                            "staged_bytes": report.staged_bytes})
    if rank == 0:
        for receiver in receivers:
            receiver.stop()
        with open(out, "w") as f:
            json.dump(reports, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("world, mesh, memory", [(2, "1d", "auto"), (3, "1d", "auto"), (4, "1d", "auto"),
                                                 (4, "2x2", "auto"), (3, "1d", "device"), (4, "2x2", "device")])
def test_fsdp2_ranks_refit_unsharded_and_tp_receivers_with_only_their_shards(tmp_path, world, mesh, memory):
    out = tmp_path / "reports.json"
    run_ranks(__file__, world, [world, mesh, f"file://{tmp_path}/rendezvous", out, memory])
    reports = json.loads(out.read_text())
    assert [r["anchor"] for r in reports] == [True] + [False] * (STEPS - 1)
    assert all((r["staged_bytes"] > 0) == (memory == "device") for r in reports), reports


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6])

"""refit.layout: a rank's pieces from DTensor placements, checked on real gloo processes.

One world of 4 gloo processes (this file run as a script) holds every distributed case: meshes of
2, 3 and 4 ranks and a 2 x 2 mesh, distribute_tensor'd tensors and FSDP2 modules before and
after AdamW steps. Every rank computes its pieces and reads each box's bytes from its local
tensors; rank 0 gathers them with the full tensors. The checks here, independent of
refit.layout, require that the boxes tile every canonical tensor exactly (replicas coincide and
agree, nothing else overlaps) and that each box's bytes are the full tensor's at the box.
"""

import sys

import pytest
import torch
from conftest import run_ranks

import refit
from refit import layout
from refit.errors import InvalidArgument

WORLD = 4
PIECE_KEYS = {"tensor", "dtype", "shape", "offset", "extent", "local", "local_shape", "local_offset"}


def box(offset, extent):
    return tuple(slice(o, o + e) for o, e in zip(offset, extent))


def as_bytes(tensor):
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def split_by_torch(full, mesh_shape, coordinate, placements):
    """The shard of ``full`` at a mesh coordinate, split left to right by torch's own functions
    (what distribute_tensor does, without its even-split limit for _StridedShard)."""
    local = full
    for mesh_dim, placement in enumerate(placements):
        if hasattr(placement, "dim"):
            local = placement._split_tensor(local, mesh_shape[mesh_dim], with_padding=False)[0][
                coordinate[mesh_dim]]
    return local.contiguous()


# ---- The ranks (this file as a script) ----------------------------------------------------------


def distributed_cases(meshes):
    """(case, mesh, placements, shape, dtype) of the distribute_tensor cases."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    bf16, f32 = torch.bfloat16, torch.float32
    return [
        ("w2 Shard(0) 5 rows", meshes["w2"], [Shard(0)], (5, 3), bf16),
        ("w3 Shard(0) 7 rows", meshes["w3"], [Shard(0)], (7, 4), f32),
        ("w3 Shard(0) 2 rows", meshes["w3"], [Shard(0)], (2, 4), f32),
        ("w3 Shard(1)", meshes["w3"], [Shard(1)], (4, 5), bf16),
        ("w4 Shard(0) 6 rows", meshes["w4"], [Shard(0)], (6, 3), bf16),  # 2, 2, 2, 0
        ("w4 Shard(0) 7 rows", meshes["w4"], [Shard(0)], (7, 3), f32),
        ("w4 Shard(0) 3 rows", meshes["w4"], [Shard(0)], (3, 2), bf16),
        ("w4 Shard(0) 1 element", meshes["w4"], [Shard(0)], (1,), f32),
        ("w4 Replicate 0-d", meshes["w4"], [Replicate()], (), f32),
        ("w4 Shard(1)", meshes["w4"], [Shard(1)], (3, 10), bf16),
        ("w4 Shard(1) 3-d experts", meshes["w4"], [Shard(1)], (3, 6, 4), bf16),
        ("w4 Replicate", meshes["w4"], [Replicate()], (5, 3), bf16),
        ("2x2 (Shard(0), Shard(1))", meshes["2x2"], [Shard(0), Shard(1)], (5, 7), bf16),
        ("2x2 (Shard(0), Shard(0))", meshes["2x2"], [Shard(0), Shard(0)], (7, 3), f32),
        ("2x2 (Shard(0), Shard(0)) 3 rows", meshes["2x2"], [Shard(0), Shard(0)], (3, 2), f32),
        ("2x2 (Replicate, Shard(1))", meshes["2x2"], [Replicate(), Shard(1)], (4, 5), bf16),
        ("2x2 (_StridedShard(0, 2), Shard(0))", meshes["2x2"],
         [_StridedShard(0, split_factor=2), Shard(0)], (7, 3), f32),
        # A strided shard alone holds two separate blocks of rows: two pieces per rank.
        ("w2 _StridedShard(0, 2) alone", meshes["w2"], [_StridedShard(0, split_factor=2)], (8, 3), f32),
    ]


#: A DTensorSpec.shard_order that is not the default: dim 0 split over mesh dim 1, then 0.
SHARD_ORDER_CASE = "2x2 (Shard(0), Shard(0)) shard_order mesh dims (1, 0)"


def with_shard_order(source, mesh):
    """A DTensor whose spec carries a non-default shard_order (torch's private constructor; no
    public API makes one), its local shard split by torch's equivalent _StridedShard placements."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta

    placements, order = (Shard(0), Shard(0)), (ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),)
    strided = DTensorSpec._convert_shard_order_to_StridedShard(order, placements, mesh)
    local = split_by_torch(source, mesh.shape, mesh.get_coordinate(), strided)
    meta = TensorMeta(source.shape, source.stride(), source.dtype)
    return DTensor(local, DTensorSpec(mesh, placements, meta, shard_order=order), requires_grad=False)


class Tiny(torch.nn.Module):
    """An embedding, a norm, two projections, a head tied to the embedding, a 0-d buffer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(7, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.up = torch.nn.Linear(6, 9)
        self.down = torch.nn.Linear(9, 6)
        self.head = torch.nn.Linear(6, 7, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, tokens):
        hidden = self.norm(self.embed(tokens))
        return self.head(hidden + self.down(torch.relu(self.up(hidden)))) * self.scale


def train(model, generator, steps, vocab):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (4, 5), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, vocab), tokens.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def rank_pieces(tensors):
    """This rank's pieces of ``tensors`` and the bytes of each box, read from its local tensors."""
    pieces, local = layout.layout_of(tensors), layout.local_tensors(tensors)
    assert all(piece["local"] in local for piece in pieces)
    assert all(piece["local_shape"] == list(local[piece["local"]].shape) for piece in pieces)
    return [(piece, as_bytes(local[piece["local"]][box(piece["local_offset"], piece["extent"])]))
            for piece in pieces]


def full_tensors(tensors):
    """Every tensor in full (a collective for DTensors: every rank of the mesh calls it)."""
    out = {}
    for name, tensor in tensors.items():
        out[name] = (tensor.full_tensor() if isinstance(tensor, torch.distributed.tensor.DTensor)
                     else tensor).detach().clone()
    return out


def rank_main(rank, init, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor.placement_types import _StridedShard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    meshes = {"w2": DeviceMesh("cpu", [0, 1]), "w3": DeviceMesh("cpu", [0, 1, 2]),
              "w4": DeviceMesh("cpu", [0, 1, 2, 3]),
              "2x2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))}
    mine, fulls, notes = {}, {}, {}

    for index, (case, mesh, placements, shape, dtype) in enumerate(distributed_cases(meshes)):
        source = torch.randn(shape, generator=torch.Generator().manual_seed(index)).to(dtype)
        if any(isinstance(p, _StridedShard) for p in placements):
            # distribute_tensor takes _StridedShard on even splits only: split with torch's own
            # functions and assemble (the full tensor is checked against the source below).
            coordinate = mesh.get_coordinate()
            local = split_by_torch(source, mesh.shape, coordinate, placements) if coordinate else source[:0]
            tensor = DTensor.from_local(local, mesh, placements, shape=source.shape, stride=source.stride())
        else:
            tensor = distribute_tensor(source, mesh, placements)
        mine[case] = rank_pieces({"w": tensor})
        if mesh.get_coordinate() is not None:
            fulls[case] = {"w": source}
            assert torch.equal(tensor.full_tensor(), source), case

    source = torch.randn((7, 3), generator=torch.Generator().manual_seed(100))
    tensor = with_shard_order(source, meshes["2x2"])
    assert torch.equal(tensor.full_tensor(), source)
    mine[SHARD_ORDER_CASE], fulls[SHARD_ORDER_CASE] = rank_pieces({"w": tensor}), {"w": source}

    partial = DTensor.from_local(torch.ones(2, 2), meshes["w4"], [Partial()])
    try:
        layout.layout_of({"model.partial": partial})
        notes["partial"] = "no error"
    except InvalidArgument as error:
        notes["partial"] = str(error)

    # FSDP2 over 4 ranks: the layout of the freshly sharded module against the weights it was
    # made from, and after AdamW steps against the all-gathered ones.
    torch.manual_seed(0)
    model = Tiny()
    # The tied head is the embedding: the layout names it once, as embed.weight.
    source = {n: t.detach().clone() for n, t in model.state_dict().items() if n != "head.weight"}
    fully_shard(model.up, mesh=meshes["w4"])
    fully_shard(model, mesh=meshes["w4"])
    mine["fsdp2 sharded"], fulls["fsdp2 sharded"] = rank_pieces(model), source
    notes["fsdp2"] = {n: (str(tuple(p.placements)), tuple(p.to_local().shape),
                          p.to_local().untyped_storage().nbytes() // p.element_size())
                      for n, p in model.named_parameters()}
    train(model, torch.Generator().manual_seed(rank), steps=3, vocab=7)
    mine["fsdp2 after AdamW"] = rank_pieces(model)
    fulls["fsdp2 after AdamW"] = full_tensors({n: t for n, t in model.state_dict(keep_vars=True).items()
                                               if n != "head.weight"})

    # FSDP2 over tensor parallelism on the 2 x 2 mesh: column- then row-parallel projections.
    torch.manual_seed(1)
    # TP splits evenly (its forward needs that); FSDP then splits each TP shard unevenly.
    tp_model = torch.nn.Sequential(torch.nn.Embedding(7, 3), torch.nn.Linear(3, 10), torch.nn.ReLU(),
                                   torch.nn.Linear(10, 7))
    source = {n: t.detach().clone() for n, t in tp_model.state_dict().items()}
    parallelize_module(tp_model, meshes["2x2"]["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
    fully_shard(tp_model, mesh=meshes["2x2"]["dp"])
    mine["fsdp2 x tp sharded"], fulls["fsdp2 x tp sharded"] = rank_pieces(tp_model), source
    notes["fsdp2 x tp"] = {n: (str(tuple(p.placements)), tuple(p.to_local().shape))
                           for n, p in tp_model.named_parameters()}
    # The TP ranks of one data-parallel group see the same tokens.
    train(tp_model, torch.Generator().manual_seed(meshes["2x2"].get_coordinate()[0]), steps=2, vocab=7)
    mine["fsdp2 x tp after AdamW"] = rank_pieces(tp_model)
    fulls["fsdp2 x tp after AdamW"] = full_tensors(tp_model.state_dict(keep_vars=True))

    gathered = [None] * WORLD if rank == 0 else None
    dist.gather_object((mine, notes), gathered, dst=0)
    if rank == 0:
        torch.save({"ranks": [g[0] for g in gathered], "notes": [g[1] for g in gathered],
                    "fulls": fulls}, out)
    dist.destroy_process_group()


# ---- The checks (pytest) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    directory = tmp_path_factory.mktemp("layout")
    out = directory / "pieces.pt"
    run_ranks(__file__, WORLD, [f"file://{directory}/rendezvous", out], timeout=240)
    return torch.load(out, weights_only=False)


def check_tiling(name, full, holdings):
    """``holdings``: (rank, piece, bytes). The boxes tile ``full``; each holds its bytes."""
    boxes = {}
    for rank, piece, data in holdings:
        where = f"{name}: rank {rank} piece {piece}"
        assert set(piece) == PIECE_KEYS, where
        assert piece["dtype"] == str(full.dtype).removeprefix("torch."), where
        assert piece["shape"] == list(full.shape), where
        offset, extent = piece["offset"], piece["extent"]
        assert len(offset) == len(extent) == len(piece["local_offset"]) == full.dim(), where
        assert all(0 <= o and 0 <= e and o + e <= s for o, e, s in zip(offset, extent, full.shape)), where
        assert data == as_bytes(full[box(offset, extent)]), where
        boxes.setdefault((tuple(offset), tuple(extent)), []).append((rank, data))
    count = torch.zeros(full.shape, dtype=torch.int32)
    for (offset, extent), holders in boxes.items():
        assert all(data == holders[0][1] for _, data in holders), (name, offset, extent, holders)
        count[box(offset, extent)] += 1
    # Exactly once everywhere: covered, and different boxes never overlap.
    assert bool((count == 1).all()), (name, count)
    # refit's own planner (C++) agrees: the pieces tile the tensor, one sender per distinct box.
    ranks = sorted({rank for rank, _, _ in holdings})
    plan = refit.plan_layouts([[piece for r, piece, _ in holdings if r == rank] for rank in ranks])
    (planned,) = plan["tensors"]
    nonempty = {key for key in boxes if all(e > 0 for e in key[1])}
    assert {(tuple(b["offset"]), tuple(b["extent"])) for b in planned["boxes"]} == nonempty, (name, plan)


CASES = [c[0] for c in distributed_cases({k: None for k in ("w2", "w3", "w4", "2x2")})] + [
    SHARD_ORDER_CASE, "fsdp2 sharded", "fsdp2 after AdamW", "fsdp2 x tp sharded", "fsdp2 x tp after AdamW"]


@pytest.mark.parametrize("case", CASES)
def test_the_pieces_of_every_rank_tile_each_tensor_with_its_bytes(world, case):
    fulls = world["fulls"][case]
    holdings = {name: [] for name in fulls}
    for rank, mine in enumerate(world["ranks"]):
        for piece, data in mine[case]:
            assert piece["tensor"] in holdings, (case, rank, piece)
            holdings[piece["tensor"]].append((rank, piece, data))
    for name, full in fulls.items():
        check_tiling(f"{case} '{name}'", full, holdings[name])


def test_the_cases_cover_what_the_issue_names(world):
    pieces = {case: [p for mine in world["ranks"] for p, _ in mine[case]] for case in CASES}
    assert [p["extent"] for p in pieces["w4 Shard(0) 6 rows"]] == [[2, 3], [2, 3], [2, 3], [0, 3]]
    assert [p["extent"] for p in pieces["w4 Shard(0) 3 rows"]][-1] == [0, 2]  # fewer rows than W
    assert [p["extent"] for p in pieces["w4 Replicate 0-d"]] == [[]] * 4
    assert len(pieces["w2 _StridedShard(0, 2) alone"]) == 4  # two blocks per rank
    assert [p["offset"] for p in pieces["w2 _StridedShard(0, 2) alone"]] == [[0, 0], [4, 0], [2, 0], [6, 0]]
    # Mesh dim 1 splits first: rank 1 (mesh coordinate (0, 1)) holds rows 4-5, not 2-3.
    assert [p["offset"][0] for p in pieces[SHARD_ORDER_CASE]] == [0, 4, 2, 6]
    # FSDP2 over TP shards the TP shard: rank (dp, tp) holds rows of TP shard tp only.
    up = [p for p in pieces["fsdp2 x tp sharded"] if p["tensor"] == "1.weight"]
    assert [(p["offset"][0], p["extent"][0]) for p in up] == [(0, 3), (5, 3), (3, 2), (8, 2)]
    # The tied head appears once, under the embedding's name; the 0-d buffer is a whole piece.
    names = {p["tensor"] for p in pieces["fsdp2 after AdamW"]}
    assert names == {"embed.weight", "norm.weight", "norm.bias", "up.weight", "up.bias",
                     "down.weight", "down.bias", "scale"}


def test_a_partial_dtensor_is_refused_by_name(world):
    message = world["notes"][0]["partial"]
    assert "model.partial" in message and "Partial" in message, message


def test_fsdp2_placements_as_torch_makes_them(world):
    fsdp2, nested = world["notes"][0]["fsdp2"], world["notes"][0]["fsdp2 x tp"]
    assert fsdp2["up.weight"][0] == "(Shard(dim=0),)"
    assert "_StridedShard(dim=0, sf=2)" in nested["1.weight"][0], nested


# ---- Without torch.distributed ------------------------------------------------------------------


def test_plain_tensors_are_whole_pieces_and_local_tensors_share_memory():
    tensors = {"a": torch.zeros(2, 3, dtype=torch.bfloat16), "s": torch.tensor(1.0)}
    assert layout.layout_of(tensors) == [
        {"tensor": "a", "dtype": "bfloat16", "shape": [2, 3], "offset": [0, 0], "extent": [2, 3],
         "local": "a", "local_shape": [2, 3], "local_offset": [0, 0]},
        {"tensor": "s", "dtype": "float32", "shape": [], "offset": [], "extent": [], "local": "s",
         "local_shape": [], "local_offset": []},
    ]
    local = layout.local_tensors(tensors)
    assert list(local) == ["a", "s"] and local["a"].data_ptr() == tensors["a"].data_ptr()


def test_a_module_gives_its_state_dict_with_ties_once():
    model = Tiny()
    model.register_buffer("scratch", torch.zeros(3), persistent=False)
    names = [p["tensor"] for p in layout.layout_of(model)]
    assert names == [n for n in model.state_dict() if n != "head.weight"]
    assert list(layout.local_tensors(model)) == names


def test_what_is_not_a_tensor_or_dtensor_is_refused_by_name():
    with pytest.raises(InvalidArgument, match="'model.x'.*int"):
        layout.layout_of({"model.x": 3})
    with pytest.raises(InvalidArgument, match="'w'.*DTensor"):
        layout.dtensor_pieces("w", torch.zeros(2))
    with pytest.raises(InvalidArgument, match="expected a torch.nn.Module"):
        layout.layout_of(3)
    from torch.distributed.tensor import Partial, Shard

    with pytest.raises(InvalidArgument, match=r"'lm_head.weight': placements \(Shard\(dim=0\), Partial"):
        layout._shard_runs("lm_head.weight", (4, 2), (2, 2), (0, 1), [Shard(0), Partial()])
    with pytest.raises(InvalidArgument, match="'w': placement S\\(2\\).*shards dim 2 of a 2-d tensor"):
        layout._shard_runs("w", (4, 2), (2,), (0,), [Shard(2)])


def reference_local(shape, mesh_shape, coordinate, placements):
    """The canonical flat indices a coordinate holds, sharded by torch's own split functions."""
    return split_by_torch(torch.arange(torch.Size(shape).numel()).reshape(shape), mesh_shape, coordinate,
                          placements)


def test_boxes_match_torchs_split_for_every_coordinate():
    """Every mesh coordinate's pieces against torch's own splitting, over shapes and meshes."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    shapes = [(0, 3), (1, 2), (5, 3), (7, 2), (8, 5), (3, 9, 2)]
    layouts = [((2,), [Shard(0)]), ((3,), [Shard(1)]), ((4,), [Shard(0)]), ((2, 2), [Shard(0), Shard(1)]),
               ((2, 3), [Shard(0), Shard(0)]), ((3, 2), [Replicate(), Shard(0)]),
               ((4, 2), [Shard(1), Shard(0)]),
               ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
               ((2, 3), [_StridedShard(0, split_factor=3), Shard(0)]),
               ((2, 2), [Shard(0), _StridedShard(0, split_factor=2)]),
               ((2,), [_StridedShard(0, split_factor=2)]), ((3,), [_StridedShard(1, split_factor=2)])]
    checked = 0
    for shape, (mesh_shape, placements) in itertools.product(shapes, layouts):
        if any(getattr(p, "dim", 0) >= len(shape) for p in placements):
            continue
        canonical = torch.arange(torch.Size(shape).numel()).reshape(shape)
        count = torch.zeros(shape, dtype=torch.int32)
        for coordinate in itertools.product(*(range(m) for m in mesh_shape)):
            runs = layout._shard_runs("w", shape, mesh_shape, coordinate, placements)
            pieces = layout._pieces_from_runs("w", "int64", shape, runs, "w")
            expected = reference_local(shape, mesh_shape, coordinate, placements)
            held = torch.full(expected.shape, -1, dtype=torch.int64)
            for piece in pieces:
                local_box = box(piece["local_offset"], piece["extent"])
                assert list(held[local_box].shape) == piece["extent"], (shape, placements, coordinate, piece)
                held[local_box] = canonical[box(piece["offset"], piece["extent"])]
                count[box(piece["offset"], piece["extent"])] += 1
            assert torch.equal(held, expected), (shape, mesh_shape, placements, coordinate, pieces)
            checked += 1
        replicas = torch.Size(mesh_shape).numel() // torch.Size(
            [mesh_shape[i] for i, p in enumerate(placements) if hasattr(p, "dim")]).numel()
        assert bool((count == replicas).all()), (shape, mesh_shape, placements, count)
    assert checked > 100


def test_an_explicit_shard_order_is_followed():
    """A non-default DTensorSpec.shard_order (dim 0 over mesh dim 1, then 0) against torch's
    own equivalent _StridedShard placements."""
    from torch.distributed.tensor import Shard

    spec_module = pytest.importorskip("torch.distributed.tensor._dtensor_spec")
    entry = getattr(spec_module, "ShardOrderEntry", None)
    if entry is None:
        pytest.skip("this torch has no shard_order")

    class Mesh:
        shape = (2, 3)

        def size(self, dim):
            return self.shape[dim]

    placements = (Shard(0), Shard(0))
    order = (entry(tensor_dim=0, mesh_dims=(1, 0)),)
    strided = spec_module.DTensorSpec._convert_shard_order_to_StridedShard(order, placements, Mesh())
    for shape in [(7, 2), (12, 1), (5, 3)]:
        for coordinate in [(0, 0), (0, 2), (1, 1), (1, 2)]:
            ordered = layout._shard_runs("w", shape, Mesh.shape, coordinate, placements, {0: [1, 0]})
            expected = layout._shard_runs("w", shape, Mesh.shape, coordinate, strided)
            # An empty share is the same wherever its (arbitrary) anchor lies.
            assert [[r for r in runs if r[0] < r[1]] for runs in ordered] == [
                [r for r in runs if r[0] < r[1]] for runs in expected], (shape, coordinate)


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3])

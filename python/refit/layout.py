"""Producer layouts: the pieces of canonical tensors that a trainer rank holds.

A rank that holds only a shard of each weight describes what it holds as a list of *pieces*;
:meth:`refit.Publisher.sync` with ``layout=`` sends each rank's pieces, and rank 0 checks that
the pieces of every rank tile each canonical tensor (docs/sharded.md).

A piece is a dict with exactly these keys::

    {"tensor": "model.embed.weight",   # the canonical tensor's name
     "dtype": "bfloat16",              # str(torch dtype) without "torch."
     "shape": [7, 16],                 # the canonical (global) shape
     "offset": [4, 0],                 # where the box begins in the canonical tensor, per dim
     "extent": [2, 16],                # the box's size per dim (0 in a dim: an empty shard)
     "local": "model.embed.weight",    # the local tensor holding the box
     "local_shape": [2, 16],           # that local tensor's shape
     "local_offset": [0, 0]}           # where the box begins in the local tensor, per dim

The box is ``[offset, offset + extent)`` per dimension; the local tensor's elements in
``[local_offset, local_offset + extent)`` equal the canonical tensor's elements in the box. A 0-d
tensor has ``shape``, ``offset`` and ``extent`` ``[]``.

:func:`layout_of` gives a rank's pieces for a module or a mapping, :func:`local_tensors` the
local tensors they name; :func:`dtensor_pieces` the pieces of one DTensor;
:func:`layout_from_loader` the pieces of plain tensors laid out as a :class:`refit.Loader`
describes (a Megatron-style trainer: row/column TP, fused qkv and gate/up, interleaved
``linear_qkv``, vocabulary-parallel embeddings, expert stacks). torch is imported
when a function is called, not with this module, and torch.distributed need not be initialised
for plain tensors.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ._tensors import named_tensors
from .errors import InvalidArgument

__all__ = ["dtensor_pieces", "layout_of", "layout_from_loader", "local_tensors", "dtype_name"]

Piece = Dict[str, Any]

# A run of canonical indices [start, stop) along one dimension. A rank's share of a dimension is
# a list of runs in local order: one run for Shard, several for _StridedShard (whose shard
# interleaves blocks of the dimension).
_Run = Tuple[int, int]


def dtype_name(dtype: Any) -> str:
    """Return refit's name of a torch dtype: ``str(dtype)`` without ``torch.`` (``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def _is_dtensor(tensor: Any) -> bool:
    import torch  # noqa: PLC0415 — torch only when a caller passes tensors

    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    return isinstance(tensor, DTensor)


def _chunk(length: int, chunks: int, index: int) -> Tuple[int, int]:
    """Positions [start, stop) of chunk ``index`` of ``length`` split as ``torch.chunk`` does.

    Every chunk but the last non-empty one has ceil(length / chunks) elements, so the chunks
    past the end are empty (7 rows over 4 ranks: 2, 2, 2, 1; 6 rows: 2, 2, 2, 0). This is what
    DTensor's Shard and FSDP2 hold (``Shard.local_shard_size_and_offset``).
    """
    size = -(-length // chunks)
    start = min(index * size, length)
    return start, min(start + size, length)


def _select(runs: List[_Run], start: int, stop: int) -> List[_Run]:
    """Return the canonical runs at positions [start, stop) of the concatenation of ``runs``.

    An empty selection is one empty run that keeps a position: the canonical index at ``start``,
    or the end of the last run when ``start`` is past the end.
    """
    selected: List[_Run] = []
    position = 0
    anchor: Optional[int] = None
    for run_start, run_stop in runs:
        length = run_stop - run_start
        if anchor is None and start < position + length:
            anchor = run_start + (start - position)
        lo, hi = max(start, position), min(stop, position + length)
        if lo < hi:
            selected.append((run_start + lo - position, run_start + hi - position))
        position += length
    if selected:
        return selected
    return [(anchor if anchor is not None else runs[-1][1],) * 2]


def _shard(runs: List[_Run], chunks: int, index: int) -> List[_Run]:
    length = sum(stop - start for start, stop in runs)
    return _select(runs, *_chunk(length, chunks, index))


def _strided_shard(runs: List[_Run], split_factor: int, chunks: int, index: int) -> List[_Run]:
    """``_StridedShard(split_factor)``: split into ``split_factor`` blocks as torch.chunk does,
    each block into ``chunks``, and take chunk ``index`` of every block, in order
    (``_StridedShard._split_tensor``)."""
    length = sum(stop - start for start, stop in runs)
    selected: List[_Run] = []
    for block in range(split_factor):
        block_start, block_stop = _chunk(length, split_factor, block)
        start, stop = _chunk(block_stop - block_start, chunks, index)
        if start < stop:
            selected.extend(_select(runs, block_start + start, block_start + stop))
    if selected:
        return selected
    first_start, first_stop = _chunk(length, split_factor, 0)
    empty_at = first_start + _chunk(first_stop - first_start, chunks, index)[0]
    return _select(runs, empty_at, empty_at)


def _merged(runs: List[_Run]) -> List[_Run]:
    """Join runs that continue one another; drop empty runs unless nothing else is left."""
    merged: List[_Run] = []
    for start, stop in runs:
        if start == stop:
            continue
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return merged or [runs[0]]


def _placement_kind(placement: Any) -> str:
    from torch.distributed.tensor import placement_types as pt  # noqa: PLC0415

    strided = getattr(pt, "_StridedShard", None)
    if strided is not None and isinstance(placement, strided):
        return "strided"
    if isinstance(placement, pt.Shard):
        return "shard"
    if isinstance(placement, pt.Replicate):
        return "replicate"
    if isinstance(placement, pt.Partial):
        return "partial"
    return "unknown"


def _default_shard_order(placements: Sequence[Any]) -> Dict[int, List[int]]:
    order: Dict[int, List[int]] = {}
    for mesh_dim, placement in enumerate(placements):
        if _placement_kind(placement) == "shard":
            order.setdefault(placement.dim, []).append(mesh_dim)
    return order


def _shard_runs(
    name: str,
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
    shard_order: Optional[Dict[int, List[int]]] = None,
) -> List[List[_Run]]:
    """Return, per tensor dimension, the canonical runs that the mesh ``coordinate`` holds.

    Placements apply left to right over the mesh dimensions (DTensor's default), each to the
    share the ones before it left; a ``shard_order`` (tensor dim -> mesh dims in the order they
    shard it) overrides that order for plain Shard placements. Raises InvalidArgument for a
    Partial or unknown placement or a shard dimension out of range.
    """
    ndim = len(shape)
    runs: List[List[_Run]] = [[(0, size)] for size in shape]
    kinds = [_placement_kind(p) for p in placements]
    for placement, kind in zip(placements, kinds):
        if kind == "partial":
            raise InvalidArgument(
                f"tensor '{name}': placements {tuple(placements)} include {placement}: a partial "
                "tensor (a pending reduction) is not a weight; redistribute it to Shard or "
                "Replicate first"
            )
        if kind == "unknown":
            raise InvalidArgument(
                f"tensor '{name}': placement {placement!r} of {tuple(placements)} is not one refit "
                "knows (Shard, _StridedShard, Replicate)"
            )
        if kind in ("shard", "strided") and not 0 <= placement.dim < ndim:
            raise InvalidArgument(
                f"tensor '{name}': placement {placement} of {tuple(placements)} shards dim "
                f"{placement.dim} of a {ndim}-d tensor"
            )
    if "strided" in kinds or shard_order is None:
        # _StridedShard encodes its order in its split factor and reads left to right.
        for mesh_dim, (placement, kind) in enumerate(zip(placements, kinds)):
            chunks, index = mesh_shape[mesh_dim], coordinate[mesh_dim]
            if kind == "shard":
                runs[placement.dim] = _shard(runs[placement.dim], chunks, index)
            elif kind == "strided":
                runs[placement.dim] = _strided_shard(
                    runs[placement.dim], int(placement.split_factor), chunks, index
                )
    else:
        for dim, mesh_dims in shard_order.items():
            for mesh_dim in mesh_dims:
                runs[dim] = _shard(runs[dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
    return [_merged(r) for r in runs]


def _pieces_from_runs(
    name: str, dtype: str, shape: Sequence[int], runs: List[List[_Run]], local: str
) -> List[Piece]:
    """One piece per combination of runs (the runs of each dimension lie in local order)."""
    per_dim = []
    local_shape = [int(sum(stop - start for start, stop in dim_runs)) for dim_runs in runs]
    for dim_runs in runs:
        local_starts = [0]
        for start, stop in dim_runs[:-1]:
            local_starts.append(local_starts[-1] + stop - start)
        per_dim.append(list(zip(dim_runs, local_starts)))
    pieces = []
    for combination in itertools.product(*per_dim):
        pieces.append(
            {
                "tensor": name,
                "dtype": dtype,
                "shape": [int(s) for s in shape],
                "offset": [int(run[0]) for run, _ in combination],
                "extent": [int(run[1] - run[0]) for run, _ in combination],
                "local": local,
                "local_shape": local_shape,
                "local_offset": [int(start) for _, start in combination],
            }
        )
    return pieces


def _spec_shard_order(tensor: Any) -> Optional[Dict[int, List[int]]]:
    """The DTensor's shard order when it is not the default left-to-right one, else None.

    torch >= 2.9 keeps one in ``DTensorSpec.shard_order``; the public APIs (distribute_tensor,
    FSDP2, parallelize_module) leave it at the default or express it with _StridedShard.
    """
    order = getattr(tensor._spec, "shard_order", None)
    if not order:
        return None
    explicit = {int(entry.tensor_dim): [int(m) for m in entry.mesh_dims] for entry in order}
    return None if explicit == _default_shard_order(tensor.placements) else explicit


def dtensor_pieces(name: str, tensor: Any) -> List[Piece]:
    """Return the pieces of canonical tensor ``name`` that this rank's shard of ``tensor`` holds.

    ``tensor`` is a DTensor; its canonical shape is the global one. The boxes come from the
    device mesh, this rank's coordinate in it and the placements: ``Shard(d)`` on any mesh
    dimension (uneven splits as ``torch.chunk``, so a rank may hold an empty box), several
    shards of one dimension (FSDP over TP: ``(_StridedShard(0, sf), Shard(0))`` or
    ``(Shard(0), Shard(0))``), and ``Replicate``. One piece as a rule; a shard that holds
    several separate blocks of a dimension (a ``_StridedShard`` not followed by the shard that
    makes it contiguous) gives one piece per block, each at its place in the local tensor. A
    rank outside the mesh holds nothing: ``[]``.

    Raises InvalidArgument, naming the tensor, for a Partial placement (not a weight), an
    unknown placement, or a local shard whose shape is not the one the placements give.
    """
    if not _is_dtensor(tensor):
        raise InvalidArgument(f"tensor '{name}': expected a DTensor, got {type(tensor).__name__}")
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return []
    shape = tuple(int(s) for s in tensor.shape)
    placements = tuple(tensor.placements)
    runs = _shard_runs(name, shape, tuple(mesh.shape), coordinate, placements, _spec_shard_order(tensor))
    expected = tuple(sum(stop - start for start, stop in dim_runs) for dim_runs in runs)
    local = tensor.to_local()
    if tuple(local.shape) != expected:
        raise InvalidArgument(
            f"tensor '{name}': the local shard's shape {tuple(local.shape)} is not the "
            f"{expected} that placements {placements} on mesh {tuple(mesh.shape)} give at "
            f"coordinate {tuple(coordinate)} (global shape {shape})"
        )
    return _pieces_from_runs(name, dtype_name(tensor.dtype), shape, runs, name)


def _whole_piece(name: str, tensor: Any) -> Piece:
    shape = [int(s) for s in tensor.shape]
    return {
        "tensor": name,
        "dtype": dtype_name(tensor.dtype),
        "shape": shape,
        "offset": [0] * len(shape),
        "extent": list(shape),
        "local": name,
        "local_shape": list(shape),
        "local_offset": [0] * len(shape),
    }


def _tensors_of(tensors: Any) -> List[Tuple[str, Any]]:
    """(name, tensor) pairs: a module's state_dict (ties once, first name), or a mapping / pairs."""
    import torch  # noqa: PLC0415

    if isinstance(tensors, torch.nn.Module):
        pairs, seen = [], set()
        # keep_vars: the Parameter objects themselves, so a tied parameter is recognised by
        # identity under its second name (state_dict lists it under every name).
        for name, tensor in tensors.state_dict(keep_vars=True).items():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            pairs.append((name, tensor))
    elif isinstance(tensors, Mapping) or (
        hasattr(tensors, "__iter__") and not isinstance(tensors, (str, bytes))
    ):
        pairs = named_tensors(tensors)
    else:
        raise InvalidArgument(
            f"expected a torch.nn.Module, a mapping or (name, tensor) pairs, got {type(tensors).__name__}"
        )
    for name, tensor in pairs:
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgument(f"tensor '{name}': expected a torch.Tensor, got {type(tensor).__name__}")
    return pairs


def layout_of(tensors: Any) -> List[Piece]:
    """Return the pieces this rank holds of a module's or a mapping's canonical tensors.

    ``tensors``: a ``torch.nn.Module`` (its ``state_dict()`` names: parameters and persistent
    buffers; a tied parameter once, under its first name), or a mapping (or pairs) name ->
    tensor, taken as given. A DTensor gives its :func:`dtensor_pieces`; a plain tensor one whole
    piece (offset zeros, extent its shape), which every rank holding it repeats as a replica.
    The pieces name their local tensors as :func:`local_tensors` of the same argument returns
    them. Tensors may be on any device: only shapes and placements are read.
    """
    pieces: List[Piece] = []
    for name, tensor in _tensors_of(tensors):
        if _is_dtensor(tensor):
            pieces.extend(dtensor_pieces(name, tensor))
        else:
            pieces.append(_whole_piece(name, tensor))
    return pieces


def local_tensors(tensors: Any) -> Dict[str, Any]:
    """Return the local tensors that :func:`layout_of`'s pieces name, in the same order.

    A DTensor gives its ``to_local()`` shard, a plain tensor itself; both detached, sharing the
    caller's memory (no copy).
    """
    out: Dict[str, Any] = {}
    for name, tensor in _tensors_of(tensors):
        out[name] = (tensor.to_local() if _is_dtensor(tensor) else tensor).detach()
    return out


def layout_from_loader(loader: Any, tensors: Any, canonical_names: Sequence[str]) -> List[Piece]:
    """Return the pieces of plain local tensors laid out as ``loader`` describes.

    ``loader``: a :class:`refit.Loader` with this rank's tensor-parallel coordinates and the
    rules a receiver in the same layout would use (``qkv_interleaved`` for Megatron-Core's
    ``linear_qkv``). ``tensors``: this rank's local tensors (a module or a mapping, as
    :func:`layout_of` takes them; only names, dtypes and shapes are read, so they may live on
    any device). ``canonical_names``: the canonical tensors this rank holds (its pipeline
    stage's); a name a ``skip`` rule matches is left out. A local tensor that no name maps onto
    raises InvalidArgument (a name missing from the list), as does a shape that does not fit
    its rule. Pass the result to ``Publisher.sync(tensors, layout=...)``.
    """
    from . import Loader  # noqa: PLC0415 — the package imports this module

    if not isinstance(loader, Loader):
        raise InvalidArgument(f"loader: expected a refit.Loader, got {type(loader).__name__}")
    locals_ = [(name, dtype_name(t.dtype), list(t.shape)) for name, t in _tensors_of(tensors)]
    from . import _core  # noqa: PLC0415

    return _core.layout_from_loader(loader._spec, locals_, [str(n) for n in canonical_names])

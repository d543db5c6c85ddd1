"""Zero-copy views of numpy arrays and torch tensors, as the core takes them.

The core takes a tensor as ``(name, dtype, shape, buffer)``: ``buffer`` is a flat ``uint8`` numpy
array over the tensor's own memory. Torch tensors have no buffer protocol and numpy has no
bfloat16, so a torch tensor is reinterpreted as bytes (``reshape(-1).view(torch.uint8)``) and
handed over through ``.numpy()``, which shares its memory. Nothing is ever copied: a tensor that cannot
be viewed in place (not contiguous, not on the CPU) is refused with a message naming it.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Mapping, NamedTuple, Sequence, Tuple, Union

import numpy as np

from .errors import InvalidArgument

#: A tensor as the core takes it: (name, dtype name, shape, flat uint8 buffer), or for a tensor in
#: device memory (name, dtype name, shape, TensorMemory).
BufferTensor = Tuple[str, str, List[int], Any]


class DeviceTensor(NamedTuple):
    """A tensor a publisher reads through refit's device boundary: its dtype (``"bfloat16"``,
    ``"torch.bfloat16"``, …), its shape and its :class:`refit.TensorMemory` backend
    (:class:`refit.torch.TorchTensorMemory`). The chunks a rank sends are staged through a bounded
    pool of host buffers (``staging_bytes``); the others are never read."""

    dtype: str
    shape: Sequence[int]
    memory: Any


def _is_torch_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr")


def _dtensor_placements(tensor: Any) -> Any:
    """The placements of a DTensor, None for any other tensor. A DTensor's byte view would run
    collectives (or fail) instead of reading this rank's bytes, so it is refused by name."""
    if type(tensor).__name__ != "DTensor":
        return None
    return tuple(getattr(tensor, "placements", ()))


def as_buffer_tensor(name: str, value: Any, writable: bool = False) -> BufferTensor:
    """Return ``value`` (a numpy array or a CPU torch tensor) as the core's tensor tuple.

    The buffer aliases ``value``'s memory. Tensors with ``requires_grad`` are detached (the
    bytes are the same). Raises InvalidArgument for a tensor that is not contiguous, not on the
    CPU, or read-only when ``writable``.
    """
    if isinstance(value, DeviceTensor):
        return (name, str(value.dtype), [int(d) for d in value.shape], value.memory)
    if _is_torch_tensor(value):
        import torch  # noqa: PLC0415 — only when the caller passes torch tensors

        tensor = value.detach()
        placements = _dtensor_placements(tensor)
        if placements is not None:
            raise InvalidArgument(
                f"tensor '{name}': it is a DTensor ({placements}), whose bytes are not this "
                "rank's shard; publish a DTensor model with refit.torch.Publisher.sync(module), "
                "which sends each rank's shards through their layout (refit.layout), or pass "
                "plain tensors: .to_local() with a layout, or .full_tensor()"
            )
        if tensor.device.type != "cpu":
            raise InvalidArgument(
                f"tensor '{name}': it is on {tensor.device}; this call takes host memory "
                "(refit.torch.Publisher and refit.torch.Receiver.attach reach device tensors "
                "through the device boundary)"
            )
        if not tensor.is_contiguous():
            raise InvalidArgument(
                f"tensor '{name}': it is not contiguous (strides {tuple(tensor.stride())}); "
                "pass .contiguous() or a contiguous export"
            )
        dtype = str(tensor.dtype)  # "torch.bfloat16": the core parses the torch spelling
        shape = list(tensor.shape)
        flat = tensor.reshape(-1)
        buffer = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
        return (name, dtype, shape, buffer)
    array = value if isinstance(value, np.ndarray) else None
    if array is None:
        raise InvalidArgument(
            f"tensor '{name}': expected a numpy array or a torch tensor, got {type(value).__name__}"
        )
    if not array.flags.c_contiguous:
        raise InvalidArgument(f"tensor '{name}': the array is not C-contiguous")
    if writable and not array.flags.writeable:
        raise InvalidArgument(f"tensor '{name}': the array is read-only")
    return (name, array.dtype.name, list(array.shape), array.reshape(-1).view(np.uint8))


TensorsLike = Union[Mapping[str, Any], Iterable[Tuple[str, Any]]]


def named_tensors(tensors: TensorsLike) -> List[Tuple[str, Any]]:
    """Return ``tensors`` (a mapping, or (name, tensor) pairs) as a list of pairs, in order."""
    if isinstance(tensors, Mapping):
        return list(tensors.items())
    pairs = list(tensors)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise InvalidArgument(
                f"tensors: expected a mapping or (name, tensor) pairs, got an element {pair!r:.80}"
            )
    return pairs


def buffer_tensors(tensors: TensorsLike) -> List[BufferTensor]:
    """Return every tensor of ``tensors`` as the core's tuple, in order, zero-copy."""
    return [as_buffer_tensor(name, value) for name, value in named_tensors(tensors)]

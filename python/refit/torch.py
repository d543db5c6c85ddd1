"""refit for PyTorch: publish a torch module from every trainer rank, receive into a module.

- :class:`Publisher` syncs a module (or a state dict) from every trainer rank, with the
  initialised ``torch.distributed`` job as the producer group (:class:`TorchGroup`, over gloo).
- :class:`Receiver` holds an inference worker's module **in place**: :meth:`Receiver.attach`
  registers every parameter and buffer's own memory, so after each commit the module's tensors
  hold the new weights — no copy of the model, and an aborted sync leaves them bit-identical to
  the previous version. ``pause`` / ``resume`` hooks bracket the time the weights are a mix of
  two versions.
- :func:`tp_loader` builds a tensor-parallel :class:`refit.Loader` from a sharded module's
  shapes and the canonical ones.

Host tensors cross to the C++ core zero-copy (a byte view of the tensor's storage: torch tensors
have no buffer protocol, and numpy no bfloat16). Tensors in device memory (a GPU) are reached
through refit's device boundary (:class:`TorchTensorMemory`): a transfer gathers the old bits of
the elements it changes, computes the new ones on the host and scatters them back — O(changes)
across PCIe, no host copy of the model. ``attach(memory="mirror")`` keeps the older way, a host
copy of the model copied in after each commit, as an explicit opt-in.
"""

from __future__ import annotations

import datetime
import re
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

import refit
from refit.errors import FailedPrecondition, InvalidArgument

__all__ = [
    "Publisher",
    "Receiver",
    "ReloadPath",
    "TensorMemory",
    "TorchGroup",
    "TorchTensorMemory",
    "state_tensors",
    "tp_loader",
]

TensorMemory = refit.TensorMemory

ModuleOrState = Union[torch.nn.Module, Mapping[str, torch.Tensor]]


def _holds_dtensors(model: ModuleOrState) -> bool:
    """Whether a module's state or a state dict holds a DTensor (a sharded model)."""
    tensors = model.state_dict(keep_vars=True).values() if isinstance(model, torch.nn.Module) else (
        model.values() if isinstance(model, Mapping) else ()
    )
    return any(type(tensor).__name__ == "DTensor" for tensor in tensors)


def state_tensors(model: ModuleOrState) -> List[Tuple[str, torch.Tensor]]:
    """Return the (name, tensor) pairs a module or state dict exports, detached, in order.

    A module gives its ``state_dict()`` (parameters and persistent buffers); its tensors share
    the module's memory.
    """
    if isinstance(model, torch.nn.Module):
        return list(model.state_dict(keep_vars=False).items())
    if isinstance(model, Mapping):
        out = []
        for name, tensor in model.items():
            if not isinstance(tensor, torch.Tensor):
                raise InvalidArgument(f"tensor '{name}': expected a torch.Tensor, got {type(tensor).__name__}")
            out.append((name, tensor.detach()))
        return out
    raise InvalidArgument(f"expected a torch.nn.Module or a state dict, got {type(model).__name__}")


# ---- Producer group ------------------------------------------------------------------------------


class TorchGroup:
    """A refit producer group over torch.distributed.

    refit's collectives are a broadcast from rank 0 and a gather to rank 0 of small byte strings
    (plans, reports, per-tensor digests), so they run on a CPU group: ``process_group`` if given
    (it must support CPU tensors, i.e. gloo), else a new gloo group over every rank, made here —
    a collective call, so every rank constructs its TorchGroup at the same point. ``timeout``
    is the group's own (gloo's) bound on a collective; each call also waits at most the time left
    in refit's transfer (``timeout_s``) and raises TimeoutError past it, which the sync reports as
    DeadlineExceeded naming the rank.
    """

    def __init__(self, process_group: Any = None, timeout: float = 600.0):
        if not (dist.is_available() and dist.is_initialized()):
            raise FailedPrecondition("refit.torch.TorchGroup: torch.distributed is not initialised")
        if process_group is None:
            process_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._root = dist.get_global_rank(process_group, 0)

    def _wait(self, work: Any, deadline: float, what: str) -> None:
        """Wait for an asynchronous collective until ``deadline`` (time.monotonic())."""
        left = deadline - time.monotonic()
        try:
            done = left > 0 and work.wait(datetime.timedelta(seconds=left))
        except RuntimeError as error:  # gloo raises on its timeout; so does a peer that left
            if "timed out" not in str(error).lower() and "timeout" not in str(error).lower():
                raise
            done = False
        if not done:
            raise TimeoutError(
                f"refit.torch.TorchGroup: {what} on rank {self.rank} of {self.world_size} did not complete "
                "within the transfer's time left"
            )

    def broadcast(self, message: Optional[bytes], timeout_s: float) -> bytes:
        """Rank 0's ``message`` on every rank (length first, then the bytes), within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        length = torch.tensor([len(message) if self.rank == 0 else 0], dtype=torch.int64)
        self._wait(dist.broadcast(length, src=self._root, group=self.process_group, async_op=True), deadline, "broadcast")
        if self.rank == 0:
            data = torch.frombuffer(bytearray(message), dtype=torch.uint8) if message else torch.empty(0, dtype=torch.uint8)
        else:
            data = torch.empty(int(length.item()), dtype=torch.uint8)
        if data.numel():
            self._wait(dist.broadcast(data, src=self._root, group=self.process_group, async_op=True), deadline, "broadcast")
        return data.numpy().tobytes()

    def gather(self, message: bytes, timeout_s: float) -> Optional[List[bytes]]:
        """Every rank's ``message`` at rank 0, in rank order (padded to the longest, then cut),
        within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._wait(
            dist.all_gather(lengths, torch.tensor([len(message)], dtype=torch.int64), group=self.process_group, async_op=True),
            deadline,
            "gather",
        )
        longest = max(int(length.item()) for length in lengths)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if message:
            mine[: len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
        if longest == 0:
            return [b""] * self.world_size if self.rank == 0 else None
        slots = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)] if self.rank == 0 else None
        self._wait(dist.gather(mine, gather_list=slots, dst=self._root, group=self.process_group, async_op=True), deadline, "gather")
        if self.rank != 0:
            return None
        return [slot[: int(length.item())].numpy().tobytes() for slot, length in zip(slots, lengths)]

    def as_group(self) -> refit.Group:
        """This group as the core's producer group (each call makes a new endpoint)."""
        return refit.callback_group(self.rank, self.world_size, self.broadcast, self.gather)


# ---- Publisher -----------------------------------------------------------------------------------


class Publisher:
    """A trainer rank's publisher of a torch module: a :class:`refit.Publisher` that reads torch
    modules, state dicts and DTensors where they are.

    ``group``: a :class:`TorchGroup`, a :data:`refit.Group`, or None — then a TorchGroup when
    torch.distributed is initialised (every rank must construct its Publisher together), else a
    group of one. ``receivers`` matter on rank 0 only.

    ``memory``: how the trainer's tensors are read.

    - ``"auto"`` (default): host tensors in place; tensors in device memory through refit's device
      boundary (:class:`TorchTensorMemory`): the chunks this rank sends are copied device → host
      into a bounded pool of reusable buffers (``staging_bytes``), each while the chunk before it
      is compared, and the chunks it does not send are never read. Host memory stays the baseline
      plus the pool, whatever the model's size.
    - ``"device"``: every tensor through the device boundary, host tensors too (what the tests
      use to run the staging path without a GPU).
    - ``"host"``: host tensors only; a tensor in device memory is an InvalidArgument.

    Other keyword arguments are :class:`refit.Publisher`'s.
    """

    def __init__(
        self, receivers: Optional[Iterable[Any]] = None, *, group: Any = None, memory: str = "auto", **options: Any
    ):
        if memory not in ("auto", "device", "host"):
            raise InvalidArgument(f"refit.torch.Publisher: memory={memory!r} is not one of 'auto', 'device', 'host'")
        self.memory = memory
        if group is None and dist.is_available() and dist.is_initialized():
            group = TorchGroup(timeout=float(options.get("transfer_timeout", 600.0)))
        if isinstance(group, TorchGroup):
            self.torch_group = group
            group = group.as_group()
        self._inner = refit.Publisher(receivers=receivers, group=group, **options)

    def _exported(self, tensors: List[Tuple[str, torch.Tensor]]) -> List[Tuple[str, Any]]:
        """``tensors`` as the core reads them: host tensors as they are, the others (by
        ``memory``) as :class:`refit.DeviceTensor` over a :class:`TorchTensorMemory`."""
        out: List[Tuple[str, Any]] = []
        for name, tensor in tensors:
            staged = self.memory == "device" or (self.memory == "auto" and tensor.device.type != "cpu")
            if not staged:
                out.append((name, tensor))
                continue
            if tensor.device.type == "meta":
                raise InvalidArgument(f"refit.torch.Publisher: tensor '{name}' is on the meta device: it has no bytes to send")
            if not tensor.is_contiguous():
                raise InvalidArgument(
                    f"refit.torch.Publisher: tensor '{name}' is not contiguous (strides {tuple(tensor.stride())}); "
                    "export a contiguous copy"
                )
            memory = TorchTensorMemory(tensor.detach(), f"tensor '{name}' on {tensor.device}")
            out.append((name, refit.DeviceTensor(str(tensor.dtype), tuple(tensor.shape), memory)))
        return out

    def sync(
        self,
        model: ModuleOrState,
        force_anchor: bool = False,
        *,
        layout: Optional[Sequence[Mapping[str, Any]]] = None,
    ) -> refit.SyncReport:
        """Refit the fleet with ``model`` (a module or state dict).

        A model of plain tensors is the whole model on every rank. A model with DTensor
        parameters (FSDP2's ``fully_shard``, DTensor tensor parallelism) is sharded: each rank
        sends only its own shards, found from the placements (:func:`refit.layout.layout_of`),
        with no gather. ``layout``: the pieces of a model of plain sharded tensors (Megatron
        style), as :meth:`refit.Publisher.sync` takes them; ``model`` is then this rank's local
        tensors.

        The tensors are read in place; export bf16 by keeping a bf16 state dict and ``copy_()``-ing
        the fp32 master weights into it before each sync.
        """
        if layout is None and _holds_dtensors(model):
            from refit.layout import layout_of, local_tensors  # noqa: PLC0415

            locals_ = list(local_tensors(model).items())
            return self._inner.sync(self._exported(locals_), force_anchor, layout=layout_of(model))
        if layout is not None:
            return self._inner.sync(self._exported(state_tensors(model)), force_anchor, layout=layout)
        return self._inner.sync(self._exported(state_tensors(model)), force_anchor)

    def adopt_baseline(self, model: ModuleOrState, version: Optional[int] = None) -> None:
        """Take ``model`` as what the receivers hold now (they loaded it), so the next sync is a delta.

        A model with DTensor parameters (FSDP2, DTensor tensor parallelism) adopts this rank's own
        shards, found from the placements as :meth:`sync` finds them: a sharded trainer restarted
        from the checkpoint the fleet holds (every rank, or one rank of W) resumes with a delta.
        Tensors in device memory are read one at a time into this rank's baseline."""
        if _holds_dtensors(model):
            from refit.layout import layout_of, local_tensors  # noqa: PLC0415

            locals_ = list(local_tensors(model).items())
            self._inner.adopt_baseline(self._exported(locals_), version, layout=layout_of(model))
            return
        self._inner.adopt_baseline(self._exported(state_tensors(model)), version)

    def set_receivers(self, receivers: Iterable[Any]) -> None:
        """Rank 0: replace the fleet from the next sync on."""
        self._inner.set_receivers(receivers)

    @property
    def membership_url(self) -> str:
        """Rank 0 with ``membership_port=``: where receivers join (``Receiver.join``)."""
        return self._inner.membership_url

    def membership(self) -> dict:
        """Rank 0: the members and how each stood at the last sync (:meth:`refit.Publisher.membership`)."""
        return self._inner.membership()

    def cancel(self) -> None:
        """Make the sync in flight (on another thread) fail soon with Cancelled."""
        self._inner.cancel()

    @property
    def rank(self) -> int:
        """This rank in the producer group."""
        return self._inner.rank

    @property
    def world_size(self) -> int:
        """The number of ranks W."""
        return self._inner.world_size

    @property
    def version(self) -> int:
        """The version this rank last committed."""
        return self._inner.version

    @property
    def run_id(self) -> str:
        """Rank 0: the training run its syncs belong to (``run_id``/``resume`` keywords)."""
        return self._inner.run_id

    @property
    def epoch(self) -> int:
        """Rank 0: this trainer's epoch of its run (known after the first sync of a resume)."""
        return self._inner.epoch

    @property
    def baseline_bytes(self) -> int:
        """Bytes this rank keeps to diff against: its share of the model (its own boxes, when sharded)."""
        return self._inner.baseline_bytes


# ---- Device boundary -----------------------------------------------------------------------------

#: The integer dtype a tensor of each element width is viewed as, so that gathers and scatters move
#: bits (a float view would canonicalise NaNs on some paths).
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class TorchTensorMemory(refit.TensorMemory):
    """A torch tensor on any device behind refit's device boundary.

    Gathers with ``index_select`` and scatters with ``index_copy_`` over an integer view of the
    tensor's bits, one call per batch of changed elements: the positions (int32, or int64 from
    2^31 elements on) go to the device once per batch and are reused by the scatter that follows
    the gather; no tensor-shaped staging. FULL items and reads use byte ranges of a ``uint8``
    view. On CUDA every operation is issued on the stream current when the memory was made (the
    worker's), and :meth:`synchronize` waits for it before a flush reports success.

    The tensor must be contiguous; it is written in place (``tensor.data_ptr()`` stays).
    """

    def __init__(self, tensor: torch.Tensor, description: Optional[str] = None):
        if not tensor.is_contiguous():
            raise InvalidArgument(
                f"refit.torch.TorchTensorMemory: the tensor is not contiguous (strides {tuple(tensor.stride())})"
            )
        if tensor.device.type == "meta":
            raise InvalidArgument("refit.torch.TorchTensorMemory: a meta tensor has no memory to write")
        width = tensor.element_size()
        if width not in _BITS_DTYPE:
            raise InvalidArgument(f"refit.torch.TorchTensorMemory: {tensor.dtype} has an element size of {width} bytes")
        super().__init__(tensor.numel() * width, description or f"torch {tensor.device} tensor")
        flat = tensor.detach().reshape(-1)
        self._bits = flat.view(_BITS_DTYPE[width])
        self._bytes = flat.view(torch.uint8)
        self._device = tensor.device
        self._index_dtype = torch.int32 if tensor.numel() < 2**31 else torch.int64
        self._stream = torch.cuda.current_stream(tensor.device) if tensor.device.type == "cuda" else None
        self._index: Optional[torch.Tensor] = None

    def _on_stream(self) -> Any:
        return torch.cuda.stream(self._stream) if self._stream is not None else _NoStream()

    def _positions(self, positions: memoryview) -> torch.Tensor:
        index = torch.frombuffer(positions, dtype=self._index_dtype).to(self._device)
        # index_copy_ takes int64 indices: widened on the device, not sent wider.
        return index if index.dtype == torch.int64 else index.long()

    def gather(self, positions: memoryview, width: int, out: memoryview) -> None:
        with self._on_stream():
            self._index = self._positions(positions)
            torch.frombuffer(out, dtype=self._bits.dtype).copy_(self._bits.index_select(0, self._index))

    def scatter(self, positions: Optional[memoryview], width: int, bits: memoryview) -> None:
        with self._on_stream():
            index = self._index if positions is None else self._positions(positions)
            self._index = None
            if index is None:
                raise RuntimeError("scatter to the gathered positions without a gather before it")
            values = torch.frombuffer(bits, dtype=self._bits.dtype).to(self._device)
            self._bits.index_copy_(0, index, values)

    def read(self, offset: int, out: memoryview) -> None:
        with self._on_stream():
            torch.frombuffer(out, dtype=torch.uint8).copy_(self._bytes[offset : offset + len(out)])

    def write(self, offset: int, data: memoryview) -> None:
        with self._on_stream():
            self._bytes[offset : offset + len(data)].copy_(torch.frombuffer(data, dtype=torch.uint8))

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


class _NoStream:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


# ---- Receiver ------------------------------------------------------------------------------------


class _TouchedMemory(TorchTensorMemory):
    """A host copy behind the device boundary that records whether a transfer wrote into it.

    The boundary's scatter and write are the only calls that change bits, so a tensor that none
    of them reached since the last commit did not change: which tensors a commit changed is known
    in O(changes), without comparing copies.
    """

    def __init__(self, tensor: torch.Tensor, name: str, touched: "set[str]"):
        super().__init__(tensor, f"reload copy '{name}'")
        self._name = name
        self._touched = touched

    def scatter(self, positions: Optional[memoryview], width: int, bits: memoryview) -> None:
        self._touched.add(self._name)
        super().scatter(positions, width, bits)

    def write(self, offset: int, data: memoryview) -> None:
        self._touched.add(self._name)
        super().write(offset, data)


class ReloadPath:
    """The reload path of a module whose engine does not read some parameters as loaded.

    Some engines transform weights after loading (vLLM's CPU backend repacks linear weights into
    its GEMM layout and empties ``.weight``; quantized layers run
    ``process_weights_after_loading``): writing into those parameters in place changes memory
    the engine no longer reads. For them, :meth:`Receiver.attach` registers ``canonical`` instead —
    refit's own copies of the checkpoint-format tensors, which transfers write (and an aborted
    one rolls back) in O(changes) — and after each commit hands the tensors that changed to
    ``load``, which runs the engine's own loading path (``load_weights`` / ``reload_weights`` and
    the post-processing). The module's other tensors keep the in-place path.

    - ``skip``: the module's own tensor names (qualified, without ``attach``'s prefix) that
      transfers must not write: the transformed parameters;
    - ``canonical``: (canonical name, host tensor) pairs, contiguous, owned by refit from here on;
      their values must be the version the receiver starts at;
    - ``load(weights)``: called with a list of (canonical name, tensor) on refit's thread inside
      the commit hook, before ``resume`` and before the committed version is reported to the
      engine's readers; it must have finished moving the bytes into the engine when it returns.
      The tensors are refit's copies: the callable must not keep or modify them;
    - ``group_of(name)``: the key of the tensors the engine loads together (the parts of one
      fused layer, whose post-processing needs all of them); every tensor of a group with a
      changed member is handed over. Default: each tensor alone.

    Thread-safety: ``load`` is called from one refit thread at a time, never concurrently.
    """

    def __init__(
        self,
        skip: Iterable[str],
        canonical: Sequence[Tuple[str, torch.Tensor]],
        load: Callable[[List[Tuple[str, torch.Tensor]]], None],
        group_of: Optional[Callable[[str], str]] = None,
    ):
        self.skip = frozenset(skip)
        self.canonical = list(canonical)
        self.load = load
        self.group_of = group_of
        names = [name for name, _ in self.canonical]
        if len(set(names)) != len(names):
            raise InvalidArgument("refit.torch.ReloadPath: a canonical name is given twice")
        for name, tensor in self.canonical:
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise InvalidArgument(
                    f"refit.torch.ReloadPath: canonical tensor '{name}' must be a contiguous host "
                    f"tensor (device {tensor.device}, strides {tuple(tensor.stride())})"
                )


def _module_tensors(module: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """Every parameter and buffer (persistent or not) of ``module``, by qualified name.

    Tied tensors appear under each of their names (``remove_duplicate=False``).
    """
    named: Dict[str, torch.Tensor] = {
        n: t.detach() for n, t in module.named_parameters(remove_duplicate=False)
    }
    for name, buffer in module.named_buffers(remove_duplicate=False):
        if buffer is not None:
            named.setdefault(name, buffer.detach())
    return list(named.items())


class Receiver:
    """An inference worker's receiver over a torch module, in place.

    ``Receiver(**options).attach(module, loader=…).start()``: ``options`` are
    :class:`refit.Receiver`'s (transport, endpoints, replica and shard, api key, config, hooks).
    ``pause()`` is called before the first payload of a transfer is applied and
    ``resume(committed, version)`` once it committed (True, the new version) or aborted (False,
    the version held again) — only if pause was called: stop generation in between, when the
    weights are a mix of two versions. Both run on refit's threads.
    """

    def __init__(self, *, pause: Optional[Callable[[], None]] = None, resume: Optional[Callable[[bool, int], None]] = None, **options: Any):
        for hook in ("before_first_apply", "after_commit", "after_abort"):
            if hook in options:
                raise InvalidArgument(f"refit.torch.Receiver: use pause/resume, not {hook}")
        if "model_path" in options and options["model_path"]:
            raise InvalidArgument("refit.torch.Receiver holds a module: use refit.Receiver for a model file")
        self._options = options
        self._pause = pause
        self._resume = resume
        self._paused = False
        self._lock = threading.Lock()
        self._inner: Optional[refit.Receiver] = None
        # memory="mirror": (module tensor, host copy) pairs copied in after each commit.
        self._mirrors: List[Tuple[torch.Tensor, torch.Tensor]] = []
        # The device boundary's backends of tensors reached through it.
        self._device_memories: List[TorchTensorMemory] = []
        # The reload path (attach(reload=...)): the canonical copies written since the last
        # commit or abort, and what the last commit handed to the engine's loading path.
        self._reload: Optional[ReloadPath] = None
        self._touched: "set[str]" = set()
        self._groups: Dict[str, List[str]] = {}
        self._paths: Dict[str, str] = {}
        self.last_reload: Optional[Dict[str, Any]] = None
        self.reloads = 0
        self.module: Optional[torch.nn.Module] = None

    # Hooks, called by the core on its threads.
    def _before_first_apply(self, transfer_id: str) -> None:
        with self._lock:
            if self._pause is not None and not self._paused:
                self._pause()
            self._paused = True

    def _finish(self, committed: bool, version: int) -> None:
        # Runs inside the core's commit (or abort) hook: the engine's memory must hold `version`
        # when this returns, so the copies and the reload happen here, synchronously.
        with self._lock:
            try:
                if committed:
                    for target, host in self._mirrors:
                        target.copy_(host)
                    self._load_touched(version)
                else:
                    # The core rolled the canonical copies back; the engine was never handed them.
                    self._touched.clear()
            finally:
                if self._paused and self._resume is not None:
                    self._resume(committed, version)
                self._paused = False

    def _load_touched(self, version: int) -> None:
        reload = self._reload
        if reload is None or not self._touched:
            return
        touched = sorted(self._touched)
        names: List[str] = []
        seen: "set[str]" = set()
        for name in touched:
            for member in self._groups.get(name, [name]):
                if member not in seen:
                    seen.add(member)
                    names.append(member)
        tensors = dict(reload.canonical)
        started = time.perf_counter()
        reload.load([(name, tensors[name]) for name in names])
        # Cleared only once the engine holds them: a load that raised is retried at the next commit.
        self._touched.clear()
        self.reloads += 1
        self.last_reload = {
            "version": int(version),
            "changed": touched,
            "loaded": names,
            "seconds": time.perf_counter() - started,
        }

    def attach(
        self,
        module: torch.nn.Module,
        loader: Optional[refit.Loader] = None,
        prefix: str = "",
        memory: str = "auto",
        mirror: Optional[bool] = None,
        reload: Optional[ReloadPath] = None,
    ) -> "Receiver":
        """Register every parameter and buffer of ``module`` (named ``prefix`` + qualified name).

        Tensors tied to another (one storage under two names, e.g. a tied LM head) are registered
        once; the other names' items are skipped, since applying an XOR delta twice to one memory
        would revert it. ``memory`` says how refit reaches the tensors:

        - ``"auto"`` (default): host tensors zero-copy (transfers write into them); tensors in
          device memory through the device boundary (:class:`TorchTensorMemory`), in place, in
          O(changes) per transfer, rolled back on the device when a transfer aborts.
        - ``"device"``: every tensor through the device boundary, host tensors too (what the
          tests use to run the device path without a GPU).
        - ``"host"``: host tensors only; a tensor in device memory is an InvalidArgument.
        - ``"mirror"``: a host copy of every tensor, copied into the module after each commit —
          the model's size in host memory and a whole-model copy per commit; kept for engines
          whose weights cannot be indexed in place.

        ``mirror=True`` / ``False`` are the older spellings of ``"mirror"`` / ``"host"``.

        ``reload``: a :class:`ReloadPath` for modules whose engine transformed some parameters
        after loading: those (``reload.skip``) are not registered; refit's canonical copies
        (``reload.canonical``) are, under their canonical names, and the ones a commit changed
        are handed to ``reload.load`` inside the commit hook. :attr:`paths` says which path each
        tensor takes. The loader's rules must not map onto a skipped tensor. Call once, before
        start.
        """
        if self._inner is not None:
            raise FailedPrecondition("refit.torch.Receiver: a module is attached already")
        if mirror is not None:
            memory = "mirror" if mirror else "host"
        if memory not in ("auto", "device", "host", "mirror"):
            raise InvalidArgument(
                f"refit.torch.Receiver.attach: memory={memory!r} is not one of 'auto', 'device', 'host', 'mirror'"
            )
        tensors = _module_tensors(module)
        for name, tensor in tensors:
            if tensor.device.type == "meta":
                raise InvalidArgument(
                    f"refit.torch.Receiver.attach: tensor '{prefix + name}' is on the meta device: it has no memory to write"
                )
        seen: Dict[Tuple[int, int, str, Tuple[int, ...]], str] = {}
        registered: List[Tuple[str, torch.Tensor]] = []
        tied: List[str] = []
        if reload is not None:
            unknown = sorted(reload.skip - {name for name, _ in tensors})
            if unknown:
                raise InvalidArgument(f"refit.torch.Receiver.attach: reload.skip names no tensor of the module: {unknown[:5]}")
            local = {prefix + name for name, _ in tensors}
            clash = sorted(local & {name for name, _ in reload.canonical})
            clash = [name for name in clash if name[len(prefix):] not in reload.skip]
            if clash:
                raise InvalidArgument(
                    f"refit.torch.Receiver.attach: reload copies {clash[:5]} have the names of module tensors written in place"
                )
            tensors = [(name, tensor) for name, tensor in tensors if name not in reload.skip]
        for name, tensor in tensors:
            key = (tensor.data_ptr(), tensor.numel(), str(tensor.dtype), tuple(tensor.shape))
            if tensor.numel() and key in seen:
                tied.append(prefix + name)
                continue
            seen[key] = name
            registered.append((prefix + name, tensor))
        rules = [{"kind": "skip", "match": re.escape(name)} for name in tied]
        if loader is not None:
            rules += loader.rules
        spec = refit.Loader(
            tp_rank=loader.tp_rank if loader is not None else 0,
            tp_size=loader.tp_size if loader is not None else 1,
            rules=rules,
        ) if rules or loader is not None else None
        inner = refit.Receiver(
            loader=spec,
            before_first_apply=self._before_first_apply,
            after_commit=lambda transfer_id, version: self._finish(True, version),
            after_abort=lambda transfer_id, version: self._finish(False, version),
            **self._options,
        )
        paths: Dict[str, str] = {}
        if reload is not None:
            groups: Dict[str, List[str]] = {}
            for name, tensor in reload.canonical:
                key = reload.group_of(name) if reload.group_of is not None else name
                groups.setdefault(key, []).append(name)
                inner.register_device(name, _TouchedMemory(tensor, name, self._touched), str(tensor.dtype), tuple(tensor.shape))
                paths[name] = "reload"
            self._groups = {name: members for members in groups.values() for name in members}
            self._reload = reload
        for name, tensor in registered:
            paths[name] = "mirror" if memory == "mirror" else "in_place"
            if memory == "mirror":
                host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
                host.copy_(tensor)
                self._mirrors.append((tensor, host))
                inner.register(name, host)
            elif memory == "device" or (memory == "auto" and tensor.device.type != "cpu"):
                backend = TorchTensorMemory(tensor, f"tensor '{name}' on {tensor.device}")
                self._device_memories.append(backend)
                inner.register_device(name, backend, str(tensor.dtype), tuple(tensor.shape))
            else:
                inner.register(name, tensor)
        self._inner = inner
        self._paths = paths
        self.module = module
        return self

    def _receiver(self) -> refit.Receiver:
        if self._inner is None:
            raise FailedPrecondition("refit.torch.Receiver: attach a module first")
        return self._inner

    def start(self) -> "Receiver":
        """Start serving (see :meth:`refit.Receiver.start`)."""
        self._receiver().start()
        return self

    def stop(self) -> None:
        """Stop serving; an open transfer is rolled back. Idempotent."""
        if self._inner is not None:
            self._inner.stop()

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def paths(self) -> Dict[str, str]:
        """How each registered tensor is written, by registered name: ``"in_place"`` (the
        module's own memory), ``"mirror"`` (a host copy copied in after each commit) or
        ``"reload"`` (refit's canonical copy, handed to the engine's loading path after each
        commit that changed it; see :class:`ReloadPath`)."""
        return dict(self._paths)

    @property
    def control_url(self) -> str:
        """The control plane's base URL."""
        return self._receiver().control_url

    @property
    def producer_endpoint(self) -> str:
        """What producers send payloads to."""
        return self._receiver().producer_endpoint

    @property
    def endpoint(self) -> Tuple[str, str]:
        """(control URL, data endpoint), as a Publisher's ``receivers`` names it."""
        return self._receiver().endpoint

    @property
    def version(self) -> int:
        """The committed version the module holds."""
        return self._receiver().version

    @property
    def ready(self) -> bool:
        """Whether the module may serve: it holds the fleet's committed version (:attr:`refit.Receiver.ready`)."""
        return self._receiver().ready

    def join(self, publisher_url: str, **advertise: Any) -> dict:
        """Join the fleet of ``publisher_url`` with one call (:meth:`refit.Receiver.join`)."""
        return self._receiver().join(publisher_url, **advertise)

    def leave(self) -> dict:
        """Leave the fleet joined last (:meth:`refit.Receiver.leave`)."""
        return self._receiver().leave()

    def status(self) -> refit.ReceiverStatus:
        """The receiver's state, version and open transfer."""
        return self._receiver().status()

    def wait_for_version(self, version: int, timeout: Optional[float] = None) -> int:
        """Block until ``version`` (or later) is committed; see :meth:`refit.Receiver.wait_for_version`."""
        return self._receiver().wait_for_version(version, timeout)


# ---- Tensor-parallel loaders ---------------------------------------------------------------------


def _shapes(source: Any) -> Dict[str, Tuple[int, ...]]:
    if isinstance(source, torch.nn.Module):
        return {name: tuple(tensor.shape) for name, tensor in _module_tensors(source)}
    out = {}
    for name, value in dict(source).items():
        out[name] = tuple(value.shape) if hasattr(value, "shape") else tuple(value)
    return out


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def tp_loader(
    module: Any,
    canonical_shapes: Any,
    tp_rank: int,
    tp_size: int,
    fused: Optional[Sequence[Mapping[str, Any]]] = None,
    pad_to: int = 64,
) -> refit.Loader:
    """Build rank ``tp_rank``'s loader of a tensor-parallel module from the shapes alone.

    ``module``: the sharded local module (or {name: tensor or shape}); ``canonical_shapes``: the
    trainer's full shapes ({name: shape}, a state dict or a module). Every local tensor that has a
    canonical namesake is mapped by comparing shapes: equal → identity (replicated); dim 0 split
    TP ways → ``row``; dim 1 split → ``column``; dim 0 padded and split as vLLM (V rounded up to
    ``pad_to``) or Megatron (to ``pad_to`` × TP) pads a vocabulary → ``vocab``. Fused tensors
    (qkv, gate_up), whose names are not canonical, are described by ``fused``: loader rules
    passed through first, e.g.
    ``{"kind": "qkv", "q": r"(.*)\\.q_proj\\.weight", "k": …, "v": …, "to": "$1.qkv_proj.weight",
    "num_heads": 8, "num_kv_heads": 2}``. A shape that fits none of these raises InvalidArgument
    naming the tensor and both shapes.
    """
    local = _shapes(module)
    canonical = _shapes(canonical_shapes)
    rules: List[Dict[str, Any]] = [dict(rule) for rule in (fused or [])]
    for name, shape in local.items():
        full = canonical.get(name)
        if full is None or tuple(full) == tuple(shape):
            continue
        exact = re.escape(name)
        if len(shape) == len(full) and len(shape) >= 1:
            if shape[0] * tp_size == full[0] and tuple(shape[1:]) == tuple(full[1:]):
                rules.append({"kind": "row", "match": exact})
                continue
            if len(shape) >= 2 and shape[1] * tp_size == full[1] and shape[0] == full[0] and tuple(shape[2:]) == tuple(full[2:]):
                rules.append({"kind": "column", "match": exact})
                continue
            # Megatron pads V to a multiple of pad_to × TP, vLLM to a multiple of pad_to (then
            # splits it evenly); either way each rank holds shape[0] rows of the padded vocabulary,
            # which the vocab rule says exactly with pad_to = shape[0].
            if shape[0] * tp_size in (_round_up(full[0], pad_to * tp_size), _round_up(full[0], pad_to)) and tuple(
                shape[1:]
            ) == tuple(full[1:]):
                rules.append({"kind": "vocab", "match": exact, "vocab_size": full[0], "pad_to": shape[0]})
                continue
        raise InvalidArgument(
            f"tp_loader: tensor '{name}' is {list(shape)} locally and {list(full)} canonically, "
            f"which is neither replicated nor a row, column or vocabulary shard of TP={tp_size}"
        )
    return refit.Loader(tp_rank=tp_rank, tp_size=tp_size, rules=rules)

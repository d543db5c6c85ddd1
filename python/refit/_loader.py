"""Loaders: how a receiver holds canonical (checkpoint-coordinate) tensors in its own layout."""

from __future__ import annotations

from typing import Any, Iterable, List, Mapping

from . import _core


class Loader:
    """How a receiver holds canonical (checkpoint-coordinate) tensors in its own layout.

    ``rules`` is a list of dicts, the first match deciding, each with a ``kind``:

    - ``identity`` / ``rename`` (``match``, ``to``): the same shape, under the name ``to``
      (a regex replacement template: ``$1``…);
    - ``skip`` (``match``): not held here;
    - ``row`` / ``column`` (``match``, ``to``): a tensor-parallel shard of dim 0 / dim 1;
    - ``qkv`` (``q``, ``k``, ``v``, ``to``, ``num_heads``, ``num_kv_heads``): q, k and v fused
      into one local tensor per rank, rows [q | k | v] of the rank's heads (GQA replicates kv
      heads when there are fewer than ranks);
    - ``qkv_interleaved`` (the same keys): Megatron-Core's ``linear_qkv``, the rank's query
      groups (``num_kv_heads`` of them in the model) each laid out as [its q heads | k | v];
    - ``gate_up`` (``gate``, ``up``, ``to``): gate and up fused, [gate block | up block];
    - ``vocab`` (``match``, ``vocab_size``, ``pad_to``): a vocabulary-parallel embedding;
    - ``expert_gate_up`` (``gate``, ``up``, ``expert_group``), ``expert_down`` (``match``,
      ``expert_group``), ``stacked_gate_up`` / ``stacked_down`` (``match``), each with ``to`` and
      optionally ``num_experts``, ``experts``, ``expert_tp_rank``, ``expert_tp_size``: MoE expert
      weights, per expert or stacked, into the stack of the experts this receiver holds (vLLM's
      ``w13_weight`` / ``w2_weight``).

    Patterns are regular expressions matched against the whole canonical name. A name no rule
    matches is identity. A trainer rank that holds its tensors in these layouts describes them
    with the same rules: :func:`refit.layout.layout_from_loader`. Unknown keys and kinds raise InvalidArgument. See docs/configuration.md
    ("Loader files") for the YAML form that :meth:`from_yaml` reads.
    """

    def __init__(self, tp_rank: int = 0, tp_size: int = 1, rules: Iterable[Mapping[str, Any]] = ()):
        self._spec = _core.check_loader(
            {"tp_rank": tp_rank, "tp_size": tp_size, "rules": [dict(rule) for rule in rules]}
        )

    @classmethod
    def from_yaml(cls, text: str, source: str = "<string>") -> "Loader":
        """Parse a loader spec from YAML text (``source`` names it in error messages)."""
        return cls._from_spec(_core.loader_from_yaml(text, source))

    @classmethod
    def from_file(cls, path: str) -> "Loader":
        """Read a loader spec YAML file (the one ``refit serve --loader`` takes)."""
        return cls._from_spec(_core.loader_from_file(str(path)))

    @classmethod
    def _from_spec(cls, spec: dict) -> "Loader":
        loader = cls.__new__(cls)
        loader._spec = spec
        return loader

    @property
    def tp_rank(self) -> int:
        """This receiver's tensor-parallel rank."""
        return self._spec["tp_rank"]

    @property
    def tp_size(self) -> int:
        """The tensor-parallel degree of the receiver's shard group (1: unsharded)."""
        return self._spec["tp_size"]

    @property
    def rules(self) -> List[dict]:
        """The rules, as dicts, in order."""
        return [dict(rule) for rule in self._spec["rules"]]

    def to_dict(self) -> dict:
        """The spec as a plain dict: {tp_rank, tp_size, rules}."""
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size, "rules": self.rules}

    def __repr__(self) -> str:
        return f"refit.Loader(tp_rank={self.tp_rank}, tp_size={self.tp_size}, rules={self.rules})"

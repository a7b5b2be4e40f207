"""``transformers`` adapter: GLM-5.3's indexers run by :class:`~sp_kpool.KPoolIndexer`.

.. code-block:: python

    from sp_kpool.integrations.transformers import replace_indexers

    model = Glm5NextForConditionalGeneration.from_pretrained(...)   # or Glm5NextTextModel
    n = replace_indexers(model, precision=None, backend="torch")    # every Glm5NextTextIndexer
    logits = model(input_ids=ids, attention_mask=mask).logits        # as before

:func:`replace_indexers` swaps every ``Glm5NextTextIndexer`` of the model for a
:class:`TransformersKPoolIndexer` with the same weights (same parameter names, so the
model's ``state_dict`` keys do not change), device and dtype, and returns how many it
swapped. The replacement keeps the indexer's forward contract:

``forward(hidden_states [B, S, hidden_size], q_resid [B, S, q_lora_rank],
attention_mask [B, S] bool, cache=None) -> [B, S, width] int32``

with ``width = index_topk + index_kpool - 1`` (``index_topk`` without
``index_kpool_always_select_tail``): per query, the key positions (columns of the padded
row, ``0 <= id < S``) its sparse attention may see, ``-1`` unused. Each batch row's real
tokens (one contiguous run: left or right padding) become one document of a packed
sequence, :class:`~sp_kpool.KPoolIndexer` selects over it, and the ids are mapped back to
row positions. Per row the ids are the **set** ``transformers``' indexer selects (up to
near-ties of the arithmetic); the column order differs (ascending pool ids, the tail in the
last ``index_kpool - 1`` columns), which the attention ignores: it turns the ids into a mask.
Padded query rows are all ``-1``, as ``transformers`` returns them; padded keys are never
selected.

A forward that continues a cache (decoding, chunked prefill: the cache layer held tokens
before this call) runs ``transformers``' own indexer arithmetic on the same weights (the
KPool operator scores whole sequences); a forward from an empty cache (the prefill, or any
forward with ``use_cache``) runs ours and writes the indexer cache exactly as
``transformers`` does, so that decoding continues from it.

The adapter reads the framework's objects by their attributes (``type(m).__name__``,
``m.config.index_topk``, ...): it imports no ``transformers`` module.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_choice, check_int
from ..config import RunOptions
from ..indexer import KPoolIndexer, _autocast_on
from ..settings import PRECISIONS
from ..sharding import ShardedSequence

__all__ = ["replace_indexers", "TransformersKPoolIndexer", "INDEXER_CLASS_NAME", "CONFIG_FIELDS"]

#: The ``transformers`` class :func:`replace_indexers` looks for (by name).
INDEXER_CLASS_NAME = "Glm5NextTextIndexer"

#: The fields of the indexer's ``config`` (``Glm5NextTextConfig``) the replacement is built from.
CONFIG_FIELDS = (
    "hidden_size", "q_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "index_kpool",
    "index_kpool_always_select_tail",
)  # fmt: skip


def _read_config(module: Any, where: str) -> dict[str, Any]:
    """The :data:`CONFIG_FIELDS` of ``module.config``, checked, and ``module.layer_idx``."""
    cfg = getattr(module, "config", None)
    if cfg is None:
        raise ValueError(f"{where}: {INDEXER_CLASS_NAME}.config is missing (expected the model's Glm5NextTextConfig)")
    out: dict[str, Any] = {}
    for field in CONFIG_FIELDS:
        if not hasattr(cfg, field):
            raise ValueError(f"{where}: config.{field} is missing from {type(cfg).__name__} "
                             f"(a Glm5NextTextConfig field the KPool indexer needs)")  # fmt: skip
        value = getattr(cfg, field)
        if field == "index_kpool_always_select_tail":
            if not isinstance(value, bool):
                raise TypeError(f"{where}: config.{field}: expected a bool, got {value!r}")
            out[field] = value
        else:
            out[field] = check_int(f"{where}: config.{field}", value, 1)
    if out["index_topk"] % out["index_kpool"]:
        raise ValueError(f"{where}: config.index_topk: expected a multiple of config.index_kpool = "
                         f"{out['index_kpool']}, got {out['index_topk']}")  # fmt: skip
    out["layer_idx"] = check_int(f"{where}: {INDEXER_CLASS_NAME}.layer_idx", getattr(module, "layer_idx", None), 0)
    return out


class _Packing:
    """One batch's packing: which flat positions ``b * S + s`` are real, their documents.

    The model passes the same mask tensor to every layer of one forward: the last packing is
    kept (by a weak reference to the mask and its version counter), so that the layers after
    the first skip the host reads and share one :class:`ShardedSequence` (and its tables).
    """

    def __init__(self, mask: torch.Tensor):
        B, S = mask.shape
        flat = mask.reshape(-1)
        self.rows = flat.nonzero().squeeze(1)  # packed row -> flat position
        self.num_real = int(self.rows.numel())
        self.columns = (self.rows % S).to(torch.int32)  # packed id -> position in its batch row
        if self.num_real:
            cu = [0] + torch.cumsum(mask.sum(1), 0).tolist()
            self.seq = ShardedSequence.split(cu, world_size=1, rank=0)
        else:
            self.seq = None


_last_packing: tuple[Any, int, tuple, _Packing] | None = None


@torch.compiler.disable  # a host read: eager, one graph break under torch.compile
def _check_runs(mask: torch.Tensor, where: str) -> None:
    """transformers pools from each row's first real token: the real tokens of every row of
    ``mask [B, S]`` (bool) must be one run."""
    S = mask.shape[1]
    n = mask.sum(1)
    first = torch.where(n > 0, mask.to(torch.int32).argmax(1), 0)
    pos = torch.arange(S, device=mask.device)
    run = (pos >= first[:, None]) & (pos < (first + n)[:, None])
    if not torch.equal(run, mask):
        b = int((run != mask).any(1).nonzero()[0])
        raise ValueError(f"{where}: row {b} is not one contiguous run of real tokens (left or right padding "
                         f"only; Glm5NextTextIndexer pools from the first real token)")  # fmt: skip


@torch.compiler.disable  # host reads (nonzero, the lengths): eager, one graph break under torch.compile
def _packing(mask: torch.Tensor, given: torch.Tensor | None) -> _Packing:
    global _last_packing
    key = (tuple(mask.shape), mask.device)
    if given is not None and _last_packing is not None:
        ref, version, last_key, packing = _last_packing
        if ref() is given and version == given._version and last_key == key:
            return packing
    packing = _Packing(mask)
    _last_packing = (weakref.ref(given), given._version, key, packing) if given is not None else None
    return packing


class TransformersKPoolIndexer(KPoolIndexer):
    """A :class:`~sp_kpool.KPoolIndexer` with the forward of ``transformers``' ``Glm5NextTextIndexer``.

    Build it with :meth:`from_transformers` (or let :func:`replace_indexers` do it). Its
    parameters are :class:`~sp_kpool.KPoolIndexer`'s, named as ``transformers``' are;
    :meth:`kpool_forward` is :class:`~sp_kpool.KPoolIndexer`'s packed call
    ``(hidden [N, hidden], q_resid [N, q_lora_rank], seq) -> [N, topk + K - 1]``.

    Args (besides :class:`~sp_kpool.KPoolIndexer`'s):
        layer_idx: the model layer (its cache entry), ``Glm5NextTextIndexer.layer_idx``.
        select_tail: ``config.index_kpool_always_select_tail``; ``False`` drops the tail
            columns (the output is ``[B, S, index_topk]``, as ``transformers``').
        original: the ``transformers`` module, kept unregistered (not in ``state_dict``,
            not moved by ``.to()``) and given these parameters on each use, to run its own
            arithmetic where a cache is continued; ``None``: such a call raises.
    """

    def __init__(self, *, layer_idx: int = 0, select_tail: bool = True, original: nn.Module | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(**kwargs)
        self.layer_idx = check_int("layer_idx", layer_idx, 0)
        if not isinstance(select_tail, bool):
            raise TypeError(f"select_tail: expected a bool, got {select_tail!r}")
        self.index_kpool_always_select_tail = select_tail
        # unregistered: no second copy in state_dict, not moved by .to(); it gets our tensors
        # (from_transformers, and on each use), so that its own old ones are freed
        self.__dict__["_original"] = original

    @classmethod
    def from_transformers(cls, module: nn.Module, *, precision: str | None = None, backend: str = "torch",
                          where: str = "module") -> "TransformersKPoolIndexer":  # fmt: skip
        """The replacement of one ``Glm5NextTextIndexer`` ``module``: its config's sizes,
        its weights (``load_state_dict(strict=True)``), device and dtype (of ``wk.weight``).

        ``where`` names the module in error messages (its path in the model). ``module``
        is given our parameters (the same tensors, no second copy).
        """
        new = cls._build(module, precision=precision, backend=backend, where=where)
        new._synced_original()
        return new

    @classmethod
    def _build(cls, module, *, precision, backend, where) -> "TransformersKPoolIndexer":
        """:meth:`from_transformers` without touching ``module``."""
        fields = _read_config(module, where)
        weight = getattr(getattr(module, "wk", None), "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"{where}: {INDEXER_CLASS_NAME}.wk.weight is missing")
        new = cls(
            hidden_size=fields["hidden_size"], q_lora_rank=fields["q_lora_rank"],
            index_n_heads=fields["index_n_heads"], index_head_dim=fields["index_head_dim"],
            index_topk=fields["index_topk"], index_kpool=fields["index_kpool"],
            precision=precision, backend=backend, device=weight.device, dtype=weight.dtype,
            layer_idx=fields["layer_idx"], select_tail=fields["index_kpool_always_select_tail"],
        )  # fmt: skip
        try:
            new.load_state_dict(module.state_dict(), strict=True)
        except RuntimeError as exc:
            sizes = ", ".join(f"{k}={fields[k]}" for k in CONFIG_FIELDS[:6])
            raise ValueError(f"{where}: the weights of the {INDEXER_CLASS_NAME} do not fit its config ({sizes}): "
                             f"{exc}") from None  # fmt: skip
        new.__dict__["_original"] = module
        return new

    @property
    def output_width(self) -> int:
        """``index_topk + index_kpool - 1`` (``index_topk`` without the tail), as ``transformers``'."""
        return self.index_topk + (self.index_kpool - 1 if self.index_kpool_always_select_tail else 0)

    def kpool_forward(self, hidden: torch.Tensor, q_resid: torch.Tensor, seq: ShardedSequence) -> torch.Tensor:
        """:meth:`sp_kpool.KPoolIndexer.forward` (packed rows, stream ids, tail included)."""
        return KPoolIndexer.forward(self, hidden, q_resid, seq)

    def _synced_original(self) -> nn.Module:
        """The ``transformers`` module, holding our parameters (cast to the module dtype
        where we keep FP32: the head gate and the key norm of a BF16 model)."""
        orig = self.__dict__.get("_original")
        if orig is None:
            raise NotImplementedError(
                "cache: continuing a cache (decoding, chunked prefill) needs the transformers module; "
                "build this indexer with TransformersKPoolIndexer.from_transformers(module)"
            )
        dt = self.wk.weight.dtype
        for name, p in self.named_parameters():
            owner, _, leaf = name.rpartition(".")
            sub = orig.get_submodule(owner)
            if p.dtype != dt:
                p = nn.Parameter(p.detach().to(dt), requires_grad=False)
            if sub._parameters.get(leaf) is not p:
                sub._parameters[leaf] = p
        return orig

    def _check(self, hidden_states, q_resid) -> tuple[int, int]:
        where = f"{INDEXER_CLASS_NAME}.forward"
        for name, x, width in (("hidden_states", hidden_states, self.hidden_size),
                               ("q_resid", q_resid, self.wq_b.weight.shape[1])):  # fmt: skip
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{where}: {name}: expected a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 3 or x.shape[-1] != width:
                raise ValueError(f"{where}: {name}: expected shape [B, S, {width}], got {list(x.shape)}")
            if x.device != self.wk.weight.device:
                raise ValueError(f"{where}: {name}: expected device {self.wk.weight.device} (the indexer's), "
                                 f"got {x.device}")  # fmt: skip
            if x.dtype != self.wk.weight.dtype and not _autocast_on(x.device):
                raise ValueError(f"{where}: {name}: expected dtype {self.wk.weight.dtype} (the indexer's; or run "
                                 f"under autocast), got {x.dtype}")  # fmt: skip
        if q_resid.shape[:2] != hidden_states.shape[:2]:
            raise ValueError(f"{where}: q_resid: expected [B, S] = {list(hidden_states.shape[:2])} as hidden_states, "
                             f"got {list(q_resid.shape[:2])}")  # fmt: skip
        return hidden_states.shape[0], hidden_states.shape[1]

    def _mask(self, attention_mask, B: int, S: int, device) -> torch.Tensor:
        where = f"{INDEXER_CLASS_NAME}.forward: attention_mask"
        if attention_mask is None:
            return torch.ones(B, S, dtype=torch.bool, device=device)
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"{where}: expected a torch.Tensor [B, S] (bool) or None, "
                            f"got {type(attention_mask).__name__}")  # fmt: skip
        if attention_mask.shape != (B, S):
            raise ValueError(f"{where}: expected the 2-D padding mask [B, S] = [{B}, {S}], "
                             f"got {list(attention_mask.shape)}")  # fmt: skip
        if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
            raise TypeError(f"{where}: expected a bool (or integer 0/1) tensor, got {attention_mask.dtype}")
        if attention_mask.device != device:
            raise ValueError(f"{where}: expected device {device}, got {attention_mask.device}")
        mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
        _check_runs(mask, where)
        return mask

    def _cache_states(self, hidden_states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[B, S, 2 D + 1]``: keys, pool gates, valid channel, as ``transformers`` caches them."""
        n = self.k_norm
        kx = self.wk(hidden_states)
        dt = kx.dtype
        k = F.layer_norm(kx, n.normalized_shape, n.weight.to(dt), n.bias.to(dt), n.eps)
        gates = F.linear(hidden_states, self.index_kpool_compress_gate)
        return torch.cat([k, gates, mask.to(k.dtype)[..., None]], dim=-1)

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, q_resid: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: Any = None, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        """Per query, the key positions its sparse attention sees: ``[B, S, width]`` int32.

        Args:
            hidden_states: ``[B, S, hidden_size]``, the module dtype (or under autocast).
            q_resid: ``[B, S, q_lora_rank]``, ``q_a_layernorm(q_a_proj(x))``.
            attention_mask: ``[B, S]`` bool (or integer 0/1) padding mask, ``True`` = real
                token; each row's real tokens one contiguous run. ``None``: no padding.
            cache: ``transformers``' cache (``past_key_values`` is accepted too). Empty before
                this call (the attention layer has just written this call's ``S`` tokens):
                our selection, and the indexer cache is written as ``transformers`` writes
                it. Holding earlier tokens: ``transformers``' own arithmetic.

        Returns ``[B, S, width]`` int32, ``width`` = :attr:`output_width`: positions
        ``0 <= id < S`` of the row, ``-1`` unused; padded query rows all ``-1``.
        """
        if "past_key_values" in kwargs:  # transformers' deprecated name of ``cache``
            if cache is not None:
                raise TypeError(f"{INDEXER_CLASS_NAME}.forward: got both cache and past_key_values")
            cache = kwargs.pop("past_key_values")
        if kwargs:
            raise TypeError(f"{INDEXER_CLASS_NAME}.forward: unexpected keyword arguments {sorted(kwargs)}")
        B, S = self._check(hidden_states, q_resid)
        device = hidden_states.device
        if cache is not None:
            layers = getattr(cache, "layers", None)
            if layers is None or not hasattr(cache, "update_indexer"):
                raise TypeError(f"{INDEXER_CLASS_NAME}.forward: cache: expected a transformers Cache with "
                                f".layers and .update_indexer, got {type(cache).__name__}")  # fmt: skip
            if int(layers[self.layer_idx].get_seq_length()) != S:  # continuing: transformers' arithmetic
                original = self._synced_original()
                import inspect

                name = "cache" if "cache" in inspect.signature(original.forward).parameters else "past_key_values"
                return original(hidden_states=hidden_states, q_resid=q_resid, attention_mask=attention_mask,
                                **{name: cache})  # transformers < 5.24 names it past_key_values
        mask = self._mask(attention_mask, B, S, device)
        if cache is not None:
            cache.update_indexer(self._cache_states(hidden_states, mask), self.layer_idx)
        packing = _packing(mask, attention_mask)
        width = self.output_width
        out = torch.full((B * S, width), -1, dtype=torch.int32, device=device)
        if packing.num_real:
            rows = packing.rows
            ids = self.kpool_forward(hidden_states.reshape(B * S, -1)[rows], q_resid.reshape(B * S, -1)[rows],
                                     packing.seq)[:, :width]  # fmt: skip
            # without the tail: the history columns [0, topk) (tail="fixed")
            out[rows] = torch.where(ids >= 0, packing.columns[ids.clamp(min=0).long()], -1)
        return out.view(B, S, width)


def replace_indexers(model: nn.Module, *, precision: str | None = None, backend: str = "torch") -> int:
    """Replace every ``Glm5NextTextIndexer`` of a ``transformers`` GLM-5.3 model in place.

    Args:
        model: any ``nn.Module`` holding them (``Glm5NextForConditionalGeneration``,
            ``Glm5NextTextModel``, ...); each found by its class name, read through its
            ``config`` (:data:`CONFIG_FIELDS`) and ``layer_idx``.
        precision: ``"bf16"`` (the model definition's arithmetic), ``"bf16-serving"``,
            ``"fp8"``; ``None``: the library default (``$SP_KPOOL_PRECISION``, else ``bf16``),
            resolved at each call.
        backend: as ``kpool_topk``'s (``"torch"``, ``"triton"``, ``"tilelang"``, ``"deepgemm"``, ``"auto"``).

    Returns how many modules it replaced (a module reachable under several names is one,
    replaced everywhere). A model whose indexers are all ours already returns 0; a model
    with no indexer at all raises ``ValueError``, as does a field missing from an
    indexer's config or weights that do not fit it (naming the module and the field), and
    a bad ``precision`` or ``backend`` (naming it), before any module is replaced.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers GLM-5.3 model), got {type(model).__name__}")
    if precision is not None:
        check_choice("precision", precision, PRECISIONS)
    RunOptions(backend=backend)  # validates the name now, whether or not the model has an indexer
    found: dict[int, list[str]] = {}
    modules: dict[int, nn.Module] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if type(m).__name__ == INDEXER_CLASS_NAME and not isinstance(m, TransformersKPoolIndexer):
            found.setdefault(id(m), []).append(name)
            modules[id(m)] = m
    if not found:
        if any(isinstance(m, TransformersKPoolIndexer) for m in model.modules()):
            return 0
        raise ValueError(f"model: no {INDEXER_CLASS_NAME} in this {type(model).__name__} (expected a transformers "
                         f"GLM-5.3 model, e.g. Glm5NextForConditionalGeneration or Glm5NextTextModel)")  # fmt: skip
    if any("" in names for names in found.values()):
        raise ValueError(f"model: is itself a {INDEXER_CLASS_NAME}; build its replacement with "
                         f"TransformersKPoolIndexer.from_transformers(model)")  # fmt: skip
    # build every replacement first: an error leaves the model untouched
    built = {key: TransformersKPoolIndexer._build(modules[key], precision=precision, backend=backend, where=names[0])
             for key, names in found.items()}  # fmt: skip
    for key, names in found.items():
        for name in names:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, built[key])
        built[key]._synced_original()  # the transformers module now holds our tensors: one copy
    return len(built)

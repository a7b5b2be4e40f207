"""Rollout selection files: the engine's indexer selections per layer and document, on disk.

One ``safetensors`` file per rollout batch (written atomically, every tensor checksummed, as
the parity captures of :mod:`sp_kpool.capture`)::

    tensor                  shape           dtype                       what
    layer<LLL>.doc<DDDDD>   [T_d, W]        the narrowest signed int    layer L's selection of document d
                                            holding its ids and -1      (-1 unused; rows 0 .. T_d - 1)

    metadata (str -> str): format ``sp_kpool.rollout/1``, ids (``tokens`` or ``pools``),
    num_layers, num_docs, kpool and topk (``-1`` when not given), source, and ``crc32``: a
    JSON object with the CRC-32 of every tensor's bytes.

Values are request-local (document-local) token positions or pool ids, as
:func:`sp_kpool.replay.shard` takes them, so a file replays at any world size and in any
layout. Compact: pool ids (``topk // K`` per row instead of ``topk`` tokens) of documents
shorter than 32768 pools take 2 bytes each, ``int8`` below 128: a 131072-token document's
layer at topk 2048 and K 4 is 131072 x 512 x 2 bytes = 128 MiB (1 GiB as int32 tokens).

SGLang (PR #26684, ``--enable-return-indexer-topk``) returns per request
``meta_info["indexer_topk"]``: base64 of int32 values that reshape to ``(seqlen - 1,
num_indexer_layers, index_topk)``, request-local sequence positions (the row of the last
token is absent). :func:`from_sglang` turns one request's into per-layer ``[seqlen - 1,
index_topk]`` arrays and :func:`sglang_batch` a batch's into ``[layer][document]``. Whether
the positions of a KPool (compressed) layer are token positions or pool positions is not
stated by that interface: the caller says it with ``ids=`` when replaying, and
:func:`sp_kpool.replay.shard` validates every row either way (a wrong guess fails, it is
never replayed silently).
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .capture import crc32_record, fail, parse_crc32, read_checked, save_atomic, verify_crc32
from .checks import check_choice, check_int

__all__ = ["FORMAT", "RolloutSelections", "narrowest", "write_selections", "read_selections", "from_sglang",
           "sglang_batch"]  # fmt: skip

FORMAT = "sp_kpool.rollout/1"
_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


def narrowest(values: torch.Tensor) -> torch.dtype:
    """The narrowest signed integer dtype that holds ``values`` and ``-1``."""
    if values.numel() == 0:
        return torch.int8
    lo, hi = min(int(values.min()), -1), int(values.max())
    return next(d for d in _DTYPES if torch.iinfo(d).min <= lo and hi <= torch.iinfo(d).max)


def _as_int_tensor(name: str, a: Any) -> torch.Tensor:
    if isinstance(a, np.ndarray):
        if a.dtype.kind not in "iu":
            raise TypeError(f"{name}: expected an integer array, got dtype {a.dtype}")
        a = torch.from_numpy(a.astype(np.int64))
    if not isinstance(a, torch.Tensor) or a.dtype.is_floating_point or a.dtype.is_complex or a.dtype == torch.bool:
        got = a.dtype if isinstance(a, torch.Tensor) else type(a).__name__
        raise TypeError(f"{name}: expected a 2-D integer tensor or array, got {got}")
    if a.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D array [T_doc, width], got shape {list(a.shape)}")
    return a.detach().to("cpu").to(torch.int64)


@dataclass(frozen=True)
class RolloutSelections:
    """A read rollout selection file: ``layers[l][d]`` is layer ``l``'s ``[T_d, W]`` selection
    of document ``d`` (CPU, its stored dtype); ``ids``: ``"tokens"`` or ``"pools"``."""

    path: Path
    ids: str
    layers: list[list[torch.Tensor]]
    kpool: int | None = None
    topk: int | None = None
    meta: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_docs(self) -> int:
        return len(self.layers[0]) if self.layers else 0

    def layer(self, index: int) -> list[torch.Tensor]:
        """Layer ``index``'s per-document selections, as :func:`sp_kpool.replay.shard` takes them."""
        return self.layers[index]


def write_selections(path: str | os.PathLike, layers: Sequence[Sequence[Any]], *, ids: str = "tokens",
                     kpool: int | None = None, topk: int | None = None, source: str = "") -> Path:  # fmt: skip
    """Write ``layers[l][d]`` (one ``[T_d, W]`` integer array per layer and document, the
    same documents in every layer) to ``path``, each in the narrowest signed dtype holding
    its values (atomically; checksummed). Returns the path."""
    check_choice("ids", ids, ("tokens", "pools"))
    kpool = check_int("kpool", kpool, 1) if kpool is not None else None
    topk = check_int("topk", topk, 1) if topk is not None else None
    if not isinstance(layers, (list, tuple)) or not layers:
        raise TypeError(f"layers: expected a non-empty list (per layer) of lists (per document), got {type(layers).__name__}")
    n_docs = None
    tensors: dict[str, torch.Tensor] = {}
    for li, docs in enumerate(layers):
        if not isinstance(docs, (list, tuple)):
            raise TypeError(f"layers[{li}]: expected a list of per-document arrays, got {type(docs).__name__}")
        if n_docs is None:
            n_docs = len(docs)
        elif len(docs) != n_docs:
            raise ValueError(f"layers[{li}]: expected {n_docs} documents (as layer 0), got {len(docs)}")
        for d, a in enumerate(docs):
            t = _as_int_tensor(f"layers[{li}][{d}]", a)
            if t.numel() and int(t.min()) < -1:
                raise ValueError(f"layers[{li}][{d}]: expected ids >= -1, got {int(t.min())}")
            tensors[f"layer{li:03d}.doc{d:05d}"] = t.to(narrowest(t)).contiguous()
    if len(layers) > 999 or (n_docs or 0) > 99999:
        raise ValueError(f"layers: at most 999 layers of 99999 documents, got {len(layers)} of {n_docs}")
    meta = {"format": FORMAT, "ids": ids, "num_layers": len(layers), "num_docs": n_docs,
            "kpool": kpool if kpool is not None else -1, "topk": topk if topk is not None else -1, "source": source,
            "crc32": crc32_record(tensors)}  # fmt: skip
    return save_atomic(path, tensors, meta)


def read_selections(path: str | os.PathLike, *, verify: bool = True) -> RolloutSelections:
    """Read a file of :func:`write_selections` (every tensor's CRC-32 checked with ``verify``).
    Raises :class:`~sp_kpool.capture.CaptureError` naming the file and what is wrong."""
    path = Path(path)

    def read(fh):
        meta = fh.metadata() or {}
        if meta.get("format") != FORMAT:
            raise fail(path, f"not an sp_kpool rollout selection file (metadata 'format' is "
                             f"{meta.get('format')!r}, expected {FORMAT!r})")  # fmt: skip
        return meta, {n: fh.get_tensor(n) for n in fh.keys()}

    meta, tensors = read_checked(path, "rollout selection file", read)
    try:
        n_layers, n_docs = int(meta["num_layers"]), int(meta["num_docs"])
        kpool, topk = int(meta.get("kpool", -1)), int(meta.get("topk", -1))
        crc_record, ids = meta["crc32"], meta["ids"]
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise fail(path, f"bad metadata ({type(exc).__name__}: {exc})") from None
    crc = parse_crc32(path, crc_record)
    if ids not in ("tokens", "pools"):
        raise fail(path, f"metadata 'ids': expected 'tokens' or 'pools', got {ids!r}")
    want = {f"layer{li:03d}.doc{d:05d}" for li in range(n_layers) for d in range(n_docs)}
    if set(tensors) != want:
        missing, extra = sorted(want - set(tensors))[:4], sorted(set(tensors) - want)[:4]
        raise fail(path, f"expected {n_layers} layers x {n_docs} documents, missing {missing}, unexpected {extra}")
    if verify:
        verify_crc32(path, tensors, crc)
    layers = [[tensors[f"layer{li:03d}.doc{d:05d}"] for d in range(n_docs)] for li in range(n_layers)]
    return RolloutSelections(path=path, ids=ids, layers=layers, kpool=kpool if kpool > 0 else None,
                             topk=topk if topk > 0 else None, meta=dict(meta))  # fmt: skip


def from_sglang(indexer_topk: Any, *, num_layers: int, index_topk: int) -> list[np.ndarray]:
    """One SGLang request's ``meta_info["indexer_topk"]`` as ``num_layers`` arrays
    ``[seqlen - 1, index_topk]`` int32 (request-local positions; no row for the last token).

    ``indexer_topk``: the base64 string (or its bytes), or the decoded int32 values (any
    shape with ``(seqlen - 1) * num_layers * index_topk`` elements, in SGLang's
    ``(seqlen - 1, num_layers, index_topk)`` order)."""
    num_layers, index_topk = check_int("num_layers", num_layers, 1), check_int("index_topk", index_topk, 1)
    if isinstance(indexer_topk, (str, bytes)):
        raw = base64.b64decode(indexer_topk)
        if len(raw) % 4:
            raise ValueError(f"indexer_topk: expected int32 values (a multiple of 4 bytes), got {len(raw)} bytes")
        flat = np.frombuffer(raw, dtype="<i4")
    else:
        arr = indexer_topk.cpu().numpy() if isinstance(indexer_topk, torch.Tensor) else np.asarray(indexer_topk)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"indexer_topk: expected integer values, got dtype {arr.dtype}")
        flat = arr.reshape(-1)
    per_row = num_layers * index_topk
    if flat.size % per_row:
        raise ValueError(f"indexer_topk: expected a multiple of num_layers x index_topk = {per_row} values "
                         f"((seqlen - 1, num_layers, index_topk)), got {flat.size}")  # fmt: skip
    rows = flat.reshape(flat.size // per_row, num_layers, index_topk).astype(np.int32)
    return [np.ascontiguousarray(rows[:, li]) for li in range(num_layers)]


def sglang_batch(requests: Sequence[Any], *, num_layers: int, index_topk: int) -> list[list[np.ndarray]]:
    """A batch of SGLang requests (each ``meta_info["indexer_topk"]``, or a response dict with
    ``meta_info``), packed in this order as the documents of the training sequence, as
    ``[layer][document]`` arrays for :func:`write_selections` and :func:`sp_kpool.replay.shard`."""
    per_request = []
    for i, r in enumerate(requests):
        if isinstance(r, dict):
            try:
                r = r["meta_info"]["indexer_topk"]
            except (KeyError, TypeError):
                raise ValueError(f"requests[{i}]: expected meta_info['indexer_topk'] (SGLang with "
                                 "--enable-return-indexer-topk)") from None  # fmt: skip
        per_request.append(from_sglang(r, num_layers=num_layers, index_topk=index_topk))
    return [[layers[li] for layers in per_request] for li in range(num_layers)]

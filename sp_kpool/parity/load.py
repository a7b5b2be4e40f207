"""Read a capture back: one rank's file, validated, or every rank's file of one call.

The file layout and the format versions are described in :mod:`sp_kpool.capture` (the
writer, next to the indexer). This reader accepts every version in :data:`FORMATS`: a file
of an older version loads with what it lacks filled in as described there; a file of a
version it does not know is refused. Every tensor's CRC-32 is checked against the one
stored at capture time, so a flipped byte is reported, not replayed.

Errors reading a capture are :class:`~sp_kpool.capture.CaptureError` (a ``ValueError``)
naming the file and what is wrong with it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..capture import FORMAT, PARAM_NAMES, CaptureError, fail, parse_crc32, read_checked, register_reader, verify_crc32

__all__ = ["Capture", "CaptureError", "FORMATS", "load_capture", "load_capture_set"]

#: Every capture format this reader knows, oldest first -> the metadata its files may lack,
#: each with the value read in its place (``config``: ``None``, rebuilt from the flat
#: fields). A field missing from a file whose version always has it is an error. The
#: tensor ``prompt_lens`` is optional in every version (``/1`` files from before the
#: compression schedules, and calls without prompt lengths, have none).
FORMATS: dict[str, dict[str, str | None]] = {
    "sp_kpool.capture/1": {
        "layout": "contiguous",  # before the ownership layouts
        "sp_kpool": "?",  # the versions that wrote it
        "torch": "?",
        "options": "{}",  # before the RunOptions record: the defaults, the backend as recorded
        "head_gate": "rounded to the parameter dtype",  # before the FP32 head gate
        "config": None,  # before the KPoolConfig record: the flat fields
    },
    "sp_kpool.capture/2": {},
}
assert FORMAT in FORMATS, FORMAT  # the writer's version is one this reader reads

_PREFIX = "sp_kpool.capture/"
_DATA = ("hidden", "q_resid", "cu_seq_lens", "ids")
_INT_META = (
    "rank", "world_size", "shard_start", "shard_size", "num_padding", "topk", "kpool", "heads",
    "alignment", "max_logits_bytes", "call",
)  # fmt: skip
_STR_META = ("tail", "order", "precision", "backend", "backend_resolved", "device", "autocast", "tag", "source")
#: Metadata written by every version since ``/2``, some of it missing from ``/1`` files.
_LATER_META = ("layout", "sp_kpool", "torch", "options", "head_gate", "config")
_NAME_RE = re.compile(r"^(?P<stem>.+)\.rank(?P<rank>\d+)-of-(?P<world>\d+)\.safetensors$")


@dataclass(frozen=True, eq=False)
class Capture:
    """One rank's capture file, validated (tensors on the CPU, dtypes as stored).

    ``hidden`` ``[S_local, hidden_size]`` and ``q_resid`` ``[S_local, q_lora_rank]`` as
    given to the live call; ``cu_seq_lens`` ``[num_docs + 1]`` int64 (global, padded);
    ``ids`` ``[S_local, W]`` int32, what the live call returned; ``params``: the seven
    indexer tensors by checkpoint name (:data:`~sp_kpool.capture.PARAM_NAMES`);
    ``crc32``: tensor name -> stored CRC-32. ``meta`` holds the typed metadata, ``format``
    (the file's version) included, with what an older version lacks filled in
    (:data:`FORMATS`).
    """

    path: Path
    meta: dict[str, Any]
    hidden: torch.Tensor
    q_resid: torch.Tensor
    cu_seq_lens: torch.Tensor
    ids: torch.Tensor
    params: dict[str, torch.Tensor]
    crc32: dict[str, int]
    #: ``[num_real_docs]`` int64, or ``None``: a call without a compression schedule, or a
    #: ``/1`` capture written before schedules were recorded (replayed as all decode order).
    prompt_lens: torch.Tensor | None = None
    #: ``layout.positions`` / ``layout.counts`` / ``layout.padding_docs`` (int64) of a
    #: layout other than the contiguous split (``None`` for it, and in captures from
    #: before layouts).
    layout: dict[str, torch.Tensor] | None = None

    @property
    def rank(self) -> int:
        """This file's rank (metadata ``rank``)."""
        return self.meta["rank"]

    @property
    def world_size(self) -> int:
        """The call's number of ranks (metadata ``world_size``)."""
        return self.meta["world_size"]

    def seq(self):
        """The call's ``ShardedSequence`` (no process group), rebuilt and checked."""
        from ..sharding import ShardedSequence

        prompts = self.prompt_lens.tolist() if self.prompt_lens is not None else None
        if self.layout is not None:
            return self._layout_seq(prompts)
        cu = self.cu_seq_lens[:-1] if self.meta["num_padding"] else self.cu_seq_lens
        try:
            seq = ShardedSequence.split(cu, world_size=self.world_size, rank=self.rank, prompt_lens=prompts)
        except (TypeError, ValueError) as exc:
            raise CaptureError(f"{self.path}: its prompt_lens do not fit its documents ({exc})") from None
        got = (seq.shard_start, seq.shard_size, seq.num_padding)
        want = (self.meta["shard_start"], self.meta["shard_size"], self.meta["num_padding"])
        if got != want or not torch.equal(seq.cu_seq_lens, self.cu_seq_lens):
            raise CaptureError(
                f"{self.path}: sharding metadata (shard_start, shard_size, num_padding) = {want} does not "
                f"match the split of its cu_seq_lens over {self.world_size} ranks {got}"
            )
        return seq

    def _layout_seq(self, prompts):
        from ..sharding import ShardedSequence, _check_cover

        lay, m = self.layout, self.meta
        counts = lay["layout.counts"].tolist()
        positions = tuple(torch.split(lay["layout.positions"], counts))
        try:
            _check_cover(positions, int(self.cu_seq_lens[-1]))
            seq = ShardedSequence(
                cu_seq_lens=self.cu_seq_lens, shard_start=None, shard_size=m["shard_size"], rank=self.rank,
                world_size=self.world_size, num_padding=m["num_padding"], prompt_lens=prompts, layout=m["layout"],
                padding_docs=tuple(lay["layout.padding_docs"].tolist()), rank_positions=positions,
            )  # fmt: skip
        except (TypeError, ValueError) as exc:
            raise CaptureError(f"{self.path}: its layout does not fit its documents ({exc})") from None
        pad = sum(int(self.cu_seq_lens[d + 1] - self.cu_seq_lens[d]) for d in seq.padding_docs)
        if len(counts) != self.world_size or counts[self.rank] != m["shard_size"] or pad != m["num_padding"]:
            raise CaptureError(f"{self.path}: layout metadata (rows per rank {counts}, padding {pad}) does not match "
                               f"rank {self.rank} of {self.world_size} with {m['shard_size']} rows and "
                               f"{m['num_padding']} padding tokens")  # fmt: skip
        return seq

    def config(self):
        """The call's :class:`~sp_kpool.config.KPoolConfig`, resolved, as it ran: rebuilt by
        ``KPoolConfig.from_record`` from metadata ``config`` (so no field is lost), or from
        the flat fields in ``/1`` captures from before that record."""
        from ..config import KPoolConfig

        try:
            return KPoolConfig.from_record(self.meta["config"])
        except (TypeError, ValueError) as exc:
            raise CaptureError(f"{self.path}: metadata 'config' is not a valid KPoolConfig ({exc})") from None

    def options(self):
        """The call's :class:`~sp_kpool.config.RunOptions` (the backend as requested)."""
        from ..config import RunOptions

        return RunOptions.from_record({**self.meta["options"], "backend": self.meta["backend"]})


def _check_format(path: Path, found: str | None) -> dict[str, str | None]:
    """What a file of version ``found`` may lack (:data:`FORMATS`); a :class:`CaptureError`
    naming the file, the version found and the versions known if it is none of them."""
    if found in FORMATS:
        return FORMATS[found]
    if isinstance(found, str) and found.startswith(_PREFIX):
        raise fail(path, f"capture format {found!r} is not one this reader knows (it reads {list(FORMATS)}): "
                          "written by a newer sp_kpool?")  # fmt: skip
    raise fail(path, f"not an sp_kpool capture (metadata 'format' is {found!r}, expected one of {list(FORMATS)})")


def load_capture(path: str | os.PathLike, *, verify: bool = True) -> Capture:
    """Read and validate one capture file (tensors on the CPU), of any version in
    :data:`FORMATS`.

    ``verify`` checks every tensor's CRC-32 against the one stored at capture time.
    Raises :class:`~sp_kpool.capture.CaptureError` naming the file and the problem (an
    unknown format version among them).
    """
    path = Path(path)

    def read(fh):
        raw_meta = fh.metadata() or {}
        names = set(fh.keys())
        lacks = _check_format(path, raw_meta.get("format"))
        want = {*_DATA, *(f"param.{n}" for n in PARAM_NAMES)}
        if want - names:
            raise fail(path, f"missing tensors {sorted(want - names)}")
        optional = {"prompt_lens", "layout.positions", "layout.counts", "layout.padding_docs"}
        return raw_meta, lacks, {n: fh.get_tensor(n) for n in sorted(want | (optional & names))}

    raw_meta, lacks, tensors = read_checked(path, "capture file", read)

    meta: dict[str, Any] = {"format": raw_meta["format"]}
    required = (*_INT_META, *_STR_META, "crc32", *(k for k in _LATER_META if k not in lacks))
    missing = [k for k in required if k not in raw_meta]
    if missing:
        raise fail(path, f"missing metadata {missing}")
    for k in _INT_META:
        try:
            meta[k] = int(raw_meta[k])
        except ValueError:
            raise fail(path, f"metadata {k!r}: expected an integer, got {raw_meta[k]!r}") from None
    for k in _STR_META:
        meta[k] = raw_meta[k]
    for k in ("layout", "sp_kpool", "torch", "head_gate"):  # in an older file, what its version implies
        meta[k] = raw_meta.get(k, lacks.get(k))
    try:
        options = json.loads(raw_meta.get("options", lacks.get("options")))
        if not isinstance(options, dict):
            raise ValueError
    except ValueError:
        raise fail(path, f"metadata 'options': expected a JSON object, got {raw_meta['options'][:80]!r}") from None
    meta["options"] = options
    crc = parse_crc32(path, raw_meta["crc32"])
    if verify:
        verify_crc32(path, tensors, crc)
    cap = Capture(
        path=path, meta=meta, hidden=tensors["hidden"], q_resid=tensors["q_resid"],
        cu_seq_lens=tensors["cu_seq_lens"], ids=tensors["ids"],
        params={n: tensors[f"param.{n}"] for n in PARAM_NAMES}, crc32=crc, prompt_lens=tensors.get("prompt_lens"),
        layout={k: v for k, v in tensors.items() if k.startswith("layout.")} or None,
    )  # fmt: skip
    _check_shapes(cap)
    meta["config"] = _config_record(path, raw_meta, meta)  # after the flat fields' own checks
    return cap


#: The config fields every capture also stores flat (the only ones of ``/1`` captures from
#: before the ``config`` record).
_FLAT_CONFIG = ("topk", "kpool", "tail", "order", "alignment", "precision", "max_logits_bytes")


def _config_record(path: Path, raw_meta: dict[str, str], meta: dict[str, Any]) -> dict[str, Any]:
    """The call's resolved :class:`~sp_kpool.config.KPoolConfig` record: metadata ``config``
    (every field, the ones added after this reader too), checked against the flat fields;
    in ``/1`` captures from before it, the flat fields."""
    flat = {k: meta[k] for k in _FLAT_CONFIG}
    if "config" not in raw_meta:
        return flat
    try:
        record = json.loads(raw_meta["config"])
        if not isinstance(record, dict):
            raise ValueError
    except ValueError:
        raise fail(path, f"metadata 'config': expected a JSON object, got {raw_meta['config'][:80]!r}") from None
    differ = [f"{k}: {record[k]!r} vs {v!r}" for k, v in flat.items() if k in record and record[k] != v]
    if differ:
        raise fail(path, "metadata 'config' disagrees with the flat metadata (config vs flat): " + "; ".join(differ))
    return record


def _check_shapes(c: Capture) -> None:
    from ..precision import PRECISIONS
    from ..selection import ORDERS, TAILS, output_width

    m, p, path = c.meta, c.params, c.path

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise fail(path, what)

    need(m["world_size"] >= 1 and 0 <= m["rank"] < m["world_size"], f"rank {m['rank']} of world size {m['world_size']} is impossible")
    need(m["precision"] in PRECISIONS, f"metadata 'precision': expected one of {list(PRECISIONS)}, got {m['precision']!r}")
    need(m["tail"] in TAILS, f"metadata 'tail': expected one of {list(TAILS)}, got {m['tail']!r}")
    need(m["order"] in ORDERS, f"metadata 'order': expected one of {list(ORDERS)}, got {m['order']!r}")
    need(m["kpool"] >= 1 and m["topk"] >= 1 and m["topk"] % m["kpool"] == 0, f"topk {m['topk']} / kpool {m['kpool']} are invalid")
    cu = c.cu_seq_lens
    need(cu.dtype == torch.int64 and cu.dim() == 1 and cu.numel() >= 2, f"cu_seq_lens: expected 1-D int64, got {cu.dtype} {list(cu.shape)}")
    S_loc, H, K = m["shard_size"], m["heads"], m["kpool"]
    if c.layout is None:
        need(m["layout"] == "contiguous", f"layout {m['layout']!r} without its positions (tensors 'layout.*')")
        need(int(cu[-1]) == S_loc * m["world_size"], f"cu_seq_lens ends at {int(cu[-1])}, expected shard_size * world_size = {S_loc * m['world_size']}")
    else:
        need(set(c.layout) == {"layout.positions", "layout.counts", "layout.padding_docs"}, f"layout tensors: expected positions, counts and padding_docs, got {sorted(c.layout)}")
        counts = c.layout["layout.counts"]
        need(counts.numel() == m["world_size"] and int(counts.sum()) == int(cu[-1]) == c.layout["layout.positions"].numel(),
             f"layout: {counts.tolist()} rows per rank do not cover the {int(cu[-1])} stream positions")  # fmt: skip
    wq, wk = p["wq_b.weight"], p["wk.weight"]
    need(wk.dim() == 2 and wq.dim() == 2, f"param wk.weight / wq_b.weight: expected 2-D, got {list(wk.shape)} / {list(wq.shape)}")
    D, hidden = wk.shape
    want = {
        "wq_b.weight": [H * D, wq.shape[1]],
        "k_norm.weight": [D],
        "k_norm.bias": [D],
        "weights_proj.weight": [H, hidden],
        "index_kpool_compress_gate": [D, hidden],
        "index_kpool_compress_ape": [K, D],
    }
    for n, shape in want.items():
        need(list(p[n].shape) == shape, f"param {n}: expected shape {shape} (H={H}, D={D}, K={K}), got {list(p[n].shape)}")
    need(list(c.hidden.shape) == [S_loc, hidden], f"hidden: expected shape {[S_loc, hidden]}, got {list(c.hidden.shape)}")
    need(list(c.q_resid.shape) == [S_loc, wq.shape[1]], f"q_resid: expected shape {[S_loc, wq.shape[1]]}, got {list(c.q_resid.shape)}")
    width = output_width(m["topk"], K, m["alignment"])
    need(list(c.ids.shape) == [S_loc, width] and c.ids.dtype == torch.int32, f"ids: expected int32 {[S_loc, width]}, got {c.ids.dtype} {list(c.ids.shape)}")


def load_capture_set(path: str | os.PathLike, *, verify: bool = True) -> tuple[Capture, list[Capture]]:
    """``(this rank's capture, every rank's capture in rank order)``, each read by
    :func:`load_capture`.

    With world size 1 the list is ``[capture]``. Otherwise the other ranks' files are found
    next to ``path`` by name (``<stem>.rank<RRR>-of-<WWW>.safetensors``) and checked to
    belong to the same call (same sequence, options, precision and parameters).
    """
    cap = load_capture(path, verify=verify)
    R = cap.world_size
    if R == 1:
        return cap, [cap]
    m = _NAME_RE.match(cap.path.name)
    if not m or int(m["world"]) != R or int(m["rank"]) != cap.rank:
        raise fail(
            cap.path,
            f"rank {cap.rank} of {R}: the replay needs every rank's file, found by the name "
            f"'<stem>.rank<RRR>-of-{R:03d}.safetensors', but this file is named differently",
        )
    caps = []
    for r in range(R):
        if r == cap.rank:
            caps.append(cap)
            continue
        other = cap.path.with_name(f"{m['stem']}.rank{r:03d}-of-{R:03d}.safetensors")
        if not other.is_file():
            raise fail(
                cap.path,
                f"rank {r} of {R} is needed to rebuild the keys and gates of the whole sequence "
                f"(replay stitches every rank's rows), but {other} does not exist",
            )
        caps.append(load_capture(other, verify=verify))
    same = ("world_size", "num_padding", "layout", "topk", "kpool", "heads", "tail", "order", "alignment",
            "max_logits_bytes", "precision", "tag", "call")  # fmt: skip
    for c in caps:
        if c.rank != caps.index(c):
            raise fail(c.path, f"metadata says rank {c.rank}, but its name says rank {caps.index(c)}")
        diff = [f"{k}: {c.meta[k]!r} vs {cap.meta[k]!r}" for k in same if c.meta[k] != cap.meta[k]]
        if not torch.equal(c.cu_seq_lens, cap.cu_seq_lens):
            diff.append("cu_seq_lens differ")
        if c.layout is None and c.meta["shard_size"] != cap.meta["shard_size"]:
            diff.append(f"shard_size: {c.meta['shard_size']} vs {cap.meta['shard_size']}")
        if (c.layout is None) != (cap.layout is None) or (c.layout is not None and any(
                not torch.equal(v, cap.layout[k]) for k, v in c.layout.items())):  # fmt: skip
            diff.append("layouts differ")
        if (c.prompt_lens is None) != (cap.prompt_lens is None) or (
                c.prompt_lens is not None and not torch.equal(c.prompt_lens, cap.prompt_lens)):  # fmt: skip
            diff.append("prompt_lens differ")
        diff += [f"param {n} differs" for n in PARAM_NAMES if c.crc32[f"param.{n}"] != cap.crc32[f"param.{n}"]]
        if diff:
            raise fail(c.path, f"does not belong to the same call as {cap.path.name}: " + "; ".join(diff))
    return cap, caps


# the writer (sp_kpool.capture, below) still gives the reader's names: given to it here
register_reader(Capture=Capture, load_capture=load_capture, load_capture_set=load_capture_set)

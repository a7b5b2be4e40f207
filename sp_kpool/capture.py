"""Capture the inputs of a live ``KPoolIndexer`` call to a ``safetensors`` file, and read it back.

Opt-in, per rank, no communication. Enable it with ``KPoolIndexer(..., capture_dir=DIR)``,
with ``$SP_KPOOL_CAPTURE_DIR`` (:mod:`sp_kpool.settings`), or on a live module with
:func:`enable`. A module without capture pays one attribute test per call; a capturing
call records *after* computing its result, so the result is unchanged.

One file per rank and captured call::

    DIR/<tag>-call<NNNN>.rank<RRR>-of-<WWW>.safetensors

    tensor          shape                       dtype       what
    hidden          [S_local, hidden_size]      as given    this rank's rows (padding rows as given)
    q_resid         [S_local, q_lora_rank]      as given    this rank's rows
    cu_seq_lens     [num_docs + 1]              int64       global, padded (``ShardedSequence.cu_seq_lens``)
    prompt_lens     [num_real_docs]             int64       ``ShardedSequence.prompt_lens``, when the call had them
    layout.positions [S]                        int64       every rank's ``positions``, rank after rank, and
    layout.counts   [world_size]                int64       their counts, and the padding documents
    layout.padding_docs [n]                     int64       (layouts other than the contiguous split only)
    ids             [S_local, W]                int32       what the live call returned
    param.<name>    checkpoint shapes           as stored   the seven indexer tensors (``wq_b.weight``, ...)

    metadata (str -> str): format ``sp_kpool.capture/1``, rank, world_size, shard_start
    (``-1`` unless the layout is contiguous), shard_size, num_padding, layout, topk, kpool,
    heads, tail, order, alignment, max_logits_bytes (resolved), precision, backend (requested) and backend_resolved, device, autocast
    (``off`` or the dtype), tag, call, source, versions, ``head_gate`` (``fp32``), ``config``
    and ``options`` (JSON:
    the resolved :class:`~sp_kpool.config.KPoolConfig` and the
    :class:`~sp_kpool.config.RunOptions`, whole: a replay rebuilds exactly what ran), and
    ``crc32``: a JSON object with the CRC-32 of every tensor's bytes (so a flipped byte is
    reported, not replayed).

Several ranks: each file holds **only its own rows**. Replaying rank ``r`` needs the keys
and gates of the whole sequence, so the replay reads all ``W`` files of the call (same
directory, same stem) and rebuilds keys and gates per rank with ``KPoolIndexer.prepare``,
exactly as the live ranks did before their all-gather; queries and head weights come from
rank ``r``'s file only. Cost: a file is ``S_local * (hidden_size + q_lora_rank)`` elements
plus the parameters (about 20 MB in BF16 at the checkpoint's shapes) and the ids
(``S_local * W * 4`` bytes); nothing is duplicated across ranks. (Storing the gathered
hidden rows in every file instead would cost ``W`` times the whole sequence's hidden
states: 1 GiB per file for 131072 BF16 tokens of width 4096.)

Captures written by earlier versions load: without ``prompt_lens`` they replay with every
pool in decode order (the report says so), and without ``config`` the flat metadata fields
(topk, kpool, tail, order, alignment, precision, max_logits_bytes) rebuild it; with it,
``KPoolConfig.from_record`` does (so fields added to the config survive a replay), and
the flat fields must agree with it. The format stays ``sp_kpool.capture/1``: what is
written has not changed since ``config`` was added, and both kinds of ``/1`` files load. Their serving-arm ids (``bf16-serving``, ``fp8``) were computed with the
head gate rounded to the parameter dtype (they have no ``head_gate`` metadata); the
replay keeps it FP32, as serving does, so their ids need not reproduce, and the parity
report says why.

Errors reading a capture are :class:`CaptureError` (a ``ValueError``) naming the file and
what is wrong with it.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checks import check_int

__all__ = [
    "CaptureError",
    "CaptureHook",
    "Capture",
    "FORMAT",
    "PARAM_NAMES",
    "hook_for",
    "check_directory",
    "enable",
    "capture_path",
    "write_capture",
    "load_capture",
    "load_capture_set",
]

FORMAT = "sp_kpool.capture/1"
#: The seven checkpoint tensors, stored as ``param.<name>``.
PARAM_NAMES = (
    "wq_b.weight",
    "wk.weight",
    "k_norm.weight",
    "k_norm.bias",
    "weights_proj.weight",
    "index_kpool_compress_gate",
    "index_kpool_compress_ape",
)
_DATA = ("hidden", "q_resid", "cu_seq_lens", "ids")
_INT_META = (
    "rank", "world_size", "shard_start", "shard_size", "num_padding", "topk", "kpool", "heads",
    "alignment", "max_logits_bytes", "call",
)  # fmt: skip
_STR_META = ("tail", "order", "precision", "backend", "backend_resolved", "device", "autocast", "tag", "source")
_NAME_RE = re.compile(r"^(?P<stem>.+)\.rank(?P<rank>\d+)-of-(?P<world>\d+)\.safetensors$")
_serial = itertools.count()
_log = logging.getLogger(__name__)


class CaptureError(ValueError):
    """A capture file is missing, unreadable, corrupted or inconsistent (message names the file)."""


# --------------------------------------------------------------------------- writing


def capture_path(directory: str | os.PathLike, tag: str, call: int, rank: int, world_size: int) -> Path:
    """``directory/<tag>-call<NNNN>.rank<RRR>-of-<WWW>.safetensors``."""
    return Path(directory) / f"{tag}-call{call:04d}.rank{rank:03d}-of-{world_size:03d}.safetensors"


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def _crc32(t: torch.Tensor) -> int:
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return 0
    return zlib.crc32(flat.view(torch.uint8).numpy())


def _autocast_state(device: torch.device) -> str:
    try:
        if torch.is_autocast_enabled(device.type):
            return str(torch.get_autocast_dtype(device.type)).replace("torch.", "")
    except (RuntimeError, TypeError):  # a device type without autocast
        pass
    return "off"


def write_capture(
    path: str | os.PathLike,
    *,
    hidden: torch.Tensor,
    q_resid: torch.Tensor,
    ids: torch.Tensor,
    seq,
    params: dict[str, torch.Tensor],
    meta: dict[str, Any],
) -> Path:
    """Write one capture file (atomically: a temporary name, then ``os.replace``).

    ``seq`` is the call's ``ShardedSequence``; ``params`` maps :data:`PARAM_NAMES` to
    tensors; ``meta`` holds the remaining metadata (options, precision, backend, ...).
    Tensors are copied to the CPU. Returns the path written.
    """
    path = Path(path)
    missing = [n for n in PARAM_NAMES if n not in params]
    if missing:
        raise ValueError(f"params: expected the seven indexer tensors, missing {missing}")
    tensors = {
        "hidden": _cpu(hidden),
        "q_resid": _cpu(q_resid),
        "cu_seq_lens": _cpu(seq.cu_seq_lens.to(torch.int64)),
        "ids": _cpu(ids),
        **{f"param.{n}": _cpu(params[n]) for n in PARAM_NAMES},
    }
    if seq.prompt_lens is not None:
        tensors["prompt_lens"] = torch.tensor(seq.prompt_lens, dtype=torch.int64)
    if not seq.is_contiguous:  # the ownership: every rank's positions and the padding documents
        tensors["layout.positions"] = torch.cat(list(seq.rank_positions)).to(torch.int64)
        tensors["layout.counts"] = torch.tensor([p.numel() for p in seq.rank_positions], dtype=torch.int64)
        tensors["layout.padding_docs"] = torch.tensor(seq.padding_docs, dtype=torch.int64)
    from . import __version__

    full = {
        "format": FORMAT,
        "sp_kpool": __version__,
        "torch": torch.__version__,
        "rank": seq.rank,
        "world_size": seq.world_size,
        "shard_start": seq.shard_start if seq.shard_start is not None else -1,
        "shard_size": seq.shard_size,
        "num_padding": seq.num_padding,
        "layout": seq.layout,
        **meta,
        "crc32": json.dumps({k: _crc32(v) for k, v in tensors.items()}, sort_keys=True),
    }
    return save_atomic(path, tensors, full)


def save_atomic(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> Path:
    """Write ``tensors`` and ``metadata`` (values as ``str``) to a ``safetensors`` file
    atomically: a temporary name in the same directory, then ``os.replace``. Returns the path."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={k: str(v) for k, v in metadata.items()})
    os.replace(tmp, path)
    return path


class CaptureHook:
    """Records the first ``calls`` forward calls of a module (see the module docstring).

    Called by ``KPoolIndexer.forward`` after the result is computed; returns the path
    written, or ``None`` once ``calls`` calls have been captured. ``tag`` defaults to
    ``kpool<NNN>``, numbered in the order hooks are made in this process (the same on every
    rank when the ranks build the model alike).
    """

    def __init__(self, directory: str | os.PathLike, calls: int = 1, tag: str | None = None) -> None:
        check_int("calls", calls, 0)
        if tag is not None and (not tag or "/" in tag or os.sep in tag):
            raise ValueError(f"tag: expected a non-empty file-name fragment, got {tag!r}")
        self.directory = Path(directory)
        self.calls = calls
        self.tag = tag if tag is not None else f"kpool{next(_serial):03d}"
        self.done = 0
        #: Recorded as metadata ``source``.
        self.source = "live"

    def __repr__(self) -> str:
        return f"CaptureHook({str(self.directory)!r}, calls={self.calls}, tag={self.tag!r}, done={self.done})"

    @torch.no_grad()
    def __call__(self, module, hidden, q_resid, seq, config, prepared: dict, ids: torch.Tensor) -> Path | None:
        if self.done >= self.calls:
            return None
        from .backends import Problem, resolve_backend

        config = config.resolve(module.settings, hidden.device)
        options = module.options
        problem = Problem(**prepared, seq=seq, config=config, settings=module.settings)
        meta = {
            "topk": config.topk,
            "kpool": config.kpool,
            "heads": module.n_heads,
            "tail": config.tail,
            "order": config.order,
            "alignment": config.alignment,
            "max_logits_bytes": config.max_logits_bytes,
            "precision": config.precision,
            "backend": options.backend,
            "backend_resolved": resolve_backend(options.backend, problem).name,
            "device": str(hidden.device),
            "autocast": _autocast_state(hidden.device),
            "tag": self.tag,
            "call": self.done,
            "source": self.source,
            "head_gate": "fp32",  # the serving modes' head gate: FP32, unrounded (older captures: rounded)
            "config": json.dumps(config.record(), sort_keys=True),  # the resolved KPoolConfig, whole
            "options": json.dumps(options.record(), sort_keys=True),  # the RunOptions, whole
        }
        params = dict(module.state_dict())
        path = capture_path(self.directory, self.tag, self.done, seq.rank, seq.world_size)
        write_capture(path, hidden=hidden, q_resid=q_resid, ids=ids, seq=seq, params=params, meta=meta)
        self.done += 1
        _log.info("sp_kpool: captured indexer call to %s", path)
        return path


def check_directory(name: str, directory: str | os.PathLike) -> Path:
    """``directory`` as a ``Path``, created if missing, after writing (and removing) a
    probe file in it: a capture directory that cannot be written fails here, when the
    module is built, not after its first forward call. ``ValueError`` naming ``name``."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a directory path (str or os.PathLike), got {type(directory).__name__}")
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"{name}: expected a writable directory, got {str(path)!r} ({exc.strerror or exc})") from None
    return path


def hook_for(directory: str | os.PathLike | None, settings=None) -> CaptureHook | None:
    """The hook a new module gets: ``directory`` if given, else ``settings.capture_dir``
    (``$SP_KPOOL_CAPTURE_DIR``), else ``None`` (no capture); ``settings.capture_calls``
    (``$SP_KPOOL_CAPTURE_CALLS``) sets the number of calls. ``settings``: the process
    settings when ``None``. The directory is checked (:func:`check_directory`)."""
    from .settings import ENV, current_settings

    settings = settings if settings is not None else current_settings()
    name = "capture_dir"
    if directory is None:
        directory, name = settings.capture_dir, ENV["capture_dir"]
        if directory is None:
            return None
    return CaptureHook(check_directory(name, directory), settings.capture_calls)


def enable(module, directory: str | os.PathLike | None, calls: int = 1, tag: str | None = None) -> CaptureHook | None:
    """Turn capture on (or off with ``directory=None``) for a live ``KPoolIndexer`` (the
    directory is checked, :func:`check_directory`)."""
    hook = None if directory is None else CaptureHook(check_directory("directory", directory), calls, tag)
    module._capture = hook
    return hook


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True, eq=False)
class Capture:
    """One rank's capture file, validated. ``meta`` holds the typed metadata."""

    path: Path
    meta: dict[str, Any]
    hidden: torch.Tensor
    q_resid: torch.Tensor
    cu_seq_lens: torch.Tensor
    ids: torch.Tensor
    params: dict[str, torch.Tensor]
    crc32: dict[str, int]
    #: ``[num_real_docs]`` int64, or ``None``: a call without a compression schedule, or a
    #: capture written before schedules were recorded (replayed as all decode order).
    prompt_lens: torch.Tensor | None = None
    #: ``layout.positions`` / ``layout.counts`` / ``layout.padding_docs`` of a layout other
    #: than the contiguous split (``None`` for it, and in captures from before layouts).
    layout: dict[str, torch.Tensor] | None = None

    @property
    def rank(self) -> int:
        return self.meta["rank"]

    @property
    def world_size(self) -> int:
        return self.meta["world_size"]

    def seq(self):
        """The call's ``ShardedSequence`` (no process group), rebuilt and checked."""
        from .sharding import ShardedSequence

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
        from .sharding import ShardedSequence, _check_cover

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
        the flat fields in captures from before that record."""
        from .config import KPoolConfig

        try:
            return KPoolConfig.from_record(self.meta["config"])
        except (TypeError, ValueError) as exc:
            raise CaptureError(f"{self.path}: metadata 'config' is not a valid KPoolConfig ({exc})") from None

    def options(self):
        """The call's :class:`~sp_kpool.config.RunOptions` (the backend as requested)."""
        from .config import RunOptions

        return RunOptions.from_record({**self.meta["options"], "backend": self.meta["backend"]})


def _fail(path: Path, what: str) -> CaptureError:
    return CaptureError(f"{path}: {what}")


def load_capture(path: str | os.PathLike, *, verify: bool = True) -> Capture:
    """Read and validate one capture file (tensors on the CPU).

    ``verify`` checks every tensor's CRC-32 against the one stored at capture time.
    Raises :class:`CaptureError` naming the file and the problem.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise _fail(path, "no such capture file")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            raw_meta = fh.metadata() or {}
            names = set(fh.keys())
            if raw_meta.get("format") != FORMAT:
                got = raw_meta.get("format")
                raise _fail(
                    path,
                    f"not an sp_kpool capture (metadata 'format' is {got!r}, expected {FORMAT!r})",
                )
            want = {*_DATA, *(f"param.{n}" for n in PARAM_NAMES)}
            if want - names:
                raise _fail(path, f"missing tensors {sorted(want - names)}")
            optional = {"prompt_lens", "layout.positions", "layout.counts", "layout.padding_docs"}
            tensors = {n: fh.get_tensor(n) for n in sorted(want | (optional & names))}
    except CaptureError:
        raise
    except Exception as exc:  # safetensors raises its own error type (and OSError, ...)
        raise _fail(path, f"cannot be read as safetensors, the file is truncated or corrupted ({exc})") from exc

    meta: dict[str, Any] = {}
    missing = [k for k in (*_INT_META, *_STR_META, "crc32") if k not in raw_meta]
    if missing:
        raise _fail(path, f"missing metadata {missing}")
    for k in _INT_META:
        try:
            meta[k] = int(raw_meta[k])
        except ValueError:
            raise _fail(path, f"metadata {k!r}: expected an integer, got {raw_meta[k]!r}") from None
    for k in _STR_META:
        meta[k] = raw_meta[k]
    meta["layout"] = raw_meta.get("layout", "contiguous")  # captures from before layouts
    for k in ("sp_kpool", "torch"):
        meta[k] = raw_meta.get(k, "?")
    # captures from before the FP32 head gate rounded it to the parameter dtype
    meta["head_gate"] = raw_meta.get("head_gate", "rounded to the parameter dtype")
    try:
        options = json.loads(raw_meta.get("options", "{}"))
        if not isinstance(options, dict):
            raise ValueError
    except ValueError:
        raise _fail(path, f"metadata 'options': expected a JSON object, got {raw_meta['options'][:80]!r}") from None
    meta["options"] = options
    try:
        crc = {str(k): int(v) for k, v in json.loads(raw_meta["crc32"]).items()}
    except (ValueError, TypeError, AttributeError):
        raise _fail(path, f"metadata 'crc32': expected a JSON object of integers, got {raw_meta['crc32'][:80]!r}") from None
    if verify:
        for name, t in tensors.items():
            if name not in crc:
                raise _fail(path, f"metadata 'crc32' has no entry for tensor {name!r}")
            got = _crc32(t)
            if got != crc[name]:
                raise _fail(
                    path,
                    f"tensor {name!r} fails its checksum (stored crc32 {crc[name]:#010x}, computed {got:#010x}): "
                    "the file is corrupted",
                )
    cap = Capture(
        path=path, meta=meta, hidden=tensors["hidden"], q_resid=tensors["q_resid"],
        cu_seq_lens=tensors["cu_seq_lens"], ids=tensors["ids"],
        params={n: tensors[f"param.{n}"] for n in PARAM_NAMES}, crc32=crc, prompt_lens=tensors.get("prompt_lens"),
        layout={k: v for k, v in tensors.items() if k.startswith("layout.")} or None,
    )  # fmt: skip
    _check_shapes(cap)
    meta["config"] = _config_record(path, raw_meta, meta)  # after the flat fields' own checks
    return cap


#: The config fields every capture also stores flat (the only ones of captures from before
#: the ``config`` record).
_FLAT_CONFIG = ("topk", "kpool", "tail", "order", "alignment", "precision", "max_logits_bytes")


def _config_record(path: Path, raw_meta: dict[str, str], meta: dict[str, Any]) -> dict[str, Any]:
    """The call's resolved :class:`~sp_kpool.config.KPoolConfig` record: metadata ``config``
    (every field, the ones added after this reader too), checked against the flat fields;
    in captures from before it, the flat fields."""
    flat = {k: meta[k] for k in _FLAT_CONFIG}
    if "config" not in raw_meta:
        return flat
    try:
        record = json.loads(raw_meta["config"])
        if not isinstance(record, dict):
            raise ValueError
    except ValueError:
        raise _fail(path, f"metadata 'config': expected a JSON object, got {raw_meta['config'][:80]!r}") from None
    differ = [f"{k}: {record[k]!r} vs {v!r}" for k, v in flat.items() if k in record and record[k] != v]
    if differ:
        raise _fail(path, "metadata 'config' disagrees with the flat metadata (config vs flat): " + "; ".join(differ))
    return record


def _check_shapes(c: Capture) -> None:
    from .precision import PRECISIONS
    from .selection import ORDERS, TAILS, output_width

    m, p, path = c.meta, c.params, c.path

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise _fail(path, what)

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
    """``(this rank's capture, every rank's capture in rank order)``.

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
        raise _fail(
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
            raise _fail(
                cap.path,
                f"rank {r} of {R} is needed to rebuild the keys and gates of the whole sequence "
                f"(replay stitches every rank's rows), but {other} does not exist",
            )
        caps.append(load_capture(other, verify=verify))
    same = ("world_size", "num_padding", "layout", "topk", "kpool", "heads", "tail", "order", "alignment",
            "max_logits_bytes", "precision", "tag", "call")  # fmt: skip
    for c in caps:
        if c.rank != caps.index(c):
            raise _fail(c.path, f"metadata says rank {c.rank}, but its name says rank {caps.index(c)}")
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
            raise _fail(c.path, f"does not belong to the same call as {cap.path.name}: " + "; ".join(diff))
    return cap, caps

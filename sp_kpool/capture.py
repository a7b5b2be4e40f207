"""Capture the inputs of a live ``KPoolIndexer`` call to a ``safetensors`` file.

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

    metadata (str -> str): format ``sp_kpool.capture/2``, rank, world_size, shard_start
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

Format versions (metadata ``format``). Each change to what a file holds that a reader
must know about bumps the version; the reader (:mod:`sp_kpool.parity.load`, table
``FORMATS``) reads every version it knows and refuses any other, naming it::

    version              what its files may lack, and what the reader uses instead
    sp_kpool.capture/1   prompt_lens (the call's pools in decode order, the report says so);
                         ``layout`` (contiguous); ``sp_kpool`` and ``torch`` (``?``);
                         ``options`` (the defaults, the backend as recorded); ``head_gate``
                         (its serving-arm ids were computed with the head gate rounded to
                         the parameter dtype: the replay keeps it FP32, as serving does, so
                         they need not reproduce, and the report says why); ``config`` (the
                         flat fields topk, kpool, tail, order, alignment, precision and
                         max_logits_bytes rebuild it)
                         (the last /1 writers wrote them all: such files read as /2 ones)
    sp_kpool.capture/2   nothing: every metadata field above is written; ``prompt_lens``
                         exactly when the call had them (``ShardedSequence.prompt_lens``)

A ``config`` record is rebuilt with ``KPoolConfig.from_record`` (so fields added to the
config later survive a replay), and the flat fields must agree with it.

This module is the writer (imported by the indexer). Reading, rebuilding and replaying a
capture live in :mod:`sp_kpool.parity` (:mod:`~sp_kpool.parity.load`,
:mod:`~sp_kpool.parity.rebuild`, :mod:`~sp_kpool.parity.replay`); :class:`Capture`,
:func:`load_capture` and :func:`load_capture_set` are importable from here too: the
reader, above this module, gives them to it at its import (:func:`register_reader`;
``import sp_kpool`` imports it), so this module imports nothing above it.

Errors reading a capture are :class:`CaptureError` (a ``ValueError``) naming the file and
what is wrong with it.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any, Callable

import torch

from .checks import check_int

__all__ = [
    "CaptureError",
    "CaptureHook",
    "FORMAT",
    "PARAM_NAMES",
    "hook_for",
    "check_directory",
    "enable",
    "capture_path",
    "write_capture",
    # the reader's names, given by sp_kpool.parity.load at its import (module __getattr__)
    "Capture",
    "load_capture",
    "load_capture_set",
]

#: The format version this writer writes (the versions and what changed: module docstring).
FORMAT = "sp_kpool.capture/2"
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
#: The metadata :func:`write_capture` takes from its caller (the rest comes from the
#: sequence and the versions): every field of the format, so each file it writes is a whole
#: ``sp_kpool.capture/2`` file.
_CALLER_META = (
    "topk", "kpool", "heads", "tail", "order", "alignment", "max_logits_bytes", "precision", "backend",
    "backend_resolved", "device", "autocast", "tag", "call", "source", "head_gate", "config", "options",
)  # fmt: skip
#: The reader's names, importable from here as before the reader moved up to
#: :mod:`sp_kpool.parity.load`, which fills this at its import (:func:`register_reader`).
_READER: dict[str, Any] = {}
_serial = itertools.count()
_log = logging.getLogger(__name__)


def register_reader(*, Capture: type, load_capture: Callable, load_capture_set: Callable) -> None:
    """Give this module the reader's names (:mod:`sp_kpool.parity.load`, at its import)."""
    _READER.update(Capture=Capture, load_capture=load_capture, load_capture_set=load_capture_set)


def __getattr__(name: str):
    """The reader's names (``Capture``, ``load_capture``, ``load_capture_set``), as
    :mod:`sp_kpool.parity.load` registered them (``sp_kpool/__init__`` imports it: the
    parity package sits above the indexer, which imports this module); ``AttributeError``
    for any other name."""
    if name in _READER:
        return _READER[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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

    ``hidden`` ``[S_local, hidden_size]``, ``q_resid`` ``[S_local, q_lora_rank]`` (any
    float dtype, stored as given), ``ids`` ``[S_local, W]`` int32; ``seq`` is the call's
    ``ShardedSequence``; ``params`` maps :data:`PARAM_NAMES` to tensors; ``meta`` holds the
    remaining metadata (options, precision, backend, ...: every field the format has,
    ``ValueError`` naming those missing). Tensors are copied to the CPU. Writes
    :data:`FORMAT`; returns the path written.
    """
    path = Path(path)
    missing = [n for n in PARAM_NAMES if n not in params]
    if missing:
        raise ValueError(f"params: expected the seven indexer tensors, missing {missing}")
    missing = [k for k in _CALLER_META if k not in meta]
    if missing:
        raise ValueError(f"meta: expected every metadata field of {FORMAT}, missing {missing}")
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
        "crc32": crc32_record(tensors),
    }
    return save_atomic(path, tensors, full)


def crc32_record(tensors: dict[str, torch.Tensor]) -> str:
    """The ``crc32`` metadata of a file holding ``tensors``: a JSON object, tensor name ->
    CRC-32 of its bytes (what :func:`read_checked` verifies)."""
    return json.dumps({k: _crc32(v) for k, v in tensors.items()}, sort_keys=True)


def fail(path: str | os.PathLike, what: str) -> CaptureError:
    """A :class:`CaptureError` naming the file ``path`` and ``what`` is wrong with it."""
    return CaptureError(f"{path}: {what}")


def read_checked(path: str | os.PathLike, kind: str, read: Callable[[Any], Any]) -> Any:
    """``read(fh)`` on the ``safetensors`` file ``path`` opened on the CPU (``fh``: its
    ``safe_open`` handle). A missing file (``no such <kind>``) or one safetensors cannot read
    (truncated, corrupted) is a :class:`CaptureError` naming the file; ``read`` raises its
    own :class:`CaptureError` for what it checks (the format, the tensors present)."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise fail(path, f"no such {kind}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            return read(fh)
    except CaptureError:
        raise
    except Exception as exc:  # safetensors raises its own error type (and OSError, ...)
        raise fail(path, f"cannot be read as safetensors, the file is truncated or corrupted ({exc})") from exc


def parse_crc32(path: str | os.PathLike, record: str) -> dict[str, int]:
    """The ``crc32`` metadata ``record`` (:func:`crc32_record`) as tensor name -> CRC-32, or a
    :class:`CaptureError` naming the file."""
    try:
        return {str(k): int(v) for k, v in json.loads(record).items()}
    except (ValueError, TypeError, AttributeError):
        raise fail(path, f"metadata 'crc32': expected a JSON object of integers, got {str(record)[:80]!r}") from None


def verify_crc32(path: str | os.PathLike, tensors: dict[str, torch.Tensor], crc: dict[str, int]) -> None:
    """Check every tensor's CRC-32 against ``crc`` (:func:`parse_crc32`); a
    :class:`CaptureError` naming the file and the first tensor without an entry or whose
    bytes changed."""
    for name, t in tensors.items():
        if name not in crc:
            raise fail(path, f"metadata 'crc32' has no entry for tensor {name!r}")
        got = _crc32(t)
        if got != crc[name]:
            raise fail(path, f"tensor {name!r} fails its checksum (stored crc32 {crc[name]:#010x}, computed "
                             f"{got:#010x}): the file is corrupted")  # fmt: skip


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

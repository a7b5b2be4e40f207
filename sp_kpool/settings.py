"""Process settings: the one place that reads the environment.

Every ``SP_KPOOL_*`` variable (and ``CUDA_HOME`` / ``CUDA_PATH``, ``XDG_CACHE_HOME``) is read
here, once per process (at the first call that needs
the settings), into a frozen :class:`Settings` that the operator passes down explicitly;
no other module reads ``os.environ``. Workers must be restarted to change a value, and the
ranks of one job must see the same values (the operator checks the resolved precision and
logits budget across ranks). ``python -m sp_kpool info`` prints the effective settings.

=============================  ==============================================  ===========
variable                       meaning                                          default
=============================  ==============================================  ===========
``SP_KPOOL_PRECISION``         default ``precision=`` (``bf16``,                ``bf16``
                               ``bf16-serving``, ``fp8``)
``SP_KPOOL_MAX_LOGITS_BYTES``  default ``max_logits_bytes=`` (bytes)            2 GiB on CUDA,
                                                                                256 MiB else
``SP_KPOOL_TABLE_CACHE``       ``0`` turns the table cache off                  ``1``
``SP_KPOOL_MQA_LAYOUT``        DeepGEMM logits columns: ``legacy`` or           detected
                               ``compact``
``SP_KPOOL_TILELANG_CONFIG``   TileLang scorer launch ``block_n,num_stages,     per H
                               threads[,block_q]``
``SP_KPOOL_CAPTURE_DIR``       capture the inputs of every ``KPoolIndexer``     off
                               built afterwards into this directory
``SP_KPOOL_CAPTURE_CALLS``     forward calls captured per module                ``1``
``SP_KPOOL_CHECK_FINITE``      ``1``: default ``check_finite=True`` (raise on   ``0``
                               NaN or infinity in an input tensor)
``SP_KPOOL_COMM_TIMEOUT``      seconds a rank waits for the other ranks in the  ``600``
                               agreement (and, on gloo, in every collective)
                               before it raises ``TimeoutError``
``SP_KPOOL_COMM_LOG_INTERVAL`` seconds a rank waits in the agreement before it  ``30``
                               logs which ranks have not arrived (and again
                               every as many seconds; the timeout is unchanged)
``SP_KPOOL_FUSED``             ``1``: registered fused selectors that are off   ``0``
                               by default may run (same ids bit for bit)
``SP_KPOOL_CUDA_SCORER``       ``1``: the ``deepgemm`` and ``triton`` backends  ``0``
                               score with the CUDA scorer
                               (``kernels/cuda_fp8_mqa.cu``; same bits;
                               experimental, not yet run on a GPU)
``CUDA_HOME``                  the CUDA toolkit whose ``bin/nvcc`` builds the   ``PATH``
                               CUDA scorer (else ``CUDA_PATH``, else ``nvcc``
                               on ``PATH``, else ``/usr/local/cuda``)
``SP_KPOOL_CACHE_DIR``         where built kernels are cached (else             ``~/.cache/
                               ``$XDG_CACHE_HOME/sp_kpool``)                    sp_kpool``
=============================  ==============================================  ===========

A variable that cannot be read does not make one rank raise alone: the process settings
(:func:`current_settings`) record the error (``Settings.env_error``; that variable takes
its default), and the operator raises it inside its agreement, so that every rank raises
the same ``ValueError`` (``python -m sp_kpool info`` prints it too).
:meth:`Settings.from_env` itself raises at once.

A test or script that needs another value builds ``Settings(...)`` (or
``Settings.from_env(mapping)``) and passes it (``kpool_topk(..., settings=...)``), instead
of changing the environment.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

__all__ = ["Settings", "current_settings", "PRECISIONS", "ENV"]

#: Arithmetic modes (``precision=``); see :mod:`sp_kpool.precision`.
PRECISIONS = ("bf16", "bf16-serving", "fp8")
MQA_LAYOUTS = ("legacy", "compact")

#: setting name -> environment variable
ENV = {
    "precision": "SP_KPOOL_PRECISION",
    "max_logits_bytes": "SP_KPOOL_MAX_LOGITS_BYTES",
    "table_cache": "SP_KPOOL_TABLE_CACHE",
    "mqa_layout": "SP_KPOOL_MQA_LAYOUT",
    "tilelang_config": "SP_KPOOL_TILELANG_CONFIG",
    "capture_dir": "SP_KPOOL_CAPTURE_DIR",
    "capture_calls": "SP_KPOOL_CAPTURE_CALLS",
    "check_finite": "SP_KPOOL_CHECK_FINITE",
    "comm_timeout": "SP_KPOOL_COMM_TIMEOUT",
    "fused": "SP_KPOOL_FUSED",
    "comm_log_interval": "SP_KPOOL_COMM_LOG_INTERVAL",
    "cuda_scorer": "SP_KPOOL_CUDA_SCORER",
    "cuda_home": "CUDA_HOME",
    "cache_dir": "SP_KPOOL_CACHE_DIR",
}

#: setting name -> (the variable read when its own is unset, how its text becomes the value)
FALLBACK_ENV = {
    "cuda_home": ("CUDA_PATH", lambda raw: raw),
    "cache_dir": ("XDG_CACHE_HOME", lambda raw: os.path.join(raw, "sp_kpool")),
}

#: Seconds a rank waits in the agreement (the first collective of every call) for the
#: other ranks: long enough for ranks that reach the call minutes apart (a first call
#: that compiles kernels), short enough that a rank that died or never calls does not
#: hold the others for the process group's timeout (30 minutes by default with NCCL).
DEFAULT_COMM_TIMEOUT = 600.0

#: Seconds a rank waits in the agreement before it logs which ranks have not arrived, and
#: then the period of that log (a wait that explains itself; the timeout is unchanged).
DEFAULT_COMM_LOG_INTERVAL = 30.0

#: Logits budget without ``SP_KPOOL_MAX_LOGITS_BYTES``: 2 GiB on CUDA devices (fewer,
#: larger chunks; each chunk costs host work) and 256 MiB elsewhere. Ranks on the same
#: kind of device get the same default, so results stay bitwise equal across world sizes.
DEFAULT_MAX_LOGITS_BYTES = 256 * 2**20
DEFAULT_MAX_LOGITS_BYTES_CUDA = 2 * 2**30


@dataclass(frozen=True)
class Settings:
    """The effective process settings (see the module docstring for each field).

    precision: default arithmetic, one of :data:`PRECISIONS`.
    max_logits_bytes: default logits budget in bytes, or ``None`` for the per-device default.
    table_cache: whether the pipeline reuses its tables between calls on one sequence.
    mqa_layout: DeepGEMM column layout (``None``: the first one the installed build has).
    tilelang_config: TileLang scorer launch ``(block_n, num_stages, threads[, block_q])``
        or ``None`` (the per-H default).
    capture_dir: capture directory for new ``KPoolIndexer`` modules, or ``None``.
    capture_calls: calls captured per module.
    check_finite: default of the operator's ``check_finite=`` (raise on non-finite inputs).
    comm_timeout: seconds the agreement (and on gloo every collective) waits for the other
        ranks (``> 0``).
    fused: whether registered fused selectors that are off by default (not yet measured
        faster than scoring, then selecting) may run (``SP_KPOOL_FUSED=1``); their ids are
        the same bit for bit either way.
    comm_log_interval: seconds a rank waits in the agreement before it logs (logger
        ``sp_kpool``, a warning) which ranks have not arrived, then again every as many
        seconds until the agreement completes or times out (``> 0``).
    cuda_scorer: whether the ``deepgemm`` (FP8) and ``triton`` (BF16) backends score their
        dense chunks with :mod:`sp_kpool.kernels.cuda_fp8_mqa` instead of DeepGEMM / the
        Triton kernel (``SP_KPOOL_CUDA_SCORER=1``): the same arithmetic, so the same bits
        and ids; experimental (written without a GPU; see that module).
    cuda_home: the CUDA toolkit whose ``bin/nvcc`` builds the CUDA scorer (``CUDA_HOME``,
        else ``CUDA_PATH``), or ``None``: ``nvcc`` on ``PATH``, else ``/usr/local/cuda``.
    cache_dir: the folder of built kernels (``SP_KPOOL_CACHE_DIR``, else
        ``$XDG_CACHE_HOME/sp_kpool``), or ``None``: ``~/.cache/sp_kpool``
        (:meth:`cache_path` resolves it).
    env_error: the error of a variable that :func:`current_settings` could not read
        (raised by the operator inside its agreement, on every rank alike), or ``None``.
    """

    precision: str = "bf16"
    max_logits_bytes: int | None = None
    table_cache: bool = True
    mqa_layout: str | None = None
    tilelang_config: tuple[int, ...] | None = None
    capture_dir: str | None = None
    capture_calls: int = 1
    check_finite: bool = False
    comm_timeout: float = DEFAULT_COMM_TIMEOUT
    fused: bool = False
    comm_log_interval: float = DEFAULT_COMM_LOG_INTERVAL
    cuda_scorer: bool = False
    cuda_home: str | None = None
    cache_dir: str | None = None
    env_error: str | None = None

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"{ENV['precision']}: expected one of {list(PRECISIONS)}, got {self.precision!r}")
        mlb = self.max_logits_bytes
        if mlb is not None and (isinstance(mlb, bool) or not isinstance(mlb, int) or mlb < 1):
            raise ValueError(f"{ENV['max_logits_bytes']}: expected a positive integer number of bytes, got {mlb!r}")
        if self.mqa_layout is not None and self.mqa_layout not in MQA_LAYOUTS:
            raise ValueError(f"{ENV['mqa_layout']}: expected 'legacy' or 'compact', got {self.mqa_layout!r}")
        tc = self.tilelang_config
        if tc is not None and (len(tc) not in (3, 4) or not all(isinstance(v, int) and v > 0 for v in tc)):
            raise ValueError(f"{ENV['tilelang_config']}: expected 'block_n,num_stages,threads[,block_q]', got {tc!r}")
        calls = self.capture_calls
        if isinstance(calls, bool) or not isinstance(calls, int) or calls < 0:
            raise ValueError(f"{ENV['capture_calls']}: expected a non-negative integer, got {calls!r}")
        if not isinstance(self.check_finite, bool):
            raise ValueError(f"{ENV['check_finite']}: expected 0 or 1, got {self.check_finite!r}")
        if not isinstance(self.fused, bool):
            raise ValueError(f"{ENV['fused']}: expected 0 or 1, got {self.fused!r}")
        if not isinstance(self.cuda_scorer, bool):
            raise ValueError(f"{ENV['cuda_scorer']}: expected 0 or 1, got {self.cuda_scorer!r}")
        t = self.comm_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"{ENV['comm_timeout']}: expected a positive number of seconds, got {t!r}")
        t = self.comm_log_interval
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"{ENV['comm_log_interval']}: expected a positive number of seconds, got {t!r}")
        # the fields as text, one repr a line: how the custom operator takes them (sp_kpool.op)
        object.__setattr__(self, "op_text", "\n".join(repr(getattr(self, f.name)) for f in dataclasses.fields(self)))

    def check(self) -> None:
        """Raise ``ValueError`` with :attr:`env_error` if a variable could not be read."""
        if self.env_error is not None:
            raise ValueError(self.env_error)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, strict: bool = True) -> "Settings":
        """Settings from ``environ`` (default ``os.environ``); unset or blank variables take
        the defaults. A bad value raises ``ValueError`` naming the variable, the expected
        and the actual value; with ``strict=False`` that variable takes its default and the
        errors are kept in :attr:`env_error` instead (joined by ``; ``)."""
        env = os.environ if environ is None else environ
        values, errors = {}, []
        for name, parse in _PARSERS.items():
            raw = env.get(ENV[name], "").strip()
            if not raw and name in FALLBACK_ENV:
                var, derive = FALLBACK_ENV[name]
                fallback = env.get(var, "").strip()
                if fallback:
                    values[name] = derive(fallback)
                continue
            if not raw:
                continue
            try:
                value = parse(ENV[name], raw)
                cls(**{name: value})  # the field's own validation
            except ValueError as exc:
                if strict:
                    raise
                errors.append(str(exc))
                continue
            values[name] = value
        if errors:
            values["env_error"] = "; ".join(errors)
        return cls(**values)

    def replace(self, **changes) -> "Settings":
        """A copy with ``changes`` (validated)."""
        return dataclasses.replace(self, **changes)

    def logits_budget(self, device) -> int:
        """The default logits budget on ``device``: ``max_logits_bytes`` if set, else 2 GiB
        on CUDA devices and 256 MiB elsewhere."""
        if self.max_logits_bytes is not None:
            return self.max_logits_bytes
        is_cuda = device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda"
        return DEFAULT_MAX_LOGITS_BYTES_CUDA if is_cuda else DEFAULT_MAX_LOGITS_BYTES

    def cache_path(self) -> Path:
        """The folder of built kernels: :attr:`cache_dir`, else ``~/.cache/sp_kpool``."""
        return Path(self.cache_dir) if self.cache_dir is not None else Path.home() / ".cache" / "sp_kpool"

    def describe(self) -> list[tuple[str, str, str]]:
        """``(variable, effective value, source)`` rows for ``python -m sp_kpool info``. A
        variable that could not be read (:attr:`env_error`) shows ``invalid`` and its error
        (the operator raises it on every call), not the default that stands in for it."""
        invalid = {part.split(": ", 1)[0]: part.split(": ", 1)[-1] for part in (self.env_error or "").split("; ") if part}
        rows = []
        for name, var in ENV.items():
            if var in invalid:
                rows.append((var, "invalid", f"{invalid[var]} (every operator call raises this)"))
                continue
            value = getattr(self, name)
            shown = _show(value)
            if name == "max_logits_bytes" and value is None:
                shown = f"{DEFAULT_MAX_LOGITS_BYTES_CUDA} on CUDA, {DEFAULT_MAX_LOGITS_BYTES} elsewhere"
            elif name == "cache_dir" and value is None:
                shown = str(self.cache_path())
            elif name == "cuda_home" and value is None:
                shown = "- (nvcc on PATH, else /usr/local/cuda)"
            rows.append((var, shown, "default" if value == getattr(Settings, name) else "set"))
        return rows


def _integer(minimum: int, expected: str):
    def parse(var: str, raw: str) -> int:
        try:
            number = int(raw)
        except ValueError:
            raise ValueError(f"{var}: expected {expected}, got {raw!r}") from None
        if number < minimum:
            raise ValueError(f"{var}: expected {expected}, got {number}")
        return number

    return parse


def _flag(var: str, raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError(f"{var}: expected 0 or 1, got {raw!r}")
    return raw == "1"


def _tilelang(var: str, raw: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in raw.split(","))
    except ValueError:
        raise ValueError(f"{var}: expected 'block_n,num_stages,threads[,block_q]', got {raw!r}") from None


def _seconds(var: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{var}: expected a positive number of seconds, got {raw!r}") from None


def _text(var: str, raw: str) -> str:
    return raw


#: setting name -> parser of its variable's (stripped, non-empty) text
_PARSERS = {
    "precision": _text,
    "max_logits_bytes": _integer(1, "a positive integer number of bytes"),
    "table_cache": _flag,
    "mqa_layout": _text,
    "tilelang_config": _tilelang,
    "capture_dir": _text,
    "capture_calls": _integer(0, "a non-negative integer"),
    "check_finite": _flag,
    "comm_timeout": _seconds,
    "fused": _flag,
    "comm_log_interval": _seconds,
    "cuda_scorer": _flag,
    "cuda_home": _text,
    "cache_dir": _text,
}


def _show(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


_CURRENT: list[Settings] = []  # the cached process settings (empty until the first call)


def current_settings() -> Settings:
    """The process settings, read from the environment at the first call, then cached
    (``current_settings.cache_clear()`` forgets them). A variable that cannot be read takes
    its default and its error is kept in ``env_error`` (raised by the operator inside its
    agreement: every rank alike). A plain cache rather than ``functools.lru_cache``, which
    ``torch.compile`` traces through with a warning."""
    if not _CURRENT:
        _CURRENT.append(Settings.from_env(strict=False))
    return _CURRENT[0]


current_settings.cache_clear = _CURRENT.clear  # type: ignore[attr-defined]

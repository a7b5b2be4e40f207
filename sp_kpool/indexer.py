"""``KPoolIndexer``: the GLM-5.3 KPool lightning indexer as an ``nn.Module`` (frozen, or
trainable with its KL loss: ``trainable=True``, :meth:`KPoolIndexer.kl_loss`).

Parameter names match the checkpoint (``...self_attn.indexer.*``) and the state dict of
``transformers``' ``Glm5NextTextIndexer``, so ``load_state_dict(strict=True)`` works:

==============================  =====================  ===================================
``wq_b.weight``                 ``[H*D, q_lora_rank]``  index queries ``q = wq_b(q_resid)``
``wk.weight``                   ``[D, hidden]``         index keys before the norm
``k_norm.weight``, ``.bias``    ``[D]``                 LayerNorm on keys, eps ``1e-6``
``weights_proj.weight``         ``[H, hidden]``         per-head gate
``index_kpool_compress_gate``   ``[D, hidden]``         per-channel pool gate
``index_kpool_compress_ape``    ``[K, D]``              per-slot, per-channel bias
==============================  =====================  ===================================
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import capture as _capture_mod
from . import op as _op
from . import pipeline
from .checks import check_choice, check_int
from .config import KPoolConfig, RunOptions
from .precision import SERVING_PRECISIONS, resolve_precision
from .settings import Settings, current_settings
from .sharding import ShardedSequence

__all__ = ["KPoolIndexer"]


def _autocast_on(device: torch.device) -> bool:
    try:
        return torch.is_autocast_enabled(device.type)
    except (RuntimeError, TypeError):  # a device type without autocast
        return False


class KPoolIndexer(nn.Module):
    """Frozen KPool indexer (forward only) that runs :func:`sp_kpool.kpool_topk`.

    Args:
        hidden_size, q_lora_rank, index_n_heads (``H``), index_head_dim (``D``),
        index_topk (``T``), index_kpool (``K``): as in the model config.
        precision: ``"bf16"``, ``"bf16-serving"`` or ``"fp8"`` (default: the settings'
            precision, ``$SP_KPOOL_PRECISION``); it decides both the preparation (key norm
            and head gate in FP32 with autocast off in the serving modes) and the selection
            arithmetic, from one resolution per call.
        tail, order, alignment, max_logits_bytes: the rest of the call's
            :class:`~sp_kpool.config.KPoolConfig` (see ``kpool_topk``).
        backend, gather, balance, balance_block, balance_row_cost, check_finite: its
            :class:`~sp_kpool.config.RunOptions` (none changes an output bit).
        device, dtype: of the parameters; ``weights_proj.weight`` and ``k_norm`` are stored
            in FP32 whatever ``dtype`` (as serving builds them; ``module.to(dtype)`` keeps
            them FP32), and ``bf16`` computes with them in the module dtype.
        mode: ``"compute"`` (default): compute the selection; ``"replay"``: return the
            rollout's selection passed per call (``forward(..., replay=captured)``, see
            :func:`sp_kpool.replay.shard`) instead of computing it; ``"verify"``: compute
            both, return the replayed one and record their comparison
            (:func:`sp_kpool.replay.compare`) in ``last_comparison``.
        replay_ids, replay_missing: ``ids=`` and ``missing=`` of :func:`sp_kpool.replay.shard`
            (``"tokens"``, ``"compute"``: rows the capture does not cover are computed,
            only they: ``kpool_topk(rows=)``).
        trainable: ``False`` (default): a frozen indexer, every parameter
            ``requires_grad=False``. ``True``: the parameters train; :meth:`forward` keeps
            (detached) what the loss needs, and :meth:`kl_loss`, called after the attention
            has run, returns the indexer's KL loss (:func:`sp_kpool.indexer_kl_loss`) with
            gradients to the parameters only (the inputs detached, as Megatron, MaxText and
            XTuner do). The selection keeps the module's precision and mode (the sparse
            stage's ids may come from any precision or from ``replay``); the loss's student
            is the ``bf16`` model arithmetic.
        verify_rows, verify_seed: ``mode="verify"``: compute and compare only a sample of
            ``verify_rows`` of each rank's rows (default ``1.0``: all), drawn from
            ``verify_seed`` (the same on every rank; the attribute may be set per step).
        capture_dir: record the inputs of the first forward call(s) to ``safetensors`` files
            in this directory, one per rank (default ``settings.capture_dir``,
            ``$SP_KPOOL_CAPTURE_DIR``; unset: no capture), created and checked for writing
            here. See :mod:`sp_kpool.capture`; replay with ``python -m sp_kpool parity``.
        settings: the process settings (default: read once from the environment).

    Attributes ``config`` (:class:`~sp_kpool.config.KPoolConfig`) and ``options``
    (:class:`~sp_kpool.config.RunOptions`) hold the call settings, validated here: every
    option raises ``ValueError``/``TypeError`` at construction, naming it.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        q_lora_rank: int,
        index_n_heads: int,
        index_head_dim: int,
        index_topk: int,
        index_kpool: int = 4,
        backend: str = "torch",
        tail: str = "fixed",
        order: str = "ascending",
        alignment: int = 1,
        max_logits_bytes: int | None = None,
        precision: str | None = None,
        gather: str = "keys",
        balance: str = "none",
        balance_block: int | None = None,
        balance_row_cost: int | None = None,
        check_finite: bool | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        capture_dir: str | None = None,
        settings: Settings | None = None,
        mode: str = "compute",
        replay_ids: str = "tokens",
        replay_missing: str = "compute",
        verify_rows: float = 1.0,
        verify_seed: int = 0,
        trainable: bool = False,
    ) -> None:
        super().__init__()
        hidden_size, q_lora_rank, index_n_heads, index_head_dim, index_topk, index_kpool = (
            check_int(name, v, 1) for name, v in (
                ("hidden_size", hidden_size),
                ("q_lora_rank", q_lora_rank),
                ("index_n_heads", index_n_heads),
                ("index_head_dim", index_head_dim),
                ("index_topk", index_topk),
                ("index_kpool", index_kpool),
            )
        )  # fmt: skip
        if index_topk % index_kpool:
            raise ValueError(f"index_topk: expected a multiple of index_kpool = {index_kpool}, got {index_topk}")
        if settings is not None and not isinstance(settings, Settings):
            raise TypeError(f"settings: expected a Settings, got {type(settings).__name__}")
        self.settings = settings if settings is not None else current_settings()
        # every option is validated here, by the records (a bad backend, tail, ... fails now,
        # not at the first forward call)
        self.config = KPoolConfig(topk=index_topk, kpool=index_kpool, tail=tail, order=order, alignment=alignment,
                                  precision=precision, max_logits_bytes=max_logits_bytes)  # fmt: skip
        self.options = RunOptions(backend=backend, gather=gather, balance=balance, balance_block=balance_block,
                                  balance_row_cost=balance_row_cost, check_finite=check_finite)  # fmt: skip
        fk = {"device": device, "dtype": dtype}
        self.hidden_size = hidden_size
        self.n_heads = index_n_heads
        self.head_dim = index_head_dim
        self.wq_b = nn.Linear(q_lora_rank, index_n_heads * index_head_dim, bias=False, **fk)
        self.wk = nn.Linear(hidden_size, index_head_dim, bias=False, **fk)
        # the key norm and the head gate are stored in FP32 whatever ``dtype``, as serving
        # builds them (a BF16 checkpoint loads exactly; see _apply)
        fp32 = {"device": device, "dtype": torch.float32}
        self.k_norm = nn.LayerNorm(index_head_dim, eps=1e-6, **fp32)
        self.weights_proj = nn.Linear(hidden_size, index_n_heads, bias=False, **fp32)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(index_kpool, index_head_dim, **fk))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(index_head_dim, hidden_size, **fk))
        if not isinstance(trainable, bool):
            raise TypeError(f"trainable: expected a bool, got {type(trainable).__name__}")
        self.trainable = trainable
        self.requires_grad_(trainable)
        #: ``trainable=True``: ``(hidden, q_resid, seq, ids)`` of the last forward (detached)
        self._last: tuple | None = None
        self._capture = _capture_mod.hook_for(capture_dir, self.settings)  # None: no capture, no cost
        from . import replay as _replay

        self.mode = check_choice("mode", mode, self.MODES)
        self.replay_ids = check_choice("replay_ids", replay_ids, _replay.IDS)
        self.replay_missing = check_choice("replay_missing", replay_missing, _replay.MISSING)
        #: ``mode="verify"``: the last call's :func:`sp_kpool.replay.compare` report (of the
        #: sample only, with ``verify_rows`` and ``verify_seed``)
        self.last_comparison: dict | None = None
        #: ``mode="verify"``: the fraction of each rank's rows computed and compared (``1.0``:
        #: every row), and the sample's seed, the same on every rank; set it per step (e.g. to
        #: the step) so each step samples other rows (:func:`sp_kpool.replay.sample_rows`)
        self.verify_rows = float(verify_rows)
        self.verify_seed = int(verify_seed)
        if not 0.0 <= self.verify_rows <= 1.0:
            raise ValueError(f"verify_rows: expected a fraction in [0, 1], got {verify_rows!r}")

    #: ``mode=``: compute the selection, replay the rollout's, or both (returning the replayed one)
    MODES = ("compute", "replay", "verify")

    #: Parameters kept in FP32 by ``module.to(dtype)`` / ``.half()`` / ``.bfloat16()`` (device
    #: moves still apply): serving's head gate and key norm weights.
    FP32_PARAMETERS = ("weights_proj.weight", "k_norm.weight", "k_norm.bias")

    def _apply(self, fn, recurse=True):
        kept = {name: self.get_parameter(name).data for name in self.FP32_PARAMETERS}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            p = self.get_parameter(name)
            if p.dtype != torch.float32:  # a dtype conversion: keep the FP32 values, take the move
                p.data = old.to(device=p.device, dtype=torch.float32)
        return self

    @property
    def precision(self) -> str | None:
        """The configured precision (``None``: the settings' default)."""
        return self.config.precision

    @property
    def index_topk(self) -> int:
        return self.config.topk

    @property
    def index_kpool(self) -> int:
        return self.config.kpool

    @torch.no_grad()
    def prepare(
        self, hidden: torch.Tensor, q_resid: torch.Tensor, precision: str | None = None
    ) -> dict[str, torch.Tensor]:
        """Projections of the local rows, as ``kpool_topk`` takes them (no gradients; see
        :meth:`project`)."""
        return self.project(hidden, q_resid, precision)

    def project(
        self, hidden: torch.Tensor, q_resid: torch.Tensor, precision: str | None = None
    ) -> dict[str, torch.Tensor]:
        """Projections of the local rows, as ``kpool_topk`` takes them (differentiable in the
        parameters where grad mode is on: what :meth:`kl_loss` uses).

        Args:
            hidden: ``[S_local, hidden_size]``; q_resid: ``[S_local, q_lora_rank]``.
            precision: as in the constructor (default: the module's). In the serving modes
                the key LayerNorm and the head-gate projection run in FP32 with autocast
                disabled, as serving does: the keys are cast back to the key dtype, the head
                gate **stays FP32** (it goes unrounded into the query weights). In ``bf16``
                both run in the module dtype, as ``transformers``' indexer does.

        Returns a dict with ``q [S_local, H, D]``, ``k [S_local, D]``, ``gates
        [S_local, D]`` and ``ape [K, D]`` in the module dtype, and ``head_weights
        [S_local, H]``: float32 in the serving modes, the module dtype in ``bf16``.
        """
        for name, x, param in (("hidden", hidden, self.wk.weight), ("q_resid", q_resid, self.wq_b.weight)):
            width = param.shape[1]
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 2 or x.shape[1] != width:
                raise ValueError(f"{name}: expected shape [S_local, {width}], got {list(x.shape)}")
            if x.device != param.device:
                raise ValueError(f"{name}: expected device {param.device} (the parameters' device), got {x.device}")
            if x.dtype != param.dtype and not _autocast_on(x.device):
                raise ValueError(f"{name}: expected dtype {param.dtype} (the parameters' dtype; or run under "
                                 f"autocast), got {x.dtype}")  # fmt: skip
        if hidden.shape[0] != q_resid.shape[0]:
            raise ValueError(
                f"q_resid: expected {hidden.shape[0]} rows (as hidden), got {q_resid.shape[0]}"
            )
        precision = resolve_precision(self.precision if precision is None else precision, self.settings)
        q = self.wq_b(q_resid).view(q_resid.shape[0], self.n_heads, self.head_dim)
        gates = F.linear(hidden, self.index_kpool_compress_gate)
        n = self.k_norm
        if precision in SERVING_PRECISIONS:
            with torch.autocast(hidden.device.type, enabled=False):
                kx = self.wk(hidden)
                k = F.layer_norm(kx.float(), n.normalized_shape, n.weight.float(), n.bias.float(), n.eps).to(kx.dtype)
                w = F.linear(hidden.float(), self.weights_proj.weight.float())  # FP32, not rounded back
        else:  # the model definition: the module dtype (the FP32-stored weights hold its values)
            kx = self.wk(hidden)
            dt = self.wk.weight.dtype
            k = F.layer_norm(kx, n.normalized_shape, n.weight.to(dt), n.bias.to(dt), n.eps)
            if k.dtype != q.dtype:  # under autocast the norm runs in FP32: score in FP32, as before the
                q = q.to(k.dtype)  # rule that q and k share a dtype (BF16 queries upcast exactly)
            w = F.linear(hidden.to(dt), self.weights_proj.weight.to(dt))
        return {"q": q, "k": k, "gates": gates, "head_weights": w, "ape": self.index_kpool_compress_ape}

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, q_resid: torch.Tensor, seq: ShardedSequence, replay=None) -> torch.Tensor:
        """Selected global token ids ``[S_local, align(T + K - 1, alignment)]`` int32, ``-1`` unused.

        ``hidden`` ``[S_local, hidden_size]`` and ``q_resid`` ``[S_local, q_lora_rank]`` are
        this rank's rows of the packed sequence described by ``seq``. Bad input on any rank
        (here or in ``kpool_topk``) makes every rank raise the same error, before any data
        moves. ``replay``: this layer's rollout selection (``mode="replay"`` or ``"verify"``;
        one ``[T_d, W_d]`` array per real document, :func:`sp_kpool.replay.shard`). Under
        ``torch.compile`` (``mode="compute"``) the projections are traced and the selection
        is one opaque custom operator (:mod:`sp_kpool.op`); a capture (``capture_dir``)
        records eager calls only; the replay modes are eager only.
        """
        if self.mode == "compute" and replay is not None:
            pipeline.fail_on_every_rank(seq, TypeError("replay: given, but the module's mode is 'compute' (set "
                                                       "mode='replay' or 'verify')"), self.settings)  # fmt: skip
        if self.mode != "compute":
            ids = self._replayed(hidden, q_resid, seq, replay)
        else:
            ids = self._computed(hidden, q_resid, seq)
        if self.trainable:
            self._last = (hidden.detach(), q_resid.detach(), seq, ids)
        return ids

    def kl_loss(self, teacher, *, selection=None, coeff: float = 1.0, normalize: str = "global_rows",
                determinism: str = "ordered") -> torch.Tensor:  # fmt: skip
        """The indexer's KL loss against the attention for the last :meth:`forward` call
        (``trainable=True``; call it after the attention has run, every rank alike).

        ``teacher``: :class:`sp_kpool.TokenMass` (column-aligned with the ids the forward
        returned) or :class:`sp_kpool.AttentionTeacher`. ``selection``: ``None`` (the sparse
        stage: the forward's ids), ``"dense"`` (the warm-up: every visible pool), or other
        ids of the same shape. ``coeff``, ``normalize``, ``determinism``: as
        :func:`sp_kpool.indexer_kl_loss`. The projections are recomputed from the forward's
        detached inputs in the ``bf16`` model arithmetic, with gradients to the parameters
        only, with the module's ``gather`` and ``balance``. Returns this rank's share (``[]``, FP32, float64 for a float64
        module).

        Under ``torch.compile`` the loss is a graph break (it runs eagerly: its collectives
        and host tables are not traced); the forward before it compiles as before.
        """
        return _kl_loss(self, teacher, selection, coeff, normalize, determinism)

    def _computed(self, hidden: torch.Tensor, q_resid: torch.Tensor, seq: ShardedSequence,
                  rows: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if _op.is_traced():  # torch.compile: the projections, then one opaque custom operator (sp_kpool.op)
            config = self.config.replace(precision=resolve_precision(self.precision, self.settings))
            prepared = self.prepare(hidden, q_resid, config.precision)
            return _op.kpool_topk_traced(**prepared, seq=seq, config=config, options=self.options,
                                         settings=self.settings)  # fmt: skip
        try:
            config = self.config.replace(precision=resolve_precision(self.precision, self.settings))  # one resolution
            prepared = self.prepare(hidden, q_resid, config.precision)
        except Exception as exc:  # noqa: BLE001 - the other ranks wait in their agreement: tell them
            pipeline.fail_on_every_rank(seq, exc, self.settings)
        ids = pipeline.run(**prepared, seq=seq, config=config, options=self.options, settings=self.settings, rows=rows)
        if self._capture is not None:  # after the result: capturing never changes it
            self._capture(self, hidden, q_resid, seq, config, prepared, ids)
        return ids

    def _replayed(self, hidden: torch.Tensor, q_resid: torch.Tensor, seq: ShardedSequence, captured) -> torch.Tensor:
        """``mode="replay"``/``"verify"``: the replayed ids (rows not covered as ``replay_missing``
        says; the projections run only when a row must be computed)."""
        from . import replay as _replay

        def inputs():
            return self.prepare(hidden, q_resid, resolve_precision(self.precision, self.settings))

        ids = _replay.shard(captured, seq, self.config, ids=self.replay_ids, missing=self.replay_missing,
                            inputs=inputs, options=self.options, settings=self.settings,
                            device=hidden.device if isinstance(hidden, torch.Tensor) else None)  # fmt: skip
        if self.mode == "verify":
            sample = _replay.sample_rows(seq, self.verify_rows, self.verify_seed)
            computed = self._computed(hidden, q_resid, seq, None if self.verify_rows >= 1.0 else sample)
            report = _replay.compare(ids, computed, seq, settings=self.settings, rows=sample)
            report["verify_rows"], report["verify_seed"] = self.verify_rows, self.verify_seed
            self.last_comparison = report
        return ids


@torch.compiler.disable
def _kl_loss(module: KPoolIndexer, teacher, selection, coeff, normalize, determinism) -> torch.Tensor:
    from .training import indexer_kl_loss

    if not module.trainable:
        raise RuntimeError("kl_loss: the indexer was built with trainable=False (frozen); build it with "
                           "trainable=True to train it")  # fmt: skip
    if module._last is None:
        raise RuntimeError("kl_loss: no forward call to take the loss of (call the indexer's forward first, "
                           "eagerly, on this step's inputs)")  # fmt: skip
    hidden, q_resid, seq, ids = module._last
    with torch.enable_grad():
        prepared = module.project(hidden, q_resid, "bf16")
    config = module.config.replace(precision="bf16")
    return indexer_kl_loss(**prepared, seq=seq, teacher=teacher, selection=ids if selection is None else selection,
                           coeff=coeff, normalize=normalize, determinism=determinism, config=config,
                           options=module.options, settings=module.settings)  # fmt: skip

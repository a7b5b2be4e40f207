"""Exact, deterministic Top-K selection on the GPU (Triton): the launcher
:func:`topk_ascending` (with :func:`supports` and :data:`MAX_K`) of the kernels
``select_kernel`` and ``short_kernel`` (rows that all see at most ``k`` columns), which are
in :mod:`sp_kpool.kernels.triton_topk_kernels` with how they select (steps 0-4); the search
and count helpers are in :mod:`sp_kpool.kernels.triton_topk_search`.

:func:`topk_ascending` selects, in every row of an FP32 score matrix, the ``k`` best
visible columns by the rule of :func:`sp_kpool.selection.topk_pools` (higher score first,
ties toward the lower column, ``-0.0`` equal to ``+0.0``) and writes them in **ascending
column order**, ``-1`` after. No host synchronisation, no per-row fix-up pass.

Imports Triton: import this module only where Triton is available.
"""

from __future__ import annotations

import functools

import torch

from .triton_topk_kernels import select_kernel, short_kernel

__all__ = ["topk_ascending", "supports", "MAX_K"]

#: Register cap (``maxnreg``) of launches of up to 8 warps: 3 programs of 8 warps per SM
#: instead of 1 (the compiler's choice, ~190 registers); the fastest of the caps timed on an
#: H200.
_DEFAULT_MAXNREG = 80

#: Largest ``k`` handled by :func:`topk_ascending` (checked on an H200 up to 2048; larger ``k``
#: selects with the other CUDA paths of :func:`sp_kpool.selection.select_pools`).
MAX_K = 2048
_MAX_GROUPS = 8192

#: Default of ``topk_ascending(vsteps=)``: phase 2's first steps split in value.
_DEFAULT_VSTEPS = 3

#: Defaults of ``topk_ascending(split2=, split4=)``: where the first step of phase 2's /
#: phase 4's search splits the values (``()``: evenly / in key).
_DEFAULT_SPLIT2 = (0.45, 0.6)
_DEFAULT_SPLIT4 = (0.006, 0.022)


#: Largest block of candidate cells (candidate groups x columns per group): the largest run
#: on an H200 (k 2048, groups of 16, 70000 columns). Larger blocks spill registers (Triton caps any block at
#: 2**20 elements); such shapes select with the other paths of ``select_pools``.
_MAX_BLOCK = 32768


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _sizes(W: int, k: int, tile: int, capg: int | None, group: int | None = None):
    """``(tile, group, ng, capg)`` of a launch for rows of width ``W``.

    ``group`` (default): 4 for ``k > 512`` in rows of at most 32768 columns, else the
    smallest power of two ``>= 8`` that makes at most 8192 groups (wider rows get wider
    groups); a given ``group`` is taken as it is (the launcher checks it). ``capg``
    (default): ``pow2(k)``; the candidate block is ``capg * group`` cells.

    Phase 2 ranks ``W / group`` group maxima and phase 4 ``capg * group`` cells, so the
    cheapest group shrinks as ``k`` grows. On an H200 (W's DeepGEMM logits, 32768 rows of
    24.6K-32.8K columns, random and recency-biased scores; also 7 and 1000 exact score
    levels), groups of 4 instead of 8: ``k`` 2048 5.1 instead of 7.3 ms, ``k`` 1024 4.0
    instead of 4.2 (both at 8 warps), ``k`` 512 3.6 instead of 2.4 (slower: kept at 8)."""
    tile = min(_pow2(tile), _pow2(max(W + 8, 16)))
    if group is None:
        if _pow2(k) > 512 and W <= 4 * _MAX_GROUPS:
            group = 4
        else:
            group = max(8, min(tile // 8, _pow2(-(-max(W, 1) // _MAX_GROUPS))))
    # groups are aligned to multiples of `group` columns: a row [a, e) within W columns
    # touches at most cdiv(W, group) of them; phase 2 holds them as [ng / gl, gl]
    ng = max(_pow2(-(-max(W, 1) // group)), group, 8)
    return tile, group, ng, _pow2(capg or _pow2(k))


def _default_warps(W: int, k: int, group: int | None = None) -> int:
    """Warps per program from the candidate block of ``capg * group`` cells: 16 cells per
    thread up to 4096 cells (4 to 8 warps), 8 warps for 8192 cells (32 per thread, under
    the 80-register cap: on an H200 ``k`` 2048 in groups of 4 took 5.1 ms at 8 warps, 6.2 at
    16; ``k`` 1024 in groups of 8 4.2 and 5.0 ms), 16 warps above."""
    _, group, _, capg = _sizes(W, k, 4096, None, group)
    cells = capg * group
    return min(8, max(4, cells // 512)) if cells <= 8192 else 16


@functools.lru_cache(maxsize=256)
def supports(width: int, k: int) -> bool:
    """Whether :func:`topk_ascending` handles rows of ``width`` columns and this ``k`` (at
    the default launch): ``1 <= k <= MAX_K`` and ``capg`` (the power of two ``>= k``)
    candidate groups of ``G`` columns within a block of 32768 cells, and at most 8192 groups
    per row (``k`` 512: up to 524288 columns; ``k`` 2048: up to 131072). Checked on an H200
    up to 70000 columns."""
    if not 1 <= k <= MAX_K:
        return False
    _, group, ng, capg = _sizes(width, k, 512 * _default_warps(width, k), None)
    return capg * group <= _MAX_BLOCK and ng <= _MAX_GROUPS




#: What the last :func:`topk_ascending` launch used (registers, spills, programs per SM,
#: constants), for the benchmarks.
last_launch: dict = {}
_occupancy: dict = {}


def _resident(kernel, num_warps: int, smem_per_sm: int = 233472) -> int:
    """Programs of ``kernel`` one SM holds at once, by registers, warps and shared memory
    (``smem_per_sm`` bytes; each program also reserves 1 KiB)."""
    try:
        kernel._init_handles()
        regs = max(int(kernel.n_regs), 1)
        smem = int(getattr(kernel.metadata, "shared", 0) or 0)
    except Exception:  # noqa: BLE001 - the interpreter or an older Triton: no register count
        return 1
    threads = 32 * num_warps
    by_regs = 65536 // (-(-regs // 8) * 8 * threads)  # registers are allocated per warp in 256s
    by_smem = smem_per_sm // (smem + 1024)
    return max(1, min(by_regs, by_smem, 2048 // threads, 32))


def topk_ascending(
    scores: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    base: torch.Tensor,
    k: int,
    *,
    tile: int | None = None,
    num_warps: int | None = None,
    programs: int | None = None,
    capg: int | None = None,
    ways: int = 3,
    maxnreg: int | None = None,
    vsteps: int | None = None,
    split2: tuple[float, float] | None = None,
    split4: tuple[float, float] | None = None,
    short_rows: bool | str = True,
    group: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The exact Top-K of each row, in ascending column order.

    Args:
        scores: ``[R, W]`` float32 (unit column stride); cells outside ``[starts[r],
            ends[r])`` are ignored, ``-inf`` cells are invisible.
        starts, ends: ``[R]`` integer, the columns ``[start, end)`` of each row to consider
            (clipped to ``[0, W)``).
        base: ``[R]`` int64, global pool id of column 0 of each row.
        k: pools to select (``1 <= k <= MAX_K``).
        tile, num_warps, programs: launch configuration (columns per step, warps per
            program, programs of the persistent grid). Defaults: ``num_warps`` so that the
            candidate block is 16 cells per thread (4 to 16), ``tile`` 512 columns per warp,
            and as many programs as the GPU holds at once (from the compiled kernel's
            register count), at most one per row.
        capg: capacity in candidate groups held in registers (a power of two >= k; default
            the power of two ``>= k``); rows with more candidate groups stream them in blocks
            of at least 256 groups (tests use a small ``capg`` to reach that path).
        ways: thresholds counted per block reduction of the split searches of phases 2
            and 4 (:func:`sp_kpool.kernels.triton_topk_search.kth_largest`), plus one (2, 3
            or 5); the streamed path always uses 5.
        maxnreg: register cap per thread passed to the compiler (more programs per SM,
            some spilling); default 80 for up to 8 warps, else the compiler's choice; ``0``:
            the compiler's choice.
        vsteps: steps of phase 2's split search that split the bracket in value rather than
            in key (``kth_largest``'s ``VSTEPS``; default ``_DEFAULT_VSTEPS``, 0: none; not
            used with ``ways=5``). The answer does not depend on it.
        split2, split4: ``(a, b)`` with ``0 < a < b < 1``, or ``()``: the first step of
            phase 2's / phase 4's search splits the bracket's FP32 value range at these
            fractions (``ways=2``: at ``a``) instead of evenly (phase 2, with ``vsteps``) or
            in key (phase 4); defaults ``_DEFAULT_SPLIT2`` and ``_DEFAULT_SPLIT4``. The
            answer does not depend on them.
        short_rows: rows whose range holds at most ``k`` columns select every visible one
            without ranking (step 0); ``False`` ranks them as the others (a row that is
            not short never takes the step: the kernel is compiled without it); ``"all"``:
            the caller guarantees that every row's range holds at most ``k`` columns (e.g.
            from its documents' lengths): one small program per row runs step 0 only (on an
            H200, 32768 rows of 2048-token documents at ``k`` 512: 0.047 ms, against 0.13
            ms through the persistent kernel); ``tile``, ``num_warps``, ``programs``, ``capg``,
            ``ways``, ``maxnreg``, ``vsteps`` and the splits do not apply there. A row that
            breaks the guarantee gets wrong ids, never writes outside its row of ``out``).
        group: columns per group of phase 1 (a power of two, at least 4, at most ``tile``;
            default: 4 for ``k > 512`` in rows of at most 32768 columns, else 8, wider for
            rows of more than 65536 columns): smaller groups make more group maxima (phase
            2) and fewer candidate cells (phase 4). The answer does not depend on it.
        out: optional ``[R, k]`` int32 destination with unit column stride (e.g. rows of
            a larger output), every element overwritten; returned.

    Returns:
        ``[R, k]`` int32 global pool ids ``base[r] + column``, ascending, ``-1`` after the
        ``min(k, visible)`` selected ones. The same ids as
        :func:`sp_kpool.selection.topk_pools`, for any input (ties included).
    """
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores: expected a 2-D float32 tensor, got {tuple(scores.shape)} {scores.dtype}")
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k: expected 1 <= k <= {MAX_K}, got {k}")
    if ways not in (2, 3, 5):
        raise ValueError(f"ways: expected 2, 3 or 5, got {ways}")
    vsteps = _DEFAULT_VSTEPS if vsteps is None else vsteps
    if isinstance(vsteps, bool) or not isinstance(vsteps, int) or vsteps < 0:
        raise ValueError(f"vsteps: expected an int >= 0, got {vsteps!r}")
    split2 = _check_split("split2", _DEFAULT_SPLIT2 if split2 is None else split2)
    split4 = _check_split("split4", _DEFAULT_SPLIT4 if split4 is None else split4)
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    R, W = scores.shape
    dev = scores.device
    if out is None:
        out = torch.empty((R, k), dtype=torch.int32, device=dev)
    elif (out.shape != (R, k) or out.dtype != torch.int32 or out.device != dev
          or (k > 1 and out.stride(1) != 1)):  # fmt: skip
        raise ValueError(f"out: expected an int32 tensor of shape {(R, k)} with unit column stride on {dev}, got "
                         f"{out.dtype} {tuple(out.shape)} strides {tuple(out.stride())} on {out.device}")  # fmt: skip
    if short_rows not in (True, False, "all"):
        raise ValueError(f"short_rows: expected True, False or 'all', got {short_rows!r}")
    if R == 0:
        return out
    # columns outside [0, W) do not exist: phase 1 reads and stores whole tiles up to the end
    # without masks, and its tile arithmetic (a start's tile + tiles) stays within int32
    starts = starts.to(device=dev, dtype=torch.int32).clamp(min=0, max=W).contiguous()
    ends = ends.to(device=dev, dtype=torch.int32).clamp(max=W).contiguous()
    base = base.to(device=dev, dtype=torch.int64).contiguous()
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 4
                              or group & (group - 1)):  # fmt: skip
        raise ValueError(f"group: expected a power of two >= 4, got {group!r}")
    if short_rows == "all":  # every row short (the caller's guarantee): step 0 only, a program per row
        kp = _pow2(k)
        warps = max(1, min(8, kp // 128))
        last_launch.clear()
        last_launch.update(kernel="short", programs=R, num_warps=warps, KP=kp)
        short_kernel[(R,)](scores, scores.stride(0), starts, ends, base, out, out.stride(0), k, KP=kp,
                           num_warps=warps)  # fmt: skip
        return out
    consts = _launch_consts(W, k, tile, num_warps, capg, group, ways, vsteps, split2, split4, maxnreg, short_rows)
    group = consts["G"]
    cut = _rows_in_storage(scores, -(-W // group) * group)
    if cut == R:  # the common case: no views to make (host time)
        _launch(scores, starts, ends, base, out, consts, programs)
    elif cut > 0:
        _launch(scores[:cut], starts[:cut], ends[:cut], base[:cut], out[:cut], consts, programs)
    if cut < R:  # rows whose last group would be read past the storage: from a padded copy
        rest = torch.nn.functional.pad(scores[cut:], (0, -W % group), value=-float("inf"))
        _launch(rest, starts[cut:], ends[cut:], base[cut:], out[cut:], consts, programs)
    return out


def _launch_consts(W: int, k: int, tile, num_warps, capg, group, ways: int, vsteps: int, split2: tuple, split4: tuple,
                   maxnreg, short_rows) -> dict:  # fmt: skip
    """The compile-time constants and launch options of ``select_kernel`` for rows of ``W``
    columns (:func:`topk_ascending`'s arguments, ``vsteps`` and the splits resolved), checked."""
    capg_req = capg
    warps = num_warps or _default_warps(W, k, group)
    tile, group, ng, capg = _sizes(W, k, tile or 512 * warps, capg, group)
    if group > tile:
        raise ValueError(f"group: expected at most the tile, {tile} columns, got {group}")
    if capg < k:
        raise ValueError(f"capg: expected at least k = {k}, got {capg_req}")
    if capg * group > _MAX_BLOCK:
        raise ValueError(
            f"scores: rows of {W} columns with k = {k} need {capg} x {group} candidate cells, "
            f"more than {_MAX_BLOCK} (see supports())"
        )
    if ng > _MAX_GROUPS:  # the searches count in 16-bit fields; phase 2 holds the maxima in registers
        raise ValueError(
            f"scores: rows of {W} columns make {ng} groups of {group} columns (tile {tile}), more than "
            f"{_MAX_GROUPS} (see supports())"
        )
    # streamed candidate blocks: at least 256 groups (small k would make tiny blocks), within the block limit
    sb = max(capg, min(256, _MAX_BLOCK // group))
    consts = dict(SHORT=int(bool(short_rows)), TILE=tile, G=group, NG=ng, CAPG=capg, KP=_pow2(k), WAYS=ways, SB=sb, GL=max(group, 8),
                  CW=max(ng, capg), num_warps=warps)  # fmt: skip
    if vsteps and ways in (2, 3):
        consts["VSTEPS"] = vsteps
        if split2:
            consts["F2A"], consts["F2B"] = split2
    if split4 and ways in (2, 3):
        consts["F4A"], consts["F4B"] = split4
    maxnreg = _DEFAULT_MAXNREG if maxnreg is None and warps <= 8 else maxnreg
    if maxnreg:
        consts["maxnreg"] = maxnreg
    return consts


def _check_split(name: str, split) -> tuple:
    """``split`` as a tuple of two floats ``0 < a < b < 1``, or ``()`` (not used)."""
    if split is None or split == () or split is False:
        return ()
    try:
        a, b = (float(x) for x in split)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected two fractions (a, b) with 0 < a < b < 1, or (), got {split!r}") from None
    if not 0 < a < b < 1:
        raise ValueError(f"{name}: expected two fractions (a, b) with 0 < a < b < 1, or (), got {split!r}")
    return a, b


def _rows_in_storage(scores: torch.Tensor, span: int) -> int:
    """How many leading rows of ``scores`` can be read for ``span`` columns (whole groups,
    up to ``group - 1`` past the row's width) within the tensor's storage."""
    R = scores.shape[0]
    avail = scores.untyped_storage().nbytes() // scores.element_size() - scores.storage_offset()
    if span > avail:
        return 0
    stride = scores.stride(0)
    if stride == 0:  # every row is the same memory
        return R
    return min(R, (avail - span) // stride + 1)


def _launch(scores, starts, ends, base, out, consts, programs):
    R, k = out.shape
    dev = scores.device
    args = [scores, scores.stride(0), starts, ends, base, out, out.stride(0)]
    if dev.type == "cuda":
        key = (dev.index, tuple(sorted(consts.items())))
        if key not in _occupancy:  # compile once per configuration (warmup costs host time)
            compiled = select_kernel.warmup(*args, out, out, R, k, 1, grid=(1,), **consts)
            props = torch.cuda.get_device_properties(dev)
            # loads the binary: register counts known after
            per_sm = _resident(compiled, consts["num_warps"], getattr(props, "shared_memory_per_multiprocessor", 233472))
            _occupancy[key] = dict(regs=getattr(compiled, "n_regs", None), spills=getattr(compiled, "n_spills", None),
                                   shared=getattr(compiled.metadata, "shared", None), per_sm=per_sm,
                                   sms=props.multi_processor_count)  # fmt: skip
        occ = _occupancy[key]
        last_launch.update(occ)
        if programs is None:
            programs = occ["sms"] * occ["per_sm"]
    progs = max(1, min(R, programs or 4))
    last_launch.update(kernel="select", programs=progs, VSTEPS=consts.get("VSTEPS", 0),
                       split2=(consts.get("F2A"), consts.get("F2B")) if "F2B" in consts else (),
                       split4=(consts.get("F4A"), consts.get("F4B")) if "F4B" in consts else (),
                       **{n: consts[n] for n in ("TILE", "G", "NG", "CAPG", "SB", "WAYS", "num_warps")})  # fmt: skip
    gmax = torch.empty((progs, consts["NG"]), dtype=torch.int32, device=dev)
    cand = torch.empty((progs, consts["CW"]), dtype=torch.int32, device=dev)
    select_kernel[(progs,)](*args, gmax, cand, R, k, progs, **consts)

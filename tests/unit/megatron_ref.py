"""Megatron-LM's reference code, loaded from the megatron-core wheel at test time.

The DSA layout helpers (``megatron/core/transformer/experimental_attention_variant/dsa_layout.py``,
plain torch; first released in megatron-core 0.19.0), ``get_batch_on_this_cp_rank`` of
``megatron/core/utils.py`` (its two functions compiled from the wheel's source), the
``PackedSeqParams`` dataclass (``megatron/core/packed_seq_params.py``) and the DSA indexer
loss (``compute_dsa_indexer_loss``, ``bwd_fused_indexer_loss_naive`` of ``dsa.py``, compiled
alone with their plain-torch helpers), without installing Megatron or its dependencies.
Shared by ``test_layout_reference.py``, ``test_integrations_megatron.py`` and
``test_training_references.py``.

The wheel: ``scripts/reference_wheels.sh`` (run by ``scripts/test.sh``) downloads it into
``.cache/wheels/`` and exports its path as ``SP_KPOOL_MEGATRON_WHEEL``. Without it the tests
that need it skip, except under CI (``SP_KPOOL_CI`` or ``CI`` set), where they fail.
"""

from __future__ import annotations

import ast
import functools
import math
import importlib.abc
import importlib.util
import os
import sys
import types
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, Union
from unittest import mock

import pytest
import torch

MEGATRON_VERSION = "0.19.2"  # keep equal to scripts/reference_wheels.sh
LAYOUT_MEMBER = "megatron/core/transformer/experimental_attention_variant/dsa_layout.py"
UTILS_MEMBER = "megatron/core/utils.py"
ROOT = Path(__file__).resolve().parents[2]
IN_CI = bool(os.environ.get("SP_KPOOL_CI") or os.environ.get("CI"))
PACKED_SEQ_PARAMS_MEMBER = "megatron/core/packed_seq_params.py"

# --- Megatron-LM, loaded from the wheel ----------------------------------------------------


class _WheelMemberLoader(importlib.abc.SourceLoader):
    """Loads one ``.py`` member of a wheel (a zip) as a module; nothing is extracted."""

    def __init__(self, wheel: Path, member: str):
        self.wheel, self.member = wheel, member

    def get_filename(self, fullname):
        return f"{self.wheel}/{self.member}"

    def get_data(self, path):
        with zipfile.ZipFile(self.wheel) as z:
            return z.read(self.member)


def _find_wheel() -> Path | None:
    env = os.environ.get("SP_KPOOL_MEGATRON_WHEEL")
    if env:
        if not Path(env).is_file():
            pytest.fail(f"SP_KPOOL_MEGATRON_WHEEL={env}: no such file")
        return Path(env)
    hits = sorted((ROOT / ".cache" / "wheels").glob(f"megatron_core-{MEGATRON_VERSION}-*.whl"))
    return hits[-1] if hits else None


def _load_dsa_layout(wheel: Path) -> types.ModuleType:
    # dsa_layout.py imports two names from megatron.core that are not plain torch and that
    # the functions compared here never use: PackedSeqParams (only an annotation of
    # get_packed_qk_cu_seqlens) and get_pg_size (only get_cp_positions_from_layout's fallback
    # with a process group). Minimal stubs stand in for them while the module executes; they
    # are removed from sys.modules afterwards (a real megatron, if imported, is used instead).
    def _get_pg_size(group=None):
        raise AssertionError("stub: get_pg_size is not used by the compared functions")

    stubs = {
        "megatron.core.packed_seq_params": {"PackedSeqParams": type("PackedSeqParams", (), {})},
        "megatron.core.utils": {"get_pg_size": _get_pg_size},
    }
    added = []
    for name, attrs in stubs.items():
        if name not in sys.modules:
            stub = types.ModuleType(name, "test stub (tests/unit/test_layout_reference.py)")
            stub.__dict__.update(attrs)
            sys.modules[name] = stub
            added.append(name)
    loader = _WheelMemberLoader(wheel, LAYOUT_MEMBER)
    spec = importlib.util.spec_from_loader("_sp_kpool_ref_megatron_dsa_layout", loader, origin=loader.get_filename(""))
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    finally:
        for name in added:
            sys.modules.pop(name, None)
    return module


def _load_cp_batch_split(wheel: Path) -> Callable:
    """``get_batch_on_this_cp_rank`` of megatron/core/utils.py. The module imports all of
    Megatron, so only its source is read: the dispatcher and the per-sequence zigzag it calls
    for a batch without cu_seqlens, compiled on their own (they use torch alone)."""
    with zipfile.ZipFile(wheel) as z:
        source = z.read(UTILS_MEMBER).decode()
    wanted = {"get_batch_on_this_cp_rank", "_get_batch_on_this_cp_rank_per_sequence_balancing"}
    tree = ast.parse(source)
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {n.name for n in body} == wanted, f"{UTILS_MEMBER} of {wheel.name}: missing {wanted}"
    namespace = {"torch": torch, "Any": Any, "Callable": Callable, "Dict": Dict, "Optional": Optional}
    exec(compile(ast.Module(body=body, type_ignores=[]), f"{wheel}/{UTILS_MEMBER}", "exec"), namespace)
    return namespace["get_batch_on_this_cp_rank"]


@functools.lru_cache(maxsize=None)
def _megatron_cached(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    missing = [m for m in (LAYOUT_MEMBER, UTILS_MEMBER) if m not in names]
    if missing:
        raise AssertionError(f"{wheel.name} has no {missing} (megatron-core >= 0.19.0 has them)")
    return _load_dsa_layout(wheel), _load_cp_batch_split(wheel)


def megatron():
    """(dsa_layout module, get_batch_on_this_cp_rank); skips without the wheel, fails in CI."""
    wheel = _find_wheel()
    if wheel is None:
        msg = (
            f"needs the megatron-core {MEGATRON_VERSION} wheel: run scripts/reference_wheels.sh "
            "(scripts/test.sh does) or set SP_KPOOL_MEGATRON_WHEEL"
        )
        if IN_CI:
            pytest.fail(f"{msg} (under CI this test must run)")
        pytest.skip(msg)
    return _megatron_cached(wheel)


def megatron_cp_batch_split(split, tokens, world_size, rank):
    """Megatron's ``get_batch_on_this_cp_rank`` of a non-packed batch (``cu_seqlens`` None),
    with the CP group's size and rank given explicitly (the two torch.distributed calls it
    makes are patched for the call, nothing else)."""
    with (
        mock.patch.object(torch.distributed, "get_world_size", lambda group=None: world_size),
        mock.patch.object(torch.distributed, "get_rank", lambda group=None: rank),
    ):
        out = split({"cu_seqlens": None, "tokens": tokens[None].clone()}, is_hybrid_cp=False, cp_group=None)
    return out["tokens"][0]


@functools.lru_cache(maxsize=None)
def _packed_seq_params_cached(wheel: Path) -> type:
    loader = _WheelMemberLoader(wheel, PACKED_SEQ_PARAMS_MEMBER)
    spec = importlib.util.spec_from_loader("_sp_kpool_ref_megatron_packed_seq_params", loader,
                                           origin=loader.get_filename(""))  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)  # a dataclass of torch alone
    return module.PackedSeqParams


def packed_seq_params_class() -> type:
    """Megatron's ``PackedSeqParams`` dataclass, from the wheel (skips without it; fails in CI)."""
    megatron()  # skips or fails alike
    return _packed_seq_params_cached(_find_wheel())


MASKING_MEMBER = "megatron/core/transformer/experimental_attention_variant/dsa_masking.py"


@functools.lru_cache(maxsize=None)
def _sort_topk_by_index_cached(wheel: Path) -> Callable:
    with zipfile.ZipFile(wheel) as z:
        source = z.read(MASKING_MEMBER).decode()
    body = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "sort_topk_by_index"]
    assert body, f"{MASKING_MEMBER} of {wheel.name}: no sort_topk_by_index"
    namespace = {"torch": torch, "Optional": Optional, "Tuple": __import__("typing").Tuple}
    exec(compile(ast.Module(body=body, type_ignores=[]), f"{wheel}/{MASKING_MEMBER}", "exec"), namespace)
    return namespace["sort_topk_by_index"]


def sort_topk_by_index() -> Callable:
    """``dsa_masking.sort_topk_by_index`` of the wheel (compiled alone from its source: torch
    only): the canonical column order Megatron's cuDNN/FlashMLA DSA path gives the top-k
    indices before its sparse attention (valid ids ascending, ``-1`` after). Skips without
    the wheel, fails in CI."""
    megatron()
    return _sort_topk_by_index_cached(_find_wheel())


# --- the DSA indexer loss (dsa.py) and its plain-torch helpers -----------------------------

DSA_MEMBER = "megatron/core/transformer/experimental_attention_variant/dsa.py"
INDEXER_LOSS_MEMBER = "megatron/core/transformer/experimental_attention_variant/dsa_indexer_loss.py"
DSA_LOSS_FUNCTIONS = ("compute_dsa_indexer_loss", "_compute_index_scores", "bwd_fused_indexer_loss_naive")


def _compile_functions(wheel: Path, member: str, wanted, namespace: dict) -> dict:
    """The top-level functions ``wanted`` (all of them: ``None``) of one ``.py`` member,
    compiled alone into ``namespace`` (their module-level imports are not run)."""
    with zipfile.ZipFile(wheel) as z:
        source = z.read(member).decode()
    body = [n for n in ast.parse(source).body
            if isinstance(n, ast.FunctionDef) and (wanted is None or n.name in wanted)]  # fmt: skip
    if wanted is not None:
        missing = set(wanted) - {n.name for n in body}
        assert not missing, f"{member} of {wheel.name}: no {sorted(missing)}"
    exec(compile(ast.Module(body=body, type_ignores=[]), f"{wheel}/{member}", "exec"), namespace)
    return namespace


@functools.lru_cache(maxsize=None)
def _dsa_indexer_loss_cached(wheel: Path) -> types.SimpleNamespace:
    layout = _load_dsa_layout(wheel)
    loader = _WheelMemberLoader(wheel, INDEXER_LOSS_MEMBER)  # imports torch and typing only
    spec = importlib.util.spec_from_loader("_sp_kpool_ref_megatron_dsa_indexer_loss", loader,
                                           origin=loader.get_filename(""))  # fmt: skip
    indexer_loss = importlib.util.module_from_spec(spec)
    loader.exec_module(indexer_loss)
    # dsa_masking.py: every function, compiled without its imports; PackedSeqParams and
    # AttnMaskType appear only in annotations and in functions not called here
    masking = types.ModuleType("_sp_kpool_ref_megatron_dsa_masking")
    stub = {"PackedSeqParams": type("PackedSeqParams", (), {}), "AttnMaskType": type("AttnMaskType", (), {})}
    masking.__dict__.update(_compile_functions(wheel, MASKING_MEMBER, None, {
        "torch": torch, "Optional": Optional, "Tuple": Tuple, "dsa_layout": layout, **stub}))  # fmt: skip
    # dsa.py imports all of Megatron: the three functions alone, with the modules they use;
    # ProcessGroupCollection is an annotation only (the caller passes a stub with .tp.size())
    ns = _compile_functions(wheel, DSA_MEMBER, DSA_LOSS_FUNCTIONS, {
        "torch": torch, "math": math, "Optional": Optional, "Tuple": Tuple, "Union": Union,
        "ProcessGroupCollection": type("ProcessGroupCollection", (), {}),
        "dsa_layout": layout, "dsa_masking": masking, "dsa_indexer_loss": indexer_loss})  # fmt: skip
    one_rank = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))
    return types.SimpleNamespace(masking=masking, pg_collection=one_rank, **{n: ns[n] for n in DSA_LOSS_FUNCTIONS})


def dsa_indexer_loss() -> types.SimpleNamespace:
    """Megatron's DSA indexer loss from the wheel's ``dsa.py``: ``compute_dsa_indexer_loss``,
    ``_compute_index_scores`` and ``bwd_fused_indexer_loss_naive`` (compiled alone from the
    source, with ``dsa_masking.py``'s functions, ``dsa_indexer_loss.py`` and ``dsa_layout.py``:
    plain torch), ``masking`` (the ``dsa_masking`` functions) and ``pg_collection``: a stub
    whose ``tp.size()`` is 1 (no TP all-reduce). Skips without the wheel, fails in CI."""
    megatron()
    return _dsa_indexer_loss_cached(_find_wheel())

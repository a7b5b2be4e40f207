"""The backend registry: backends by name, at the bottom of the package.

:data:`BACKENDS` is filled by :mod:`sp_kpool.backends` when it is imported (which
``import sp_kpool`` does); :class:`~sp_kpool.config.RunOptions` checks ``backend=``
against :func:`backend_names` without importing the backends (they import the config),
and :func:`sp_kpool.backends.resolve_backend` picks the backend that runs a problem.
Registering a backend is adding it here (tests do, with ``monkeypatch.setitem``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .backends.base import Backend

__all__ = ["BACKENDS", "backend_names"]

#: Registered backends by name, in no particular order (priority decides ``auto``).
BACKENDS: dict[str, "Backend"] = {}


def backend_names() -> list[str]:
    """Names accepted by ``backend=``: ``"auto"`` and every registered backend."""
    return ["auto", *BACKENDS]

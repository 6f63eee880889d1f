"""The one switch of the fused kernels, and the seam the operators call them through.

The operators in this package compute their results with plain torch ops.
Where a faster implementation exists for the inputs at hand (today: the fused
CPU kernels in :mod:`kcla_mm.ops.fused`), an operator's ``forward`` makes one
call, :func:`fused_call`, which either returns that implementation's result or
``None``, and then the operator computes the plain way. The fast paths give the
same values (within float rounding where their docstrings say so); they decide
from the inputs alone whether they apply.

The switch (in the style of timm's ``set_fused_attn``)::

    import kcla_mm.ops as ops
    ops.set_fused_kernels(False)          # from now on, plain torch only
    with ops.fused_kernels(False):        # only inside the block
        model(x)
    ops.use_fused_kernels()               # the current setting

Its default comes from the environment variable ``KCLA_MM_CPU_KERNELS``:
``0`` (or ``false``/``off``/``no``) turns the fused kernels off; ``require``
keeps them on and makes a failed build an error instead of a warning (see
:mod:`kcla_mm.ops.fused.build`). Deleting the folder ``kcla_mm/ops/fused``
leaves the plain implementations, which need nothing from it.
"""
import contextlib
import importlib
import os
from typing import Any, Iterator, Optional

import torch

from .common import compiling

ENV = 'KCLA_MM_CPU_KERNELS'

_override: Optional[bool] = None
_backend: Any = False  # False: not imported yet; None: absent


def _env_enabled() -> bool:
    return os.environ.get(ENV, '1').strip().lower() not in ('0', 'false', 'off', 'no')


def use_fused_kernels() -> bool:
    """Whether the operators may use the fused kernels (where they apply)."""
    return _env_enabled() if _override is None else _override


def set_fused_kernels(enabled: Optional[bool]) -> None:
    """Turn the fused kernels on or off for the whole process.

    Args:
        enabled: ``True``/``False``, or ``None`` to go back to the default of
            the environment variable ``KCLA_MM_CPU_KERNELS``.
    """
    global _override
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f'set_fused_kernels takes True, False or None, got {enabled!r}')
    _override = enabled


@contextlib.contextmanager
def fused_kernels(enabled: bool = True) -> Iterator[None]:
    """Context manager: the fused kernels on (or off) inside the block only."""
    global _override
    if not isinstance(enabled, bool):
        raise ValueError(f'fused_kernels takes True or False, got {enabled!r}')
    before = _override
    _override = enabled
    try:
        yield
    finally:
        _override = before


def fused_backend() -> Any:
    """The module of fast paths, :mod:`kcla_mm.ops.fused`, or ``None`` where it is absent."""
    global _backend
    if _backend is False:
        try:
            _backend = importlib.import_module(f'{__package__}.fused')
        except ImportError:
            _backend = None
    return _backend


def fused_call(op: str, *args: Any) -> Any:
    """``kcla_mm.ops.fused.<op>(*args)`` where the switch is on, else ``None``.

    Every fast path returns ``None`` where it does not apply to its inputs;
    the caller then computes the plain way.
    """
    if not use_fused_kernels() or compiling() or torch.jit.is_tracing():
        return None  # (torch.compile and tracing record the plain ops)
    backend = fused_backend()
    return None if backend is None else getattr(backend, op)(*args)

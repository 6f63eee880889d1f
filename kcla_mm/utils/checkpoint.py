"""Safe checkpoint loading for everything kcla_mm touches.

``torch.load(weights_only=False)`` runs arbitrary pickled code, and released
checkpoints come from the internet. mmengine 0.10.7 calls ``torch.load``
without ``weights_only``; torch >= 2.6 then defaults to ``weights_only=True``
and refuses mmengine's own checkpoints (they hold message-hub history buffers
and numpy arrays). :func:`safe_load` loads with ``weights_only=True`` and an
explicit allow-list of exactly those types; :func:`install_safe_loader` makes
mmengine's local-file checkpoint loader (used by ``load_from``, ``--resume``,
``init_cfg=dict(type='Pretrained')`` and ``load_checkpoint``) use it.

A file that needs any other type is refused with an error that names the
type. To load such a file knowingly, set ``KCLA_MM_TRUST_CHECKPOINTS=1`` (the
tools' ``--trust-checkpoint`` flag does this): it is then loaded with
``weights_only=False``. Only do this for files you trust.
"""
import collections
import os
import os.path as osp
import pickle
import re
from typing import Any, List, Optional

import torch

TRUST_ENV = 'KCLA_MM_TRUST_CHECKPOINTS'


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint needs a type outside the allow-list."""


def _numpy_globals() -> List[Any]:
    import numpy as np
    out = [np.ndarray, np.dtype]
    try:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy 2.x
        from numpy._core.multiarray import _reconstruct, scalar
    out += [_reconstruct, scalar]
    # Concrete dtype classes (np.dtypes.Float64DType, ...) pickled by np.dtype.
    dtypes = getattr(np, 'dtypes', None)
    if dtypes is not None:
        out += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith('DType')]
    return out


#: The methods ``HistoryBuffer.__getstate__`` pickles (as ``getattr(HistoryBuffer, name)``).
_HISTORY_BUFFER_METHODS = ('min', 'max', 'current', 'mean')


def _history_buffer_method(owner: Any, name: Any) -> Any:
    """``builtins.getattr`` as far as mmengine checkpoints need it, and no further.

    mmengine's message hub pickles each ``HistoryBuffer`` with its statistics
    methods, which pickle writes as ``getattr(HistoryBuffer, 'mean')``. A free
    ``getattr`` in an unpickler reaches any attribute (``__globals__``, ...),
    so only these four lookups are allowed.
    """
    from mmengine.logging.history_buffer import HistoryBuffer
    if owner is HistoryBuffer and name in _HISTORY_BUFFER_METHODS:
        return getattr(HistoryBuffer, name)
    raise pickle.UnpicklingError(
        f'Unsupported global: GLOBAL builtins.getattr({owner!r}, {name!r}); only '
        f'getattr(HistoryBuffer, one of {_HISTORY_BUFFER_METHODS}) is allowed')


def allowed_globals() -> List[Any]:
    """The types mmengine's own checkpoints contain, beyond what torch allows."""
    out = _numpy_globals() + [collections.OrderedDict, collections.defaultdict]
    try:
        from mmengine.logging.history_buffer import HistoryBuffer
        out += [HistoryBuffer, (_history_buffer_method, 'builtins.getattr')]
    except ImportError:
        pass
    try:
        from mmengine.config.config import ConfigDict
        out.append(ConfigDict)
    except ImportError:
        pass
    return out


def trusted() -> bool:
    return os.environ.get(TRUST_ENV, '') not in ('', '0', 'false', 'False')


def safe_load(f, map_location: Optional[Any] = None, trust: Optional[bool] = None) -> Any:
    """``torch.load`` with ``weights_only=True`` and the mmengine allow-list.

    Args:
        f: a path or a file-like object.
        map_location: as for :func:`torch.load`.
        trust: load with ``weights_only=False``; default: the
            ``KCLA_MM_TRUST_CHECKPOINTS`` environment variable.

    Raises:
        UnsafeCheckpointError: the file needs a type outside the allow-list;
            the message names it.
    """
    if trust if trust is not None else trusted():
        return torch.load(f, map_location=map_location, weights_only=False)
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.findall(r'GLOBAL ([\w.]+)', str(e)) or re.findall(r'global[: ]+([\w.]+)', str(e))
        what = found[0] if found else 'an object outside the allow-list'
        name = f if isinstance(f, (str, os.PathLike)) else 'the checkpoint'
        raise UnsafeCheckpointError(
            f'refusing to load {name}: it needs {what}, which is not in kcla_mm\'s '
            'allow-list of checkpoint types (tensors, containers, numpy arrays and '
            'mmengine history buffers). Loading it could run arbitrary code. If you '
            f'trust this file, set {TRUST_ENV}=1 (or pass --trust-checkpoint to the '
            'kcla_mm tools).') from None


def load_from_local(filename: str, map_location=None) -> Any:
    """mmengine's local-file loader, made safe (same signature and errors)."""
    filename = osp.expanduser(filename)
    if not osp.isfile(filename):
        raise FileNotFoundError(f'{filename} can not be found.')
    return safe_load(filename, map_location=map_location)


def install_safe_loader() -> None:
    """Make mmengine load local checkpoints through :func:`safe_load`."""
    try:
        from mmengine.runner.checkpoint import CheckpointLoader
    except ImportError:
        return
    CheckpointLoader.register_scheme(prefixes='', loader=load_from_local, force=True)

"""Safe checkpoint loading, atomic checkpoint writing and shape checks.

``torch.load(weights_only=False)`` runs arbitrary pickled code, and released
checkpoints come from the internet. mmengine 0.10.7 calls ``torch.load``
without ``weights_only``; torch >= 2.6 then defaults to ``weights_only=True``
and refuses mmengine's own checkpoints (they hold message-hub history buffers
and numpy arrays). :func:`safe_load` loads with ``weights_only=True`` and an
explicit allow-list of exactly the types mmengine, mmdet, mmseg and
mmpretrain write; :func:`load_from_local` is mmengine's local-file loader made safe, which
:mod:`kcla_mm.host_fixes` registers with mmengine's ``CheckpointLoader``.

A file that needs any other type is refused with an error that names the
type. To load such a file knowingly, set ``KCLA_MM_TRUST_CHECKPOINTS=1`` (the
tools' ``--trust-checkpoint`` flag does this): it is then loaded with
``weights_only=False``. Only do this for files you trust. A file that is
truncated or otherwise not a complete checkpoint is refused with
:class:`CorruptCheckpointError`, which names the file.

Saving: mmengine 0.10.7 writes checkpoints in place (``LocalBackend.put``
opens the final path with ``'wb'``), so a run killed mid-write leaves a
partial file under the final name and destroys the file it overwrote.
:func:`atomic_write_bytes` writes a temporary file in the same folder,
``fsync`` s it and ``os.replace`` s it onto the final name: the final name
holds either the old file or the complete new one, never a part.
"""
import collections
import io
import os
import os.path as osp
import pickle
import pickletools
import re
import stat
import uuid
import zipfile
from pathlib import Path
from typing import Any, List, Mapping, Optional, Tuple, Union

import torch
from mmengine.fileio.backends import LocalBackend

TRUST_ENV = 'KCLA_MM_TRUST_CHECKPOINTS'


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint needs a type outside the allow-list."""


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is truncated, empty or not a torch checkpoint at all."""


#: Substrings of the errors torch.load raises for incomplete or foreign files
#: (zip format: no central directory; legacy format: unexpected end of data).
_CORRUPT_PATTERNS = ('PytorchStreamReader failed', 'unexpected EOF', 'pickle data was truncated',
                     'invalid load key', 'Ran out of input', 'file might be corrupted')


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


#: Builtin types whose constructors only build a value. A protocol-2 pickle
#: writes ``b''`` as ``bytes()`` (an empty numpy array, e.g. the history of a
#: message-hub buffer that was never updated, holds one) and a set as
#: ``set([...])``. torch's own list has some of them, depending on its version.
HARMLESS_BUILTINS = (bytes, bytearray, set, frozenset, complex, range, slice)


def allowed_globals() -> List[Any]:
    """The types mmengine's, mmdet's and mmseg's checkpoints contain, beyond torch's."""
    out = list(HARMLESS_BUILTINS) + _numpy_globals() + [
        collections.OrderedDict, collections.defaultdict, collections.Counter,
        collections.deque
    ]
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


def _pickles_parse(f: Any) -> bool:
    """Whether the pickles of a checkpoint file are complete, without running any of them.

    ``pickletools.genops`` only decodes opcodes. Zip checkpoints hold one
    pickle (``*/data.pkl``); legacy ones start with five consecutive pickles
    (magic number, protocol, system info, objects, storage keys). ``False``
    means truncated or garbage; ``True`` for objects that are not paths.
    """
    if not isinstance(f, (str, os.PathLike)):
        return True
    try:
        if zipfile.is_zipfile(f):
            with zipfile.ZipFile(f) as z:
                names = [n for n in z.namelist() if n.endswith('data.pkl')]
                streams = [io.BytesIO(z.read(names[0]))] if names else []
        else:
            with open(f, 'rb') as fh:
                data = io.BytesIO(fh.read())
            streams = [data] * 5
        if not streams:
            return False
        for stream in streams:
            for _ in pickletools.genops(stream):
                pass
    except Exception:
        return False
    return True


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
        CorruptCheckpointError: the file is truncated or not a checkpoint.
    """
    name = f if isinstance(f, (str, os.PathLike)) else 'the checkpoint'
    try:
        if trust if trust is not None else trusted():
            return torch.load(f, map_location=map_location, weights_only=False)
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(f, map_location=map_location, weights_only=True)
    except (EOFError, RuntimeError, pickle.UnpicklingError) as e:
        if (isinstance(e, EOFError) or any(p in str(e) for p in _CORRUPT_PATTERNS)
                or not _pickles_parse(f)):
            reason = str(e).splitlines()[0] if str(e) else 'end of file'
            raise CorruptCheckpointError(
                f'{name} is not a complete checkpoint (truncated, empty or not written by '
                f'torch.save): {type(e).__name__}: {reason}. An interrupted save or download '
                'leaves such a file; use an earlier checkpoint or download it again.') from None
        if not isinstance(e, pickle.UnpicklingError):
            raise
        found = re.findall(r'GLOBAL ([\w.]+)', str(e)) or re.findall(r'global[: ]+([\w.]+)', str(e))
        what = found[0] if found else 'an object outside the allow-list'
        raise UnsafeCheckpointError(
            f'refusing to load {name}: it needs {what}, which is not in kcla_mm\'s '
            'allow-list of checkpoint types (tensors, builtin values and containers, numpy '
            'arrays, mmengine history buffers and config dicts). Loading it could run '
            'arbitrary code. If you '
            f'trust this file, set {TRUST_ENV}=1 (or pass --trust-checkpoint to the '
            'kcla_mm tools).') from None


def load_from_local(filename: str, map_location=None) -> Any:
    """mmengine's local-file loader, made safe (same signature and errors)."""
    filename = osp.expanduser(filename)
    if not osp.isfile(filename):
        raise FileNotFoundError(f'{filename} can not be found.')
    return safe_load(filename, map_location=map_location)


def atomic_write_bytes(data: bytes, path: Union[str, Path]) -> None:
    """Write ``data`` to ``path`` so that ``path`` never holds a partial file.

    The bytes go to a temporary file in the same folder, which is flushed to
    disk and then renamed onto ``path`` (``os.replace`` is atomic within a
    file system). An existing file keeps its permissions; a new one gets the
    usual ``0o666 & ~umask``. A symlink is followed: its target is replaced.
    On any error the temporary file is removed and ``path`` is unchanged; a
    process killed mid-write leaves at most a ``.<name>.tmp-*`` file.

    Args:
        data: the complete file contents.
        path: the final file name; its folder is created if needed.

    Raises:
        OSError: writing failed (a full disk, a quota, ...); the message names
            ``path`` and says that the previous file under it is unchanged.
    """
    path = osp.realpath(os.fspath(path))
    folder = osp.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = osp.join(folder, f'.{osp.basename(path)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}')
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, 'wb') as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if osp.exists(path):
                os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
            os.replace(tmp, path)
        except BaseException:
            if osp.exists(tmp):
                os.remove(tmp)
            raise
    except OSError as e:
        kept = 'the previous file under that name is unchanged' if osp.exists(path) \
            else 'no file was created'
        raise _naming(e, f'could not write {path} ({e.strerror or e}); {kept}', path) from e


def _naming(error: OSError, message: str, path: str) -> OSError:
    """``error`` with ``message``: same type and errno (ENOSPC stays ENOSPC).

    The error of a write to an open file carries no file name.
    """
    try:
        return type(error)(error.errno, message, path)
    except Exception:  # a subclass with another constructor
        return OSError(error.errno, message, path)


class AtomicLocalBackend(LocalBackend):
    """mmengine's local file backend whose ``put`` writes atomically.

    Every checkpoint mmengine saves (``CheckpointHook``,
    ``Runner.save_checkpoint``, ``mmengine.runner.save_checkpoint``) goes
    through ``get_file_backend(path).put``; :mod:`kcla_mm.host_fixes` registers
    this class as the ``'local'`` backend for paths without a prefix.
    NOTE: the ``last_checkpoint`` pointer file is written by ``CheckpointHook``
    with ``open`` (not through ``put``), but only after the checkpoint it names
    has been renamed into place, so it never names a partial file.
    """

    def put(self, obj: bytes, filepath: Union[str, Path]) -> None:
        target = osp.realpath(os.fspath(filepath))
        if osp.exists(target) and not osp.isfile(target):
            return super().put(obj, filepath)  # a device or pipe: write in place
        atomic_write_bytes(obj, target)


class CheckpointShapeError(ValueError):
    """Tensors of a checkpoint have other shapes than the model's."""


def shape_mismatches(model: torch.nn.Module,
                     state_dict: Mapping[str, Any]) -> List[Tuple[str, tuple, tuple]]:
    """``(key, checkpoint shape, model shape)`` for every tensor that would not load.

    Keys are compared after removing a DDP ``module.`` prefix, as mmengine does.
    """
    own = model.state_dict()
    out = []
    for key, value in state_dict.items():
        key = re.sub(r'^module\.', '', key)
        if key in own and hasattr(value, 'shape') and tuple(value.shape) != tuple(own[key].shape):
            out.append((key, tuple(value.shape), tuple(own[key].shape)))
    return out


def check_checkpoint_shapes(model: torch.nn.Module, checkpoint: Mapping[str, Any],
                            name: str = 'the checkpoint', limit: int = 20) -> None:
    """Raise if any tensor of ``checkpoint`` does not fit ``model``.

    mmengine only logs a warning for such tensors and keeps the model's own
    (random) values: right for fine-tuning with a new head (``load_from``),
    wrong when resuming or evaluating, where every tensor must load.

    Args:
        model: the model (unwrapped).
        checkpoint: an mmengine checkpoint (``{'state_dict': ...}``) or a state dict.
        name: how to call the checkpoint in the message.
        limit: at most this many keys are listed.

    Raises:
        CheckpointShapeError: lists each mismatched key with both shapes.
    """
    state_dict = checkpoint.get('state_dict', checkpoint)
    bad = shape_mismatches(model, state_dict)
    if not bad:
        return
    lines = [f'  {k}: checkpoint {list(a)}, model {list(b)}' for k, a, b in bad[:limit]]
    if len(bad) > limit:
        lines.append(f'  ... and {len(bad) - limit} more')
    raise CheckpointShapeError(
        f'{name} does not fit the model: {len(bad)} tensors have other shapes '
        '(was it trained with another config?):\n' + '\n'.join(lines))

"""Fixes the host stack (mmengine 0.10.7 under torch >= 2.6) needs; applied on import.

``import kcla_mm`` only registers kcla_mm's components. Importing this module
changes three things of mmengine for the whole process, which is why the
project's configs name it next to ``kcla_mm``::

    custom_imports = dict(imports=['kcla_mm', 'kcla_mm.host_fixes'],
                          allow_failed_imports=False)

and kcla_mm's tools import it. What it changes, each through mmengine's
public extension point where one exists:

- Local checkpoint files (``load_from``, ``--resume``,
  ``init_cfg=dict(type='Pretrained')``, ``load_checkpoint``) load with
  ``weights_only=True`` and an allow-list of the types mmengine, mmdet and
  mmseg write (:func:`kcla_mm.utils.checkpoint.safe_load`): registered with
  ``CheckpointLoader.register_scheme(prefixes='')``, the scheme of paths
  without a prefix.
- Checkpoints are written atomically (temporary file, ``fsync``, rename;
  :class:`kcla_mm.utils.checkpoint.AtomicLocalBackend`): registered with
  ``mmengine.fileio.register_backend('local', prefixes='')``, the backend
  ``get_file_backend`` picks for local paths.
- ``--launcher pytorch`` runs on machines without an accelerator (gloo;
  :func:`kcla_mm.utils.dist.install_cpu_distributed`). mmengine has no
  extension point for it; that function says which private step it wraps.

Idempotent. With GPUs the distributed launch is unchanged.
"""
from mmengine.fileio import register_backend
from mmengine.runner.checkpoint import CheckpointLoader

from .utils.checkpoint import AtomicLocalBackend, load_from_local
from .utils.dist import install_cpu_distributed

__all__ = ['install']


def install() -> None:
    """Apply the three fixes (done once on import; calling it again changes nothing)."""
    CheckpointLoader.register_scheme(prefixes='', loader=load_from_local, force=True)
    register_backend('local', AtomicLocalBackend, force=True, prefixes='')
    install_cpu_distributed()


install()

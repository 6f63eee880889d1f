"""Building the fused CPU kernels of KCLA (``torch.ops.kcla_mm``), on first use.

- ``csrc/kcla_eval_cpu.cpp`` does a whole KCLA step in eval mode (pooling, the
  per-head math, the state update, the depthwise value convolution, the folded
  norm and gate, ReLU and the residual add) in two passes over the feature
  map, where the plain path runs about 50 ops and 12 passes
  (``torch.ops.kcla_mm.eval_step``); and a residual block's end, its last
  BatchNorms, the add and the ReLU, in one pass (``residual_bn_relu_pool_``,
  ``residual_relu_pool_``; they also return the map's pool, which
  ``eval_step`` accepts in place of its own pooling pass).
- ``csrc/kcla_train_cpu.cpp`` does the training step: the per-head math
  (``head_forward``/``head_backward``) and the feature-map part with
  BatchNorm's batch statistics in four passes (``train_stats``,
  ``train_apply``, ``train_grad_stats``, ``train_backward``), and
  ``step_forward``/``step_backward``, which chain them for one block, and an
  init layer's adaptation of the incoming state (``adapt_forward``/
  ``adapt_backward``: the strided grouped ``adjust``, ``norm_u`` and the
  pool, two passes each way), and a residual block's end in training
  (``block_end_forward``/``block_end_backward``: its last BatchNorm and its
  shortcut's, the add, the ReLU and the pool; one pass after each norm's
  statistics forward, two backward); the autograd side is
  :mod:`kcla_mm.ops.fused.cpu_autograd`.

Both are compiled with :func:`torch.utils.cpp_extension.load` (needs a C++
compiler and ``ninja``, which ``tools/setup_env.sh`` installs) into torch's
extension cache, once per machine type, as one library.

Where it cannot be built the plain path runs, after one warning. Environment:

- ``KCLA_MM_CPU_KERNELS=0``: never build or use the kernels (the default of
  :func:`kcla_mm.ops.set_fused_kernels`).
- ``KCLA_MM_CPU_KERNELS=require``: a failed build raises instead of warning
  (CI uses this, so a broken build cannot hide behind the fallback).
- ``KCLA_MM_CPU_STAGE_ROWS=1`` / ``0``: whether ``eval_step`` copies the rows
  its convolution reads into a padded ring (default: where L1 has fewer than
  12 ways; see ``stage_rows`` in ``csrc/kcla_cpu.h``). The numbers are the
  same either way; the tests use it to check that.

Build ahead of time (e.g. in a Docker image): ``python -m kcla_mm.ops.fused.build``.
"""
import hashlib
import os
import platform
import re
import threading
import warnings
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..config import ENV, use_fused_kernels

_CSRC = Path(__file__).with_name('csrc')
_SOURCES = (_CSRC / 'kcla_eval_cpu.cpp', _CSRC / 'kcla_train_cpu.cpp')
_HEADERS = (_CSRC / 'kcla_cpu.h', )
#: the ops the build registers under ``torch.ops.kcla_mm``
OPS = ('eval_step', 'residual_relu_pool_', 'residual_relu_pool_mask_', 'relu_pool_backward',
       'residual_bn_relu_pool_',
       'train_stats', 'train_apply', 'train_grad_stats', 'train_backward', 'tail_coeffs',
       'tail_grad_coeffs', 'tail_param_grads', 'head_forward', 'head_backward', 'step_forward',
       'step_backward', 'adapt_forward', 'adapt_backward', 'block_end_forward',
       'block_end_backward')
_LOCK = threading.Lock()
_STATE: dict = {}  # 'ok': bool once tried, 'error': the build error


def _mode() -> str:
    return os.environ.get(ENV, '1').strip().lower()


def enabled() -> bool:
    """Whether the kernels may be used at all (:func:`kcla_mm.ops.use_fused_kernels`)."""
    return use_fused_kernels()


def _cpu_tag() -> str:
    """Names the build after the CPU's instruction sets (it is built with ``-march=native``)."""
    flags = ''
    try:
        for line in Path('/proc/cpuinfo').read_text().splitlines():
            if line.startswith('flags'):
                flags = line
                break
    except OSError:
        pass
    key = '|'.join((flags, platform.machine(), torch.__version__)
                   + tuple(p.read_text() for p in _SOURCES + _HEADERS))
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def compile_flags() -> list:
    """The C++ flags of the build: optimised for this machine's CPU, with OpenMP."""
    flags = ['-O3', '-fopenmp']
    if platform.machine() in ('x86_64', 'AMD64', 'aarch64', 'arm64'):
        flags.append('-march=native' if platform.machine() in ('x86_64', 'AMD64')
                     else '-mcpu=native')
    return flags


def _cpp_extension_load():
    """``torch.utils.cpp_extension.load``, imported without its CUDA_HOME warning.

    A CUDA build of torch on a machine without a GPU warns at that import that
    no CUDA runtime is found; these kernels are C++ for the CPU and never use it.
    """
    import logging
    logger = logging.getLogger('torch.utils.cpp_extension')
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torch.utils.cpp_extension import load
    finally:
        logger.setLevel(level)
    return load


def _build(verbose: bool = False) -> None:
    load = _cpp_extension_load()
    load(name=f'kcla_mm_cpu_{_cpu_tag()}', sources=[str(p) for p in _SOURCES],
         extra_cflags=compile_flags(), extra_ldflags=['-fopenmp'], is_python_module=False,
         verbose=verbose)


def available(build: bool = True) -> bool:
    """Whether the ops of ``torch.ops.kcla_mm`` can be called (builds them on first use).

    Raises:
        RuntimeError: the build failed and ``KCLA_MM_CPU_KERNELS=require``.
    """
    if not enabled():
        return False
    if _STATE.get('ok'):
        return True
    if 'ok' not in _STATE and not build:
        return False
    with _LOCK:
        if 'ok' not in _STATE:
            try:
                _build()
                _STATE['ok'] = all(hasattr(torch.ops.kcla_mm, op) for op in OPS)
            except Exception as e:  # compiler missing, ninja missing, build error
                _STATE['ok'] = False
                _STATE['error'] = e
                if _mode() != 'require':
                    warnings.warn(
                        'kcla_mm: could not build the fused KCLA CPU kernels, using the eager '
                        f'path (slower, same numbers): {type(e).__name__}: {e}', RuntimeWarning)
    if not _STATE['ok'] and _mode() == 'require':
        raise RuntimeError('kcla_mm: KCLA_MM_CPU_KERNELS=require but the fused CPU kernels '
                           f'could not be built: {_STATE.get("error")!r}')
    return _STATE['ok']


def build_error() -> Optional[BaseException]:
    """The exception of a failed build, if any."""
    return _STATE.get('error')


_LIBRARY = re.compile(r'TORCH_LIBRARY(_FRAGMENT|_IMPL)?\(kcla_mm\b')


def renamespaced(source: str, namespace: str) -> str:
    """Kernel source text with its ops registered under ``torch.ops.<namespace>``."""
    return _LIBRARY.sub(lambda m: f'TORCH_LIBRARY{m.group(1) or ""}({namespace}', source)


def build_variant(csrc: Path, workdir: Path, prefix: str,
                  flags: Optional[Sequence[str]] = None) -> str:
    """Compile the kernel sources of ``csrc`` with their ops under a namespace of their own.

    For side-by-side builds in one process: another version of the sources
    (``tools/analysis_tools/benchmark_cpu_ops.py --against``), or the same
    sources for other instruction sets (the tests). The namespace,
    ``<prefix>_<digest of the sources and flags>``, is returned; the ops are
    ``getattr(torch.ops, namespace)``.

    Args:
        csrc: a folder of kernel sources, as ``kcla_mm/ops/fused/csrc``.
        workdir: where the renamed sources are written.
        prefix: the namespace's start (a C++ identifier).
        flags: the C++ flags; default :func:`compile_flags`.

    Raises:
        FileNotFoundError: ``csrc`` has no ``.cpp`` file.
    """
    csrc = Path(csrc)
    sources = sorted(csrc.glob('*.cpp'))
    if not sources:
        raise FileNotFoundError(f'{csrc}: no .cpp files there (expected a kcla_mm/ops/fused/csrc)')
    flags = list(compile_flags() if flags is None else flags)
    digest = hashlib.sha1(b''.join(p.read_bytes() for p in sorted(csrc.iterdir()) if p.is_file())
                          + ' '.join(flags).encode()).hexdigest()[:10]
    namespace = f'{prefix}_{digest}'
    dst = Path(workdir) / namespace
    dst.mkdir(parents=True, exist_ok=True)
    for p in csrc.iterdir():
        if p.is_file():
            text = p.read_text()
            (dst / p.name).write_text(renamespaced(text, namespace) if p.suffix == '.cpp'
                                      else text)
    load = _cpp_extension_load()
    load(name=f'{namespace}_ext', sources=[str(dst / p.name) for p in sources],
         extra_cflags=flags, extra_ldflags=['-fopenmp'], is_python_module=False)
    return namespace


if __name__ == '__main__':
    os.environ.setdefault('KCLA_MM_CPU_KERNELS', 'require')
    _build(verbose=True)
    print('kcla_mm: fused CPU kernels built and loaded:',
          all(hasattr(torch.ops.kcla_mm, op) for op in OPS))

"""The fast paths of the layer-attention operators: fused CPU kernels.

Nothing outside this folder depends on it: the operators reach it only
through :func:`kcla_mm.ops.config.fused_call`, which passes one call here and
falls back to plain torch where this returns ``None`` (or where the folder is
absent). Each entry point decides from its inputs whether it applies.

- :mod:`.cpu`: the rules and the calls (:func:`kcla_step`, :func:`residual_end`);
- :mod:`.cpu_autograd`: the autograd functions of the training kernels;
- :mod:`.build`: building ``csrc/`` into ``torch.ops.kcla_mm`` on first use;
- ``csrc/``: the C++ kernels (``kcla_cpu.h`` shared by both files,
  ``kcla_eval_cpu.cpp`` the eval step and block end, ``kcla_train_cpu.cpp``
  the training step, the per-head math, the adaptation and the block end).
"""
from .cpu import kcla_step, residual_end

__all__ = ['kcla_step', 'residual_end']

"""Distributed training on machines without CUDA, with mmengine 0.10.7.

Two steps of mmengine's ``--launcher pytorch`` path assume GPUs:

- ``mmengine.dist.init_dist`` calls ``torch.cuda.set_device(LOCAL_RANK)``
  before ``init_process_group``; a CPU build of torch has no CUDA bindings
  and raises ``AttributeError: module 'torch._C' has no attribute
  '_cuda_setDevice'``, whatever the backend.
- ``Runner.wrap_model`` passes ``device_ids=[LOCAL_RANK]`` to
  ``MMDistributedDataParallel``; DDP refuses ``device_ids`` for a CPU module.

:func:`install_cpu_distributed` (called by :mod:`kcla_mm.host_fixes`) removes
both assumptions where no accelerator is available and changes nothing where
one is. On CPU the backend must be ``gloo`` (``--cfg-options
env_cfg.dist_cfg.backend=gloo``); NCCL is refused with that hint.

NOTE: mmengine has no public extension point for either step, so both are
wrapped in place: ``init_dist('pytorch')`` calls the private
``mmengine.dist.utils._init_dist_pytorch`` (``Runner.setup_env`` reaches it
from ``env_cfg``, with no registry in between), and ``Runner.wrap_model``
instantiates ``MMDistributedDataParallel`` by class when the config has no
``model_wrapper_cfg`` (its registry is consulted only when one is given).
"""
import functools
import time
from typing import Callable

import torch


def _no_accelerator() -> bool:
    from mmengine.device import (is_cuda_available, is_mlu_available, is_musa_available,
                                 is_npu_available)
    return not (is_cuda_available() or is_mlu_available() or is_npu_available()
                or is_musa_available())


def _cpu_init_dist_pytorch(original: Callable) -> Callable:

    @functools.wraps(original)
    def init(backend: str = 'nccl', init_backend: str = 'torch', **kwargs) -> None:
        if init_backend != 'torch' or not _no_accelerator():
            return original(backend, init_backend=init_backend, **kwargs)
        if backend == 'nccl':
            raise ValueError(
                "dist_cfg backend='nccl' needs CUDA GPUs and none is available; on CPU use "
                "gloo: env_cfg=dict(dist_cfg=dict(backend='gloo')) or "
                '--cfg-options env_cfg.dist_cfg.backend=gloo')
        torch.distributed.init_process_group(backend=backend, **kwargs)

    init.kcla_mm_cpu = True
    return init


def _cpu_ddp_init(original: Callable) -> Callable:

    @functools.wraps(original)
    def __init__(self, module: torch.nn.Module, *args, **kwargs) -> None:
        on_cpu = all(p.device.type == 'cpu' for p in module.parameters())
        if kwargs.get('device_ids') is not None and on_cpu and _no_accelerator():
            kwargs['device_ids'] = None  # DDP's rule for CPU modules
        original(self, module, *args, **kwargs)

    __init__.kcla_mm_cpu = True
    return __init__


def install_cpu_distributed() -> None:
    """Let ``tools/dist_train.sh`` run on CPU (gloo); idempotent, no-op with GPUs."""
    try:
        from mmengine.dist import utils as dist_utils
        from mmengine.model.wrappers import MMDistributedDataParallel
    except ImportError:
        return
    if not getattr(dist_utils._init_dist_pytorch, 'kcla_mm_cpu', False):
        dist_utils._init_dist_pytorch = _cpu_init_dist_pytorch(dist_utils._init_dist_pytorch)
    if not getattr(MMDistributedDataParallel.__init__, 'kcla_mm_cpu', False):
        MMDistributedDataParallel.__init__ = _cpu_ddp_init(MMDistributedDataParallel.__init__)


def shutdown_distributed(drain_s: float = 0.2) -> None:
    """Destroy the default process group, if one was initialised, and let its
    worker threads finish while the interpreter is still alive.

    Without this, one rank of ``tools/dist_train.sh`` occasionally died after
    training had finished, with ``terminate called without an active
    exception`` (SIGABRT). A core dump showed the cause: a gloo worker thread
    was destroying a finished broadcast (the last collective, mmengine's
    metric broadcast) and needed the GIL to release its tensors' Python
    objects; once ``Py_FinalizeEx`` has begun, a thread that asks for the GIL
    is made to exit, and the exit unwinds through a destructor: terminate.

    ``destroy_process_group`` alone does not stop those threads after DDP has
    been used, because DDP keeps references to the group; so the GIL is
    released for ``drain_s`` seconds, which lets a waiting worker finish (no
    new work can be queued once the group is destroyed; even ``sleep(0)``
    usually suffices). Measured with ``tests/test_reliability/exit_worker.py``
    (2 gloo processes: a DDP step, broadcasts, exit): 10 of 20 runs aborted
    with ``destroy_process_group`` alone, 0 of 20 with the wait.
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(drain_s)  # releases the GIL

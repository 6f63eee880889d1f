"""Shared predicates and tiny builders for the test suite."""
import contextlib
import inspect
import os
import os.path as osp
import socket
import subprocess
from typing import Dict, Optional, Sequence

import torch
from torch import nn

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


def assert_finite(t: torch.Tensor, what: str = 'tensor') -> None:
    bad = ~torch.isfinite(t)
    assert not bad.any(), f'{what} has {int(bad.sum())} non-finite values'


def params_without_grad(module: nn.Module):
    """Names of trainable parameters whose .grad is None or all zero."""
    return [n for n, p in module.named_parameters()
            if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)]


def state_bytes(state) -> int:
    """Bytes of all tensors held by an operator state (NamedTuple of tensors or tuples)."""
    total = 0
    for field in state:
        tensors = field if isinstance(field, tuple) else (field, )
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def randomize_norms(module: nn.Module, seed: int = 0) -> None:
    """Give every BatchNorm non-trivial affine parameters and running statistics."""
    g = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)


@contextlib.contextmanager
def torch_threads(n: int):
    """``torch``'s intra-op threads set to ``n`` inside, restored after: the 2 cores
    of a CI machine are shared, and oversubscribing them costs up to 10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def kcla_layer(channels: int, head_dim: int, seed: int = 0, **kwargs) -> nn.Module:
    """A KCLA layer seeded by ``seed``, its norms randomised (:func:`randomize_norms`)
    and ``Phi`` halved: gates away from 0 and 1, outputs of both signs after the norm."""
    from kcla_mm.ops import KCLA
    torch.manual_seed(seed)
    layer = KCLA(channels, head_dim=head_dim, **kwargs)
    randomize_norms(layer, seed)
    with torch.no_grad():
        layer.phi.weight.mul_(0.5)
    return layer


def record_calls(monkeypatch, owner, name: str, what) -> list:
    """Wrap ``owner.name`` (a function, method or static method) to record each call.

    Every call still runs the original; ``what(args, kwargs, result)`` gives what
    is appended to the list returned. ``monkeypatch`` undoes the wrap.
    """
    calls = []
    static = isinstance(inspect.getattr_static(owner, name), staticmethod)
    orig = getattr(owner, name)

    def wrapper(*args, **kwargs):
        result = orig(*args, **kwargs)
        calls.append(what(args, kwargs, result))
        return result

    monkeypatch.setattr(owner, name, staticmethod(wrapper) if static else wrapper)
    return calls


class Doubled(nn.Module):
    """A parametrization (``torch.nn.utils.parametrize``): the weight is twice the original."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


def kernels_called(fn, *args, **kwargs) -> set:
    """Names of the fused kernels (``kcla_mm::*`` ops) that ``fn(*args, **kwargs)`` calls.

    Read from torch's profiler, which records every op the dispatcher runs,
    so a test can check which implementation computed a result.
    """
    return set(kernel_calls(fn, *args, **kwargs)[1])


def kernel_calls(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), Counter of the fused kernels it called)``.

    As :func:`kernels_called`, with ``fn``'s result and how many times each
    ``kcla_mm::*`` op ran (e.g. once per block of a backbone).
    """
    import collections

    from torch.autograd import profiler
    with profiler.profile() as prof:
        result = fn(*args, **kwargs)
    return result, collections.Counter(e.name.split('::', 1)[1] for e in prof.function_events
                                       if e.name.startswith('kcla_mm::'))


def tiny_unet_options(data_root: str, iters: int, val_interval: int) -> list:
    """``--cfg-options`` for the tiny UNet demo configs on ``data_root``: 64x64
    images, batch 4, ``iters`` iterations, validation every ``val_interval``."""
    opts = ['model.data_preprocessor.size=(64,64)',
            'train_dataloader.dataset.pipeline.2.scale=(64,64)', f'train_cfg.max_iters={iters}',
            f'train_cfg.val_interval={val_interval}', f'default_hooks.checkpoint.interval={iters}',
            f'param_scheduler.0.T_max={iters}', f'param_scheduler.0.end={iters}',
            'default_hooks.logger.interval=5', 'train_dataloader.batch_size=4']
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        opts.append(f'{loader}.dataset.data_root={data_root}')
    for loader in ('val_dataloader', 'test_dataloader'):
        opts.append(f'{loader}.dataset.pipeline.1.scale=(64,64)')
    return opts


def load_tool(path, name: str):
    """The module of a script under ``tools/`` (which is no package), loaded as ``name``."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def subprocess_env(**extra: str) -> Dict[str, str]:
    """The environment for child runs: one thread each (2 shared cores), repo importable."""
    env = dict(os.environ)
    env.pop('KCLA_MM_TRUST_CHECKPOINTS', None)
    env.update(OMP_NUM_THREADS='1', MKL_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [env.get('PYTHONPATH')] if p]))
    env.update(extra)
    return env


def subprocess_run(cmd: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None,
                   check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd`` in the repository root; on failure show its output."""
    proc = subprocess.run(list(cmd), cwd=ROOT, env=subprocess_env() if env is None else env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f'{cmd} exited with {proc.returncode}:\n{proc.stdout[-6000:]}')
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

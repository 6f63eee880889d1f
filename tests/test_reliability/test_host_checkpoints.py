"""Checkpoints that mmengine, mmdet and mmseg write in real training runs load safely.

Each host trains 2 iterations (``tools/train.py`` for the mmdet and mmseg
configs, mmengine's ``Runner`` for a plain mmengine model) with what puts the
most into a checkpoint: ``--amp`` (the loss scaler's state beside the
optimizer's), an ``EMAHook`` (``ema_state_dict``), a param scheduler,
``--auto-scale-lr`` and a message-hub buffer that was registered but never
updated. The safe loader (``weights_only=True`` and kcla_mm's allow-list)
must return exactly what an unrestricted load returns, and ``--resume`` must
continue from the file.
"""
import functools
import os.path as osp

import numpy as np
import pytest
import torch
from mmengine.hooks import Hook
from mmengine.logging import HistoryBuffer
from mmengine.registry import HOOKS
from reliability_utils import (TRAIN, run_script, write_det_config, write_det_data,
                               write_seg_config, write_seg_data)

import kcla_mm.host_fixes  # noqa: F401  (the safe loader)
from kcla_mm.utils.checkpoint import safe_load

EMPTY = 'custom/registered_never_updated'  # no train/ prefix: the log processor skips it


@HOOKS.register_module(force=True)
class RegisterEmptyHistoryBufferHook(Hook):
    """Registers a message-hub scalar that is saved with the run but never updated."""

    def before_train(self, runner) -> None:
        runner.message_hub.load_state_dict(dict(
            log_scalars={EMPTY: HistoryBuffer()}, runtime_info={}, resumed_keys={EMPTY: True}))


EXTRA = '''
custom_hooks = [
    dict(type='EMAHook', momentum=0.001, priority=49),
    dict(type='RegisterEmptyHistoryBufferHook'),
]
auto_scale_lr = dict(enable=False, base_batch_size=16)
'''


@pytest.fixture
def amp_on_cpu(monkeypatch):
    """mmengine's ``AmpOptimWrapper`` on CPU: bfloat16 autocast, a CPU ``GradScaler``.

    The wrapper asserts a GPU and builds ``torch.cuda.amp.GradScaler``; what
    it puts into a checkpoint (the scaler's state beside the optimizer's) is
    the same with a CPU scaler.
    """
    from mmengine.optim.optimizer import amp_optimizer_wrapper as amp
    monkeypatch.setattr(amp, 'is_cuda_available', lambda: True)
    monkeypatch.setattr(amp, 'GradScaler', functools.partial(torch.amp.GradScaler, 'cpu'))


def assert_same(a, b, where='checkpoint') -> None:
    """``a`` (safe load) equals ``b`` (unrestricted load) in type and value, recursively."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f'{where}[{k!r}]')
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f'{where}[{i}]')
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, HistoryBuffer):
        for x, y in zip(a.data, b.data):
            assert np.array_equal(x, y), where
    else:
        assert a == b, where


def check_checkpoint(path: str) -> dict:
    got = safe_load(path)
    assert_same(got, torch.load(path, weights_only=False))
    # what the options put into it is there
    assert 'ema_state_dict' in got
    assert got['optimizer']['loss_scaler']['scale'] > 0
    assert got['param_schedulers']
    assert got['message_hub']['log_scalars'][EMPTY].data[0].size == 0
    return got


def train(tmp_path, monkeypatch, cfg: str, *args: str) -> str:
    monkeypatch.setenv('LOCAL_RANK', '0')  # the tool sets it; keep it local to the test
    work = str(tmp_path / 'work')
    run_script(TRAIN, [cfg, '--work-dir', work, '--amp', '--auto-scale-lr'] + list(args),
               monkeypatch)
    return work


@pytest.mark.slow
def test_a_segmentation_run_checkpoint_loads_safely_and_resumes(
        tmp_path, monkeypatch, amp_on_cpu):
    data = write_seg_data(str(tmp_path / 'data'))
    cfg = write_seg_config(str(tmp_path / 'tiny_unet.py'), data, max_iters=2, ckpt_interval=2,
                           extra=EXTRA)
    work = train(tmp_path, monkeypatch, cfg)
    assert check_checkpoint(osp.join(work, 'iter_2.pth'))['meta']['iter'] == 2
    # and the user's --resume continues from it
    train(tmp_path, monkeypatch, cfg, '--resume', '--cfg-options', 'train_cfg.max_iters=3')
    assert check_checkpoint(osp.join(work, 'iter_3.pth'))['meta']['iter'] == 3


@pytest.mark.slow
def test_a_detection_run_checkpoint_loads_safely(tmp_path, monkeypatch, amp_on_cpu):
    # NOTE: mmcv's CPU NMS has no bfloat16 kernel, so the detector computes in
    # float32; the optimizer wrapper and its scaler are those of an AMP run.
    import contextlib

    from mmengine.runner import amp
    monkeypatch.setattr(amp, 'autocast', lambda **kwargs: contextlib.nullcontext())
    data = write_det_data(str(tmp_path / 'coco'), num_train=2, num_val=1)
    cfg = write_det_config(str(tmp_path / 'tiny_frcnn.py'), data, max_iters=2, extra=EXTRA)
    work = train(tmp_path, monkeypatch, cfg)
    got = check_checkpoint(osp.join(work, 'iter_2.pth'))
    assert got['meta']['dataset_meta']['classes'] == ('circle', 'square', 'triangle')


def toy_model():
    from mmengine.model import BaseModel

    class Toy(BaseModel):

        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)
            self.norm = torch.nn.BatchNorm1d(2)

        def forward(self, inputs, labels=None, mode='tensor'):
            out = self.norm(self.linear(torch.stack(inputs)))
            if mode == 'loss':
                return dict(loss=(out - torch.stack(labels)).square().mean())
            return out

    return Toy()


@pytest.mark.slow
def test_a_plain_mmengine_run_checkpoint_loads_safely(tmp_path, amp_on_cpu):
    from mmengine.runner import Runner
    from torch.utils.data import DataLoader
    generator = torch.Generator().manual_seed(0)
    samples = [dict(inputs=torch.rand(4, generator=generator),
                    labels=torch.rand(2, generator=generator)) for _ in range(8)]
    runner = Runner(
        model=toy_model(), work_dir=str(tmp_path / 'work'),
        train_dataloader=DataLoader(samples, batch_size=4, collate_fn=lambda b: {
            'inputs': [s['inputs'] for s in b], 'labels': [s['labels'] for s in b]}),
        optim_wrapper=dict(type='AmpOptimWrapper', optimizer=dict(type='SGD', lr=0.1)),
        param_scheduler=dict(type='LinearLR', start_factor=0.5, by_epoch=False, begin=0, end=2),
        train_cfg=dict(by_epoch=False, max_iters=2),
        auto_scale_lr=dict(enable=True, base_batch_size=8),
        default_hooks=dict(checkpoint=dict(type='CheckpointHook', interval=2, by_epoch=False)),
        custom_hooks=[dict(type='EMAHook', momentum=0.01),
                      dict(type='RegisterEmptyHistoryBufferHook')],
        default_scope='mmengine')
    runner.train()
    check_checkpoint(osp.join(str(tmp_path / 'work'), 'iter_2.pth'))

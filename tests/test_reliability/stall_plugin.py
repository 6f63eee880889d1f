"""Test plugin: freeze a training run while it saves a checkpoint or while it validates.

Imported by the resume tests' config (``custom_imports``), which also lists
``dict(type='StallDuringValidationHook')`` in ``custom_hooks``. Both do
nothing unless the environment asks:

- ``KCLA_TEST_STALL_ON=iter_4.pth``: the ``os.replace`` that would move that
  checkpoint onto its final name first creates ``KCLA_TEST_STALL_MARKER`` and
  then sleeps, so that the test can SIGKILL the run while the checkpoint
  exists only as a temporary file.
- ``KCLA_TEST_STALL_IN_VAL=4``: the validation after iteration 4 creates the
  marker before its first batch and sleeps, so that the test can SIGKILL the
  run in the middle of validating.
"""
import os
import os.path as osp
import time

from mmengine.hooks import Hook
from mmengine.registry import HOOKS

_STALL_ON = os.environ.get('KCLA_TEST_STALL_ON')
_STALL_IN_VAL = os.environ.get('KCLA_TEST_STALL_IN_VAL')
_MARKER = os.environ.get('KCLA_TEST_STALL_MARKER')


def _stall(note: str) -> None:
    with open(_MARKER, 'w') as f:
        f.write(note)
    time.sleep(600)


if _STALL_ON and _MARKER:
    _replace = os.replace

    def _stalling_replace(src, dst, *args, **kwargs):
        if osp.basename(os.fspath(dst)) == _STALL_ON:
            _stall(os.fspath(src))
        return _replace(src, dst, *args, **kwargs)

    os.replace = _stalling_replace


@HOOKS.register_module(force=True)
class StallDuringValidationHook(Hook):
    """Stalls the validation after iteration ``KCLA_TEST_STALL_IN_VAL``, if set."""

    def before_val_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        if _STALL_IN_VAL and _MARKER and batch_idx == 0 and runner.iter == int(_STALL_IN_VAL):
            _stall(f'validating after iteration {runner.iter}')

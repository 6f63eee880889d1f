"""Resume after SIGKILL: the run continues where it stopped and ends bit-identical.

A real ``tools/train.py`` run (tiny KCLA UNet, synthetic 32x32 data,
``IterBasedTrainLoop`` of 6 iterations, a checkpoint and a validation every
2, deterministic single-threaded CPU) is killed with SIGKILL

- while it saves the checkpoint of iteration 4, after the one of iteration 2
  was written: ``--resume`` continues from iteration 2, the last complete
  checkpoint;
- while it validates after iteration 4: ``--resume`` continues from
  iteration 4.

Either way its final weights equal those of an uninterrupted run with the
same seed, which runs beside the killed ones.
"""
import glob
import json
import os
import os.path as osp
import signal
import subprocess
import sys
import time

import pytest
import torch
from reliability_utils import ROOT, TRAIN, write_seg_config, write_seg_data
from utils import subprocess_env, subprocess_run

from kcla_mm.utils.checkpoint import safe_load

PLUGIN_DIR = osp.dirname(osp.abspath(__file__))
RUN_TIMEOUT = 300


def _env(**extra: str) -> dict:
    env = subprocess_env(**extra)
    env['PYTHONPATH'] = os.pathsep.join([PLUGIN_DIR, env['PYTHONPATH']])
    return env


def _train(cfg: str, work_dir: str, *args: str) -> list:
    return [sys.executable, TRAIN, cfg, '--work-dir', work_dir] + list(args)


@pytest.fixture(scope='module')
def config(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp('resume')
    data = write_seg_data(str(root / 'data'))
    extra = ("custom_imports = dict(imports=['kcla_mm', 'kcla_mm.host_fixes', 'stall_plugin'], "
             'allow_failed_imports=False)\n'
             "custom_hooks = [dict(type='StallDuringValidationHook')]\n"
             'train_cfg = dict(max_iters=max_iters, val_interval=2)\n')
    return write_seg_config(str(root / 'tiny_unet.py'), data, max_iters=6, ckpt_interval=2,
                            extra=extra)


class Reference:
    """The uninterrupted run, started once and running beside the killed ones."""

    def __init__(self, cfg: str, work_dir: str) -> None:
        self.work_dir = work_dir
        self.proc = subprocess.Popen(_train(cfg, work_dir), cwd=ROOT, env=_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._final = None

    def final_state_dict(self) -> dict:
        if self._final is None:
            out, _ = self.proc.communicate(timeout=RUN_TIMEOUT)
            assert self.proc.returncode == 0, out[-6000:]
            ckpt = safe_load(osp.join(self.work_dir, 'iter_6.pth'))
            assert ckpt['meta']['iter'] == 6
            self._final = ckpt['state_dict']
        return self._final


@pytest.fixture(scope='module')
def reference(config, tmp_path_factory):
    ref = Reference(config, str(tmp_path_factory.mktemp('reference')))
    yield ref
    if ref.proc.poll() is None:
        ref.proc.kill()
        ref.proc.wait()


def _logged_iters(work_dir: str, timestamp_dir: str) -> list:
    path = osp.join(work_dir, timestamp_dir, 'vis_data', 'scalars.json')
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r['iter'] for r in rows if 'loss' in r]


def _kill_when_stalled(cmd: list, marker: str, **stall: str) -> None:
    """Run ``cmd`` until the stall plugin creates ``marker``, then SIGKILL it."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env(KCLA_TEST_STALL_MARKER=marker, **stall))
    try:
        end = time.monotonic() + RUN_TIMEOUT
        while not osp.exists(marker):
            if proc.poll() is not None:
                raise AssertionError(f'the run ended (rc={proc.returncode}) before stalling:\n'
                                     f'{proc.stdout.read()[-6000:]}')
            assert time.monotonic() < end, f'{marker} did not appear within {RUN_TIMEOUT}s'
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _resume_and_compare(cfg: str, run_dir: str, from_iter: int, reference: Reference) -> None:
    first_run = set(os.listdir(run_dir))
    out = subprocess_run(_train(cfg, run_dir, '--resume'), timeout=RUN_TIMEOUT,
                         env=_env()).stdout
    assert f'resumed epoch: 0, iter: {from_iter}' in out
    (resumed_ts, ) = [d for d in set(os.listdir(run_dir)) - first_run
                      if osp.isdir(osp.join(run_dir, d))]
    assert _logged_iters(run_dir, resumed_ts) == list(range(from_iter + 1, 7))

    got = safe_load(osp.join(run_dir, 'iter_6.pth'))
    want = reference.final_state_dict()
    assert got['meta']['iter'] == 6
    assert list(got['state_dict']) == list(want)
    differ = [k for k, v in want.items() if not torch.equal(v, got['state_dict'][k])]
    assert differ == [], f'resumed weights differ from the uninterrupted run: {differ[:5]}'
    # and training did change them: the comparison is not between two initialisations
    init = safe_load(osp.join(run_dir, 'iter_2.pth'))['state_dict']
    assert any(not torch.equal(v, init[k]) for k, v in want.items() if v.is_floating_point())


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_save_then_resume_equals_uninterrupted_run(
        tmp_path, config, reference):
    run_dir = str(tmp_path / 'interrupted')
    _kill_when_stalled(_train(config, run_dir), str(tmp_path / 'stalled'),
                       KCLA_TEST_STALL_ON='iter_4.pth')
    # Killed mid-save: iteration 2 is complete, iteration 4 never reached its name.
    assert safe_load(osp.join(run_dir, 'iter_2.pth'))['meta']['iter'] == 2
    assert not osp.exists(osp.join(run_dir, 'iter_4.pth'))
    assert glob.glob(osp.join(run_dir, '.iter_4.pth.tmp-*')), 'the save was not in progress'
    with open(osp.join(run_dir, 'last_checkpoint')) as f:
        assert f.read().strip().endswith('iter_2.pth')
    _resume_and_compare(config, run_dir, 2, reference)


@pytest.mark.slow
def test_sigkill_during_validation_then_resume_equals_uninterrupted_run(
        tmp_path, config, reference):
    run_dir = str(tmp_path / 'interrupted')
    marker = str(tmp_path / 'stalled')
    _kill_when_stalled(_train(config, run_dir), marker, KCLA_TEST_STALL_IN_VAL='4')
    with open(marker) as f:
        assert f.read() == 'validating after iteration 4'
    # the checkpoint of iteration 4 was written before the validation began
    assert safe_load(osp.join(run_dir, 'iter_4.pth'))['meta']['iter'] == 4
    with open(osp.join(run_dir, 'last_checkpoint')) as f:
        assert f.read().strip().endswith('iter_4.pth')
    _resume_and_compare(config, run_dir, 4, reference)

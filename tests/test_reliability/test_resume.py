"""Resume after SIGKILL: the run continues where it stopped and ends bit-identical.

A real ``tools/train.py`` run (tiny KCLA UNet, synthetic 32x32 data,
``IterBasedTrainLoop`` of 6 iterations, a checkpoint every 2, deterministic
single-threaded CPU) is killed with SIGKILL while it saves the checkpoint of
iteration 4, after the one of iteration 2 was written. ``--resume`` then
continues from iteration 2 (the last complete checkpoint), and its final
weights equal those of an uninterrupted run with the same seed.
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
from reliability_utils import (ROOT, TRAIN, subprocess_env, subprocess_run, write_seg_config,
                               write_seg_data)

from kcla_mm.utils.checkpoint import safe_load

PLUGIN_DIR = osp.dirname(osp.abspath(__file__))
RUN_TIMEOUT = 240


def _config(tmp_path) -> str:
    data = write_seg_data(str(tmp_path / 'data'))
    extra = "custom_imports = dict(imports=['kcla_mm', 'stall_plugin'], " \
            'allow_failed_imports=False)\n'
    return write_seg_config(str(tmp_path / 'tiny_unet.py'), data, max_iters=6,
                            ckpt_interval=2, extra=extra)


def _env(**extra: str) -> dict:
    env = subprocess_env(**extra)
    env['PYTHONPATH'] = os.pathsep.join([PLUGIN_DIR, env['PYTHONPATH']])
    return env


def _logged_iters(work_dir: str, timestamp_dir: str) -> list:
    path = osp.join(work_dir, timestamp_dir, 'vis_data', 'scalars.json')
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r['iter'] for r in rows if 'loss' in r]


def _wait_for(path: str, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not osp.exists(path):
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ''
            raise AssertionError(f'the run ended (rc={proc.returncode}) before stalling:\n'
                                 f'{out[-6000:]}')
        if time.monotonic() > end:
            proc.kill()
            raise AssertionError(f'{path} did not appear within {timeout}s')
        time.sleep(0.2)


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_save_then_resume_equals_uninterrupted_run(tmp_path):
    cfg = _config(tmp_path)
    ref_dir, run_dir = str(tmp_path / 'reference'), str(tmp_path / 'interrupted')
    marker = str(tmp_path / 'stalled')
    train = [sys.executable, TRAIN, cfg, '--work-dir']
    # The uninterrupted reference and the run to be killed, side by side.
    ref = subprocess.Popen(train + [ref_dir], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    victim = subprocess.Popen(
        train + [run_dir], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=_env(KCLA_TEST_STALL_ON='iter_4.pth', KCLA_TEST_STALL_MARKER=marker))
    try:
        _wait_for(marker, victim, RUN_TIMEOUT)
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(timeout=30) == -signal.SIGKILL
        ref_out, _ = ref.communicate(timeout=RUN_TIMEOUT)
        assert ref.returncode == 0, ref_out[-6000:]
    finally:
        for p in (ref, victim):
            if p.poll() is None:
                p.kill()

    # Killed mid-save: iteration 2 is complete, iteration 4 never reached its name.
    assert safe_load(osp.join(run_dir, 'iter_2.pth'))['meta']['iter'] == 2
    assert not osp.exists(osp.join(run_dir, 'iter_4.pth'))
    assert glob.glob(osp.join(run_dir, '.iter_4.pth.tmp-*')), 'the save was not in progress'
    with open(osp.join(run_dir, 'last_checkpoint')) as f:
        assert f.read().strip().endswith('iter_2.pth')
    first_run = set(os.listdir(run_dir))

    out = subprocess_run(train + [run_dir, '--resume'], timeout=RUN_TIMEOUT, env=_env()).stdout
    assert 'resumed epoch: 0, iter: 2' in out
    (resumed_ts, ) = [d for d in set(os.listdir(run_dir)) - first_run
                      if osp.isdir(osp.join(run_dir, d))]
    assert _logged_iters(run_dir, resumed_ts) == [3, 4, 5, 6]

    got = safe_load(osp.join(run_dir, 'iter_6.pth'))
    want = safe_load(osp.join(ref_dir, 'iter_6.pth'))
    assert got['meta']['iter'] == want['meta']['iter'] == 6
    assert list(got['state_dict']) == list(want['state_dict'])
    differ = [k for k, v in want['state_dict'].items() if not torch.equal(v, got['state_dict'][k])]
    assert differ == [], f'resumed weights differ from the uninterrupted run: {differ[:5]}'
    # and training did change them: the comparison is not between two initialisations
    init = safe_load(osp.join(run_dir, 'iter_2.pth'))['state_dict']
    assert any(not torch.equal(v, init[k]) for k, v in want['state_dict'].items()
               if v.is_floating_point())

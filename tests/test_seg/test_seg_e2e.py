"""End to end: synthetic download -> converter -> tools/train.py -> tools/test.py."""
import glob
import importlib.util
import json
import os.path as osp
import subprocess
import sys

import pytest
from utils import tiny_unet_options

from kcla_mm.datasets.synthetic_medical import generate

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CONFIG = osp.join(ROOT, 'configs', 'unet',
                  'unet_kcla-r18-tiny_1xb8-300i_synthetic-kvasir-128x128.py')
ITERS = 30
METRICS = ('fg_IoU', 'fg_DSC', 'mIoU', 'mDice')


def kvasir_converter():
    tools = osp.join(ROOT, 'tools', 'dataset_converters')
    if tools not in sys.path:
        sys.path.insert(0, tools)
    spec = importlib.util.spec_from_file_location('kvasir_seg', osp.join(tools, 'kvasir_seg.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(cmd, cwd):
    proc = subprocess.run([sys.executable] + cmd, capture_output=True, text=True, cwd=cwd)
    assert proc.returncode == 0, f'{cmd[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}'
    return proc


def small(data_root: str):
    """cfg-options: the demo config on ``data_root`` at 64x64, for ITERS iterations."""
    return tiny_unet_options(data_root, ITERS, ITERS)


def json_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_train_checkpoint_and_test_reproduces_the_metrics(tmp_path):
    generate('kvasir', str(tmp_path / 'download'), num=20, size=64, seed=0)
    data = str(tmp_path / 'data')
    # (the converter's command line is tested in test_converters.py)
    assert kvasir_converter().main([str(tmp_path / 'download'), '--out', data]) == 0
    train_dir = tmp_path / 'train'
    run(['tools/train.py', CONFIG, '--work-dir', str(train_dir), '--cfg-options'] + small(data),
        ROOT)
    ckpt = train_dir / f'iter_{ITERS}.pth'
    assert ckpt.is_file()
    (scalars, ) = glob.glob(str(train_dir / '*' / 'vis_data' / 'scalars.json'))
    logged = json_lines(scalars)
    losses = [entry['loss'] for entry in logged if 'loss' in entry]
    assert len(losses) >= 3 and losses[-1] < losses[0]
    (val, ) = [entry for entry in logged if 'fg_IoU' in entry]

    test_dir = tmp_path / 'test'
    run(['tools/test.py', CONFIG, str(ckpt), '--work-dir', str(test_dir), '--show-dir',
         str(tmp_path / 'overlays'), '--cfg-options'] + small(data)
        + ['default_hooks.visualization.interval=1'], ROOT)
    dumps = glob.glob(str(test_dir / '*' / '*.json'))
    assert len(dumps) == 1, dumps
    (tested, ) = json_lines(dumps[0])
    for key in METRICS:
        assert tested[key] == pytest.approx(val[key], abs=1e-6), key
    assert 0 <= tested['fg_DSC'] <= 100
    overlays = glob.glob(str(tmp_path / 'overlays' / '**' / '*.png'), recursive=True)
    assert len(overlays) == 6  # one per val image (6 of 20 at 7:3)

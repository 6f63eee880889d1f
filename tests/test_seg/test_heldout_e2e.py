"""Held-out test protocol end to end: a three-way split, the best checkpoint
chosen on val, the test split reported with it (checked against the written
predictions)."""
import glob
import json
import os
import os.path as osp
import re
import subprocess
import sys

import cv2
import numpy as np
import pytest
from utils import tiny_unet_options

from kcla_mm.datasets.synthetic_medical import generate

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CONFIG = osp.join(ROOT, 'configs', 'unet', 'heldout',
                  'unet_kcla-r18-tiny_1xb8-300i_synthetic-kvasir-heldout-128x128.py')
ITERS = 30
VAL_INTERVAL = 10


def tiny(data_root: str, iters: int = ITERS, val_interval: int = VAL_INTERVAL):
    """cfg-options: the held-out demo config on ``data_root`` at 64x64 for ``iters``."""
    return tiny_unet_options(data_root, iters, val_interval)


def three_way_data(tmp_path) -> str:
    """20 synthetic pairs at 64 px, converted 12/4/4 (train/val/test)."""
    sys.path.insert(0, osp.join(ROOT, 'tools', 'dataset_converters'))
    try:
        import kvasir_seg
    finally:
        sys.path.pop(0)
    generate('kvasir', str(tmp_path / 'download'), num=20, size=64, seed=0)
    data = str(tmp_path / 'data')
    assert kvasir_seg.main([str(tmp_path / 'download'), '--out', data, '--ratio', '0.6',
                            '--test-ratio', '0.2']) == 0
    return data


def split_names(data: str) -> dict:
    splits: dict = {}
    with open(osp.join(data, 'splits.txt')) as f:
        for line in f:
            name, split = line.split()
            splits.setdefault(split, []).append(name)
    return splits


def run(cmd):
    proc = subprocess.run([sys.executable] + cmd, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, f'{cmd[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}'
    return proc


def json_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_selects_on_val_and_reports_on_test(tmp_path):
    data = three_way_data(tmp_path)
    splits = split_names(data)
    assert {s: len(n) for s, n in splits.items()} == dict(train=12, val=4, test=4)

    train_dir = tmp_path / 'train'
    run(['tools/train.py', CONFIG, '--work-dir', str(train_dir), '--cfg-options']
        + tiny(data))
    (scalars, ) = glob.glob(str(train_dir / '*' / 'vis_data' / 'scalars.json'))
    val = [e for e in json_lines(scalars) if 'fg_DSC' in e]
    assert [e['step'] for e in val] == [10, 20, 30]
    # The checkpoint kept is that of the first best val fg_DSC.
    best = max(val, key=lambda e: e['fg_DSC'])
    (ckpt, ) = glob.glob(str(train_dir / 'best_fg_DSC_iter_*.pth'))
    assert int(re.search(r'iter_(\d+)\.pth$', ckpt)[1]) == best['step']

    preds = tmp_path / 'preds'
    run(['tools/test.py', CONFIG, ckpt, '--work-dir', str(tmp_path / 'test'), '--out',
         str(preds), '--cfg-options'] + tiny(data))
    (dump, ) = glob.glob(str(tmp_path / 'test' / '*' / '*.json'))
    (tested, ) = json_lines(dump)
    # The predictions written are those of the test images, and only those.
    assert sorted(osp.splitext(f)[0] for f in os.listdir(preds)) == sorted(splits['test'])
    # Recompute the scores from the written masks: pooled and per image.
    counts = []
    for name in splits['test']:
        pred = cv2.imread(str(preds / f'{name}.png'), cv2.IMREAD_UNCHANGED) == 1
        gt = cv2.imread(osp.join(data, 'masks', 'test', f'{name}.png'),
                        cv2.IMREAD_UNCHANGED) == 1
        assert pred.shape == gt.shape  # scored at the original resolution
        counts.append([(pred & gt).sum(), (pred & ~gt).sum(), (~pred & gt).sum(),
                       (~pred & ~gt).sum()])
    tp, fp, fn, tn = np.sum(counts, axis=0)
    assert tested['fg_IoU'] == pytest.approx(100 * tp / (tp + fp + fn))
    assert tested['fg_DSC'] == pytest.approx(200 * tp / (2 * tp + fp + fn))
    assert tested['fg_Sen'] == pytest.approx(100 * tp / (tp + fn))
    assert tested['fg_Spe'] == pytest.approx(100 * tn / (tn + fp))
    dice = [2 * a / (2 * a + b + c) if a + b + c else 1.0 for a, b, c, _ in counts]
    assert tested['img_mDice'] == pytest.approx(100 * np.mean(dice))

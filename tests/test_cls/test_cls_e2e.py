"""End to end: tools/run_demo_cls.py (synthetic CIFAR-100 -> train -> init -> test)."""
import json
import os.path as osp
import subprocess
import sys

import pytest

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
ITERS = 60
CLASSES = 10


@pytest.mark.slow
def test_demo_trains_well_above_its_untrained_model_and_chance(tmp_path):
    work = tmp_path / 'demo'
    proc = subprocess.run(
        [sys.executable, 'tools/run_demo_cls.py', '--work-dir', str(work), '--iters', str(ITERS),
         '--classes', str(CLASSES), '--num-train', '100', '--num-test', '20'],
        capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, f'{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}'
    assert (work / 'train' / f'iter_{ITERS}.pth').is_file()
    assert (work / 'untrained.pth').is_file()
    with open(work / 'results.json') as f:
        summary = json.load(f)
    top1 = {name: summary['results'][name]['accuracy/top1'] for name in ('untrained', 'trained')}
    chance = summary['chance']['accuracy/top1']
    assert chance == pytest.approx(100 / CLASSES)
    # 200 test images: the binomial standard error of an accuracy is at most
    # 3.5 points, so 30 points over the untrained model and three times chance
    # are far outside noise (a run of this test gave 83.5 against 12.5).
    assert top1['trained'] >= top1['untrained'] + 30, top1
    assert top1['trained'] >= 3 * chance, top1
    assert 'untrained' in proc.stdout and 'chance' in proc.stdout

"""tools/analysis_tools/multi_run.py: mean ± std over runs."""
import glob
import json
import math
import os.path as osp
import subprocess
import sys

import numpy as np
import pytest
from test_heldout_e2e import CONFIG, ROOT, three_way_data, tiny
from utils import load_tool

TOOL = osp.join(ROOT, 'tools', 'analysis_tools', 'multi_run.py')


@pytest.fixture(scope='module')
def multi_run():
    return load_tool(TOOL, 'multi_run')


def test_summary_is_mean_and_sample_std_by_hand(multi_run):
    runs = [dict(mIoU=90.0, fg_IoU=80.0, img_mDice=70.0),
            dict(mIoU=91.0, fg_IoU=84.0, img_mDice=70.0),
            dict(mIoU=95.0, fg_IoU=82.0, img_mDice=70.0)]
    summary = multi_run.summarize(runs)
    assert list(summary) == ['fg_IoU', 'img_mDice', 'mIoU']  # paper metrics first
    assert summary['fg_IoU'] == dict(mean=pytest.approx(82.0), std=pytest.approx(2.0), n=3)
    # mIoU: deviations -2, -1, 3 -> sum of squares 14 over n - 1 = 2.
    assert summary['mIoU']['std'] == pytest.approx(math.sqrt(7))
    assert summary['img_mDice']['std'] == 0
    table = multi_run.format_table(['seed 0', 'seed 1', 'seed 2'], runs, summary)
    assert '82.00 ± 2.00' in table and '92.00 ± 2.65' in table
    assert table.splitlines()[0].split() == ['metric', 'mean', '±', 'std', 'seed', '0', 'seed',
                                             '1', 'seed', '2']


def test_one_run_or_a_nan_has_no_std(multi_run):
    assert multi_run.summarize([dict(fg_IoU=80.0)])['fg_IoU'] == dict(mean=80.0, std=None, n=1)
    nan = multi_run.summarize([dict(fg_IoU=math.nan), dict(fg_IoU=1.0)])['fg_IoU']
    assert nan['mean'] is None and nan['std'] is None


def test_best_checkpoint_must_be_unique(multi_run, tmp_path):
    with pytest.raises(FileNotFoundError, match='save_best'):
        multi_run.best_checkpoint(str(tmp_path))
    (tmp_path / 'best_fg_DSC_iter_10.pth').write_bytes(b'')
    assert multi_run.best_checkpoint(str(tmp_path)).endswith('best_fg_DSC_iter_10.pth')
    (tmp_path / 'best_mIoU_iter_20.pth').write_bytes(b'')
    with pytest.raises(ValueError, match='best_mIoU_iter_20.pth'):
        multi_run.best_checkpoint(str(tmp_path))
    assert multi_run.best_checkpoint(str(tmp_path), 'best_mIoU_*.pth').endswith('20.pth')


@pytest.mark.slow
def test_two_seeds_give_mean_and_std_of_the_test_scores(tmp_path):
    data = three_way_data(tmp_path)
    work = tmp_path / 'runs'
    proc = subprocess.run([sys.executable, TOOL, CONFIG, '--seeds', '0', '1', '--work-dir',
                           str(work), '--cfg-options'] + tiny(data, iters=20),
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((work / 'multi_run.json').read_text())
    assert result['held_out'] and result['test_split'].endswith('images/test')
    assert [r['seed'] for r in result['runs']] == [0, 1]
    for run in result['runs']:
        # Each run's scores are those tools/test.py logged for its best checkpoint.
        assert osp.basename(run['checkpoint']).startswith('best_fg_DSC_iter_')
        (dump, ) = glob.glob(osp.join(run['work_dir'], 'test', '*', '*.json'))
        with open(dump) as f:
            logged = json.loads(f.readline())
        for key, value in run['metrics'].items():
            assert logged[key] == pytest.approx(value), key
    first, second = (r['metrics'] for r in result['runs'])
    assert first['fg_DSC'] != second['fg_DSC']  # the seeds trained different models
    for key in ('fg_IoU', 'fg_DSC', 'fg_Acc', 'fg_Sen', 'fg_Spe', 'img_mDice', 'img_mIoU',
                'mIoU', 'mDice'):
        values = [first[key], second[key]]
        stats = result['summary'][key]
        assert stats['mean'] == pytest.approx(np.mean(values))
        assert stats['std'] == pytest.approx(abs(values[0] - values[1]) / math.sqrt(2))
        row = f'{stats["mean"]:.2f} ± {stats["std"]:.2f}'
        assert any(line.split()[:1] == [key] and row in line
                   for line in proc.stdout.splitlines()), proc.stdout[-3000:]
    assert 'NOTE' not in proc.stdout  # held out: no warning

    # --gather evaluates the finished runs again, without training: same scores.
    gathered = tmp_path / 'gathered'
    proc = subprocess.run([sys.executable, TOOL, CONFIG, '--gather', str(work / 'seed_0'),
                           str(work / 'seed_1'), '--work-dir', str(gathered), '--cfg-options']
                          + tiny(data, iters=20), capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = json.loads((gathered / 'multi_run.json').read_text())
    assert [r['label'] for r in again['runs']] == ['seed_0', 'seed_1']
    assert '[multi_run] training' not in proc.stdout
    for run, before in zip(again['runs'], result['runs']):
        assert run['checkpoint'] == before['checkpoint']
        assert run['metrics'] == pytest.approx(before['metrics'])

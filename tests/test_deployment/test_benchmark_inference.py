"""tools/analysis_tools/benchmark_inference.py: its table and its interleaved timing."""
import json
import os.path as osp

import pytest
from utils import load_tool

pytest.importorskip('onnxruntime', reason='the deploy extra is not installed '
                    '(pip install -e .[deploy])')

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOL = osp.join(ROOT, 'tools', 'analysis_tools', 'benchmark_inference.py')


bench = load_tool(TOOL, 'kcla_benchmark_inference')


def test_rounds_rotate_the_order_and_drop_the_warmup():
    calls = []
    fns = {name: (lambda n=name: calls.append(n)) for name in 'abc'}
    times = bench.measure(fns, repeats=2, warmup=1)
    assert calls == list('abc' 'bca' 'cab')
    assert all(len(t) == 2 for t in times.values())


def test_table_gives_ratios_to_the_plain_resnet_of_the_same_runtime():
    C = bench.Candidate
    times = {C('r50', 8, True, 'eager_fused'): [0.2, 0.4, 0.3],  # median 0.3
             C('r50', 8, True, 'eager_plain'): [0.6],
             C('r50', 8, True, 'onnxruntime'): [0.4],
             C('r50', 8, False, 'eager_plain'): [0.25],
             C('r50', 8, False, 'onnxruntime'): [0.2]}
    lines = bench.table(times, {'r50': 'R50'})
    rows = [[c.strip() for c in line.strip('|').split('|')] for line in lines[2:]]
    assert [r[2] for r in rows] == ['PyTorch eager, fused kernels', 'PyTorch eager, plain path',
                                    'onnxruntime']
    fused, plain, ort = rows
    assert fused[3:] == ['300.0', '26.7', '250.0', '32.0', '1.20x', '1.00x']
    assert plain[7:] == ['2.40x', '0.50x']
    assert ort[5:] == ['200.0', '40.0', '2.00x', '0.75x']


@pytest.mark.slow  # exports four tiny models and times them once
def test_quick_run_writes_the_table(tmp_path):
    bench.main(['--quick', '--out-dir', str(tmp_path), '--models', 'unet-r18', 'r50'])
    text = (tmp_path / 'benchmark_inference.md').read_text()
    assert 'threads:' in text and 'machine:' in text
    rows = [line for line in text.splitlines() if line.startswith('| KCLA')]
    assert len(rows) == 2 * 2 * 3  # models x batches x runtimes
    data = json.loads((tmp_path / 'benchmark_inference.json').read_text())
    assert len(data['times']) == 2 * 2 * 5  # and two plain-ResNet runtimes each
    assert all(len(t['seconds']) == 1 and t['seconds'][0] > 0 for t in data['times'])

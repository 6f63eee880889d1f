"""The layer-attention benchmark: a --quick run end to end, and its measuring pieces."""
import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kcla_mm.analysis.benchmark as bench
import kcla_mm.ops as ops
from kcla_mm.analysis.benchmark import (THP_ENV, TUNED_ALLOCATOR_ENV, Candidate, LiveTensorBytes,
                                        Result, Setting, build_backbone, markdown_table, num_blocks,
                                        peak_train_memory, round_ratio_table, round_ratios, run)
from kcla_mm.models.backbones.cifar_kcla_resnet import CifarKCLAResNet

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / 'tools' / 'analysis_tools' / 'benchmark_layer_attention.py'
METHODS = ['none', 'MRLALight', 'FullLayerAttention', 'KCLA']


pytestmark = pytest.mark.usefixtures('one_thread')


def cells(line):
    return [c.strip() for c in line.strip().strip('|').split('|')]


@pytest.mark.slow  # a subprocess: imports mmdet (10-20 s on a shared 2-core machine)
def test_quick_run_writes_table_and_plot(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in TUNED_ALLOCATOR_ENV}
    proc = subprocess.run([sys.executable, str(TOOL), '--quick', '--out-dir', str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (tmp_path / 'benchmark.md').read_text()
    assert 'CPU threads: 1' in md  # the number of threads is stated
    # the tool restarted itself with the tuned allocator, and says so
    settings = ' '.join(f'{k}={v}' for k, v in TUNED_ALLOCATOR_ENV.items())
    assert f'CPU allocator: {settings} for every candidate' in md
    rows = [cells(line) for line in md.splitlines() if line.startswith('| ') and 'x)' in line]
    names = [(r[0], r[1]) for r in rows]
    expected = [(f'{fam}-{d}', m) for fam, d in [('ResNet', 18), ('CIFAR-ResNet', 8),
                                                 ('CIFAR-ResNet', 14)] for m in METHODS]
    assert names == expected  # one row per candidate
    for r in rows:
        ratios = [float(x) for x in re.findall(r'\(([\d.]+)x\)', ' | '.join(r[3:8]))]
        assert len(ratios) == 5  # params, FLOPs, forward, train step, memory
        if r[1] == 'none':
            assert ratios == [1.0] * 5 and r[8:11] == ['+0.000'] * 3  # time, time, memory
        else:  # layer attention adds parameters and FLOPs
            assert ratios[0] > 1 and ratios[1] > 1
        assert len(r) == 12 and r[11].isdigit()  # page faults per training step, counted
    # then the same rounds paired, per method (one round in --quick: min = median = max)
    paired = [cells(line) for line in md.splitlines() if re.search(r'\| [\d.]+x / ', line)]
    assert [(r[0], r[1]) for r in paired] == [n for n in expected if n[1] != 'none']
    for r in paired:
        assert r[2] == '1' and len(set(r[4].split(' / '))) == 1
    png = (tmp_path / 'benchmark.png').read_bytes()
    assert png[:4] == b'\x89PNG' and len(png) > 10000
    assert (tmp_path / 'benchmark.json').stat().st_size > 0
    # --from-json re-renders the same table without measuring
    again = tmp_path / 'again'
    proc = subprocess.run([sys.executable, str(TOOL), '--from-json',
                           str(tmp_path / 'benchmark.json'), '--out-dir', str(again)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (again / 'benchmark.md').read_text() == md
    assert (again / 'benchmark.png').read_bytes()[:4] == b'\x89PNG'


@pytest.mark.parametrize('depth, block, n, width', [
    (8, 'BasicBlock', 1, 64), (20, 'BasicBlock', 3, 64), (20, 'Bottleneck', 2, 256),
    (56, 'Bottleneck', 6, 256)])
def test_cifar_family_builds_the_cifar_backbone(depth, block, n, width):
    model = build_backbone('cifar', depth, 'KCLA', cifar_block=block).eval()
    assert type(model) is CifarKCLAResNet and model.cifar_block == block
    assert [len(getattr(model, s)) for s in model.res_layers] == [n] * 3
    assert num_blocks(model) == 3 * n
    out = model(torch.rand(1, 3, 32, 32))
    assert [tuple(o.shape) for o in out] == [(1, width, 8, 8)]  # stem keeps 32x32; strides 1, 2, 2


class _Exec(Exception):
    pass


def _record_exec(monkeypatch):
    calls = []

    def fake_execve(path, argv, env):
        calls.append((path, argv, env))
        raise _Exec

    monkeypatch.setattr(bench.os, 'execve', fake_execve)
    return calls


def test_restart_with_tuned_allocator_reexecutes_once_with_the_settings(monkeypatch):
    calls = _record_exec(monkeypatch)
    for k in TUNED_ALLOCATOR_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv('MALLOC_TRIM_THRESHOLD_', '12345')  # the caller's own value stays
    monkeypatch.setattr(bench.sys, 'platform', 'linux')
    assert 'not the tuned settings' in bench.allocator_description()
    with pytest.raises(_Exec):
        bench.restart_with_tuned_allocator(['tool.py', '--depths', '50'])
    (path, argv, env), = calls
    assert path == sys.executable and argv == [sys.executable, 'tool.py', '--depths', '50']
    assert env[THP_ENV] == '1' and env['PATH'] == os.environ['PATH']  # the rest is kept
    assert env['MALLOC_MMAP_THRESHOLD_'] == str(2**32) and env['MALLOC_TRIM_THRESHOLD_'] == '12345'
    # the restarted process finds the settings and goes on
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    bench.restart_with_tuned_allocator(['tool.py'])
    assert len(calls) == 1 and bench.tuned_allocator_on()
    assert bench.allocator_description() == (
        f'CPU allocator: {THP_ENV}=1 MALLOC_MMAP_THRESHOLD_={2**32} MALLOC_TRIM_THRESHOLD_=12345 '
        'for every candidate (as set in the environment)')  # not claimed to be the tuned ones
    monkeypatch.setenv('MALLOC_TRIM_THRESHOLD_', str(2**34))
    assert 'glibc keeps freed memory' in bench.allocator_description()
    # nowhere but on Linux
    monkeypatch.delenv(THP_ENV)
    monkeypatch.setattr(bench.sys, 'platform', 'darwin')
    bench.restart_with_tuned_allocator(['tool.py'])
    assert len(calls) == 1


def test_benchmark_tool_restarts_from_the_command_line_only(monkeypatch):
    spec = importlib.util.spec_from_file_location('kcla_benchmark_tool', TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    calls = _record_exec(monkeypatch)
    monkeypatch.delenv(THP_ENV, raising=False)
    monkeypatch.setattr(bench.sys, 'platform', 'linux')
    monkeypatch.setattr(sys, 'argv', [str(TOOL), '--quick', '--out-dir', 'never'])
    with pytest.raises(_Exec):
        tool.main()
    assert calls[0][1][1:] == [str(TOOL), '--quick', '--out-dir', 'never']
    assert tool.parse_args(['--default-allocator']).default_allocator
    assert not tool.parse_args([]).default_allocator


def _fake_cpu(tmp_path, flags, caches):
    cpuinfo = tmp_path / 'cpuinfo'
    cpuinfo.write_text(f'processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: {flags}\n\n')
    for i, (level, kind, size) in enumerate(caches):
        d = tmp_path / 'cache' / f'index{i}'
        d.mkdir(parents=True)
        for name, value in (('level', level), ('type', kind), ('size', size)):
            (d / name).write_text(f'{value}\n')
    return str(cpuinfo), str(tmp_path / 'cache')


@pytest.mark.parametrize('flags,caches,expected', [
    ('fpu avx2 avx512f avx512bw amx_tile',
     [(1, 'Data', '48K'), (1, 'Instruction', '64K'), (2, 'Unified', '2048K'),
      (3, 'Unified', '491520K')],
     'AVX-512, AMX; L2 2 MiB, L3 480 MiB'),
    ('fpu sse4_2 avx2 fma', [(2, 'Unified', '512K'), (3, 'Unified', '32768K')],
     'AVX2; L2 512 KiB, L3 32 MiB'),
    ('fpu sse4_2', [], ''),  # nothing known to report
])
def test_cpu_features_names_vector_isa_and_outer_caches(tmp_path, flags, caches, expected):
    # the header states what the ratios depend on: vector width and L2/L3 sizes
    cpuinfo, cache_dir = _fake_cpu(tmp_path, flags, caches)
    assert bench.cpu_features(cpuinfo, cache_dir) == expected
    assert bench.cpu_name(cpuinfo) == 'Test CPU'


def test_cpu_features_without_proc_or_sysfs(tmp_path):
    # a machine without /proc/cpuinfo or the sysfs cache tree: no header part, no error
    assert bench.cpu_features(str(tmp_path / 'none'), str(tmp_path / 'none')) == ''
    assert bench.cpu_name(str(tmp_path / 'none'))  # what platform knows instead


def test_cifar_depth_must_fit_the_block():
    # 6n + 2 for BasicBlocks, 9n + 2 for Bottlenecks: 21 is neither, 14 only the first
    with pytest.raises(ValueError, match='6n'):
        build_backbone('cifar', 21, 'KCLA')
    with pytest.raises(ValueError, match='9n'):
        build_backbone('cifar', 14, 'KCLA', cifar_block='Bottleneck')


def test_live_tensor_bytes_counts_peak_not_total():
    with LiveTensorBytes() as tracker:
        for _ in range(3):
            a = torch.empty(1000, dtype=torch.float32)  # 4000 B, freed by the next iteration
            del a
        b = torch.empty(250, dtype=torch.float64)  # 2000 B
        view = b[10:]  # a view shares its storage: not counted again
        del view
    assert tracker.peak == 4000 and tracker.current == 2000


def test_live_tensor_bytes_never_counts_resident_storages():
    # a parameter seen again as the output of a view op (detach, as saved-tensor
    # hooks produce) is already counted in the resident bytes
    w = torch.empty(1000)
    with LiveTensorBytes([w]) as tracker:
        kept = [w.detach(), torch.empty(10)]
    assert tracker.peak == tracker.current == 40
    with LiveTensorBytes() as control:
        kept.append(w.detach())
    assert control.current == 4000 and len(kept) == 3


def test_peak_train_memory_grows_with_the_saved_history():
    # FullLayerAttention keeps every value of the stage: more memory than the plain ResNet.
    x = torch.rand(2, 3, 16, 16)
    plain = peak_train_memory(build_backbone('cifar', 20, 'none', tiny=True), x)
    full = peak_train_memory(build_backbone('cifar', 20, 'FullLayerAttention', tiny=True), x)
    assert full > plain > x.numel() * 4


@pytest.mark.parametrize('fused', [False, True])
def test_kept_attn_outputs_cost_at_most_one_map_per_block(fused):
    # recompute_attn_outputs=False: the next block keeps its copy of each KCLA
    # output (the benchmark's --keep-attn-outputs). On the eager path the peak
    # then holds at most one more map per block but the last, and at least
    # stage 1's three, which the backward pass frees last; the fused CPU
    # kernels keep the outputs of the steps with a state anyway, so there it
    # costs the first block's output only. The other methods recompute nothing
    if fused and not _fused_kernels_built():
        pytest.skip('the fused CPU kernels are not built here')
    with ops.fused_kernels(fused):
        _check_kept_attn_outputs(fused)


def _check_kept_attn_outputs(fused):
    x = torch.rand(2, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    mem = {keep: peak_train_memory(build_backbone('imagenet', 50, 'KCLA', tiny=True,
                                                  channels_last=True,
                                                  recompute_attn_outputs=not keep), x)
           for keep in (False, True)}
    model = build_backbone('imagenet', 50, 'KCLA', tiny=True, channels_last=True)
    sizes = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: sizes.append(out[0].nbytes))
             for m in model.layer_attn_modules()]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    assert len(sizes) == 16 and sizes[0] == sizes[2] > sizes[3]
    if fused:
        assert 0 < mem[True] - mem[False] <= sizes[0]
    else:
        assert sum(sizes[:3]) <= mem[True] - mem[False] <= sum(sizes[:-1])
    mrla = [peak_train_memory(build_backbone('cifar', 8, 'MRLALight', tiny=True,
                                             recompute_attn_outputs=r), x[:, :, :16, :16])
            for r in (True, False)]
    assert mrla[0] == mrla[1]


def test_benchmark_tool_keeps_attn_outputs_when_asked(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location('kcla_benchmark_tool', TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    seen = {}

    def fake_run(candidates, models, *args, **kwargs):
        seen.update(models)
        return {}

    monkeypatch.setattr(tool, 'run', fake_run)
    monkeypatch.setattr(tool, 'write_outputs', lambda results, header, *a: '\n'.join(header))
    for flag, recompute in (([], True), (['--keep-attn-outputs'], False)):
        seen.clear()
        tool.main(['--quick', '--no-flops', '--methods', 'KCLA', '--depths', '18',
                   '--cifar-depths', '--out-dir', str(tmp_path)] + flag)
        assert {m.recompute_attn_outputs for m in seen.values()} == {recompute}
        header = (tmp_path / 'benchmark.json').read_text()
        assert ('recompute_attn_outputs=False' in header) is not recompute


def test_run_interleaves_and_measures_memory_in_the_warmup():
    cands = [Candidate('cifar', 8, m) for m in ('none', 'KCLA')]
    models = {c: build_backbone(c.family, c.depth, c.method, tiny=True) for c in cands}
    settings = {'cifar': Setting(2, 16)}
    seen = []
    results = run(cands, models, settings, torch.device('cpu'), repeats=2, warmup=1,
                  count_flops_fn=lambda m, x: seen.append(tuple(x.shape)) or 123,
                  progress=seen.append)
    assert [len(results[c].forward) for c in cands] == [2, 2]  # warm-up discarded
    assert [len(results[c].train) for c in cands] == [2, 2]
    assert seen[0] == (1, 3, 16, 16) and results[cands[1]].flops == 123  # FLOPs at batch 1
    x = torch.rand(2, 3, 16, 16)
    for c in cands:  # the warm-up step's memory is that of a separate tracked step
        assert results[c].memory == peak_train_memory(models[c], x)
    table = markdown_table(results)
    assert table.count('\n') == 3 and '(1.00x)' in table.splitlines()[2]


def test_run_keeps_the_fastest_of_the_inner_runs(monkeypatch):
    # each round times --inner back-to-back runs and keeps the fastest
    import kcla_mm.analysis.benchmark as bmod
    cands = [Candidate('cifar', 8, 'none')]
    models = {c: build_backbone(c.family, c.depth, c.method, tiny=True) for c in cands}
    fake = iter([5.0, 3.0, 4.0, 9.0, 7.0, 8.0] * 2)
    monkeypatch.setattr(bmod, 'timed', lambda fn, device: next(fake))
    results = run(cands, models, {'cifar': Setting(2, 16)}, torch.device('cpu'), repeats=2,
                  warmup=0, count_flops_fn=lambda m, x: None, inner=3)
    assert results[cands[0]].forward == [3.0, 3.0] and results[cands[0]].train == [7.0, 7.0]
    with pytest.raises(ValueError, match='inner=0'):
        run(cands, models, {'cifar': Setting(2, 16)}, torch.device('cpu'), repeats=1,
            warmup=0, count_flops_fn=lambda m, x: None, inner=0)


def test_run_sets_the_mode_outside_the_timed_calls(monkeypatch):
    # model.eval()/train() walk every module (about 1 ms for a KCLA-ResNet-50,
    # twice the plain one's): the timed calls run in the mode already set
    import kcla_mm.analysis.benchmark as bmod
    cands = [Candidate('cifar', 8, 'KCLA')]
    model = build_backbone('cifar', 8, 'KCLA', tiny=True)
    switches, timed_modes = [], []
    real_train = type(model).train

    def train(self, mode=True):
        switches.append(mode)
        return real_train(self, mode)

    monkeypatch.setattr(type(model), 'train', train)

    def fake_timed(fn, device):
        before = len(switches)
        fn()
        assert len(switches) == before, 'a mode switch inside the timed call'
        timed_modes.append(model.training)
        return 1.0

    monkeypatch.setattr(bmod, 'timed', fake_timed)
    run(cands, {cands[0]: model}, {'cifar': Setting(2, 16)}, torch.device('cpu'), repeats=2,
        warmup=0, count_flops_fn=lambda m, x: None, inner=2)
    # per round: two eval-mode forwards, then two training steps
    assert timed_modes == [False, False, True, True] * 2
    assert switches and not all(switches) and any(switches)


def test_run_resets_gradients_over_a_parameter_list_not_a_module_walk(monkeypatch):
    # model.parameters() walks every module (KCLA's models have about twice as
    # many): the timed steps reset the gradients over a list, as an optimiser
    # holds it, and still start from no gradient
    import kcla_mm.analysis.benchmark as bmod
    cands = [Candidate('cifar', 8, 'KCLA')]
    model = build_backbone('cifar', 8, 'KCLA', tiny=True)
    walks = []
    real_parameters = type(model).parameters

    def parameters(self, recurse=True):
        walks.append(True)
        return real_parameters(self, recurse)

    monkeypatch.setattr(type(model), 'parameters', parameters)
    grads_at_start = []
    real_backward = torch.Tensor.backward

    def backward(self, *args, **kwargs):
        grads_at_start.append([p.grad is None for p in real_parameters(model)])
        return real_backward(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, 'backward', backward)

    def fake_timed(fn, device):
        before, steps = len(walks), len(grads_at_start)
        fn()
        assert len(walks) == before, 'a walk over the modules inside the timed call'
        timed_steps.extend(grads_at_start[steps:])
        return 1.0

    timed_steps = []
    monkeypatch.setattr(bmod, 'timed', fake_timed)
    for p in real_parameters(model):  # stale gradients from before the run
        p.grad = torch.ones_like(p)
    run(cands, {cands[0]: model}, {'cifar': Setting(2, 16)}, torch.device('cpu'), repeats=2,
        warmup=0, count_flops_fn=lambda m, x: None, inner=2)
    assert len(timed_steps) == 4 and all(all(g) for g in timed_steps)
    assert all(p.grad is None for p in real_parameters(model))  # reset after the round too
    # called alone, it walks the modules
    walks.clear()
    bmod.train_step(model, torch.rand(2, 3, 16, 16), set_mode=False)
    assert walks


def test_run_counts_page_faults_per_training_step(monkeypatch):
    # the counter's difference around the inner training steps, divided by them
    import kcla_mm.analysis.benchmark as bmod
    cands = [Candidate('cifar', 8, 'none')]
    models = {c: build_backbone(c.family, c.depth, c.method, tiny=True) for c in cands}
    counter = iter([100, 160, 1000, 1090])  # two rounds: 60 and 90 faults over 3 steps
    monkeypatch.setattr(bmod, 'minor_faults', lambda: next(counter))
    results = run(cands, models, {'cifar': Setting(2, 16)}, torch.device('cpu'), repeats=2,
                  warmup=0, count_flops_fn=lambda m, x: None, inner=3)
    r = results[cands[0]]
    assert r.faults == [20.0, 30.0] and r.faults_median == 25.0
    assert markdown_table(results).splitlines()[2].endswith('| 25 |')
    monkeypatch.undo()
    assert isinstance(bmod.minor_faults(), int)  # the real counter, on this (POSIX) machine


def _timed(c, forward, train):
    return Result(c, 16, 1, None, None, list(forward), list(train))


def test_round_ratios_pair_the_same_rounds():
    plain, kcla = Candidate('imagenet', 50, 'none'), Candidate('imagenet', 50, 'KCLA')
    base = _timed(plain, [1.0, 2.0, 4.0], [10.0, 20.0, 40.0])
    r = _timed(kcla, [1.5, 2.2, 4.0], [12.0, 26.0, 44.0])
    assert round_ratios(r, base, 'forward') == pytest.approx([1.5, 1.1, 1.0])
    assert round_ratios(r, base, 'train') == pytest.approx([1.2, 1.3, 1.1])
    # the ratio of medians (the main table: 26 / 20) differs from the paired median (1.2)
    assert statistics.median(r.train) / statistics.median(base.train) == pytest.approx(1.3)
    # nothing to pair: different numbers of rounds, or a baseline time of 0
    assert round_ratios(_timed(kcla, [1.0], [1.0]), base, 'train') == []
    assert round_ratios(r, _timed(plain, [1.0, 0.0, 1.0], [1.0, 1.0, 1.0]), 'forward') == []


def test_round_ratio_table_rows_and_spread():
    plain, kcla = Candidate('imagenet', 50, 'none'), Candidate('imagenet', 50, 'KCLA')
    orphan = Candidate('cifar', 20, 'MRLALight')  # its plain ResNet was not measured
    results = {plain: _timed(plain, [1.0, 2.0, 4.0], [10.0, 20.0, 40.0]),
               kcla: _timed(kcla, [1.5, 2.2, 4.0], [12.0, 26.0, 44.0]),
               orphan: _timed(orphan, [1.0], [1.0])}
    lines = round_ratio_table(results).splitlines()
    assert len(lines) == 3  # header, rule, one row: neither the baseline nor the orphan
    assert cells(lines[2]) == ['ResNet-50', 'KCLA', '3', '1.000x / 1.100x / 1.500x',
                               '1.100x / 1.200x / 1.300x']
    results[kcla] = _timed(kcla, [1.0, 1.0], [1.0, 1.0])  # rounds that do not pair
    assert cells(round_ratio_table(results).splitlines()[2])[3:] == ['n/a', 'n/a']


def test_t_interval_against_hand_computed_and_scipy_quantiles():
    # mean 2, standard deviation 1, three values: 2 +- t(0.975, 2) / sqrt(3)
    mean, low, high = bench.t_interval([1.0, 2.0, 3.0])
    assert mean == 2.0
    assert (low, high) == pytest.approx((2 - 4.303 / math.sqrt(3), 2 + 4.303 / math.sqrt(3)))
    assert bench.t_interval([1.5])[0] == 1.5 and math.isnan(bench.t_interval([1.5])[1])
    # the table's quantiles are Student's (scipy where installed: an independent reference)
    stats = pytest.importorskip('scipy.stats')
    for df in (1, 2, 5, 14, 30):
        assert bench._T975[df - 1] == pytest.approx(stats.t.ppf(0.975, df), abs=6e-4)
    # past 30 degrees of freedom the 30's quantile (wider than the true one)
    values = [float(i % 7) for i in range(50)]
    m, lo, _ = bench.t_interval(values)
    assert m - lo == pytest.approx(2.042 * statistics.stdev(values) / math.sqrt(50))
    assert m - lo > stats.t.ppf(0.975, 49) * statistics.stdev(values) / math.sqrt(50)


def _pool_runs():
    plain, kcla = Candidate('imagenet', 50, 'none'), Candidate('imagenet', 50, 'KCLA')
    mrla = Candidate('imagenet', 50, 'MRLALight')
    run1 = {plain: Result(plain, 16, 1, None, 100, [1.0, 1.0, 1.0], [10.0, 10.0, 10.0]),
            kcla: Result(kcla, 16, 1, None, 120, [1.1, 1.2, 1.0], [12.0, 11.0, 13.0]),
            mrla: Result(mrla, 16, 1, None, 150, [1.3, 1.3, 1.3], [14.0, 14.0, 14.0])}
    run2 = {plain: Result(plain, 16, 1, None, 100, [2.0, 2.0], [20.0, 40.0]),
            kcla: Result(kcla, 16, 1, None, 121, [2.2, 2.6], [22.0, 26.0])}
    return run1, run2


def test_pooled_ratio_table_pools_the_runs_ratios_and_rounds():
    run1, run2 = _pool_runs()
    lines = bench.pooled_ratio_table([run1, run2]).splitlines()
    assert len(lines) == 4  # header, rule, MRLA-light (one run), KCLA (both runs)
    mrla, kcla = cells(lines[2]), cells(lines[3])
    # forward: ratios of medians 1.1 and 1.2; mean 1.15, s = 0.0707, t(0.975, 1) = 12.706;
    # every round: 1.1, 1.2, 1.0, 1.1, 1.3 -> median 1.1
    half = 12.706 * statistics.stdev([1.1, 1.2]) / math.sqrt(2)
    assert kcla[:5] == ['ResNet-50', 'KCLA', '2', '5', '1.100x - 1.200x']
    assert kcla[5] == f'1.150x ({1.15 - half:.3f}x - {1.15 + half:.3f}x)'
    assert kcla[6] == '1.100x'
    # training: medians 12 / 10 and 24 / 30; rounds 1.2, 1.1, 1.3, 1.1, 0.65 -> 1.1
    assert kcla[7] == '0.800x - 1.200x' and kcla[8].startswith('1.000x (')
    assert kcla[9] == '1.100x'
    assert kcla[10] == '1.200x - 1.210x'  # memory
    # one run: no interval
    assert mrla[:7] == ['ResNet-50', 'MRLALight', '1', '3', '1.300x - 1.300x', '1.300x',
                        '1.300x']
    assert mrla[10] == '1.500x - 1.500x'


def _benchmark_tool():
    spec = importlib.util.spec_from_file_location('kcla_benchmark_layer_attention', TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write_run(path, results, device='CPU X (AVX2), 2 logical cores; CPU threads: 2',
               fmt='channels-last'):
    header = [f'device: {device}', 'ResNet: batch 4 at 224x224; CIFAR ResNet: batch 16 at 32x32',
              f'medians of 3 interleaved rounds after 1 warm-up; memory format: {fmt}']
    path.write_text(json.dumps(dict(header=header, argv=[],
                                    results=bench.dump_results(results))))
    return str(path)


def test_benchmark_tool_pools_runs_of_one_machine_and_setting(tmp_path):
    tool = _benchmark_tool()
    run1, run2 = _pool_runs()
    run1[Candidate('imagenet', 50, 'none')].faults = [0.0, 2.0, 1.0]
    assert bench.load_results({'results': bench.dump_results(run1)}) == run1  # a round trip
    a, b = _write_run(tmp_path / 'a.json', run1), _write_run(tmp_path / 'b.json', run2)
    text = tool.pool([a, b], str(tmp_path / 'out'))
    assert (tmp_path / 'out' / 'pooled.md').read_text() == text
    assert '- device: CPU X (AVX2), 2 logical cores; CPU threads: 2' in text
    assert f'- pooled: 2 runs: {a}, {b}' in text
    assert text.endswith(bench.pooled_ratio_table([run1, run2]) + '\n')
    # runs of another machine, thread count or memory format are not pooled
    for kw, what in [(dict(device='CPU Y (AVX-512), 2 logical cores; CPU threads: 2'),
                      'the device'),
                     (dict(device='CPU X (AVX2), 2 logical cores; CPU threads: 1'), 'the device'),
                     (dict(fmt='contiguous'), 'the memory format')]:
        c = _write_run(tmp_path / 'c.json', run2, **kw)
        with pytest.raises(SystemExit, match=f'{re.escape(c)} differs from .* in {what}'):
            tool.pool([a, c], str(tmp_path / 'out'))
    bad = tmp_path / 'bad.json'
    bad.write_text('{"rows": []}')
    with pytest.raises(SystemExit, match=f'{re.escape(str(bad))} is not a benchmark.json'):
        tool.pool([a, str(bad)], str(tmp_path / 'out'))
    with pytest.raises(SystemExit):  # argparse: one of the two re-rendering modes
        tool.parse_args(['--pool', a, '--from-json', a])
    assert tool.parse_args(['--pool', a, b]).pool == [a, b]


def _ops_tool():
    # a tool of the fused kernels: their tests go with them
    pytest.importorskip('kcla_mm.ops.fused.build')
    spec = importlib.util.spec_from_file_location(
        'kcla_benchmark_cpu_ops', ROOT / 'tools' / 'analysis_tools' / 'benchmark_cpu_ops.py')
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ops_benchmark_renames_only_the_op_namespace():
    renamespaced = pytest.importorskip('kcla_mm.ops.fused.build').renamespaced
    src = ('TORCH_LIBRARY(kcla_mm, m) {}\nTORCH_LIBRARY_FRAGMENT(kcla_mm, m) {}\n'
           'TORCH_LIBRARY_IMPL(kcla_mm, CPU, m) {}\n// kcla_mm::eval_step stays\n')
    got = renamespaced(src, 'kcla_ab0')
    assert got == ('TORCH_LIBRARY(kcla_ab0, m) {}\nTORCH_LIBRARY_FRAGMENT(kcla_ab0, m) {}\n'
                   'TORCH_LIBRARY_IMPL(kcla_ab0, CPU, m) {}\n// kcla_mm::eval_step stays\n')


def _needs_kernels():
    if not _fused_kernels_built():
        pytest.skip('fused CPU kernels not built')


def test_ops_benchmark_times_every_op_of_the_installed_build(capsys):
    _needs_kernels()
    ops_tool = _ops_tool()
    times = ops_tool.main(['--batch', '1', '--size', '64', '--rounds', '2', '--warmup', '0',
                           '--threads', '1'])
    assert set(times) == {('kcla_mm', op) for op in ops_tool.OPS}
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in times.values())
    out = capsys.readouterr().out
    assert '| training total |' in out and 'batch 1 at 64x64' in out
    with pytest.raises(SystemExit, match='no .cpp files'):
        ops_tool.main(['--against', str(ROOT / 'tests'), '--size', '64', '--rounds', '1'])


def test_ops_benchmark_rotation_copies_inputs_to_the_requested_size():
    ops_tool = _ops_tool()
    d = {'x': torch.arange(250_000, dtype=torch.float32), 'v': torch.ones(3)}  # ~1 MB
    assert ops_tool.rotation(d, 0) == [d]
    copies = ops_tool.rotation(d, 3.5)
    assert len(copies) == 4 and copies[0] is d  # ceil(3.5 MB / 1.000012 MB)
    for c in copies[1:]:
        assert c.keys() == d.keys()
        assert all(torch.equal(c[k], d[k]) and c[k].data_ptr() != d[k].data_ptr() for k in d)


def test_ops_benchmark_gives_each_call_the_next_copy():
    ops_tool = _ops_tool()
    seen = []
    copies = [{'id': i} for i in range(3)]
    fake = {op: (lambda d: seen.append(d['id'])) for op in ('train_stats', 'eval_step')}
    real_calls = ops_tool.calls
    ops_tool.calls = lambda ns: fake
    try:
        times = ops_tool.measure(['a', 'b'], [(copies, 2)], ('train_stats', 'eval_step'),
                                 rounds=2, warmup=0)
    finally:
        ops_tool.calls = real_calls
    assert seen == [0, 1, 2, 0, 1, 2, 0, 1]  # 2 rounds x 2 builds x 2 ops, in turn
    assert set(times) == {(ns, op) for ns in 'ab' for op in ('train_stats', 'eval_step')}
    assert all(len(v) == 2 for v in times.values())


def test_ops_benchmark_counts_adaptations_once_per_stage_transition():
    # a block's ops once per block; an init layer's adaptation once at each
    # stage but the first, where no state arrives
    ops_tool = _ops_tool()
    assert [ops_tool.calls_per_step('adapt_backward', s, 3) for s in range(4)] == [0, 1, 1, 1]
    assert [ops_tool.calls_per_step('block_end_forward', s, b)
            for s, b in enumerate((3, 4, 6, 3))] == [3, 4, 6, 3]
    seen = []
    fake = {op: (lambda d, op=op: seen.append((op, d['stage'])))
            for op in ('train_stats', 'adapt_forward')}
    real_calls = ops_tool.calls
    ops_tool.calls = lambda ns: fake
    try:
        ops_tool.measure(['a'], [({'stage': 0}, 3), ({'stage': 1}, 4)],
                         ('train_stats', 'adapt_forward'), rounds=1, warmup=0)
    finally:
        ops_tool.calls = real_calls
    assert seen == [('train_stats', 0), ('train_stats', 1), ('adapt_forward', 1)]


def test_ops_benchmark_names_the_ops_an_older_build_lacks():
    ops_tool = _ops_tool()
    with pytest.raises(SystemExit, match='has no adapt_forward, block_end_backward.*--ops'):
        ops_tool.check_same('kcla_mm_no_such_build', [], ['adapt_forward', 'block_end_backward'])


def test_ops_benchmark_rotates_inputs_when_asked(capsys):
    _needs_kernels()
    ops_tool = _ops_tool()
    times = ops_tool.main(['--batch', '1', '--size', '64', '--rounds', '1', '--warmup', '0',
                           '--threads', '1', '--ops', 'train_apply', '--rotate-mb', '2'])
    assert set(times) == {('kcla_mm', 'train_apply')}
    out = capsys.readouterr().out
    assert 'inputs rotated over' in out and 'copies per stage (at least 2 MB each' in out
    with pytest.raises(SystemExit):
        ops_tool.parse_args(['--rotate-mb', '-1'])


def test_ops_benchmark_slope_ignores_one_slow_size():
    slope = _ops_tool().theil_sen_slope
    rows = (2, 3, 4, 5, 6, 7)
    line = [10.0 + 3.0 * h for h in rows]
    assert slope(rows, line) == pytest.approx(3.0)
    # one size far off (a map whose addresses crowd a cache set): a two-point
    # slope through it would be wrong by 20 or more, the median of all is not
    assert slope(rows, line[:1] + [line[1] + 60.0] + line[2:]) == pytest.approx(3.0)
    assert slope((0, 1), (1.0, -1.0)) == -2.0


def test_ops_benchmark_per_element_in_l2_and_from_memory(capsys):
    _needs_kernels()
    ops_tool = _ops_tool()
    torch.set_num_threads(2)
    res = ops_tool.main(['--per-element', '--batch', '1', '--size', '32', '--rounds', '1',
                         '--warmup', '0', '--ops', 'train_apply', '--rotate-mb', '1'])
    assert torch.get_num_threads() == 2  # measured on one thread, then restored
    ref = ops_tool.REFERENCE
    assert set(res) == {(ns, op, k) for ns, op in (('kcla_mm', 'train_apply'), (ref, ref))
                        for k in ('l2', 'memory')}
    assert all(len(v) == 1 and math.isfinite(v[0]) for v in res.values())
    assert all(res[(ns, op, 'memory')][0] > 0 for ns, op, _ in res)
    out = capsys.readouterr().out
    assert '1 thread' in out and 'inputs rotated over at least 1 MB' in out
    assert '| train_apply | installed build |' in out and '| torch.add | reference |' in out


@pytest.mark.slow  # compiles a second copy of the kernels (about a minute on 2 cores)
def test_ops_benchmark_builds_another_source_tree_side_by_side(tmp_path):
    _needs_kernels()
    ops_tool = _ops_tool()
    csrc = ROOT / 'kcla_mm' / 'ops' / 'fused' / 'csrc'
    times = ops_tool.main(['--against', str(csrc), '--batch', '1', '--size', '32', '--rounds',
                           '1', '--warmup', '0', '--threads', '1', '--ops', 'train_apply',
                           'eval_step'])
    spaces = {ns for ns, _ in times}
    assert len(spaces) == 2 and 'kcla_mm' in spaces  # checked equal, then timed
    # a variant that computes something else is refused, not timed
    bad = tmp_path / 'csrc'
    shutil.copytree(csrc, bad)
    header = (bad / 'kcla_cpu.h').read_text()
    # conv_span's middle row of taps, which train_apply convolves with: the right
    # tap reads the centre column instead (the mutation must land, or the test
    # would pass without anything to catch)
    right = 'acc += tap_row<L>(k + 3, a[1], b[1], c[1]);'
    assert header.count(right) == 1
    (bad / 'kcla_cpu.h').write_text(header.replace(right, right.replace('c[1]', 'b[1]')))
    with pytest.raises(SystemExit, match='train_apply differs'):
        ops_tool.main(['--against', str(bad), '--batch', '1', '--size', '32', '--rounds', '1',
                       '--threads', '1', '--ops', 'train_apply'])


def _fused_kernels_built() -> bool:
    try:
        from kcla_mm.ops.fused import build
    except ImportError:
        return False
    return build.available()


@pytest.mark.parametrize('amp', [torch.bfloat16, None])
def test_run_measures_under_autocast_when_asked(amp):
    # --amp: every forward and training step of the run (the memory's too)
    # under torch.autocast to the dtype; without it, none under autocast
    seen = []
    model = build_backbone('cifar', 8, 'KCLA', tiny=True)
    model.register_forward_pre_hook(
        lambda m, a: seen.append(torch.get_autocast_dtype('cpu')
                                 if torch.is_autocast_enabled('cpu') else None))
    c = Candidate('cifar', 8, 'KCLA')
    run([c], {c: model}, {'cifar': Setting(2, 16)}, torch.device('cpu'), repeats=1, warmup=1,
        count_flops_fn=lambda m, x: None, amp=amp)
    assert len(seen) >= 3 and set(seen) == {amp}


def test_without_mmpretrain_the_cifar_family_is_refused_by_name_and_imagenet_runs(tmp_path):
    # an mmdet-only installation: mmpretrain cannot be imported
    blocker = tmp_path / 'without_mmpretrain.py'
    blocker.write_text(
        'import sys\n'
        'sys.modules["mmpretrain"] = None  # import fails, find_spec says not installed\n'
        f'sys.argv = [{str(TOOL)!r}] + sys.argv[1:]\n'
        f'exec(compile(open({str(TOOL)!r}).read(), {str(TOOL)!r}, "exec"))\n')
    run = [sys.executable, str(blocker), '--quick', '--no-flops', '--methods', 'KCLA',
           '--out-dir', str(tmp_path / 'out')]
    proc = subprocess.run(run + ['--depths', '--cifar-depths', '8'], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and 'needs mmpretrain' in proc.stderr
    proc = subprocess.run(run + ['--depths', '18', '--cifar-depths'], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '| ResNet-18 | KCLA |' in (tmp_path / 'out' / 'benchmark.md').read_text()

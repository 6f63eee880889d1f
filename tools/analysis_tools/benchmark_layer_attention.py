"""Benchmark the cost of layer attention against depth (none, MRLALight, FullLayerAttention, KCLA).

In one process, for each method and depth: parameters, FLOPs (batch 1),
forward time (eval, no autograd), training-step time (forward + backward of
the mean output, no optimiser step) and peak memory of a training step.
Every figure is also given as a ratio to the plain ResNet of the same depth
measured in the same run; "per block" columns give (time - plain time) /
number of blocks, where KCLA's cost per block is flat and exact layer
attention's grows with depth.

Depth families: ResNet-50/101/152 (--depths; batch 4 at 224x224 by default)
and CIFAR-style ResNets (--cifar-depths 20 56 110 254; CifarKCLAResNet, 3 stages
of n blocks; batch 16 at 32x32): by default of BasicBlocks, depth 6n+2, 16/32/64
channels; with --cifar-block Bottleneck the layer-attention papers' networks,
depth 9n+2, 64/128/256 channels. Deep enough for the quadratic term of exact
layer attention to show.

Method: candidates are interleaved: each of --warmup + --repeats rounds runs
every candidate (--inner forwards back to back, then --inner training steps,
keeping the fastest of each: the steady state, after the previous
candidate's caches and allocator state are gone), in an order rotated by one
per round, so drift affects all alike; the warm-up rounds are discarded and
medians over rounds reported. Times: perf_counter on CPU, CUDA events on CUDA (after
a synchronisation). Peak memory: torch.cuda.max_memory_allocated on CUDA; on
CPU the peak of live tensor bytes during one training step, tracked by a
TorchDispatchMode that counts every tensor storage an aten op creates
(forward and backward) until a weak reference reports it freed, plus the
parameters, buffers and input (kernel workspaces outside aten ops are not
seen). Memory of compiled candidates on CPU: n/a (compiled kernels allocate
outside the dispatcher). FLOPs: mmengine's FlopAnalyzer (one multiply-add =
1), plus elementwise arithmetic unless --no-elementwise. The number of CPU
threads is set with --threads and stated in the output. On CPU the tool
re-executes itself with the tuned allocator settings of
kcla_mm.analysis.benchmark.TUNED_ALLOCATOR_ENV (torch's huge pages, glibc keeping freed
memory; for every candidate alike; --default-allocator keeps the defaults),
says so, and counts the page faults of every training step.

Outputs in --out-dir: benchmark.md (settings + table, then the same rounds
paired: each method's time over the plain ResNet's of the same round, min /
median / max over the rounds, which shows how far single rounds stray from
the ratio of medians), benchmark.json (all measurements, every repeat),
benchmark.png (extra cost over the plain ResNet against depth). With --pool,
nothing is measured: several runs' benchmark.json, of one machine and one
setting, are pooled into pooled.md (each run's ratio of medians, their mean
with a 95% Student-t interval over the runs, the median of every round's
ratio): one run on a shared machine settles a ratio to a few percent at best.

Examples::

    python tools/analysis_tools/benchmark_layer_attention.py            # ~10 min on 2 cores
    python tools/analysis_tools/benchmark_layer_attention.py --quick    # smoke test, seconds
    python tools/analysis_tools/benchmark_layer_attention.py --device cuda --batch 32 --compile
    python tools/analysis_tools/benchmark_layer_attention.py --pool a/benchmark.json b/bench.json
"""
import argparse
import json
import os
import os.path as osp
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

from kcla_mm.analysis.benchmark import (CIFAR_DEPTHS, IMAGENET_DEPTHS, METHODS, Candidate, Setting,
                                        allocator_description, build_backbone, count_flops,
                                        cpu_features, cpu_name, dump_results, load_results,
                                        markdown_table, plot, pooled_ratio_table,
                                        restart_with_tuned_allocator, round_ratio_table, run)

QUICK = dict(depths=[18], cifar_depths=[8, 14], batch=2, size=32, cifar_batch=2, cifar_size=16,
             repeats=1, warmup=0, threads=1, inner=1)
FULL = dict(depths=list(IMAGENET_DEPTHS), cifar_depths=list(CIFAR_DEPTHS), batch=4, size=224,
            cifar_batch=16, cifar_size=32, repeats=5, warmup=1, threads=None, inner=3)


def _fused_kernels_available() -> bool:
    try:
        from kcla_mm.ops.fused import build
    except ImportError:  # the fast paths are optional
        return False
    return build.available()


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    doc = __doc__.split('\n\n')
    parser = argparse.ArgumentParser(
        description='\n\n'.join(doc[:2]), epilog='\n\n'.join(doc[2:]),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--methods', nargs='+', default=list(METHODS), choices=METHODS,
                        metavar='METHOD',
                        help=f'methods to measure, any of {", ".join(METHODS)}; the plain '
                        'baseline "none" is always added')
    parser.add_argument('--depths', type=int, nargs='*', default=None,
                        help=f'ResNet depths (18, 34, 50, 101, 152; none: skip the family); '
                        f'default {FULL["depths"]}')
    parser.add_argument('--cifar-depths', type=int, nargs='*', default=None,
                        help=f'CIFAR ResNet depths (6n+2 or 9n+2, see --cifar-block; none: '
                        f'skip the family); default '
                        f'{FULL["cifar_depths"]}')
    parser.add_argument('--cifar-block', default='BasicBlock', choices=('BasicBlock', 'Bottleneck'),
                        help='block of the CIFAR ResNets: BasicBlock (depth 6n+2, default) or '
                        'Bottleneck (depth 9n+2, the layer-attention papers\' networks)')
    parser.add_argument('--batch', type=int, default=None,
                        help=f'ResNet batch size (default {FULL["batch"]})')
    parser.add_argument('--size', type=int, default=None,
                        help=f'ResNet input size (default {FULL["size"]})')
    parser.add_argument('--cifar-batch', type=int, default=None,
                        help=f'CIFAR ResNet batch size (default {FULL["cifar_batch"]})')
    parser.add_argument('--cifar-size', type=int, default=None,
                        help=f'CIFAR ResNet input size (default {FULL["cifar_size"]})')
    parser.add_argument('--repeats', type=int, default=None,
                        help=f'timed rounds; medians are reported (default {FULL["repeats"]})')
    parser.add_argument('--warmup', type=int, default=None,
                        help=f'untimed rounds first (default {FULL["warmup"]})')
    parser.add_argument('--inner', type=int, default=None,
                        help='back-to-back runs of a candidate per round; the round keeps the '
                        f'fastest (default {FULL["inner"]})')
    parser.add_argument('--threads', type=int, default=None,
                        help='CPU threads for torch (default: torch\'s current setting; 1 with '
                        '--quick)')
    parser.add_argument('--device', default='cpu', help='cpu (default) or cuda[:i]')
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument('--channels-last', action='store_true',
                     help='run every candidate (and its input) channels-last')
    fmt.add_argument('--contiguous', action='store_true',
                     help='run every candidate in NCHW (default: each backbone\'s own choice, '
                     'channels-last with layer attention, NCHW without)')
    parser.add_argument('--default-allocator', action='store_true',
                        help='on CPU, keep the allocators\' default settings; by default the '
                        'tool re-executes itself with '
                        'kcla_mm.analysis.benchmark.TUNED_ALLOCATOR_ENV (huge pages, freed '
                        'memory kept), the same for every candidate')
    parser.add_argument('--keep-attn-outputs', action='store_true',
                        help='build the backbones with recompute_attn_outputs=False: KCLA\'s '
                        'outputs kept for the backward pass instead of recomputed (more '
                        'memory, less time; with the fused CPU kernels only the first block\'s '
                        'output, the others are kept anyway)')
    parser.add_argument('--amp', choices=('fp16', 'bf16'), default=None,
                        help='run every forward and training step under torch.autocast to '
                        'this dtype (mixed precision, as GPU users train); default: float32')
    parser.add_argument('--compile', action='store_true',
                        help='also measure every candidate through torch.compile')
    parser.add_argument('--no-elementwise', action='store_true',
                        help='FLOPs without elementwise arithmetic (mmengine\'s default count)')
    parser.add_argument('--no-flops', action='store_true',
                        help='skip counting FLOPs (tracing deep networks takes a while)')
    parser.add_argument('--quick', action='store_true',
                        help='tiny widths and sizes for a smoke test: ' + ', '.join(
                            f'{k}={v}' for k, v in QUICK.items()) + ' (explicit flags win)')
    parser.add_argument('--from-json', metavar='FILE',
                        help='measure nothing: re-render benchmark.md and benchmark.png from a '
                        'benchmark.json of an earlier run into --out-dir')
    parser.add_argument('--pool', metavar='FILE', nargs='+',
                        help='measure nothing: pool the rounds of several benchmark.json runs '
                        'of one machine and setting (each run\'s ratios, their mean with a 95%% '
                        'interval over the runs, the median of all rounds) into pooled.md in '
                        '--out-dir')
    parser.add_argument('--out-dir', default='work_dirs/benchmark_layer_attention',
                        help='folder for benchmark.md, benchmark.json and benchmark.png')
    args = parser.parse_args(argv)
    if args.pool and args.from_json:
        parser.error('--pool and --from-json: give one of them')
    preset = QUICK if args.quick else FULL
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if 'none' not in args.methods:
        args.methods = ['none'] + args.methods
    args.methods = [m for m in METHODS if m in args.methods]
    if args.repeats < 1 or args.warmup < 0 or args.inner < 1:
        parser.error('--repeats and --inner must be >= 1 and --warmup >= 0')
    if args.compile and args.warmup < 1:
        parser.error('--compile needs --warmup >= 1 (the first call compiles)')
    if not args.depths and not args.cifar_depths:
        parser.error('nothing to measure: both --depths and --cifar-depths are empty')
    bad = [d for d in args.depths if d not in (50, 101, 152, 18, 34)]
    if bad:
        parser.error(f'--depths {bad}: ResNet depths are 18, 34, 50, 101, 152')
    if args.cifar_depths:
        try:  # the CIFAR family is mmpretrain's; the ImageNet family needs only mmdet
            from kcla_mm.models.backbones.cifar_kcla_resnet import cifar_stage_blocks
        except ImportError as e:
            parser.error(f'the CIFAR family (--cifar-depths) builds CifarKCLAResNet, which needs '
                         f'mmpretrain ({e}); install it, or pass --cifar-depths without depths')
        for depth in args.cifar_depths:
            try:
                cifar_stage_blocks(depth, args.cifar_block)
            except ValueError as e:
                parser.error(f'--cifar-depths: {e}')
    return args


def device_description(device: torch.device) -> str:
    if device.type == 'cuda':
        return f'{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})'
    features = cpu_features()
    return (f'CPU {cpu_name()}' + (f' ({features})' if features else '')
            + f', {os.cpu_count()} logical cores')


def write_outputs(results: Dict[Candidate, object], header: List[str], out_dir: str,
                  title: str) -> str:
    """Write benchmark.md and benchmark.png; returns the tables (as benchmark.md has them)."""
    table = (markdown_table(results) + '\n\nThe same rounds paired: each round\'s time over '
             'the plain ResNet\'s of that round\n\n' + round_ratio_table(results))
    os.makedirs(out_dir, exist_ok=True)
    with open(osp.join(out_dir, 'benchmark.md'), 'w') as f:
        f.write('\n'.join(f'- {line}' for line in header) + '\n\n' + table + '\n')
    plot(results, osp.join(out_dir, 'benchmark.png'), title)
    return table


def rerender(path: str, out_dir: str) -> Dict[Candidate, object]:
    """Re-render the table and the plot of an earlier run's benchmark.json."""
    with open(path) as f:
        data = json.load(f)
    results = load_results(data)
    print(write_outputs(results, data['header'], out_dir, data['header'][0]))
    print(f'wrote benchmark.md and benchmark.png to {out_dir}')
    return results


#: what must agree for runs to be pooled, as (key, what it is, whether the
#: key starts its header line): the machine (and threads), the input sizes,
#: and the memory format (at the end of the line on the rounds)
_POOL_KEYS = (('device: ', 'the device', True), ('ResNet: ', 'the input sizes', True),
              ('memory format: ', 'the memory format', False),
              ('precision: ', 'the precision', True))


def _header_value(header: List[str], key: str, at_start: bool) -> Optional[str]:
    for line in header:
        if line.startswith(key) if at_start else key in line:
            return line[line.index(key) + len(key):]
    # runs written before the precision line existed ran in float32
    return 'float32' if key == 'precision: ' else None


def pool(paths: Sequence[str], out_dir: str) -> str:
    """Pool several runs' benchmark.json into pooled.md in ``out_dir``; returns its text.

    Raises:
        SystemExit: a file is not a benchmark.json, or its run differs from
            the first one's in the device, threads, input sizes or memory format.
    """
    runs, first = [], None
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
            header = list(data['header'])
            results = load_results(data)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f'--pool: {path} is not a benchmark.json of this tool '
                             f'({type(e).__name__}: {e})')
        if first is None:
            first = (path, header)
        for key, what, at_start in _POOL_KEYS:
            mine = _header_value(header, key, at_start)
            theirs = _header_value(first[1], key, at_start)
            if mine != theirs:
                raise SystemExit(f'--pool: {path} differs from {first[0]} in {what} '
                                 f'({mine!r} against {theirs!r}); pool the runs of one '
                                 'machine and one setting')
        runs.append(results)
    values = [(key, _header_value(first[1], key, at_start)) for key, _, at_start in _POOL_KEYS]
    lines = [key + value for key, value in values if value is not None]
    lines.append(f'pooled: {len(paths)} runs: ' + ', '.join(paths))
    text = ('\n'.join(f'- {line}' for line in lines) + '\n\n' + pooled_ratio_table(runs)
            + '\n')
    os.makedirs(out_dir, exist_ok=True)
    with open(osp.join(out_dir, 'pooled.md'), 'w') as f:
        f.write(text)
    return text


def main(argv: Optional[Sequence[str]] = None) -> Dict[Candidate, object]:
    """Run the benchmark; returns the results per candidate."""
    args = parse_args(argv)
    if args.from_json:
        return rerender(args.from_json, args.out_dir)
    if args.pool:
        print(pool(args.pool, args.out_dir), end='')
        print(f'wrote pooled.md to {args.out_dir}')
        return {}
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('--device cuda: CUDA is not available')
    if argv is None and device.type == 'cpu' and not args.default_allocator:
        restart_with_tuned_allocator()  # the command line: same arguments, new process
    channels_last = True if args.channels_last else (False if args.contiguous else None)
    settings = {'imagenet': Setting(args.batch, args.size),
                'cifar': Setting(args.cifar_batch, args.cifar_size)}
    candidates: List[Candidate] = []
    models = {}
    torch.manual_seed(0)
    for family, depths in (('imagenet', args.depths), ('cifar', args.cifar_depths)):
        for depth in depths:
            for method in args.methods:
                model = build_backbone(
                    family, depth, method, tiny=args.quick, channels_last=channels_last,
                    recompute_attn_outputs=not args.keep_attn_outputs,
                    cifar_block=args.cifar_block).to(device)
                # (a channels-last backbone keeps its convolution weights
                # channels-last itself: the model is measured as configs build it)
                c = Candidate(family, depth, method)
                candidates.append(c)
                models[c] = model
                if args.compile:
                    cc = Candidate(family, depth, method, compiled=True)
                    candidates.append(cc)
                    models[cc] = torch.compile(model)
    started = time.time()

    def progress(msg: str) -> None:
        print(f'[{time.time() - started:6.1f}s] {msg}', flush=True)

    def flops(model: torch.nn.Module, x: torch.Tensor) -> Optional[int]:
        if args.no_flops:
            return None
        return count_flops(model, x, elementwise=not args.no_elementwise)

    fmt = 'channels-last' if args.channels_last else ('NCHW' if args.contiguous else
                                                      'each backbone\'s default')
    header = [
        f'device: {device_description(device)}; torch {torch.__version__}; '
        f'CPU threads: {torch.get_num_threads()}',
    ] + ([allocator_description()] if device.type == 'cpu' else []) + [
        f'ResNet: batch {args.batch} at {args.size}x{args.size}; CIFAR ResNet '
        f'({args.cifar_block}s): batch {args.cifar_batch} at {args.cifar_size}x{args.cifar_size}'
        + ('; tiny widths (--quick)' if args.quick else ''),
        f'medians of {args.repeats} interleaved rounds after {args.warmup} warm-up, each the '
        f'fastest of {args.inner} back-to-back runs (eval()/train() called before them, '
        f'untimed; gradients reset to None over a parameter list, as an optimiser does); memory '
        f'format: {fmt}' + ('; torch.compile measured too' if args.compile else ''),
        f'precision: {"autocast " + args.amp if args.amp else "float32"}',
        'FLOPs: not counted (--no-flops)' if args.no_flops else
        'FLOPs per image (batch 1), one multiply-add = 1' + (
            '' if args.no_elementwise else ', elementwise arithmetic counted'),
        'peak train memory: ' + ('torch.cuda.max_memory_allocated' if device.type == 'cuda'
                                 else 'peak live tensor bytes of one training step '
                                 '(TorchDispatchMode storage tracking) + parameters, buffers '
                                 'and input'),
        'per block: (time - plain ResNet time) / blocks, ms; ratios (x) to the plain ResNet '
        'of the same depth in this run',
        'KCLA outputs: ' + ('kept for the backward pass (recompute_attn_outputs=False)'
                            if args.keep_attn_outputs else
                            'recomputed in the backward pass where KCLA keeps its input (the '
                            'default; the fused CPU kernels keep the outputs but the first)'),
        'KCLA on CPU: ' + (
            'fused CPU kernels (eval: torch.ops.kcla_mm.eval_step; training: train_*, head_* '
            'and, at the init layers, adapt_* ops); each block\'s last BatchNorms (host ops), '
            'add and ReLU with the pool in one pass (residual_bn_relu_pool_, block_end_*; the '
            'plain ResNet runs them as torch ops)' if device.type == 'cpu'
            and _fused_kernels_available() else 'eager ops'),
    ]
    for line in header:
        print(line)
    results = run(candidates, models, settings, device, args.repeats, args.warmup,
                  channels_last=bool(args.channels_last), count_flops_fn=flops,
                  progress=progress, inner=args.inner,
                  amp={'fp16': torch.float16, 'bf16': torch.bfloat16}.get(args.amp))
    title = f'{device_description(device)}, CPU threads: {torch.get_num_threads()}'
    print(write_outputs(results, header, args.out_dir, title))
    with open(osp.join(args.out_dir, 'benchmark.json'), 'w') as f:
        json.dump(dict(header=header, argv=list(sys.argv[1:] if argv is None else argv),
                       results=dump_results(results)), f, indent=1)
    print(f'wrote benchmark.md, benchmark.json and benchmark.png to {args.out_dir}')
    return results


if __name__ == '__main__':
    main()

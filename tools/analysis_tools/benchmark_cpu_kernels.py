"""A/B of KCLA with and without the fused CPU kernels, in one process.

Measures, interleaved round by round, the eval-mode forward (or with
``--train`` the training step: forward in train mode and backward of the
mean output) of a plain ResNet, KCLA-ResNet with the eager ops
(``KCLA_MM_CPU_KERNELS=0``) and KCLA-ResNet with the fused kernels
(``torch.ops.kcla_mm``), all channels-last, and prints medians and ratios to
the plain ResNet::

    .venv/bin/python tools/analysis_tools/benchmark_cpu_kernels.py --depth 50 --batch 4 \\
        --threads 2 --repeats 15 [--train]

The ratios, not the milliseconds, compare across runs on a shared machine.
"""
import argparse
import os
import statistics
import time

import torch

from kcla_mm.analysis.benchmark import allocator_description, restart_with_tuned_allocator
from kcla_mm.models.backbones.mmdet_kcla_resnet import KCLAResNet
from kcla_mm.ops.fused import build as cpu_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--depth', type=int, default=50, choices=(18, 34, 50, 101, 152))
    parser.add_argument('--batch', type=int, default=4)
    parser.add_argument('--size', type=int, default=224)
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--repeats', type=int, default=15)
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument('--train', action='store_true',
                        help='time training steps instead of eval forwards')
    parser.add_argument('--default-allocator', action='store_true',
                        help='keep the allocators\' default settings (by default the tool '
                        're-executes itself with kcla_mm.analysis.benchmark.TUNED_ALLOCATOR_ENV)')
    args = parser.parse_args()
    if not args.default_allocator:
        restart_with_tuned_allocator()
    for name in ('batch', 'size', 'threads', 'repeats'):
        if getattr(args, name) < 1:
            parser.error(f'--{name} must be >= 1, got {getattr(args, name)}')
    torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        raise SystemExit(f'the fused CPU kernels are not available: {cpu_kernels.build_error()}')
    torch.manual_seed(0)
    kw = dict(depth=args.depth, out_indices=(3, ), norm_eval=False)
    plain = KCLAResNet(layer_attn=None, channels_last=True, **kw).train(args.train)
    kcla = KCLAResNet(layer_attn=dict(type='KCLA'), **kw).train(args.train)
    x = torch.rand(args.batch, 3, args.size, args.size)
    candidates = {'plain ResNet': (plain, '1'), 'KCLA eager': (kcla, '0'),
                  'KCLA fused': (kcla, '1')}
    times = {name: [] for name in candidates}
    saved = os.environ.get('KCLA_MM_CPU_KERNELS')
    try:
        for r in range(args.warmup + args.repeats):
            names = list(candidates)
            for name in names[r % 3:] + names[:r % 3]:  # rotate the order
                model, env = candidates[name]
                os.environ['KCLA_MM_CPU_KERNELS'] = env
                if args.train:
                    for p in model.parameters():
                        p.grad = None
                    start = time.perf_counter()
                    model(x)[0].mean().backward()
                    elapsed = time.perf_counter() - start
                else:
                    with torch.no_grad():
                        start = time.perf_counter()
                        model(x)
                        elapsed = time.perf_counter() - start
                if r >= args.warmup:
                    times[name].append(elapsed)
    finally:
        if saved is None:
            os.environ.pop('KCLA_MM_CPU_KERNELS', None)
        else:
            os.environ['KCLA_MM_CPU_KERNELS'] = saved
    what = 'training step' if args.train else 'eval forward'
    print(f'ResNet-{args.depth}, {what}, batch {args.batch} at {args.size}x{args.size}, '
          f'{args.threads} CPU threads, torch {torch.__version__}, medians of {args.repeats} '
          f'interleaved rounds after {args.warmup} warm-up')
    print(allocator_description())
    base = statistics.median(times['plain ResNet'])
    print(f'| candidate | {what} (ms) | ratio |\n| --- | ---: | ---: |')
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f'| {name} | {t * 1e3:.1f} | {t / base:.2f}x |')


if __name__ == '__main__':
    main()

"""Time the fused KCLA CPU kernels op by op at ResNet-50 shapes, against other builds.

For each training kernel of a KCLA step (``train_stats``, ``train_apply``,
``train_grad_stats``, ``train_backward``) and the eval kernel
(``eval_step``): the time of one call per block, summed over the blocks of a
ResNet-50 (3, 4, 6 and 3 blocks of 256, 512, 1024 and 2048 channels at
1/4 .. 1/32 of the input size), median over interleaved rounds. The other
training kernels the model calls are timed the same way: a block's end
(``block_end_forward``/``_backward``, one call per block, without the
shortcut's norm that the first block of each stage has) and an init layer's
adaptation (``adapt_forward``/``_backward``, one call at each of the three
stage transitions). "training total" is the four ``train_*`` kernels'.
``train_backward`` is called as the model calls it for every block but the
first: given the step's output, from which it takes
``x`` (``x_is_out``; giving it ``x`` instead would skip that work).
``--against DIR`` adds builds of other kernel
sources (a ``kcla_mm/ops/fused/csrc`` folder, e.g. of a ``git worktree`` at another
commit): each is compiled under its own op namespace, checked to compute
what the installed build computes, and timed in the same rounds, so that two
versions of a kernel compare on one machine at one time::

    git worktree add /tmp/before HEAD~1
    .venv/bin/python tools/analysis_tools/benchmark_cpu_ops.py \\
        --against /tmp/before/kcla_mm/ops/fused/csrc

By default every call reads the same inputs, which then stay in the caches
between calls; in a network most of a block's maps come from memory.
``--rotate-mb 600`` keeps copies of each stage's inputs, at least that many
MB of them, and gives every call the next copy, so that each call reads its
maps from memory (on an Intel Xeon with AVX-512 a prefetch in
``train_apply`` measured 3% with the same inputs and 8-11% out of cache).
Passing the same folder twice to ``--against`` builds it twice: an A/A pair,
whose spread is the noise floor of the comparison.

``--per-element`` asks where an op's time goes instead, on one thread: per
output element at stage 1's 256 channels, its time with all its maps in the
core's L2 cache (the slope of the time against the height of small maps, so
that the fixed cost of a call cancels) against its time on the stage-1 maps
of the ResNet-50 read from memory, with ``torch.add`` of two maps as a
reference that memory traffic bounds. A ratio near 1 says the op is bound by
its own instructions; near the reference's, by memory. (On an Intel Xeon
with AVX-512 the four training kernels took 50-70% of their from-memory time
on the same work in L2, ``train_backward`` 70% (given ``x``), ``eval_step``
33-39%, ``torch.add`` 15%. The writes of maps stored non-temporally go to
memory in both figures.)

Restarts itself with the tuned CPU allocator settings unless
``--default-allocator`` (see :data:`kcla_mm.analysis.benchmark.TUNED_ALLOCATOR_ENV`).
"""
import argparse
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from kcla_mm.analysis.benchmark import allocator_description, restart_with_tuned_allocator
from kcla_mm.ops.fused import build as cpu_kernels

#: ResNet-50's stages: (channels, stride to the input, blocks)
STAGES = ((256, 4, 3), (512, 8, 4), (1024, 16, 6), (2048, 32, 3))
OPS = ('train_stats', 'train_apply', 'train_grad_stats', 'train_backward', 'eval_step',
       'block_end_forward', 'block_end_backward', 'adapt_forward', 'adapt_backward')
#: ops called once per stage transition (stages 2-4), not once per block
PER_TRANSITION = ('adapt_forward', 'adapt_backward')


def calls_per_step(op: str, stage: int, blocks: int) -> int:
    """How many times a ResNet-50 training step (or forward) calls ``op`` at ``stage``."""
    if op in PER_TRANSITION:
        return 1 if stage > 0 else 0
    return blocks


def stage_inputs(channels: int, size: int, batch: int, seed: int,
                 width: Optional[int] = None) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (batch, channels, size, size if width is None else width)
    maps = {k: torch.rand(shape, generator=g).contiguous(memory_format=torch.channels_last)
            for k in ('x', 'prev', 'gy', 'gmean')}
    vec = {k: torch.rand(batch, channels, generator=g) for k in ('beta', 'a', 'alpha', 'kappa',
                                                                 'lam')}
    vec['shift'] = torch.rand(batch, channels, generator=g) - 0.5
    heads = channels // 64
    extra = dict(wv=torch.randn(channels, 1, 3, 3, generator=g) / 3,
                 wq=torch.randn(1, 1, 5, generator=g), wk=torch.randn(1, 1, 5, generator=g),
                 phi=torch.randn(heads, heads, generator=g) / heads,
                 inv_tau=torch.linspace(0.7, 1 / 0.7, heads, dtype=torch.float64),
                 log_z=torch.rand(batch, heads, generator=g), norm_scale=torch.rand(channels),
                 norm_shift=torch.rand(channels) - 0.5)
    d = {**maps, **vec, **extra}
    d['mean'] = torch.ops.kcla_mm.train_stats(d['x'], d['prev'], d['beta'], d['wv'])[0]
    # the step's output: what train_backward reads in place of x in the model
    # (x_is_out) for every block but the first
    d['out'] = torch.ops.kcla_mm.train_apply(d['x'], d['mean'], d['wv'], d['a'], d['shift'])
    # a block's end: its last convolution's output x, the shortcut prev, a
    # training-mode BatchNorm (its running statistics updated by every call;
    # an eval-mode one where a map has one value per channel)
    d.update(norm_w=torch.rand(channels, generator=g) + 0.5,
             norm_b=torch.randn(channels, generator=g) * 0.1, norm_rm=torch.zeros(channels),
             norm_rv=torch.ones(channels),
             bn_train=torch.tensor(shape[0] * shape[2] * shape[3] > 1))
    _, _, d['end_mask'], d['end_mu'], d['end_invstd'], _, _ = block_end_forward(
        torch.ops.kcla_mm, d)
    # an init layer adapting the previous stage's state (channels / 2, twice the
    # size) with ResNet-50's adjust: 32 inputs per group of 64 outputs
    d['m'] = torch.rand(batch, channels // 2, 2 * shape[2], 2 * shape[3],
                        generator=g).contiguous(memory_format=torch.channels_last)
    d['adjust'] = torch.randn(channels, 32, 1, 1, generator=g) / math.sqrt(32)
    _, d['y'], _, _, d['adapt_mu'], d['adapt_invstd'] = adapt_forward(torch.ops.kcla_mm, d)
    return d


def block_end_forward(o, d):
    return o.block_end_forward(d['x'], d['prev'], d['norm_w'], d['norm_b'], d['norm_rm'],
                               d['norm_rv'], bool(d['bn_train']), 0.1, 1e-5, None, None, None,
                               None, False, 0.0, 1e-5)


def adapt_forward(o, d):
    return o.adapt_forward(d['m'], d['adjust'], 2, d['norm_w'], d['norm_b'], d['norm_rm'],
                           d['norm_rv'], bool(d['bn_train']), 0.1, 1e-5)


def calls(namespace: str) -> Dict[str, Callable[[Dict[str, torch.Tensor]], object]]:
    o = getattr(torch.ops, namespace)
    return {
        'train_stats': lambda d: o.train_stats(d['x'], d['prev'], d['beta'], d['wv']),
        'train_apply': lambda d: o.train_apply(d['x'], d['mean'], d['wv'], d['a'], d['shift']),
        'train_grad_stats': lambda d: o.train_grad_stats(d['gy'], d['mean'], d['wv'], d['a'],
                                                         d['shift'], None),
        'train_backward': lambda d: o.train_backward(
            d['gy'], d['gmean'], d['out'], d['prev'], d['mean'], d['beta'], d['wv'], d['a'],
            d['shift'], None, d['alpha'], d['kappa'], d['lam'], True),
        # not in place, so that every call sees the same inputs
        'eval_step': lambda d: o.eval_step(
            d['x'], d['prev'], d['log_z'], d['wq'], d['wk'], d['inv_tau'], d['phi'], d['wv'],
            d['norm_scale'], d['norm_shift'], None, None, None, 1, 10.0, 1e-3, False, False),
        'block_end_forward': lambda d: block_end_forward(o, d),
        'block_end_backward': lambda d: o.block_end_backward(
            d['gy'], d['alpha'], d['end_mask'], d['x'], d['norm_w'], d['end_mu'],
            d['end_invstd'], bool(d['bn_train']), None, None, None, None, False),
        'adapt_forward': lambda d: adapt_forward(o, d),
        'adapt_backward': lambda d: o.adapt_backward(
            d['gy'], d['alpha'], d['m'], d['y'], d['adjust'], 2, d['norm_w'], d['adapt_mu'],
            d['adapt_invstd'], bool(d['bn_train'])),
    }


def _tensors(out) -> List[torch.Tensor]:
    return [t for t in (out if isinstance(out, (tuple, list)) else (out, )) if t.numel()]


def check_same(namespace: str, data: Sequence[Tuple[Dict[str, torch.Tensor], int]],
               ops: Sequence[str]) -> None:
    """Raise unless ``namespace``'s ops compute what the installed build computes."""
    ref, got = calls('kcla_mm'), calls(namespace)
    missing = [op for op in ops if not hasattr(getattr(torch.ops, namespace), op)]
    if missing:
        raise SystemExit(f'{namespace}: the build has no {", ".join(missing)} (sources older '
                         f'than the op); leave it out with --ops')
    for op in ops:
        for d, _ in data:
            for a, b in zip(_tensors(ref[op](d)), _tensors(got[op](d))):
                if not a.is_floating_point():
                    # a packed ReLU mask: a bit may flip where two builds round an
                    # input near 0 apart; the output it masks is compared
                    continue
                scale = float(a.double().abs().max()) + 1e-12
                err = float((a.double() - b.double()).abs().max()) / scale
                # builds that sum in another order differ by about 1e-5 (an
                # adapt_backward that did measured 1.4e-5); a wrong term, far more
                if err > 1e-4:
                    raise SystemExit(f'{namespace}: {op} differs from the installed build '
                                     f'(max relative error {err:.2e})')


def rotation(d: Dict[str, torch.Tensor], megabytes: float) -> List[Dict[str, torch.Tensor]]:
    """``d`` and copies of it, at least ``megabytes`` MB of tensors in all (``d`` alone for 0)."""
    size = sum(t.numel() * t.element_size() for t in d.values()) / 1e6
    copies = max(1, math.ceil(megabytes / size)) if megabytes > 0 else 1
    return [d] + [{k: t.clone() for k, t in d.items()} for _ in range(copies - 1)]


def rotated(items: Sequence, r: int) -> list:
    """``items`` started at the ``r``-th (cyclically): round ``r``'s order, so that drift
    affects every candidate alike."""
    k = r % len(items)
    return list(items[k:]) + list(items[:k])


def measure(namespaces: Sequence[str], data, ops: Sequence[str], rounds: int,
            warmup: int) -> Dict[Tuple[str, str], List[float]]:
    """ms per ResNet-50 step of each op, per round: ``{(namespace, op): [ms, ...]}``.

    ``data``: ``[(inputs, blocks)]`` per stage, ``inputs`` one dict or a list
    of copies (see :func:`rotation`), used in turn, one per call.
    """
    times = {(ns, op): [] for ns in namespaces for op in ops}
    data = [(d if isinstance(d, list) else [d], blocks) for d, blocks in data]
    calls_made = 0
    for r in range(warmup + rounds):
        for ns in rotated(namespaces, r):
            fns = calls(ns)
            for op in ops:
                total = 0.0
                for stage, (copies, blocks) in enumerate(data):
                    n = calls_per_step(op, stage, blocks)
                    if n == 0:
                        continue
                    d = copies[calls_made % len(copies)]
                    start = time.perf_counter()
                    fns[op](d)
                    total += (time.perf_counter() - start) * n
                calls_made += 1
                if r >= warmup:
                    times[(ns, op)].append(total * 1e3)
    return times


#: --per-element's in-L2 figure: the slope of time against map height over
#: these heights, one sample of SLOPE_WIDTH pixels per row (one band of rows
#: each on one thread, see bands_of in csrc/kcla_cpu.h; all seven maps of
#: train_backward in 1.4 MB at 7 rows). The median of the slopes between
#: every two heights (Theil-Sen), so that one slow size (a cache set that a
#: map's addresses happen to crowd) does not decide it.
SLOPE_ROWS = (2, 3, 4, 5, 6, 7)
SLOPE_WIDTH = 28
#: --per-element's reference row
REFERENCE = 'torch.add'


def _seconds_per_call(fn: Callable[[], object], batch_seconds: float = 0.005,
                      batches: int = 5) -> float:
    """Seconds per call of ``fn``: the fastest of ``batches`` batches of back-to-back calls,
    each lasting about ``batch_seconds``."""
    start = time.perf_counter()
    fn()
    reps = max(3, math.ceil(batch_seconds / max(time.perf_counter() - start, 1e-9)))
    best = math.inf
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def per_element(namespaces: Sequence[str], ops: Sequence[str], batch: int, size: int,
                rounds: int, warmup: int,
                rotate_mb: float) -> Dict[Tuple[str, str, str], List[float]]:
    """Picoseconds per output element of each op at stage 1's channels, one thread, per round.

    ``{(namespace, op, 'l2'): [...], (namespace, op, 'memory'): [...]}``, and
    the same for ``torch.add`` under ``(REFERENCE, REFERENCE, ...)``. In L2:
    the slope of the time per call against the height of the maps
    (``SLOPE_ROWS``, one sample of ``SLOPE_WIDTH`` pixels per row; see
    :func:`theil_sen_slope`) over the elements of a row, so that the fixed
    cost per call cancels. From memory: the stage-1 maps of the
    ResNet-50 (``batch``, ``size / 4``), the inputs rotated over ``rotate_mb``
    MB. One thread, so that both figures are one core's.
    """
    channels, stride, _ = STAGES[0]
    small = [stage_inputs(channels, h, 1, 10 + i, width=SLOPE_WIDTH)
             for i, h in enumerate(SLOPE_ROWS)]
    row_elements = channels * SLOPE_WIDTH
    big = rotation(stage_inputs(channels, size // stride, batch, 0), rotate_mb)
    big_elements = batch * channels * (size // stride) ** 2
    # torch.add of two maps: a reference bound by memory traffic (2 maps read, 1 written)
    runs = [(ns, op) for ns in namespaces for op in ops] + [(REFERENCE, REFERENCE)]
    out = {(ns, op, k): [] for ns, op in runs for k in ('l2', 'memory')}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _per_element_rounds(runs, out, small, row_elements, big, big_elements, rounds, warmup)
    finally:
        torch.set_num_threads(threads)
    return out


def theil_sen_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The median of the slopes between every two points (distinct ``xs``)."""
    return statistics.median((ys[j] - ys[i]) / (xs[j] - xs[i])
                             for i in range(len(xs)) for j in range(i + 1, len(xs)))


def _per_element_rounds(runs, out, small, row_elements, big, big_elements, rounds,
                        warmup) -> None:
    for r in range(warmup + rounds):
        for ns, op in rotated(runs, r):
            f = (lambda d: torch.add(d['x'], d['prev'])) if ns == REFERENCE else calls(ns)[op]
            seconds = [_seconds_per_call(lambda d=d: f(d)) for d in small]
            start = time.perf_counter()
            for d in big:
                f(d)
            memory = (time.perf_counter() - start) / len(big) / big_elements
            if r >= warmup:
                out[(ns, op, 'l2')].append(
                    theil_sen_slope(SLOPE_ROWS, seconds) / row_elements * 1e12)
                out[(ns, op, 'memory')].append(memory * 1e12)


def per_element_table(res, namespaces: Sequence[str], labels: Sequence[str],
                      ops: Sequence[str]) -> str:
    lines = ['| op | build | in L2 (ps per element) | from memory (ps per element) | '
             'in L2 / from memory |', '| --- | --- | ---: | ---: | ---: |']
    rows = [(op, ns, label) for op in ops for ns, label in zip(namespaces, labels)]
    for op, ns, label in rows + [(REFERENCE, REFERENCE, 'reference')]:
        l2 = statistics.median(res[(ns, op, 'l2')])
        mem = statistics.median(res[(ns, op, 'memory')])
        lines.append(f'| {op} | {label} | {l2:.0f} | {mem:.0f} | {l2 / mem:.2f} |')
    return '\n'.join(lines)


def table(times, namespaces: Sequence[str], labels: Sequence[str], ops: Sequence[str]) -> str:
    lines = ['| op | ' + ' | '.join(labels) + ' |',
             '| --- |' + ' ---: |' * len(labels)]
    for op in ops + ('training total', ):
        row = []
        for ns in namespaces:
            if op == 'training total':
                ms = sum(statistics.median(times[(ns, o)]) for o in ops if o.startswith('train'))
            else:
                ms = statistics.median(times[(ns, op)])
            row.append(f'{ms:.2f}')
        lines.append(f'| {op} | ' + ' | '.join(row) + ' |')
    return '\n'.join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--against', nargs='*', default=[], type=Path, metavar='CSRC',
                        help='other kernel source folders to build and time side by side')
    parser.add_argument('--batch', type=int, default=4)
    parser.add_argument('--size', type=int, default=224, help='input size of the ResNet-50')
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--rounds', type=int, default=9)
    parser.add_argument('--warmup', type=int, default=1)
    parser.add_argument('--ops', nargs='+', default=list(OPS), choices=OPS)
    parser.add_argument('--rotate-mb', type=float, default=0.0, metavar='MB',
                        help='keep copies of each stage\'s inputs, at least this many MB, and '
                        'give each call the next copy, so that it reads from memory, not cache '
                        '(e.g. 600; default 0: the same inputs every call)')
    parser.add_argument('--per-element', action='store_true',
                        help='per output element at stage 1\'s channels, on one thread: each '
                        'op\'s time with its maps in L2 against its time reading them from '
                        'memory (rotated over --rotate-mb, 600 if not given)')
    parser.add_argument('--default-allocator', action='store_true',
                        help='keep the allocators\' default settings (by default the tool '
                        're-executes itself with kcla_mm.analysis.benchmark.TUNED_ALLOCATOR_ENV)')
    args = parser.parse_args(argv)
    for name in ('batch', 'size', 'threads', 'rounds'):
        if getattr(args, name) < 1:
            parser.error(f'--{name} must be >= 1, got {getattr(args, name)}')
    if args.size < 32:
        parser.error(f'--size must be >= 32 (stage 4 is 1/32 of it), got {args.size}')
    if not (math.isfinite(args.rotate_mb) and args.rotate_mb >= 0):
        parser.error(f'--rotate-mb must be a finite number >= 0, got {args.rotate_mb}')
    return args


def main(argv=None) -> Dict[tuple, List[float]]:
    """ms per step per round, ``{(namespace, op): [...]}``; with ``--per-element`` the
    ps per element of :func:`per_element`."""
    args = parse_args(argv)
    if argv is None and not args.default_allocator:
        restart_with_tuned_allocator()
    torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        raise SystemExit(f'the fused CPU kernels are not available: {cpu_kernels.build_error()}')
    data = [(stage_inputs(c, args.size // s, args.batch, i), blocks)
            for i, (c, s, blocks) in enumerate(STAGES)]
    namespaces, labels = ['kcla_mm'], ['installed build']
    workdir = Path(tempfile.mkdtemp(prefix='kcla_ops_ab_'))
    try:
        for i, csrc in enumerate(args.against):
            try:
                ns = cpu_kernels.build_variant(csrc, workdir, f'kcla_ab{i}')
            except FileNotFoundError as e:
                raise SystemExit(f'--against {e}') from None
            check_same(ns, data, args.ops)
            namespaces.append(ns)
            labels.append(str(csrc))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.per_element:
        rotate_mb = args.rotate_mb or 600.0
        res = per_element(namespaces, args.ops, args.batch, args.size, args.rounds,
                          args.warmup, rotate_mb)
        c, stride, _ = STAGES[0]
        print(f'fused KCLA CPU kernels (and torch.add of two maps), ps per output element at '
              f'{c} channels, 1 thread (--threads does not apply), torch {torch.__version__}, '
              f'medians of {args.rounds} interleaved rounds after {args.warmup} warm-up; in L2: '
              f'the time per added row of [1, {c}, H, {SLOPE_WIDTH}] maps, H = '
              f'{SLOPE_ROWS[0]}..{SLOPE_ROWS[-1]} (Theil-Sen slope), over its elements; from '
              f'memory: [{args.batch}, {c}, {args.size // stride}, {args.size // stride}] maps, '
              f'inputs rotated over at least {rotate_mb:g} MB')
        print(allocator_description())
        print(per_element_table(res, namespaces, labels, tuple(args.ops)))
        return res
    data = [(rotation(d, args.rotate_mb), blocks) for d, blocks in data]
    times = measure(namespaces, data, args.ops, args.rounds, args.warmup)
    inputs = ('the same inputs every call' if args.rotate_mb <= 0 else
              f'inputs rotated over {", ".join(str(len(c)) for c, _ in data)} copies per stage '
              f'(at least {args.rotate_mb:g} MB each: read from memory)')
    print(f'fused KCLA CPU kernels, ms per ResNet-50 step (one call per block, summed over the '
          f'16 blocks), batch {args.batch} at {args.size}x{args.size}, {args.threads} threads, '
          f'torch {torch.__version__}, medians of {args.rounds} interleaved rounds after '
          f'{args.warmup} warm-up, {inputs}')
    print(allocator_description())
    print(table(times, namespaces, labels, tuple(args.ops)))
    return times


if __name__ == '__main__':
    main()

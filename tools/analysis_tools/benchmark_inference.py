"""CPU inference speed: onnxruntime against PyTorch eager, KCLA against the plain ResNet.

For each model (KCLA-ResNet-18/34-UNet at 256x256, the KCLA-ResNet-50
backbone at 224x224; ``--models``) and batch size (``--batches``, default 1
and 8), in one process, five candidates:

- KCLA, PyTorch eager with the fused CPU kernels (the default path);
- KCLA, PyTorch eager on the plain path (fused kernels switched off);
- KCLA, onnxruntime (CPU execution provider) running the graph that
  ``tools/deployment/pytorch2onnx.py`` exports;
- the plain ResNet of the same depth (``layer_attn=None``), PyTorch eager;
- the plain ResNet, onnxruntime.

The UNets are timed as exported: the whole segmentor, from the RGB 0-255
image through normalisation to logits and mask; the ResNet-50 as a backbone
(its four stages' features). Weights are the models' initialisation (speed
does not depend on them).

Method: after ``--warmup`` rounds, each of ``--repeats`` rounds runs every
candidate once, in an order rotated by one per round, so drift on a shared
machine affects all alike; medians over rounds are reported, as milliseconds
per batch and images per second, and every KCLA figure also as a ratio to
the plain ResNet's time under the same runtime. PyTorch and onnxruntime get
the same number of threads (``--threads``, default PyTorch's); onnxruntime's
are told not to busy-wait between runs (they do by default), which would take
the cores from the PyTorch candidate timed next. The plain ResNet runs in the
host's memory format (NCHW), the KCLA-ResNet channels-last (its default). Runs
are short: on a shared virtual machine single runs stray by 5-40%.

Writes ``--out-dir``/benchmark_inference.md (settings and table) and
``benchmark_inference.json`` (every round).

Examples::

    python tools/analysis_tools/benchmark_inference.py                 # a few minutes on 2 cores
    python tools/analysis_tools/benchmark_inference.py --quick         # tiny models, seconds
    python tools/analysis_tools/benchmark_inference.py --models unet-r18 --batches 1
"""
import argparse
import json
import os
import os.path as osp
import platform
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
for _folder in ('deployment', 'analysis_tools'):
    if osp.join(ROOT, 'tools', _folder) not in sys.path:
        sys.path.insert(0, osp.join(ROOT, 'tools', _folder))
import pytorch2onnx as p2o  # noqa: E402
from _common import quiet_logs  # noqa: E402

#: model name -> (label, config of the KCLA model, config of the plain one, input size)
MODELS: Dict[str, Tuple[str, Optional[str], Optional[str], int]] = {
    'unet-r18': ('KCLA-ResNet-18-UNet',
                 'configs/unet/unet_kcla-r18_1xb8-300e_kvasir-seg-256x256.py',
                 'configs/unet/unet_r18_1xb8-300e_kvasir-seg-256x256.py', 256),
    'unet-r34': ('KCLA-ResNet-34-UNet',
                 'configs/unet/unet_kcla-r34_1xb8-300e_kvasir-seg-256x256.py',
                 'configs/unet/unet_r34_1xb8-300e_kvasir-seg-256x256.py', 256),
    'r50': ('KCLA-ResNet-50 backbone', None, None, 224),
}
#: ``--quick``: the tiny demo UNet and a narrow ResNet-50
QUICK_UNET = 'configs/unet/unet_kcla-r18-tiny_1xb8-300i_synthetic-kvasir-128x128.py'
RUNTIMES = ('eager_fused', 'eager_plain', 'onnxruntime')
RUNTIME_NAMES = {'eager_fused': 'PyTorch eager, fused kernels',
                 'eager_plain': 'PyTorch eager, plain path', 'onnxruntime': 'onnxruntime'}


@dataclass(frozen=True)
class Candidate:
    model: str  # a key of MODELS
    batch: int
    kcla: bool  # False: the plain ResNet
    runtime: str  # one of RUNTIMES ('eager_fused' only with kcla)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--models', nargs='+', choices=list(MODELS), default=list(MODELS))
    parser.add_argument('--batches', type=int, nargs='+', default=[1, 8])
    parser.add_argument('--repeats', type=int, default=3, help='timed rounds (default 3)')
    parser.add_argument('--warmup', type=int, default=1, help='untimed rounds (default 1)')
    parser.add_argument('--threads', type=int, default=None,
                        help='CPU threads of PyTorch and onnxruntime (default: PyTorch\'s)')
    parser.add_argument('--quick', action='store_true',
                        help='tiny models at 64x64, one round: checks the tool, measures nothing')
    parser.add_argument('--out-dir', default='work_dirs/benchmark_inference')
    return parser.parse_args(argv)


def build_unet(config: str, layer_attn_none: bool = False) -> Tuple[nn.Module, object]:
    opts = {'model.backbone.layer_attn': None} if layer_attn_none else None
    cfg, model = p2o.build_model(osp.join(ROOT, config), None, opts)
    return p2o.make_graph(cfg, model, 'segmentor'), cfg


def build_r50(kcla: bool, tiny: bool = False) -> nn.Module:
    from mmdet.registry import MODELS as DET_MODELS
    from mmengine.registry import init_default_scope

    import kcla_mm  # noqa: F401
    init_default_scope('mmdet')
    kwargs = dict(base_channels=16, stem_channels=16, head_dim=16) if tiny else {}
    backbone = DET_MODELS.build(dict(type='KCLAResNet', depth=50,
                                     layer_attn=dict(type='KCLA') if kcla else None, **kwargs))
    with quiet_logs():  # (init_weights reports every parameter)
        backbone.init_weights()
    return p2o.FeatureGraph(backbone).eval()


def build_graphs(name: str, quick: bool) -> Dict[bool, nn.Module]:
    """``{True: the KCLA model, False: the plain ResNet}`` as exportable graphs."""
    if name == 'r50':
        return {kcla: build_r50(kcla, tiny=quick) for kcla in (True, False)}
    config = QUICK_UNET if quick else MODELS[name][1]
    plain = MODELS[name][2]
    graphs = {True: build_unet(config)[0]}
    graphs[False] = build_unet(config, layer_attn_none=True)[0] if quick else build_unet(plain)[0]
    return graphs


def runner(graph: nn.Module, runtime: str, x: torch.Tensor, ort_model=None) -> Callable[[], None]:
    if runtime == 'onnxruntime':
        feed = {'image': x.numpy()}
        return lambda: ort_model.run(None, feed)

    from kcla_mm.ops import fused_kernels

    def eager() -> None:
        with torch.no_grad(), fused_kernels(runtime == 'eager_fused'):
            graph(x)
    return eager


def measure(fns: Dict[Candidate, Callable[[], None]], repeats: int,
            warmup: int) -> Dict[Candidate, List[float]]:
    """Seconds per call of every candidate, interleaved rounds in rotated order."""
    order = list(fns)
    times: Dict[Candidate, List[float]] = {c: [] for c in order}
    for r in range(warmup + repeats):
        k = r % len(order)
        for c in order[k:] + order[:k]:
            start = time.perf_counter()
            fns[c]()
            if r >= warmup:
                times[c].append(time.perf_counter() - start)
    return times


def fused_kernels_available() -> bool:
    """Whether kcla_mm's fused CPU kernels are built (the eager-fused rows use them)."""
    try:
        from kcla_mm.ops.fused import build
    except ImportError:  # the optional folder kcla_mm/ops/fused is absent
        return False
    return build.available()


def machine() -> str:
    from kcla_mm.analysis.benchmark import cpu_features, cpu_name
    features = cpu_features()
    return (f'{cpu_name()}{f" ({features})" if features else ""}, {os.cpu_count()} logical '
            f'CPUs, {platform.system()} {platform.machine()}')


def table(times: Dict[Candidate, List[float]], labels: Dict[str, str]) -> List[str]:
    med = {c: statistics.median(t) for c, t in times.items()}
    lines = ['| model | batch | runtime | KCLA ms | KCLA img/s | plain ResNet ms | '
             'plain img/s | KCLA / plain time | speed-up over eager fused |',
             '|---|---:|---|---:|---:|---:|---:|---:|---:|']
    keys = sorted({(c.model, c.batch) for c in med}, key=lambda k: (list(MODELS).index(k[0]), k[1]))
    for model, batch in keys:
        fused = med.get(Candidate(model, batch, True, 'eager_fused'))
        for rt in RUNTIMES:
            k = med.get(Candidate(model, batch, True, rt))
            if k is None:
                continue
            plain_rt = 'eager_plain' if rt.startswith('eager') else rt
            p = med.get(Candidate(model, batch, False, plain_rt))
            cells = [labels[model], str(batch), RUNTIME_NAMES[rt], f'{1e3 * k:.1f}',
                     f'{batch / k:.1f}']
            cells += [f'{1e3 * p:.1f}', f'{batch / p:.1f}', f'{k / p:.2f}x'] if p else ['-'] * 3
            cells.append(f'{fused / k:.2f}x' if fused else '-')
            lines.append('| ' + ' | '.join(cells) + ' |')
    return lines


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    if args.quick:
        args.repeats, args.warmup, args.batches = 1, 0, [1, 2]
    os.makedirs(args.out_dir, exist_ok=True)
    labels, fns, ort_models = {}, {}, []
    tmp = tempfile.TemporaryDirectory()
    for name in args.models:
        label, _, _, size = MODELS[name]
        size = 64 if args.quick else size
        labels[name] = f'{label}{" (tiny)" if args.quick else ""} {size}x{size}'
        print(f'[benchmark_inference] building and exporting {labels[name]}', flush=True)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            graphs = build_graphs(name, args.quick)
        for kcla, graph in graphs.items():
            x0 = p2o.random_input(graph, 1, size, size)
            path = osp.join(tmp.name, f'{name}_{"kcla" if kcla else "plain"}.onnx')
            p2o.export(graph, x0, path)
            # no busy-waiting threads left behind to slow the next candidate down
            ort_model = p2o.ort_session(path, threads, spinning=False)
            ort_models.append(ort_model)
            for batch in args.batches:
                x = p2o.random_input(graph, batch, size, size)
                for rt in RUNTIMES if kcla else ('eager_plain', 'onnxruntime'):
                    fns[Candidate(name, batch, kcla, rt)] = runner(graph, rt, x, ort_model)
    print(f'[benchmark_inference] timing {len(fns)} candidates, {args.warmup} + {args.repeats} '
          'rounds', flush=True)
    times = measure(fns, args.repeats, args.warmup)
    import onnxruntime
    header = [
        f'- machine: {machine()}',
        f'- threads: {threads} (PyTorch intra-op and onnxruntime intra-op alike)',
        f'- torch {torch.__version__}, onnxruntime {onnxruntime.__version__} '
        '(CPUExecutionProvider, default graph optimisations, threads not spinning between '
        'runs, which would take the cores from the candidate timed next)',
        f'- fused KCLA CPU kernels: {"built and on" if fused_kernels_available() else "absent"}',
        f'- {args.warmup} warm-up + {args.repeats} timed rounds, candidates interleaved; '
        'medians; single runs on a shared virtual machine stray by 5-40%',
    ]
    lines = table(times, labels)
    with open(osp.join(args.out_dir, 'benchmark_inference.md'), 'w') as f:
        f.write('\n'.join(header + [''] + lines) + '\n')
    with open(osp.join(args.out_dir, 'benchmark_inference.json'), 'w') as f:
        json.dump(dict(machine=machine(), threads=threads, repeats=args.repeats,
                       warmup=args.warmup, labels=labels,
                       times=[dict(model=c.model, batch=c.batch, kcla=c.kcla, runtime=c.runtime,
                                   seconds=t) for c, t in times.items()]), f, indent=1)
    print('\n'.join(header + [''] + lines))
    tmp.cleanup()


if __name__ == '__main__':
    main()

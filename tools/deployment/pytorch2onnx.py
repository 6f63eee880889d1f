"""Export a kcla_mm model to ONNX and check it against onnxruntime.

Three graphs, chosen with ``--part``:

- ``segmentor`` (default for mmseg configs): a whole KCLA-ResNet-UNet (or any
  ``EncoderDecoder``) with its data preprocessing inside. Input ``image``:
  ``[B, 3, H, W]`` float32, **RGB, 0-255**, already resized as the config's
  test pipeline does (``Resize`` to the config's ``img_scale``); the graph
  normalises it with the config's ``data_preprocessor`` mean and std. Outputs
  ``logits`` ``[B, K, H, W]`` (``K = out_channels``: 1 for the binary
  configs) and ``mask`` ``[B, H, W]`` uint8 (``sigmoid(logits) > threshold``
  for one output channel, else the argmax), both at the input size. mmseg
  resizes the logits to the original image size before thresholding; do the
  same (bilinear) for masks at the original size.
- ``backbone``: the backbone alone (every ``layer_attn`` method: KCLA,
  FullLayerAttention, MRLALight, None). Input ``image``: the *normalised*
  ``[B, 3, H, W]`` tensor (what the data preprocessor returns); outputs
  ``feat0``, ``feat1``, ... for ``out_indices``.
- ``backbone_neck`` (default for mmdet configs): backbone and neck (FPN) of a
  detector, input as for ``backbone``, outputs the neck's levels. The RPN,
  RoI heads and NMS are not exported (see docs/deployment.md).

The batch axis and both spatial axes are dynamic (``--static`` fixes them):
the graph pools globally, the UNet decoder resizes to its skip features' sizes
and the FPN to the next level's, so nothing depends on the export size. The
export traces the model (TorchScript exporter, ``dynamo=False``), which takes
kcla_mm's plain PyTorch path: the fused CPU kernels are switched off during the
export (``kcla_mm.ops.fused_kernels(False)``) and are not part of the graph
(they compute the same values). Two aten ops of the operators have no
translation in that exporter; the tool registers its own for the export
(:data:`SYMBOLICS`).

``--verify`` runs the graph in onnxruntime (CPU execution provider) and the
model in PyTorch on random inputs at the export size and at another batch and
size, and prints the largest absolute error and the relative error (largest
absolute error over the largest absolute reference value) of every output;
it fails (exit code 1) above ``--rtol``. With ``--images DIR`` (segmentor),
each image also goes through mmseg's own inference (the config's test
pipeline, ``model.test_step``) and through the graph, and the two masks at the
original image size are compared pixel by pixel.

Examples::

    python tools/deployment/pytorch2onnx.py \\
        configs/unet/unet_kcla-r18-tiny_1xb8-300i_synthetic-kvasir-128x128.py \\
        work_dirs/demo_seg/train/iter_300.pth --out work_dirs/demo_seg/unet.onnx \\
        --verify --images work_dirs/demo_seg/data/images/val
    python tools/deployment/pytorch2onnx.py configs/kcla/faster-rcnn_kcla-r50_fpn_1x_coco.py \\
        --part backbone --shape 224 224 --out kcla_r50.onnx --verify \\
        --cfg-options model.backbone.layer_attn.type=MRLALight
"""
import argparse
import contextlib
import glob
import importlib
import os
import os.path as osp
import sys
import warnings
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
PARTS = ('segmentor', 'backbone', 'backbone_neck')
#: the ONNX opset of the exported graphs (onnxruntime >= 1.14 runs it)
OPSET = 17
#: default bound of ``--verify``: largest absolute error / largest absolute reference value
RTOL = 1e-4
IMAGE_SUFFIXES = ('.jpg', '.jpeg', '.png', '.bmp')


def _logaddexp(g, a, b):
    """ONNX for ``aten::logaddexp`` (the KCLA state's log-normaliser), which torch's
    TorchScript exporter lacks: ``max(a, b) + log(1 + exp(-|a - b|))``, stable."""
    one = g.op('Constant', value_t=torch.tensor(1.0))
    tail = g.op('Exp', g.op('Neg', g.op('Abs', g.op('Sub', a, b))))
    return g.op('Add', g.op('Max', a, b), g.op('Log', g.op('Add', one, tail)))


def _addcmul(g, x, tensor1, tensor2, value, out=None):
    """ONNX for ``aten::addcmul`` in both forms, ``x + value * tensor1 * tensor2``.

    torch's own translation takes no ``out=`` argument, which the eval-mode
    norm of the layer attention uses (the BatchNorm folded into one affine,
    written in place); traced, the result is the node's output all the same.
    """
    product = g.op('Mul', g.op('Mul', tensor1, tensor2), g.op('CastLike', value, tensor1))
    return g.op('Add', x, product)


#: ``{aten op: ONNX translation}`` the export adds to those of torch's exporter
SYMBOLICS = {'aten::logaddexp': _logaddexp, 'aten::addcmul': _addcmul}


@contextlib.contextmanager
def onnx_symbolics(opset: int) -> Iterator[None]:
    """:data:`SYMBOLICS` registered for the export only."""
    for name, fn in SYMBOLICS.items():
        torch.onnx.register_custom_op_symbolic(name, fn, opset)
    try:
        yield
    finally:
        for name in SYMBOLICS:
            torch.onnx.unregister_custom_op_symbolic(name, opset)


class FeatureGraph(nn.Module):
    """A backbone (and optionally a neck) returning its features as a tuple."""

    def __init__(self, backbone: nn.Module, neck: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.neck = neck

    def forward(self, image: Tensor) -> Tuple[Tensor, ...]:
        feats = self.backbone(image)  # ([B, C_i, H / s_i, W / s_i], ...)
        if self.neck is not None:
            feats = self.neck(feats)
        return tuple(feats)


class SegmentorGraph(nn.Module):
    """An mmseg ``EncoderDecoder`` from an RGB 0-255 image to logits and mask.

    Args:
        segmentor: the model, in eval mode.
        mean, std: the data preprocessor's normalisation, RGB order.
    """

    def __init__(self, segmentor: nn.Module, mean: Sequence[float],
                 std: Sequence[float]) -> None:
        super().__init__()
        self.segmentor = segmentor
        self.register_buffer('mean', torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer('std', torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1))
        head = segmentor.decode_head
        self.align_corners = head.align_corners
        self.binary = head.out_channels == 1
        self.threshold = float(head.threshold if head.threshold is not None else 0.5)

    def forward(self, image: Tensor) -> Tuple[Tensor, Tensor]:
        x = (image - self.mean) / self.std  # [B, 3, H, W]
        feats = self.segmentor.extract_feat(x)
        logits = self.segmentor.decode_head(feats)  # [B, K, h, w]
        logits = F.interpolate(logits, size=x.shape[2:], mode='bilinear',
                               align_corners=self.align_corners)  # [B, K, H, W]
        if self.binary:
            mask = logits[:, 0].sigmoid() > self.threshold  # [B, H, W]
        else:
            mask = logits.argmax(1)  # [B, H, W]
        return logits, mask.to(torch.uint8)


def output_names(graph: nn.Module, example: Tensor) -> List[str]:
    if isinstance(graph, SegmentorGraph):
        return ['logits', 'mask']
    with torch.no_grad():
        n = len(graph(example))
    return [f'feat{i}' for i in range(n)]


def export(graph: nn.Module, example: Tensor, path: str, dynamic: bool = True,
           opset: int = OPSET) -> List[str]:
    """Trace ``graph`` on ``example`` into the ONNX file ``path``; returns the output names.

    Args:
        graph: a :class:`FeatureGraph` or :class:`SegmentorGraph` in eval mode.
        example: ``[B, 3, H, W]`` input of the trace.
        dynamic: batch, height and width of the input and of every output
            left free (``batch``, ``height``, ``width``); else fixed to
            ``example``'s.
    """
    graph.eval()
    names = output_names(graph, example)
    axes = None
    if dynamic:
        axes = {'image': {0: 'batch', 2: 'height', 3: 'width'}}
        if isinstance(graph, SegmentorGraph):  # both at the input size
            axes.update(logits={0: 'batch', 2: 'height', 3: 'width'},
                        mask={0: 'batch', 1: 'height', 2: 'width'})
        else:
            axes.update({n: {0: 'batch', 2: f'{n}_height', 3: f'{n}_width'} for n in names})
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    from kcla_mm.ops import fused_kernels
    with fused_kernels(False), onnx_symbolics(opset), torch.no_grad(), \
            warnings.catch_warnings():
        # tracer notes on Python values taken as constants (shape checks)
        warnings.simplefilter('ignore')
        torch.onnx.export(graph, (example, ), path, input_names=['image'], output_names=names,
                          dynamic_axes=axes, opset_version=opset, dynamo=False)
    return names


def ort_session(path: str, threads: Optional[int] = None, spinning: bool = True):
    """An onnxruntime ``InferenceSession`` on the CPU execution provider.

    Args:
        threads: its intra-op threads (default: onnxruntime's, one per core).
        spinning: whether its threads busy-wait for work after a run
            (onnxruntime's default): lower latency for back-to-back runs, but
            the cores stay busy for a while after each, away from anything
            else in the process.
    """
    import onnxruntime as ort
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    if not spinning:
        options.add_session_config_entry('session.intra_op.allow_spinning', '0')
    options.log_severity_level = 3
    return ort.InferenceSession(path, options, providers=['CPUExecutionProvider'])


def run_ort(ort_model, image: Tensor) -> List[np.ndarray]:
    return ort_model.run(None, {'image': image.detach().cpu().numpy()})


def compare(reference: Sequence[Tensor], outputs: Sequence[np.ndarray],
            names: Sequence[str]) -> Dict[str, Dict[str, float]]:
    """Per output: ``max_abs`` error, ``rel`` (``max_abs`` / largest ``|reference|``)
    and, for integer outputs (masks), ``mismatch`` (the fraction of differing elements)."""
    report = {}
    for name, ref, out in zip(names, reference, outputs):
        ref = ref.detach().cpu().numpy()
        if ref.shape != out.shape:
            raise AssertionError(f'{name}: onnxruntime gave shape {out.shape}, PyTorch {ref.shape}')
        if np.issubdtype(ref.dtype, np.integer) or ref.dtype == np.bool_:
            report[name] = dict(mismatch=float(np.mean(ref != out)))
            continue
        err = float(np.abs(ref.astype(np.float64) - out).max()) if ref.size else 0.0
        scale = float(np.abs(ref).max()) if ref.size else 0.0
        report[name] = dict(max_abs=err, rel=err / scale if scale > 0 else err)
    return report


def random_input(graph: nn.Module, batch: int, height: int, width: int,
                 seed: int = 0) -> Tensor:
    """An RGB 0-255 image for a :class:`SegmentorGraph`, a standard normal one otherwise."""
    g = torch.Generator().manual_seed(seed)
    if isinstance(graph, SegmentorGraph):
        return torch.rand(batch, 3, height, width, generator=g) * 255
    return torch.randn(batch, 3, height, width, generator=g)


def verify(graph: nn.Module, path: str, shapes: Sequence[Tuple[int, int, int]],
           threads: Optional[int] = None) -> List[Tuple[Tuple[int, int, int], Dict]]:
    """onnxruntime against PyTorch (eager, default kernels) on random inputs.

    Args:
        shapes: ``(batch, height, width)`` of each check.

    Returns:
        ``[(shape, compare() report), ...]``.
    """
    ort_model = ort_session(path, threads)
    names = [o.name for o in ort_model.get_outputs()]
    results = []
    for i, (b, h, w) in enumerate(shapes):
        x = random_input(graph, b, h, w, seed=i)
        with torch.no_grad():
            ref = graph(x)
        results.append(((b, h, w), compare(ref, run_ort(ort_model, x), names)))
    return results


def worst(results: Sequence[Tuple[Tuple[int, int, int], Dict]]) -> float:
    """The largest relative error of a :func:`verify` result."""
    return max((r.get('rel', 0.0) for _, report in results for r in report.values()),
               default=0.0)


# ---------------------------------------------------------------- from a config


def _tool(name: str, folder: str):
    """The module ``tools/.../<name>.py`` of this repository (``folder`` under the root)."""
    path = osp.join(ROOT, folder)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


def build_model(config: str, checkpoint: Optional[str] = None,
                cfg_options: Optional[dict] = None):
    """``(cfg, model)``: the config's model in eval mode, with the checkpoint's weights.

    Without a checkpoint the model keeps its initialisation (``Pretrained``
    entries of the config are dropped: nothing is downloaded).
    """
    common = _tool('_common', osp.join('tools', 'analysis_tools'))
    cfg = common.load_config(config, cfg_options)
    scope = cfg.get('default_scope', 'mmdet')
    if scope == 'mmseg':
        from mmseg.registry import MODELS
    else:
        from mmdet.registry import MODELS
    model_cfg = common.drop_pretrained(cfg.model)
    with common.quiet_logs(), warnings.catch_warnings():
        warnings.simplefilter('ignore', UserWarning)
        model = MODELS.build(model_cfg)
        if checkpoint is None:
            model.init_weights()
        else:
            from mmengine.runner import load_checkpoint
            load_checkpoint(model, checkpoint, map_location='cpu', strict=True)
    return cfg, model.eval()


def normalisation(cfg) -> Tuple[List[float], List[float]]:
    """Mean and std of the config's data preprocessor in RGB order."""
    pre = cfg.model.get('data_preprocessor') or cfg.get('data_preprocessor') or {}
    mean, std = pre.get('mean'), pre.get('std')
    if mean is None or std is None:
        raise SystemExit('the config\'s data_preprocessor has no mean/std: the graph would not '
                         'know how to normalise its input')
    if not pre.get('bgr_to_rgb', False) and not pre.get('rgb_to_bgr', False):
        warnings.warn('the data preprocessor converts no colour order: the model was trained on '
                      'BGR images; feed the graph BGR')
    return [float(v) for v in mean], [float(v) for v in std]


def make_graph(cfg, model: nn.Module, part: str) -> nn.Module:
    if part == 'segmentor':
        if not hasattr(model, 'decode_head'):
            raise SystemExit(f'--part segmentor needs an mmseg EncoderDecoder config, got a '
                             f'{type(model).__name__}')
        mean, std = normalisation(cfg)
        return SegmentorGraph(model, mean, std).eval()
    if part == 'backbone_neck':
        if getattr(model, 'neck', None) is None:
            raise SystemExit(f'--part backbone_neck: the {type(model).__name__} has no neck')
        return FeatureGraph(model.backbone, model.neck).eval()
    return FeatureGraph(model.backbone).eval()


def default_part(model: nn.Module) -> str:
    if hasattr(model, 'decode_head'):
        return 'segmentor'
    return 'backbone_neck' if getattr(model, 'neck', None) is not None else 'backbone'


def test_size(cfg) -> Optional[Tuple[int, int]]:
    """``(H, W)`` of the config's test ``Resize`` (``keep_ratio=False``), if it has one."""
    pipeline = (cfg.get('test_dataloader') or {}).get('dataset', {}).get('pipeline', [])
    for t in pipeline:
        if t.get('type') == 'Resize' and not t.get('keep_ratio', False) and 'scale' in t:
            w, h = t['scale']  # mmcv's scale is (w, h)
            return int(h), int(w)
    return None


def image_files(folder: str) -> List[str]:
    files = [f for f in glob.glob(osp.join(folder, '**', '*'), recursive=True)
             if f.lower().endswith(IMAGE_SUFFIXES)]
    if not files:
        raise SystemExit(f'no images ({", ".join(IMAGE_SUFFIXES)}) under {folder}')
    return sorted(files)


def compare_on_images(cfg, model: nn.Module, path: str, files: Sequence[str],
                      threads: Optional[int] = None) -> List[Dict[str, float]]:
    """mmseg's inference (test pipeline, ``test_step``) and the graph, image by image.

    The graph gets the image after the config's test pipeline (resized),
    converted to RGB; its logits are resized to the original size and
    thresholded as mmseg does. Returns per image the fraction of pixels whose
    labels differ and the largest absolute error of the logits at the input
    size.
    """
    from mmengine.dataset import Compose, pseudo_collate
    from mmseg.models.utils import resize
    ort_model = ort_session(path, threads)
    pipeline = Compose(_tool('infer', 'tools').inference_pipeline(cfg, 'seg'))
    head = model.decode_head
    out = []
    for f in files:
        data = pseudo_collate([pipeline(dict(img_path=f))])
        with torch.no_grad():
            sample = model.test_step(data)[0]
            inputs = model.data_preprocessor(data, False)['inputs']  # normalised, RGB
            torch_logits = model.encode_decode(inputs, [sample.metainfo])
        img = data['inputs'][0].float()[None]  # [1, 3, H, W] in the loader's BGR order
        if model.data_preprocessor.channel_conversion:
            img = img[:, [2, 1, 0]]
        logits, _ = run_ort(ort_model, img)
        logits = torch.from_numpy(logits)
        ori = sample.metainfo['ori_shape'][:2]
        up = resize(logits, size=ori, mode='bilinear', align_corners=head.align_corners,
                    warning=False)[0]
        if head.out_channels == 1:
            label = (up.sigmoid() > head.threshold).to(torch.int64)[0]
        else:
            label = up.argmax(0)
        ref = sample.pred_sem_seg.data[0]
        out.append(dict(mismatch=float((label != ref).float().mean()),
                        max_abs=float((logits - torch_logits).abs().max())))
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    from mmengine.config import DictAction
    parser = argparse.ArgumentParser(description='Export a kcla_mm model to ONNX')
    parser.add_argument('config', help='a kcla_mm config (mmseg or mmdet)')
    parser.add_argument('checkpoint', nargs='?', default=None,
                        help='its checkpoint (tools/train.py); without it: the initialisation')
    parser.add_argument('--out', required=True, help='the .onnx file to write')
    parser.add_argument('--part', choices=PARTS, default=None,
                        help='what to export (default: segmentor for mmseg configs, '
                        'backbone_neck for detectors)')
    parser.add_argument('--shape', type=int, nargs=2, default=None, metavar=('H', 'W'),
                        help='input size of the export (default: the config\'s test Resize, '
                        'else 224 224)')
    parser.add_argument('--batch', type=int, default=1, help='batch of the export (default 1)')
    parser.add_argument('--static', action='store_true',
                        help='fix batch and spatial size to those of the export')
    parser.add_argument('--opset', type=int, default=OPSET, help=f'ONNX opset (default {OPSET})')
    parser.add_argument('--verify', action='store_true',
                        help='compare onnxruntime with PyTorch and print the errors')
    parser.add_argument('--rtol', type=float, default=RTOL,
                        help=f'largest relative error --verify accepts (default {RTOL:g})')
    parser.add_argument('--images', default=None, metavar='DIR',
                        help='with --verify and a segmentor: compare with mmseg\'s predictions '
                        'on these images too')
    parser.add_argument('--max-mismatch', type=float, default=1e-3,
                        help='largest fraction of mask pixels that may differ on --images '
                        '(pixels at the threshold; default 1e-3)')
    parser.add_argument('--threads', type=int, default=None,
                        help='CPU threads of PyTorch and onnxruntime (default: theirs)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, default=None,
                        help='override config settings, e.g. model.backbone.layer_attn=None')
    return parser.parse_args(argv)


def _print_report(results) -> None:
    for (b, h, w), report in results:
        cells = []
        for name, r in report.items():
            if 'mismatch' in r:
                cells.append(f'{name}: {100 * r["mismatch"]:.4f}% elements differ')
            else:
                cells.append(f'{name}: max abs {r["max_abs"]:.3g}, rel {r["rel"]:.3g}')
        print(f'  batch {b}, {h}x{w}: ' + '; '.join(cells))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg, model = build_model(args.config, args.checkpoint, args.cfg_options)
    part = args.part or default_part(model)
    graph = make_graph(cfg, model, part)
    h, w = args.shape or test_size(cfg) or (224, 224)
    example = random_input(graph, args.batch, h, w)
    names = export(graph, example, args.out, dynamic=not args.static, opset=args.opset)
    axes = 'fixed shapes' if args.static else 'dynamic batch, height and width'
    print(f'exported {part} of {osp.basename(args.config)} to {args.out} '
          f'(traced at batch {args.batch}, {h}x{w}; {axes}; opset {args.opset}; '
          f'outputs {", ".join(names)})')
    if isinstance(graph, SegmentorGraph):
        mean = ', '.join(f'{v:g}' for v in graph.mean.flatten().tolist())
        std = ', '.join(f'{v:g}' for v in graph.std.flatten().tolist())
        print(f'input "image": [B, 3, H, W] float32, RGB, 0-255, resized to {h}x{w} as the '
              f'test pipeline does; normalised inside the graph (mean {mean}; std {std})')
    else:
        print('input "image": [B, 3, H, W] float32, normalised as the data preprocessor does')
    if not args.verify:
        return 0
    shapes = [(args.batch, h, w)]
    if not args.static:
        shapes.append((args.batch + 1, h + 32, w + 64))
    results = verify(graph, args.out, shapes, args.threads)
    print(f'onnxruntime (CPUExecutionProvider) against PyTorch (rel = max abs error / max '
          f'|PyTorch output|; bound {args.rtol:g}):')
    _print_report(results)
    ok = worst(results) <= args.rtol
    if args.images:
        if not isinstance(graph, SegmentorGraph):
            raise SystemExit('--images compares segmentation masks: use --part segmentor')
        files = image_files(args.images)
        per_image = compare_on_images(cfg, model, args.out, files, args.threads)
        mismatch = max(r['mismatch'] for r in per_image)
        err = max(r['max_abs'] for r in per_image)
        print(f'{len(files)} images of {args.images} through mmseg and through the graph: '
              f'mask pixels differing at most {100 * mismatch:.4f}% per image (mean '
              f'{100 * np.mean([r["mismatch"] for r in per_image]):.4f}%), logits max abs error '
              f'{err:.3g}')
        ok = ok and mismatch <= args.max_mismatch
    print('verify: ' + ('OK' if ok else 'FAILED'))
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())

"""ONNX export (tools/deployment/pytorch2onnx.py): onnxruntime reproduces PyTorch.

Needs the ``deploy`` extra (``pip install -e .[deploy]``: onnx, onnxruntime);
skipped without it.
"""
import importlib.util
import os.path as osp
import sys

import numpy as np
import pytest
import torch

onnx = pytest.importorskip('onnx', reason='the deploy extra is not installed '
                           '(pip install -e .[deploy])')
pytest.importorskip('onnxruntime', reason='the deploy extra is not installed '
                    '(pip install -e .[deploy])')

from utils import load_tool, randomize_norms  # noqa: E402

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOL = osp.join(ROOT, 'tools', 'deployment', 'pytorch2onnx.py')
TINY_UNET = osp.join(ROOT, 'configs', 'unet',
                     'unet_kcla-r18-tiny_1xb8-300i_synthetic-kvasir-128x128.py')
FULL_UNET = osp.join(ROOT, 'configs', 'unet', 'unet_kcla-r18_1xb8-300e_kvasir-seg-256x256.py')
DET_DEMO = osp.join(ROOT, 'configs', 'kcla', 'demo', 'faster-rcnn_kcla-r18_fpn_synthetic.py')
#: the bound the tool's --verify applies: max abs error / max |PyTorch output|
RTOL = 1e-4
METHODS = ['KCLA', 'FullLayerAttention', 'MRLALight', None]

pytestmark = pytest.mark.usefixtures('one_thread')


p2o = load_tool(TOOL, 'kcla_pytorch2onnx')


def tiny_backbone(method, depth=18, seed=0):
    from mmdet.models.backbones import ResNet  # noqa: F401  (mmdet's registry is filled)

    from kcla_mm.models.backbones import KCLAResNet
    torch.manual_seed(seed)
    backbone = KCLAResNet(depth=depth, base_channels=16, stem_channels=16,
                          head_dim=8 if depth < 50 else 16,
                          layer_attn=None if method is None else dict(type=method))
    backbone.init_weights()
    randomize_norms(backbone, seed)  # trained-like statistics: non-trivial folded norms
    return p2o.FeatureGraph(backbone).eval()


def tiny_unet(seed=0):
    cfg, model = p2o.build_model(TINY_UNET)
    randomize_norms(model, seed)
    return cfg, model


@pytest.mark.parametrize('method', METHODS, ids=str)
def test_backbone_matches_onnxruntime_at_other_batch_and_size(tmp_path, method):
    graph = tiny_backbone(method)
    path = str(tmp_path / 'backbone.onnx')
    names = p2o.export(graph, torch.randn(1, 3, 64, 64), path)
    assert names == ['feat0', 'feat1', 'feat2', 'feat3']
    # the trace's size, then another batch and a size that is not a multiple of 32
    results = p2o.verify(graph, path, [(1, 64, 64), (3, 80, 48), (2, 72, 100)])
    for shape, report in results:
        for name, r in report.items():
            assert r['rel'] < RTOL, (method, shape, name, r)


def test_bottleneck_backbone_matches_onnxruntime(tmp_path):
    graph = tiny_backbone('KCLA', depth=50)
    path = str(tmp_path / 'r50.onnx')
    p2o.export(graph, torch.randn(1, 3, 64, 64), path)
    assert p2o.worst(p2o.verify(graph, path, [(2, 64, 96)])) < RTOL


def test_detector_backbone_and_neck_match_onnxruntime(tmp_path):
    cfg, model = p2o.build_model(DET_DEMO)
    randomize_norms(model)
    assert p2o.default_part(model) == 'backbone_neck'
    graph = p2o.make_graph(cfg, model, 'backbone_neck')
    path = str(tmp_path / 'det.onnx')
    names = p2o.export(graph, torch.randn(1, 3, 128, 128), path)
    assert names == [f'feat{i}' for i in range(5)]  # the FPN's five levels
    assert p2o.worst(p2o.verify(graph, path, [(2, 96, 160)])) < RTOL


def test_graph_holds_only_standard_onnx_ops(tmp_path):
    # the fused CPU kernels are custom torch ops: none may reach the graph
    path = str(tmp_path / 'kcla.onnx')
    p2o.export(tiny_backbone('KCLA'), torch.randn(1, 3, 64, 64), path)
    model = onnx.load(path)
    onnx.checker.check_model(model)
    domains = {node.domain for node in model.graph.node}
    assert domains <= {'', 'ai.onnx'}, domains


@pytest.mark.parametrize('dynamic', [True, False])
def test_input_axes_are_dynamic_unless_static(tmp_path, dynamic):
    path = str(tmp_path / 'kcla.onnx')
    p2o.export(tiny_backbone('KCLA'), torch.randn(2, 3, 64, 64), path, dynamic=dynamic)
    (image, ) = onnx.load(path).graph.input
    dims = [d.dim_param or d.dim_value for d in image.type.tensor_type.shape.dim]
    assert dims == (['batch', 3, 'height', 'width'] if dynamic else [2, 3, 64, 64])


@pytest.mark.parametrize('fused', [True, False])
def test_export_leaves_the_fused_kernel_switch_as_it_was(tmp_path, fused):
    import kcla_mm.ops as ops
    with ops.fused_kernels(fused):
        p2o.export(tiny_backbone('KCLA'), torch.randn(1, 3, 64, 64), str(tmp_path / 'k.onnx'))
        assert ops.use_fused_kernels() is fused


def test_segmentor_graph_normalises_inside_and_matches_onnxruntime(tmp_path):
    cfg, model = tiny_unet()
    graph = p2o.make_graph(cfg, model, 'segmentor')
    path = str(tmp_path / 'unet.onnx')
    assert p2o.export(graph, p2o.random_input(graph, 1, 64, 64), path) == ['logits', 'mask']
    results = p2o.verify(graph, path, [(1, 64, 64), (2, 96, 64)])
    for _, report in results:
        assert report['logits']['rel'] < RTOL
        assert report['mask']['mismatch'] < 1e-3
    # the graph's input is the RGB 0-255 image: it equals mmseg's own normalisation
    # (of the loader's BGR image, at the config's size: smaller ones it pads)
    img = torch.randint(0, 256, (1, 3, 128, 128)).float()
    data = dict(inputs=[img[0, [2, 1, 0]].to(torch.uint8)], data_samples=None)
    with torch.no_grad():
        inputs = model.data_preprocessor(data, False)['inputs']  # BGR -> RGB, normalised
        ref = model.encode_decode(inputs, [dict(img_shape=(128, 128))])
        logits, mask = graph(img)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(mask, (ref[:, 0].sigmoid() > 0.5).to(torch.uint8))


def test_mmseg_predictions_on_image_files_equal_the_graphs(tmp_path):
    import cv2
    cfg, model = tiny_unet()
    graph = p2o.make_graph(cfg, model, 'segmentor')
    path = str(tmp_path / 'unet.onnx')
    p2o.export(graph, p2o.random_input(graph, 1, 128, 128), path)
    rng = np.random.default_rng(0)
    files = []
    for i, (h, w) in enumerate([(100, 140), (128, 128), (90, 60)]):  # resized to 128x128
        files.append(str(tmp_path / f'img{i}.png'))
        cv2.imwrite(files[-1], rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    per_image = p2o.compare_on_images(cfg, model, path, files)
    assert len(per_image) == 3
    for r in per_image:
        assert r['mismatch'] < 1e-3 and r['max_abs'] < 1e-3, r


def test_command_line_verifies_and_prints_the_errors(tmp_path, capsys):
    out = str(tmp_path / 'unet.onnx')
    rc = p2o.main([TINY_UNET, '--out', out, '--shape', '64', '64', '--verify'])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert osp.isfile(out)
    assert 'RGB, 0-255' in text and 'verify: OK' in text
    checks = [line for line in text.splitlines() if line.startswith('  batch')]
    assert len(checks) == 2  # the trace's shape, another batch and size
    assert all('logits: max abs' in line and ', rel ' in line for line in checks)


def test_command_line_fails_above_the_bound(tmp_path, capsys):
    # an impossible bound: the exit code says the check failed
    rc = p2o.main([TINY_UNET, '--out', str(tmp_path / 'unet.onnx'), '--shape', '64', '64',
                   '--verify', '--rtol', '0', '--static'])
    assert rc == 1
    assert 'verify: FAILED' in capsys.readouterr().out


@pytest.mark.slow  # the demo's data made and converted, a model saved, exported and checked
def test_command_line_on_a_saved_demo_model_and_its_validation_images(tmp_path, capsys):
    # what docs/deployment.md runs on the demo's trained UNet, on a saved
    # model of that config and the demo's synthetic Kvasir-SEG validation split
    from mmengine.runner import save_checkpoint

    from kcla_mm.datasets.synthetic_medical import generate
    generate('kvasir', str(tmp_path / 'download'), num=10, size=96, seed=0)
    spec = importlib.util.spec_from_file_location(
        'kvasir_seg', osp.join(ROOT, 'tools', 'dataset_converters', 'kvasir_seg.py'))
    converter = importlib.util.module_from_spec(spec)
    sys.path.insert(0, osp.dirname(spec.origin))
    spec.loader.exec_module(converter)
    assert converter.main([str(tmp_path / 'download'), '--out', str(tmp_path / 'data')]) == 0
    _, model = tiny_unet()
    ckpt = str(tmp_path / 'iter_1.pth')
    save_checkpoint(dict(meta={}, state_dict=model.state_dict()), ckpt)
    val = str(tmp_path / 'data' / 'images' / 'val')
    rc = p2o.main([TINY_UNET, ckpt, '--out', str(tmp_path / 'unet.onnx'), '--verify',
                   '--images', val])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert f'3 images of {val}' in text and 'differing at most 0.0000%' in text, text


@pytest.mark.slow  # full size: an export of about a minute on 2 cores
def test_full_size_kcla_resnet18_unet_at_256(tmp_path):
    cfg, model = p2o.build_model(FULL_UNET)
    randomize_norms(model)
    graph = p2o.make_graph(cfg, model, 'segmentor')
    assert p2o.test_size(cfg) == (256, 256)
    path = str(tmp_path / 'unet_r18.onnx')
    p2o.export(graph, p2o.random_input(graph, 1, 256, 256), path)
    results = p2o.verify(graph, path, [(1, 256, 256), (2, 256, 256)])
    for _, report in results:
        assert report['logits']['rel'] < RTOL, report
        assert report['mask']['mismatch'] < 1e-3, report


def test_a_plain_export_needs_no_custom_translation(tmp_path):
    # torch.onnx.export of the backbone as it is (TorchScript exporter, no
    # translations registered): the ops traced are standard ONNX ops, and
    # onnxruntime reproduces the eager outputs
    ort = pytest.importorskip('onnxruntime')
    import kcla_mm.ops as ops
    from kcla_mm.models.backbones import KCLAResNet
    torch.manual_seed(0)
    model = KCLAResNet(depth=18, base_channels=8, head_dim=8).eval()
    x = torch.rand(2, 3, 64, 64)
    path = str(tmp_path / 'backbone.onnx')
    with ops.fused_kernels(False), torch.no_grad():
        torch.onnx.export(model, (x, ), path, dynamo=False, input_names=['x'])
        want = model(x)
    got = ort.InferenceSession(path, providers=['CPUExecutionProvider']).run(
        None, {'x': x.numpy()})
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.from_numpy(a), b, rtol=1e-4, atol=1e-5)

"""tools/infer.py: a saved kcla_mm model run on a folder of images.

The models are the demos' (tiny KCLA-ResNet-18 UNet, small KCLA Faster
R-CNN), built and saved with mmengine as tools/train.py saves them, and run on
the demos' synthetic images.
"""
import glob
import json
import os.path as osp
import subprocess
import sys

import cv2
import numpy as np
import pytest
import torch
from utils import load_tool, randomize_norms

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOL = osp.join(ROOT, 'tools', 'infer.py')
SEG_CONFIG = osp.join(ROOT, 'configs', 'unet',
                      'unet_kcla-r18-tiny_1xb8-300i_synthetic-kvasir-128x128.py')
DET_CONFIG = osp.join(ROOT, 'configs', 'kcla', 'demo', 'faster-rcnn_kcla-r18_fpn_synthetic.py')


infer = load_tool(TOOL, 'kcla_infer')


def save_model(config: str, path: str, dataset_meta=None):
    """The config's model, initialised (norms randomised), saved with mmengine."""
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmengine.runner import save_checkpoint

    import kcla_mm  # noqa: F401
    cfg = Config.fromfile(config)
    scope = cfg.default_scope
    init_default_scope(scope)
    if scope == 'mmseg':
        from mmseg.registry import MODELS
    else:
        from mmdet.registry import MODELS
    torch.manual_seed(0)
    model = MODELS.build(cfg.model)
    model.init_weights()
    randomize_norms(model)
    meta = {} if dataset_meta is None else dict(dataset_meta=dataset_meta)
    save_checkpoint(dict(meta=meta, state_dict=model.state_dict()), path)
    return cfg, model.eval()


def run_cli(args):
    proc = subprocess.run([sys.executable, TOOL] + [str(a) for a in args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_output_names_keep_sub_folders_apart(tmp_path):
    files = [str(tmp_path / 'a' / 'x.jpg'), str(tmp_path / 'b' / 'x.jpg')]
    assert infer.output_names(files, str(tmp_path)) == ['a__x', 'b__x']


def test_image_files_of_a_folder_and_of_a_file(tmp_path):
    for name in ('b.png', 'a.JPG', 'sub/c.bmp', 'notes.txt'):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b'')
    found = [osp.relpath(f, tmp_path) for f in infer.image_files(str(tmp_path))]
    assert found == ['a.JPG', 'b.png', 'sub/c.bmp']
    assert infer.image_files(str(tmp_path / 'b.png')) == [str(tmp_path / 'b.png')]
    (tmp_path / 'empty').mkdir()
    with pytest.raises(SystemExit, match='no images'):
        infer.image_files(str(tmp_path / 'empty'))
    with pytest.raises(SystemExit, match='no such file or folder'):
        infer.image_files(str(tmp_path / 'missing'))


@pytest.mark.parametrize('config, task, expected', [
    (osp.join(ROOT, 'configs', 'unet', 'unet_kcla-r18_1xb8-300e_kvasir-seg-256x256.py'), 'seg',
     ['LoadImageFromFile', 'Resize', 'PackSegInputs']),
    (DET_CONFIG, 'det', ['LoadImageFromFile', 'Resize', 'PackDetInputs']),
])
def test_inference_pipeline_loads_images_under_the_inferencers_name(config, task, expected):
    # the configs load with kcla_mm's error-naming loaders; the inferencers look
    # for LoadImageFromFile, and unlabelled images have no annotations to load
    from mmengine.config import Config

    import kcla_mm  # noqa: F401
    cfg = Config.fromfile(config)
    assert [t['type'] for t in infer.inference_pipeline(cfg, task)] == expected
    assert infer.task_of(cfg) == task


@pytest.mark.parametrize('stored', [True, False], ids=['checkpoint', 'config'])
def test_class_names_of_the_masks_and_the_overlays(tmp_path, stored):
    # from the checkpoint where tools/train.py stored them, else from the config's
    # dataset; never the host's default (Cityscapes' for mmseg)
    meta = dict(classes=('bg', 'lesion'), palette=[[0, 0, 0], [255, 0, 0]])
    cfg, _ = save_model(SEG_CONFIG, str(tmp_path / 'unet.pth'), meta if stored else None)
    inferencer = infer.build_inferencer(cfg, str(tmp_path / 'unet.pth'), 'seg', 'cpu')
    want = ('bg', 'lesion') if stored else ('background', 'polyp')
    assert tuple(inferencer.model.dataset_meta['classes']) == want
    assert tuple(inferencer.visualizer.dataset_meta['classes']) == want


@pytest.mark.slow  # a subprocess importing mmseg, a model per image
def test_segmentation_masks_overlays_and_json(tmp_path):
    from mmseg.apis import inference_model

    from kcla_mm.datasets.synthetic_medical import generate
    generate('kvasir', str(tmp_path / 'download'), num=4, size=96, seed=0)
    images = str(tmp_path / 'download' / 'Kvasir-SEG' / 'images')
    files = sorted(glob.glob(osp.join(images, '*.jpg')))
    ckpt = str(tmp_path / 'unet.pth')
    # no class names in the checkpoint: they come from the config's dataset
    cfg, model = save_model(SEG_CONFIG, ckpt)
    out = tmp_path / 'out'
    proc = run_cli([SEG_CONFIG, ckpt, images, '--out-dir', out])
    assert '4 images' in proc.stdout

    result = json.loads((out / 'predictions.json').read_text())
    assert result['task'] == 'segmentation'
    assert result['classes'] == ['background', 'polyp']
    assert [r['image'] for r in result['images']] == files
    # mmseg's inference_model drops annotation loaders by name only
    cfg.test_pipeline = infer.inference_pipeline(cfg, 'seg')
    model.cfg = cfg
    for record in result['images']:
        img = cv2.imread(record['image'])
        mask = cv2.imread(str(out / record['mask']), cv2.IMREAD_UNCHANGED)
        assert mask.dtype == np.uint8 and mask.shape == img.shape[:2]  # the original size
        assert set(np.unique(mask)) <= {0, 1}
        assert sum(record['pixel_share'].values()) == pytest.approx(1.0)
        assert record['pixel_share']['polyp'] == pytest.approx(mask.mean(), abs=1e-6)
        # the mask is mmseg's prediction for that image
        ref = inference_model(model, record['image']).pred_sem_seg.data[0].numpy()
        np.testing.assert_array_equal(mask, ref)
        overlay = cv2.imread(str(out / record['overlay']))
        assert overlay.shape == img.shape


@pytest.mark.slow  # a subprocess importing mmdet, a Faster R-CNN per image
def test_detection_boxes_json_and_overlays(tmp_path):
    from kcla_mm.datasets.synthetic_coco import generate
    generate(str(tmp_path / 'coco'), num_train=1, num_val=3, size=128, seed=0)
    images = str(tmp_path / 'coco' / 'val2017')
    ckpt = str(tmp_path / 'det.pth')
    classes = ('circle', 'square', 'triangle')
    save_model(DET_CONFIG, ckpt, dataset_meta=dict(classes=classes))
    out = tmp_path / 'out'
    run_cli([DET_CONFIG, ckpt, images, '--out-dir', out, '--score-thr', '0'])

    result = json.loads((out / 'predictions.json').read_text())
    assert result['task'] == 'detection' and result['classes'] == list(classes)
    assert len(result['images']) == 3
    boxes = [d for r in result['images'] for d in r['detections']]
    assert boxes, 'an untrained detector still returns its top proposals at --score-thr 0'
    for record in result['images']:
        h, w = record['height'], record['width']
        assert cv2.imread(str(out / record['overlay'])).shape[:2] == (h, w)
        for d in record['detections']:
            x1, y1, x2, y2 = d['bbox']
            assert 0 <= x1 <= x2 <= w and 0 <= y1 <= y2 <= h
            assert d['class'] == classes[d['label']] and 0 <= d['score'] <= 1
    assert not (out / 'masks').exists()

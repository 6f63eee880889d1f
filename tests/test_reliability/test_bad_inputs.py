"""Bad arguments and bad images: a clear error naming the culprit, or a finite result.

- Invalid backbone arguments in a full detector/segmentor config raise at
  ``MODELS.build`` time, naming the argument and its value, in both scopes.
- Odd sizes (33x47), single pixels, all-black and all-white images work
  through the backbones and through whole models; NaN/Inf inputs raise a
  ``ValueError`` naming the input and the offending samples. Nothing returns
  NaN silently.
"""
import copy
import warnings

import pytest
import torch
from mmengine.config import Config
from mmengine.registry import init_default_scope
from reliability_utils import write_det_config, write_seg_config

from kcla_mm.models.backbones import KCLAResNet, KCLAResNetSeg

HOSTS = [KCLAResNet, KCLAResNetSeg]
METHODS = ['KCLA', 'FullLayerAttention', 'MRLALight', None]
# ImageNet normalisation, as in every config: the extremes of an RGB image.
MEAN = torch.tensor([123.675, 116.28, 103.53]).view(1, 3, 1, 1)
STD = torch.tensor([58.395, 57.12, 57.375]).view(1, 3, 1, 1)


@pytest.fixture(scope='module')
def configs(tmp_path_factory) -> dict:
    """The tiny detector and segmentor configs, parsed once (each parse takes seconds)."""
    root = tmp_path_factory.mktemp('configs')
    return {task: Config.fromfile(write(str(root / f'tiny_{task}.py'), str(root / 'data')))
            for task, write in (('det', write_det_config), ('seg', write_seg_config))}


def model_config(configs: dict, task: str) -> Config:
    return copy.deepcopy(configs[task])


def build_model(cfg: Config):
    init_default_scope(cfg.default_scope)
    from mmengine.registry import MODELS
    return MODELS.build(cfg.model)


@pytest.mark.parametrize('override, match', [
    (dict(depth=19), 'depth=19'),
    (dict(head_dim=3), 'head_dim=3'),
    (dict(out_indices=(0, 4)), r'out_indices=\(0, 4\)'),
    (dict(frozen_stages=9), 'frozen_stages=9'),
    (dict(layer_attn=dict(type='Nope')), 'Nope'),
    (dict(layer_attn=dict(type='KCLA', temperature_range=(0, 1))), r'temperature_range=\(0'),
    (dict(layer_attn=dict(type='KCLA', drop_path=1.5)), 'drop_path=1.5'),
    (dict(layer_attn=dict(type='KCLA', clamp=-1)), 'clamp=-1'),
], ids=lambda v: str(v) if isinstance(v, dict) else '')
@pytest.mark.parametrize('task', ['det', 'seg'])
def test_invalid_backbone_arguments_in_a_config_fail_at_build_time(configs, task, override, match):
    # every invalid backbone argument names itself and its value, through the registry
    cfg = model_config(configs, task)
    cfg.model.backbone.update(override)
    with pytest.raises(ValueError, match=match):
        build_model(cfg)


def tiny(cls, method, **kw):
    if cls is KCLAResNetSeg:
        kw.setdefault('stem_channels', 8)
    torch.manual_seed(0)
    layer_attn = None if method is None else dict(type=method)
    return cls(depth=18, base_channels=8, head_dim=8, layer_attn=layer_attn, norm_eval=False,
               **kw)


def expected_sizes(h: int, w: int):
    """Stem conv and max-pool (stride 2 each), then stages 2-4 (stride 2): ceil halvings."""
    sizes = []
    h, w = -(-h // 4), -(-w // 4)
    for _ in range(4):
        sizes.append((h, w))
        h, w = -(-h // 2), -(-w // 2)
    return sizes


def normalised(raw: torch.Tensor) -> torch.Tensor:
    return (raw - MEAN) / STD


@pytest.mark.parametrize('size', [(33, 47), (1, 1), (2, 65), (31, 1)])
@pytest.mark.parametrize('method', METHODS)
@pytest.mark.parametrize('cls', HOSTS)
def test_sizes_that_are_no_multiple_of_32_work(cls, method, size):
    model = tiny(cls, method).eval()
    outs = model(normalised(torch.rand(2, 3, *size) * 255))
    assert [tuple(o.shape[2:]) for o in outs] == expected_sizes(*size)
    assert all(torch.isfinite(o).all() for o in outs)


@pytest.mark.parametrize('method', METHODS)
@pytest.mark.parametrize('cls', HOSTS)
def test_a_single_pixel_trains_with_two_samples_and_fails_clearly_with_one(cls, method):
    model = tiny(cls, method).train()
    outs = model(normalised(torch.rand(2, 3, 1, 1) * 255))
    assert all(torch.isfinite(o).all() for o in outs)
    sum(o.mean() for o in outs).backward()
    # BatchNorm has no statistics over one value: torch says so
    with pytest.raises(ValueError, match='Expected more than 1 value per channel'):
        model(normalised(torch.rand(1, 3, 1, 1) * 255))


BACKBONES = [(KCLAResNet, m) for m in METHODS] + [(KCLAResNetSeg, 'KCLA')]


@pytest.mark.parametrize('pixel', [0.0, 255.0], ids=['black', 'white'])
@pytest.mark.parametrize('norm_cfg', [dict(type='BN'), dict(type='GN', num_groups=4)],
                         ids=['BN', 'GN'])
@pytest.mark.parametrize('cls, method', BACKBONES)
def test_constant_images_give_finite_features(cls, method, norm_cfg, pixel):
    # zero variance everywhere: BN/GN of constants, all-equal keys and key norms
    model = tiny(cls, method, norm_cfg=norm_cfg)
    raw = torch.full((2, 3, 33, 47), pixel)
    for x in (normalised(raw), raw):  # also without normalisation
        for mode in (True, False):
            outs = model.train(mode)(x)
            assert all(torch.isfinite(o).all() for o in outs), (x.flatten()[0].item(), mode)


@pytest.mark.parametrize('bad', [float('nan'), float('inf'), -float('inf')])
@pytest.mark.parametrize('method', ['KCLA', None])
@pytest.mark.parametrize('cls', HOSTS)
def test_non_finite_inputs_raise_naming_the_input_and_samples(cls, method, bad):
    model = tiny(cls, method).eval()
    x = torch.rand(3, 3, 32, 32)
    x[1, 0, 5, 7] = bad
    kind = 'NaN' if bad != bad else 'Inf'
    with pytest.raises(ValueError, match=rf'input x .*1 non-finite values \({kind}\) in batch '
                                         r'samples \[1\]'):
        model(x)
    with pytest.raises(ValueError):
        model.train()(x)  # in training too


def test_the_finite_check_stays_out_of_traced_graphs():
    model = tiny(KCLAResNet, 'KCLA').eval()
    x = torch.rand(1, 3, 32, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always', torch.jit.TracerWarning)
        traced = torch.jit.trace(model, x, check_trace=False)
    # no data-dependent branch of the check was recorded into the graph
    assert not [w for w in caught if w.filename.endswith('kcla_resnet.py')]
    for a, b in zip(traced(x), model(x)):
        torch.testing.assert_close(a, b)


def seg_batch(img: torch.Tensor):
    from mmseg.structures import SegDataSample
    h, w = img.shape[1:]
    return dict(inputs=[img], data_samples=[SegDataSample(metainfo=dict(
        img_shape=(h, w), ori_shape=(h, w)))])


def det_batch(img: torch.Tensor):
    from mmdet.structures import DetDataSample
    h, w = img.shape[1:]
    return dict(inputs=[img], data_samples=[DetDataSample(metainfo=dict(
        img_shape=(h, w), ori_shape=(h, w), scale_factor=(1.0, 1.0)))])


IMAGES = {
    '33x47': lambda: torch.randint(0, 256, (3, 33, 47), dtype=torch.uint8),
    '1x1': lambda: torch.randint(0, 256, (3, 1, 1), dtype=torch.uint8),
    'black': lambda: torch.zeros(3, 40, 40, dtype=torch.uint8),
    'white': lambda: torch.full((3, 40, 40), 255, dtype=torch.uint8),
}


@pytest.mark.parametrize('image', list(IMAGES))
@pytest.mark.parametrize('task', ['det', 'seg'])
def test_whole_models_predict_finite_results_for_odd_images(configs, task, image):
    torch.manual_seed(0)
    model = build_model(model_config(configs, task))
    model.init_weights()
    model.eval()
    img = IMAGES[image]()
    with torch.no_grad():
        (pred, ) = model.test_step((det_batch if task == 'det' else seg_batch)(img))
        if task == 'seg':
            assert pred.pred_sem_seg.data.shape[-2:] == img.shape[1:]
            assert torch.isfinite(pred.seg_logits.data).all()
        else:
            assert torch.isfinite(pred.pred_instances.bboxes).all()
            assert torch.isfinite(pred.pred_instances.scores).all()
        # and without the data preprocessor's padding to a multiple of 32
        batch = model.data_preprocessor((det_batch if task == 'det' else seg_batch)(img))
        x = batch['inputs'][..., :img.shape[1], :img.shape[2]]
        outs = model(x, batch['data_samples'], mode='tensor')
        flat = [t for o in (outs if isinstance(outs, tuple) else (outs, ))
                for t in (o if isinstance(o, (list, tuple)) else (o, ))]
        assert flat and all(torch.isfinite(t).all() for t in flat)


@pytest.mark.parametrize('task', ['det', 'seg'])
def test_whole_models_refuse_nan_images(configs, task):
    model = build_model(model_config(configs, task)).eval()
    img = torch.rand(3, 32, 32) * 255
    img[2, 3, 4] = float('nan')
    with pytest.raises(ValueError, match='non-finite'):
        model.test_step((det_batch if task == 'det' else seg_batch)(img))

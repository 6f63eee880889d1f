"""UNetHead: full-resolution output, argument rules, use inside EncoderDecoder."""
import pytest
import torch
from mmengine.config import ConfigDict
from mmengine.registry import DefaultScope
from mmengine.structures import PixelData
from mmseg.registry import MODELS
from mmseg.structures import SegDataSample
from utils import assert_finite, params_without_grad

import kcla_mm  # noqa: F401  (registers UNetHead, KCLAResNet, BinaryDiceLoss)
from kcla_mm.models.backbones import KCLAResNetSeg
from kcla_mm.models.decode_heads import UNetHead

TINY = dict(depth=18, base_channels=16, stem_channels=16, head_dim=8)
TINY_CHANNELS = (16, 32, 64, 128)


def tiny_head(**kwargs) -> UNetHead:
    cfg = dict(in_channels=TINY_CHANNELS, decoder_channels=(32, 16, 16, 8, 8), num_classes=2,
               out_channels=1, threshold=0.5)
    cfg.update(kwargs)
    return UNetHead(**cfg)


@pytest.mark.parametrize('size', [(64, 64), (64, 96), (72, 40)])
@pytest.mark.parametrize('out_channels', [1, 2])
def test_full_resolution_on_kcla_resnet_features(size, out_channels):
    backbone = KCLAResNetSeg(**TINY).eval()
    head = tiny_head(out_channels=out_channels, threshold=0.5 if out_channels == 1 else None)
    x = torch.rand(2, 3, *size)
    with torch.no_grad():
        out = head(backbone(x))
    assert out.shape == (2, out_channels, *size)
    assert_finite(out, 'UNetHead output')


def test_stem_feature_as_extra_skip():
    # Five features at strides 2..32 (stem first): four skip blocks and one x2 block.
    channels = (16, 16, 32, 64, 128)
    head = tiny_head(in_channels=channels, in_index=(0, 1, 2, 3, 4))
    feats = [torch.rand(1, c, 64 // s, 64 // s) for c, s in zip(channels, (2, 4, 8, 16, 32))]
    assert head(feats).shape == (1, 1, 64, 64)
    widths = [b.convs[0].conv.in_channels for b in head.decoder]
    assert widths == [128 + 64, 32 + 32, 16 + 16, 16 + 16, 8]


def test_in_index_selects_backbone_outputs():
    # Only stages 1..3 of four outputs; the first output must not be used.
    head = tiny_head(in_channels=TINY_CHANNELS[1:], in_index=(1, 2, 3),
                     decoder_channels=(32, 16, 8, 8, 8))
    feats = [torch.rand(1, c, 64 // s, 64 // s)
             for c, s in zip(TINY_CHANNELS, (4, 8, 16, 32))]
    feats[0] = None
    assert head(feats).shape == (1, 1, 64, 64)


def test_every_parameter_gets_a_gradient():
    backbone, head = KCLAResNetSeg(**TINY), tiny_head()
    head(backbone(torch.rand(2, 3, 64, 64))).sum().backward()
    assert params_without_grad(head) == []


@pytest.mark.parametrize('kwargs, match', [
    # one channel count per selected feature
    (dict(in_index=(0, 1, 2)), 'same length'),
    # conv_seg reads the last decoder block
    (dict(channels=16), r'decoder_channels\[-1\]'),
    # one decoder block per skip at least
    (dict(decoder_channels=(32, 16)), 'at least 3'),
    (dict(upsample_mode='bicubic'), 'upsample_mode'),
    (dict(input_transform='resize_concat'), 'multiple_select'),
    (dict(in_channels=64), 'sequence'),
])
def test_argument_rules(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_head(**kwargs)


def segmentor(out_channels: int = 1):
    loss = [dict(type='CrossEntropyLoss', use_sigmoid=True, loss_name='loss_bce'),
            dict(type='BinaryDiceLoss', loss_name='loss_dice')] if out_channels == 1 \
        else dict(type='CrossEntropyLoss')
    cfg = dict(
        type='EncoderDecoder',
        data_preprocessor=dict(type='SegDataPreProcessor', mean=[0, 0, 0], std=[1, 1, 1],
                               size=(64, 64)),
        backbone=dict(type='KCLAResNet', **TINY),
        decode_head=dict(type='UNetHead', in_channels=list(TINY_CHANNELS),
                         decoder_channels=[32, 16, 16, 8, 8], num_classes=2,
                         out_channels=out_channels, threshold=0.5 if out_channels == 1 else None,
                         loss_decode=loss),
        test_cfg=dict(mode='whole'))
    with DefaultScope.overwrite_default_scope('mmseg'):
        return MODELS.build(ConfigDict(cfg))


def batch(n: int = 2, size=(64, 64)):
    samples = []
    for _ in range(n):
        label = torch.zeros(1, *size, dtype=torch.int64)
        label[:, 16:40, 20:50] = 1
        s = SegDataSample(gt_sem_seg=PixelData(data=label))
        s.set_metainfo(dict(img_shape=size, ori_shape=size, pad_shape=size))
        samples.append(s)
    return [torch.rand(3, *size) * 255 for _ in range(n)], samples


@pytest.mark.parametrize('out_channels', [1, 2])
def test_encoder_decoder_loss_and_predict(out_channels):
    model = segmentor(out_channels)
    model.init_weights()
    data = model.data_preprocessor(dict(zip(('inputs', 'data_samples'), batch())), True)
    losses = model(**data, mode='loss')
    expected = {'decode.loss_bce', 'decode.loss_dice'} if out_channels == 1 \
        else {'decode.loss_ce'}
    assert expected <= set(losses)
    sum(v for k, v in losses.items() if 'loss' in k).backward()
    # (the backbone's zero_init_residual leaves some of its grads exactly 0 at init)
    assert params_without_grad(model.decode_head) == []
    assert model.backbone.conv1.weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        preds = model(**model.data_preprocessor(dict(zip(('inputs', 'data_samples'),
                                                         batch(1, (48, 80))))), mode='predict')
    assert preds[0].pred_sem_seg.shape == (48, 80)
    assert preds[0].seg_logits.data.shape == (out_channels, 48, 80)


def test_binary_accuracy_uses_the_threshold():
    # mmseg's top-1 accuracy on one channel would report the background fraction.
    head = tiny_head(loss_decode=dict(type='CrossEntropyLoss', use_sigmoid=True))
    _, samples = batch(1)
    label = samples[0].gt_sem_seg.data.float()
    perfect = (label * 20 - 10)[None]  # +10 on foreground, -10 on background
    acc = head.loss_by_feat(perfect, samples)['acc_seg']
    assert float(acc) == pytest.approx(100.0)
    assert float(head.loss_by_feat(-perfect, samples)['acc_seg']) == pytest.approx(0.0)

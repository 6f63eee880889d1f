# KCLA-ResNet-34 encoder + UNet decoder, one sigmoid output (BCE + Dice).
#
# Other encoders change only `model.backbone` (and `decode_head.in_channels`
# for Bottleneck depths): depth=18/34 -> in_channels=[64, 128, 256, 512];
# depth=50 -> [256, 512, 1024, 2048]. `layer_attn=None` is the ResNet-UNet
# baseline; dict(type='MRLALight') / dict(type='FullLayerAttention') are the
# comparison methods.
#
# `model.data_preprocessor` (normalisation constants, pad size) comes from the
# dataset base config, see configs/unet/_base_/datasets/.

# ImageNet-pretrained encoder: path of a *local* checkpoint (nothing is ever
# downloaded), e.g. one converted with tools/model_converters/. None trains
# the encoder from scratch. From the command line:
#   --cfg-options model.backbone.init_cfg.type=Pretrained \
#                 model.backbone.init_cfg.checkpoint=checkpoints/kcla_resnet34.pth
pretrained = None

norm_cfg = dict(type='BN', requires_grad=True)
model = dict(
    type='EncoderDecoder',
    # data_preprocessor: set by each config from its dataset base.
    backbone=dict(
        type='KCLAResNet',
        depth=34,
        in_channels=3,
        num_stages=4,
        out_indices=(0, 1, 2, 3),
        strides=(1, 2, 2, 2),
        dilations=(1, 1, 1, 1),
        norm_cfg=norm_cfg,
        norm_eval=False,
        style='pytorch',
        layer_attn=dict(type='KCLA', drop_path=0.0),
        init_cfg=None if pretrained is None else dict(type='Pretrained', checkpoint=pretrained)),
    decode_head=dict(
        type='UNetHead',
        in_channels=[64, 128, 256, 512],
        in_index=[0, 1, 2, 3],
        decoder_channels=[256, 128, 64, 32, 16],
        dropout_ratio=0.0,
        num_classes=2,
        out_channels=1,
        threshold=0.5,
        norm_cfg=norm_cfg,
        align_corners=False,
        loss_decode=[
            dict(type='CrossEntropyLoss', use_sigmoid=True, loss_weight=1.0, loss_name='loss_bce'),
            dict(type='BinaryDiceLoss', smooth=1.0, loss_weight=1.0, loss_name='loss_dice'),
        ]),
    train_cfg=dict(),
    test_cfg=dict(mode='whole'))

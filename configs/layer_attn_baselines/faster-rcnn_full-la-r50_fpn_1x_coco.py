# Comparison: Faster R-CNN with exact (full) layer attention in a ResNet-50; same
# schedule and settings as configs/kcla/faster-rcnn_kcla-r50_fpn_1x_coco.py.
_base_ = 'mmdet::faster_rcnn/faster-rcnn_r50_fpn_1x_coco.py'

custom_imports = dict(imports=['kcla_mm', 'kcla_mm.host_fixes'], allow_failed_imports=False)

# ImageNet-pretrained backbone: a local file, never a download. Put it at this
# path or override it:
#   --cfg-options model.backbone.init_cfg.checkpoint=/path/to/weights.pth
# (see README.md in this folder for where the weights come from).
model = dict(
    backbone=dict(
        type='KCLAResNet',
        layer_attn=dict(type='FullLayerAttention', drop_path=0.0),
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/full-la_r50_imagenet.pth')))

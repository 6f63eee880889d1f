# Mask R-CNN with a KCLA-ResNet-101 backbone on COCO2017: mmdet's R-101-FPN 1x
# (12 epochs, 8 GPUs x 2 images) with only the backbone changed.
_base_ = 'mmdet::mask_rcnn/mask-rcnn_r101_fpn_1x_coco.py'

custom_imports = dict(imports=['kcla_mm', 'kcla_mm.host_fixes'], allow_failed_imports=False)

# ImageNet-pretrained backbone: a local file, never a download. Put it at this
# path or override it:
#   --cfg-options model.backbone.init_cfg.checkpoint=/path/to/weights.pth
# (see README.md in this folder for where the weights come from).
model = dict(
    backbone=dict(
        type='KCLAResNet',
        layer_attn=dict(type='KCLA', drop_path=0.0),
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/kcla_r101_imagenet.pth')))

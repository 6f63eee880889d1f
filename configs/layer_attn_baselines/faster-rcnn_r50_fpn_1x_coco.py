# Comparison: Faster R-CNN with the plain ResNet-50 (KCLAResNet with layer_attn=None,
# identical to mmdet's ResNet); same schedule and settings as
# configs/kcla/faster-rcnn_kcla-r50_fpn_1x_coco.py, but a local checkpoint
# instead of mmdet's torchvision:// download.
_base_ = 'mmdet::faster_rcnn/faster-rcnn_r50_fpn_1x_coco.py'

custom_imports = dict(imports=['kcla_mm', 'kcla_mm.host_fixes'], allow_failed_imports=False)

# ImageNet-pretrained backbone: a local file, never a download. Put it at this
# path or override it:
#   --cfg-options model.backbone.init_cfg.checkpoint=/path/to/weights.pth
# (see README.md in this folder for where the weights come from).
model = dict(
    backbone=dict(
        type='KCLAResNet',
        layer_attn=None,
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/resnet50_imagenet.pth')))

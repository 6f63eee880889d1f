# Comparison: Mask R-CNN with an MRLA-light ResNet-50 backbone; same schedule and
# settings as configs/kcla/mask-rcnn_kcla-r50_fpn_1x_coco.py.
_base_ = 'mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py'

custom_imports = dict(imports=['kcla_mm', 'kcla_mm.host_fixes'], allow_failed_imports=False)

# ImageNet-pretrained backbone: a local file, never a download. Put it at this
# path or override it:
#   --cfg-options model.backbone.init_cfg.checkpoint=/path/to/weights.pth
# (see README.md in this folder for where the weights come from).
model = dict(
    backbone=dict(
        type='KCLAResNet',
        layer_attn=dict(type='MRLALight', drop_path=0.0),
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/mrla-light_r50_imagenet.pth')))

# Demo: Mask R-CNN with the small KCLA-ResNet-18 of the Faster R-CNN demo,
# trained from scratch on the synthetic shapes (polygon masks); COCO bbox and
# segm AP. Everything but the mask branch comes from the Faster R-CNN demo.
_base_ = './faster-rcnn_kcla-r18_fpn_synthetic.py'

model = dict(
    type='MaskRCNN',
    data_preprocessor=dict(pad_mask=True),
    roi_head=dict(
        mask_roi_extractor=dict(
            type='SingleRoIExtractor',
            roi_layer=dict(type='RoIAlign', output_size=14, sampling_ratio=1),
            out_channels={{_base_.width}},
            featmap_strides=[4, 8, 16, 32]),
        mask_head=dict(
            type='FCNMaskHead',
            num_convs=2,
            in_channels={{_base_.width}},
            conv_out_channels={{_base_.width}},
            num_classes=3,
            loss_mask=dict(type='CrossEntropyLoss', use_mask=True, loss_weight=1.0))),
    train_cfg=dict(rcnn=dict(mask_size=28)),
    test_cfg=dict(rcnn=dict(mask_thr_binary=0.5)))

train_pipeline = [
    dict(type='LoadImageFromFileNamingErrors'),
    dict(type='LoadAnnotationsNamingErrors', with_bbox=True, with_mask=True),
    dict(type='Resize', scale={{_base_.image_size}}, keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFileNamingErrors'),
    dict(type='Resize', scale={{_base_.image_size}}, keep_ratio=True),
    dict(type='LoadAnnotationsNamingErrors', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(metric=['bbox', 'segm'])
test_evaluator = val_evaluator

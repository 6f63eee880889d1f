"""UNet decoder for ResNet encoders: upsampling with skip concatenation.

Ronneberger, Fischer, Brox, "U-Net: Convolutional Networks for Biomedical
Image Segmentation", MICCAI 2015. The ResNet-encoder form ("ResNet-UNet") is
the one popularised by segmentation_models_pytorch's ``Unet``: each decoder
block upsamples the deeper feature to the resolution of the next shallower
encoder feature, concatenates them and applies two 3x3 conv-norm-act layers;
blocks after the last skip upsample by 2 without a skip, until the output is
at the input resolution.

mmseg 1.x ships a UNet *backbone* (encoder and decoder in one module) but no
decode head that consumes the multi-scale features of a ResNet encoder; this
head fills that gap and works with ``EncoderDecoder``.
"""
from typing import List, Optional, Sequence

import torch
from mmcv.cnn import ConvModule
from mmseg.models.decode_heads.decode_head import BaseDecodeHead
from mmseg.models.utils import resize
from mmseg.utils import SampleList
from torch import Tensor, nn

UPSAMPLE_MODES = ('bilinear', 'nearest')


class UNetDecoderBlock(nn.Module):
    """Upsample, optionally concatenate a skip feature, then two 3x3 convs.

    Args:
        in_channels: channels of the deeper input ``x``.
        skip_channels: channels of the skip feature (0: no skip; the block
            upsamples ``x`` by 2).
        out_channels: output channels.
        upsample_mode: ``'bilinear'`` or ``'nearest'``.
        align_corners: ``align_corners`` of bilinear upsampling.
        conv_cfg: conv layer config (mmcv).
        norm_cfg: norm layer config (mmcv).
        act_cfg: activation config (mmcv).
    """

    def __init__(self,
                 in_channels: int,
                 skip_channels: int,
                 out_channels: int,
                 upsample_mode: str = 'bilinear',
                 align_corners: bool = False,
                 conv_cfg: Optional[dict] = None,
                 norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None) -> None:
        super().__init__()
        self.upsample_mode = upsample_mode
        # F.interpolate accepts align_corners only for the linear modes.
        self.align_corners = align_corners if upsample_mode == 'bilinear' else None
        conv_kwargs = dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg,
                           act_cfg=dict(type='ReLU') if act_cfg is None else act_cfg)
        self.convs = nn.Sequential(
            ConvModule(in_channels + skip_channels, out_channels, 3, padding=1, **conv_kwargs),
            ConvModule(out_channels, out_channels, 3, padding=1, **conv_kwargs))

    def forward(self, x: Tensor, skip: Optional[Tensor] = None) -> Tensor:
        """Decode one level.

        Args:
            x: deeper feature, ``[B, C_in, h, w]``.
            skip: encoder feature ``[B, C_skip, H, W]`` or ``None``.

        Returns:
            ``[B, C_out, H, W]`` (``[B, C_out, 2h, 2w]`` without a skip).
        """
        if skip is None:
            x = resize(x, scale_factor=2, mode=self.upsample_mode,
                       align_corners=self.align_corners, warning=False)  # [B, C_in, 2h, 2w]
        else:
            x = resize(x, size=skip.shape[2:], mode=self.upsample_mode,
                       align_corners=self.align_corners, warning=False)  # [B, C_in, H, W]
            x = torch.cat([x, skip], dim=1)  # [B, C_in + C_skip, H, W]
        return self.convs(x)  # [B, C_out, H, W]


class UNetHead(BaseDecodeHead):
    """UNet decoder over the multi-scale features of a ResNet encoder.

    The selected features (``in_index``, ordered shallow to deep) are decoded
    from the deepest: decoder block ``k < L - 1`` (``L = len(in_index)``)
    upsamples to the size of feature ``L - 2 - k`` and concatenates it; the
    remaining ``len(decoder_channels) - (L - 1)`` blocks each upsample by 2
    without a skip. For a ResNet with ``out_indices=(0, 1, 2, 3)`` (strides
    4..32) the default five decoder blocks end at stride 1, the input
    resolution. A backbone that also returns its stride-2 stem feature is
    decoded the same way: put the stem first in ``in_channels``/``in_index``
    and drop one of the trailing blocks.

    Binary segmentation follows mmseg's convention: ``num_classes=2,
    out_channels=1`` with ``threshold`` gives one sigmoid logit per pixel.

    Args:
        in_channels: channels of the selected encoder features, shallow to
            deep (``base_channels * 2**i * expansion`` for ResNet stage ``i``).
        decoder_channels: output channels of every decoder block, deepest
            first; at least ``len(in_channels) - 1`` entries.
        channels: channels before ``conv_seg``; must equal
            ``decoder_channels[-1]`` (the default).
        in_index: indices of the backbone outputs to use, shallow to deep.
        upsample_mode: ``'bilinear'`` or ``'nearest'``.
        **kwargs: :class:`mmseg.models.decode_heads.BaseDecodeHead` arguments
            (``num_classes``, ``out_channels``, ``threshold``, ``norm_cfg``,
            ``loss_decode``, ...). ``input_transform`` is always
            ``'multiple_select'``.

    Example:
        >>> import torch
        >>> from kcla_mm.models.decode_heads import UNetHead
        >>> head = UNetHead(in_channels=(16, 32, 64, 128), decoder_channels=(64, 32, 16, 8, 8),
        ...                 num_classes=2, out_channels=1, threshold=0.5)
        >>> feats = [torch.rand(1, c, 64 // s, 64 // s)
        ...          for c, s in zip((16, 32, 64, 128), (4, 8, 16, 32))]
        >>> tuple(head(feats).shape)
        (1, 1, 64, 64)
    """

    def __init__(self,
                 in_channels: Sequence[int],
                 decoder_channels: Sequence[int] = (256, 128, 64, 32, 16),
                 channels: Optional[int] = None,
                 in_index: Sequence[int] = (0, 1, 2, 3),
                 upsample_mode: str = 'bilinear',
                 **kwargs) -> None:
        in_channels = self._check_sequence(in_channels, 'in_channels')
        in_index = self._check_sequence(in_index, 'in_index')
        decoder_channels = self._check_sequence(decoder_channels, 'decoder_channels')
        if len(in_index) != len(in_channels):
            raise ValueError(f'in_index={in_index} and in_channels={in_channels} must have the '
                             'same length (one channel count per selected feature)')
        if len(decoder_channels) < len(in_channels) - 1:
            raise ValueError(f'decoder_channels={decoder_channels} needs at least '
                             f'{len(in_channels) - 1} entries (one block per skip) for '
                             f'in_channels={in_channels}')
        if channels is None:
            channels = decoder_channels[-1]
        elif channels != decoder_channels[-1]:
            raise ValueError(f'channels={channels} must equal decoder_channels[-1]='
                             f'{decoder_channels[-1]} (the input width of conv_seg)')
        if upsample_mode not in UPSAMPLE_MODES:
            raise ValueError(f'upsample_mode={upsample_mode!r}; choose one of {UPSAMPLE_MODES}')
        transform = kwargs.pop('input_transform', 'multiple_select')
        if transform != 'multiple_select':
            raise ValueError(f"UNetHead needs input_transform='multiple_select', "
                             f'got {transform!r}')
        super().__init__(list(in_channels), channels, in_index=list(in_index),
                         input_transform='multiple_select', **kwargs)
        self.decoder_channels = decoder_channels
        self.num_skips = len(in_channels) - 1
        skips = list(reversed(in_channels[:-1])) + [0] * (len(decoder_channels) - self.num_skips)
        block_in = [in_channels[-1]] + list(decoder_channels[:-1])
        self.decoder = nn.ModuleList([
            UNetDecoderBlock(c_in, c_skip, c_out, upsample_mode=upsample_mode,
                             align_corners=self.align_corners, conv_cfg=self.conv_cfg,
                             norm_cfg=self.norm_cfg, act_cfg=self.act_cfg)
            for c_in, c_skip, c_out in zip(block_in, skips, decoder_channels)
        ])

    @staticmethod
    def _check_sequence(value, name: str) -> tuple:
        if isinstance(value, int) or not all(isinstance(v, int) and v >= 0 for v in value):
            raise ValueError(f'{name} must be a sequence of non-negative ints, got {value!r}')
        if len(value) == 0:
            raise ValueError(f'{name} must not be empty')
        return tuple(value)

    def forward(self, inputs: Sequence[Tensor]) -> Tensor:
        """Decode the encoder features to per-pixel logits.

        Args:
            inputs: backbone outputs; ``inputs[in_index[i]]`` is
                ``[B, in_channels[i], H_i, W_i]`` with ``H_i`` decreasing in ``i``.

        Returns:
            ``[B, out_channels, H_0 * 2**t, W_0 * 2**t]`` logits, ``t`` the number
            of blocks without a skip (``H_0`` the shallowest feature's height).
        """
        feats: List[Tensor] = self._transform_inputs(inputs)
        x = feats[-1]  # [B, C_deep, H_deep, W_deep]
        skips = list(reversed(feats[:-1])) + [None] * (len(self.decoder) - self.num_skips)
        for block, skip in zip(self.decoder, skips):
            x = block(x, skip)  # [B, C_k, H_k, W_k]
        return self.cls_seg(x)  # [B, out_channels, H, W]

    def loss_by_feat(self, seg_logits: Tensor, batch_data_samples: SampleList) -> dict:
        """mmseg's losses, with ``acc_seg`` corrected for one output channel.

        Args:
            seg_logits: ``[B, out_channels, H, W]`` from :meth:`forward`.
            batch_data_samples: samples with ``gt_sem_seg`` ``[1, H', W']``.

        Returns:
            Loss components and ``acc_seg`` (pixel accuracy in percent).
        """
        losses = super().loss_by_feat(seg_logits, batch_data_samples)
        if self.out_channels == 1:
            # NOTE: mmseg's accuracy() takes the top-1 channel, which is always
            # channel 0 when there is one channel; use the thresholded sigmoid.
            label = self._stack_batch_gt(batch_data_samples).squeeze(1)  # [B, H', W']
            logits = resize(seg_logits, size=label.shape[1:], mode='bilinear',
                            align_corners=self.align_corners)  # [B, 1, H', W']
            pred = (logits.squeeze(1).sigmoid() > self.threshold).to(label)  # [B, H', W']
            valid = label != self.ignore_index
            correct = (pred[valid] == label[valid]).float().sum()
            losses['acc_seg'] = correct * (100.0 / max(int(valid.sum()), 1))
        return losses

"""Decode heads for mmseg: the UNet decoder for ResNet encoders."""
from .unet_head import UNetDecoderBlock, UNetHead

__all__ = ['UNetDecoderBlock', 'UNetHead']

# Runtime of the medical UNet configs: mmseg's runtime plus the kcla_mm plugin.
_base_ = 'mmseg::_base_/default_runtime.py'

# Registers KCLAResNet, UNetHead, BinaryDiceLoss, the medical datasets and
# ForegroundIoUMetric in mmseg's registries.
custom_imports = dict(imports=['kcla_mm', 'kcla_mm.host_fixes'], allow_failed_imports=False)

# Overlays written by `tools/test.py --show-dir`: keep the image visible.
visualizer = dict(alpha=0.5)

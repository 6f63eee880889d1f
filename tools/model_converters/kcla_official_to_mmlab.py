"""Convert a KCLA reference ImageNet checkpoint (``.pth.tar``) to kcla_mm.

The output is an mmengine checkpoint (``{'state_dict': ..., 'meta': ...}``)
that ``KCLAResNet(depth=50 or 101)`` with default arguments loads with no
missing and no unexpected keys. Use it as
``init_cfg=dict(type='Pretrained', checkpoint=DST)``.

Example:
    python tools/model_converters/kcla_official_to_mmlab.py \\
        resnet50_kcla.pth.tar checkpoints/kcla_r50_imagenet.pth
"""
import argparse
import io
import os
import sys

import torch

from kcla_mm.utils.checkpoint import TRUST_ENV, atomic_write_bytes, safe_load
from kcla_mm.utils.official_checkpoint import (NotAnOfficialCheckpoint, convert_official_state_dict,
                                               extract_state_dict)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('src', help='reference checkpoint (.pth.tar)')
    p.add_argument('dst', help='output mmengine checkpoint (.pth)')
    p.add_argument('--allow-unmapped', action='store_true',
                   help='write the output even if some keys could not be mapped')
    p.add_argument('--trust-checkpoint', action='store_true',
                   help=f'load SRC with weights_only=False (runs pickled code; only for '
                        f'files you trust). Same as {TRUST_ENV}=1')
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not os.path.isfile(args.src):
        print(f'error: {args.src} does not exist', file=sys.stderr)
        return 2
    try:
        obj = safe_load(args.src, map_location='cpu', trust=args.trust_checkpoint or None)
        state_dict, report = convert_official_state_dict(extract_state_dict(obj))
    except (NotAnOfficialCheckpoint, ValueError) as e:
        print(f'error: {args.src}: {e}; nothing written', file=sys.stderr)
        return 1
    except Exception as e:  # unreadable / corrupt / unsafe file
        print(f'error: cannot read {args.src}: {e}; nothing written', file=sys.stderr)
        return 1
    if report['unmapped']:
        print(f'{len(report["unmapped"])} keys could not be mapped:', file=sys.stderr)
        for k in report['unmapped']:
            print(f'  {k}', file=sys.stderr)
        if not args.allow_unmapped:
            print('nothing written (pass --allow-unmapped to write the rest)', file=sys.stderr)
            return 1
    print(f'mapped {len(state_dict)} tensors; dropped {len(report["dropped"])} on purpose '
          '(fc, norm_d, never-used init modules)')
    os.makedirs(os.path.dirname(os.path.abspath(args.dst)), exist_ok=True)
    meta = {'converted_from': os.path.basename(args.src),
            'epoch': obj.get('epoch') if isinstance(obj, dict) else None}
    buf = io.BytesIO()
    torch.save({'state_dict': state_dict, 'meta': meta}, buf)
    atomic_write_bytes(buf.getvalue(), args.dst)  # a crash never leaves a half-written DST
    print(f'wrote {args.dst}')
    return 0


if __name__ == '__main__':
    sys.exit(main())

"""Convert a KCLA reference ImageNet checkpoint (``.pth.tar``) to kcla_mm.

The output is an mmengine checkpoint (``{'state_dict': ..., 'meta': ...}``)
of one of two kinds, chosen with ``--to``:

- ``backbone`` (the default): the backbone alone, which ``KCLAResNet(depth=50
  or 101)`` with default arguments loads with no missing and no unexpected
  keys; the reference's ``fc`` is left out. Use it as
  ``init_cfg=dict(type='Pretrained', checkpoint=DST)`` (detection,
  segmentation).
- ``classifier``: the whole ImageNet classifier, ``backbone.*`` and the
  reference's ``fc`` as ``head.fc.*``, which the ``ImageClassifier`` of
  ``configs/kcla_resnet/kcla-r50_8xb32-100e_in1k.py`` (or ``kcla-r101_...``)
  loads with ``strict=True``. Give it to ``tools/test.py``. The source must
  hold ``fc.weight`` and ``fc.bias`` of shape ``[NUM_CLASSES, 2048]`` and
  ``[NUM_CLASSES]`` (``--num-classes``, 1000 unless given); otherwise nothing
  is written.

Examples:
    python tools/model_converters/kcla_official_to_mmlab.py \\
        resnet50_kcla.pth.tar checkpoints/kcla_r50_imagenet.pth
    python tools/model_converters/kcla_official_to_mmlab.py --to classifier \\
        resnet50_kcla.pth.tar checkpoints/kcla-r50_in1k_classifier.pth
    python tools/test.py configs/kcla_resnet/kcla-r50_8xb32-100e_in1k.py \\
        checkpoints/kcla-r50_in1k_classifier.pth
"""
import argparse
import io
import os
import sys

import torch

from kcla_mm.utils.checkpoint import TRUST_ENV, atomic_write_bytes, safe_load
from kcla_mm.utils.official_checkpoint import (FC_KEYS, NotAnOfficialCheckpoint,
                                               convert_official_state_dict, extract_state_dict,
                                               to_classifier_state_dict)

IMAGENET_CLASSES = 1000


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('src', help='reference checkpoint (.pth.tar)')
    p.add_argument('dst', help='output mmengine checkpoint (.pth)')
    p.add_argument('--to', choices=('backbone', 'classifier'), default='backbone',
                   help='backbone: the backbone keys alone (for init_cfg Pretrained); '
                        'classifier: backbone.* and head.fc.* for mmpretrain\'s ImageClassifier '
                        '(default: backbone)')
    p.add_argument('--num-classes', type=int, default=None,
                   help=f'with --to classifier: the classes the source\'s fc must have '
                        f'(default: {IMAGENET_CLASSES})')
    p.add_argument('--allow-unmapped', action='store_true',
                   help='write the output even if some keys could not be mapped')
    p.add_argument('--trust-checkpoint', action='store_true',
                   help=f'load SRC with weights_only=False (runs pickled code; only for '
                        f'files you trust). Same as {TRUST_ENV}=1')
    args = p.parse_args(argv)
    if args.num_classes is not None and args.to != 'classifier':
        p.error('--num-classes applies to --to classifier only')
    if args.to == 'classifier' and args.num_classes is None:
        args.num_classes = IMAGENET_CLASSES
    return args


def classifier_state_dict(source_sd, backbone_sd, num_classes: int):
    """``backbone_sd`` and the source's ``fc`` as mmpretrain ``ImageClassifier`` keys."""
    missing = [k for k in FC_KEYS if k not in source_sd]
    if missing:
        raise ValueError(f'no {" and ".join(missing)}: the checkpoint holds no classifier, '
                         'which --to classifier needs (--to backbone converts the rest)')
    return to_classifier_state_dict(backbone_sd, source_sd['fc.weight'], source_sd['fc.bias'],
                                    num_classes=num_classes)


def plain_int(value):
    """``value`` if it is an int (the meta holds plain values only), else ``None``."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def main(argv=None) -> int:
    args = parse_args(argv)
    if not os.path.isfile(args.src):
        print(f'error: {args.src} does not exist', file=sys.stderr)
        return 2
    try:
        obj = safe_load(args.src, map_location='cpu', trust=args.trust_checkpoint or None)
        source = extract_state_dict(obj)
        state_dict, report = convert_official_state_dict(source)
        if args.to == 'classifier':
            state_dict = classifier_state_dict(source, state_dict, args.num_classes)
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
    if args.to == 'classifier':
        dropped = [k for k in report['dropped'] if k not in FC_KEYS]
        print(f'mapped {len(state_dict)} tensors (fc as head.fc); dropped {len(dropped)} on '
              'purpose (norm_d, never-used init modules)')
    else:
        print(f'mapped {len(state_dict)} tensors; dropped {len(report["dropped"])} on purpose '
              '(fc, norm_d, never-used init modules)')
    os.makedirs(os.path.dirname(os.path.abspath(args.dst)), exist_ok=True)
    meta = {'converted_from': os.path.basename(args.src),
            'epoch': plain_int(obj.get('epoch')) if isinstance(obj, dict) else None}
    if args.to == 'classifier':
        meta['num_classes'] = state_dict[FC_KEYS['fc.weight']].shape[0]
    buf = io.BytesIO()
    torch.save({'state_dict': state_dict, 'meta': meta}, buf)
    atomic_write_bytes(buf.getvalue(), args.dst)  # a crash never leaves a half-written DST
    print(f'wrote {args.dst}')
    return 0


if __name__ == '__main__':
    sys.exit(main())

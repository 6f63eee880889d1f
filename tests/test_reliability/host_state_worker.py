"""Which host objects an import changes: run as ``python host_state_worker.py MODULE...``.

Imports what kcla_mm itself imports from the hosts, records the objects that
kcla_mm's host fixes replace, then imports each MODULE in turn and prints, as
JSON, ``{module: [names of the objects that changed]}``. Run in a fresh
interpreter: a test process has long imported everything.
"""
import importlib
import json
import sys

import mmcv.transforms  # noqa: F401
import mmdet.datasets  # noqa: F401
import mmdet.models  # noqa: F401
import mmpretrain.datasets  # noqa: F401
import mmpretrain.models  # noqa: F401
import mmseg.datasets  # noqa: F401
import mmseg.models  # noqa: F401
import torch
import torch.serialization
from mmengine.dist import utils as dist_utils
from mmengine.fileio.backends import backends, prefix_to_backends
from mmengine.fileio.backends.local_backend import LocalBackend
from mmengine.model.wrappers import MMDistributedDataParallel
from mmengine.runner.checkpoint import CheckpointLoader


def snapshot() -> dict:
    return {
        'LocalBackend.put': LocalBackend.put,
        "fileio backends['local']": backends['local'],
        "fileio prefix_to_backends['']": prefix_to_backends[''],
        'mmengine.dist.utils._init_dist_pytorch': dist_utils._init_dist_pytorch,
        'mmengine.dist.utils.init_dist': dist_utils.init_dist,
        'MMDistributedDataParallel.__init__': MMDistributedDataParallel.__init__,
        'CheckpointLoader schemes': dict(CheckpointLoader._schemes),
        'torch.load': torch.load,
        'torch safe globals': list(torch.serialization.get_safe_globals()),
    }


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))
    return a is b


if __name__ == '__main__':
    changed = {}
    before = snapshot()
    for module in sys.argv[1:]:
        importlib.import_module(module)
        after = snapshot()
        changed[module] = [k for k in before if not same(before[k], after[k])]
        before = after
    print(json.dumps(changed))

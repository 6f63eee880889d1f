"""One rank of the exit race that ``shutdown_distributed`` guards against.

Run as 2 processes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): a DDP
step keeps the gloo group alive past ``destroy_process_group``, then the
process broadcasts Python-owned tensors and exits right away, as
``tools/train.py`` does after mmengine's metric broadcast. ``--no-drain``
skips the wait, for checking that the race is still reproduced.

``kcla_mm/utils/dist.py`` is loaded from its file: importing the package
(mmdet, mmseg) would take longer than the race is worth.
"""
import importlib.util
import os.path as osp
import sys

import torch
import torch.distributed as dist

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))


def load_dist_utils():
    spec = importlib.util.spec_from_file_location(
        'kcla_dist_utils', osp.join(ROOT, 'kcla_mm', 'utils', 'dist.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == '__main__':
    # at module level, as in the failing runs: the DDP model and its group
    # are still referenced when the interpreter starts to finalize
    shutdown_distributed = load_dist_utils().shutdown_distributed
    dist.init_process_group('gloo')
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 3))
    model(torch.randn(2, 3)).sum().backward()
    for _ in range(3):
        dist.broadcast(torch.ones(1000), 0)
    if '--no-drain' in sys.argv[1:]:
        dist.destroy_process_group()  # what shutdown_distributed did before
    else:
        shutdown_distributed()

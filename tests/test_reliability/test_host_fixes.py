"""``import kcla_mm`` changes no host object; ``kcla_mm.host_fixes`` changes exactly three.

The host fixes (safe checkpoint loading, atomic checkpoint writing,
distributed training on CPU) are applied by importing
:mod:`kcla_mm.host_fixes`, which the project's configs name in
``custom_imports`` and its tools import. A user who imports only the
backbones gets only the backbones.
"""
import glob
import json
import os.path as osp
import sys

import pytest
from mmengine.fileio import get_file_backend
from mmengine.runner.checkpoint import CheckpointLoader
from reliability_utils import ROOT
from utils import subprocess_run

import kcla_mm.host_fixes
from kcla_mm.utils.checkpoint import AtomicLocalBackend, load_from_local

WORKER = osp.join(osp.dirname(osp.abspath(__file__)), 'host_state_worker.py')
FIXED = ["fileio backends['local']", "fileio prefix_to_backends['']",
         'mmengine.dist.utils._init_dist_pytorch', 'MMDistributedDataParallel.__init__',
         'CheckpointLoader schemes']


@pytest.fixture(scope='module')
def changed_by_import() -> dict:
    """``{module: [host objects its import changed]}``, from one fresh interpreter."""
    out = subprocess_run([sys.executable, WORKER, 'kcla_mm', 'kcla_mm.host_fixes'],
                         timeout=300).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_import_kcla_mm_changes_no_host_object(changed_by_import):
    assert changed_by_import['kcla_mm'] == []


def test_host_fixes_change_exactly_the_fixed_objects(changed_by_import):
    # the control of the test above: the same snapshot does see the fixes
    assert sorted(changed_by_import['kcla_mm.host_fixes']) == sorted(FIXED)


def test_host_fixes_use_mmengine_extension_points():
    assert CheckpointLoader._get_checkpoint_loader('work_dirs/iter_2.pth') is load_from_local
    assert type(get_file_backend('work_dirs/iter_2.pth')) is AtomicLocalBackend
    # prefixed paths keep their own loaders and backends
    assert CheckpointLoader._get_checkpoint_loader('https://host/x.pth') is not load_from_local
    assert type(get_file_backend('https://host/x.pth')) is not AtomicLocalBackend


def test_installing_again_changes_nothing():
    from mmengine.dist import utils as dist_utils
    from mmengine.model.wrappers import MMDistributedDataParallel
    before = (dict(CheckpointLoader._schemes), dist_utils._init_dist_pytorch,
              MMDistributedDataParallel.__init__)
    kcla_mm.host_fixes.install()
    after = (dict(CheckpointLoader._schemes), dist_utils._init_dist_pytorch,
             MMDistributedDataParallel.__init__)
    assert after[0] == before[0] and after[1:] == before[1:]
    assert type(get_file_backend('x.pth')) is AtomicLocalBackend


def test_every_config_that_imports_kcla_mm_names_the_host_fixes():
    # the project's configs say what they change, and mmdet's and mmseg's own
    # tools get the fixes through them
    paths = glob.glob(osp.join(ROOT, 'configs', '**', '*.py'), recursive=True)
    lines = {osp.relpath(p, ROOT): line.strip() for p in paths for line in open(p)
             if line.startswith('custom_imports')}
    assert len(lines) >= 10, lines  # every detection config and the UNet runtime base
    wrong = {p: line for p, line in lines.items()
             if "imports=['kcla_mm', 'kcla_mm.host_fixes']" not in line}
    assert wrong == {}

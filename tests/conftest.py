import os
import sys

import pytest

# Run from a checkout without installing: the repository root is importable.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def one_thread():
    """One intra-op thread for a module's tests (``pytestmark = pytest.mark.usefixtures``)."""
    from utils import torch_threads
    with torch_threads(1):
        yield


@pytest.fixture(autouse=True)
def restore_default_scope():
    """Drop the ``DefaultScope`` instances a test created (a Runner or ``init_default_scope``).

    mmengine builds every ``type`` in the latest default scope, so a leftover
    ``mmpretrain`` scope would make a later mmseg build take mmpretrain's
    ``CrossEntropyLoss``, and a leftover ``mmseg`` scope later ``mmdet`` builds fail.
    """
    from mmengine.registry import DefaultScope
    before = set(DefaultScope._instance_dict)
    yield
    for name in [n for n in DefaultScope._instance_dict if n not in before]:
        del DefaultScope._instance_dict[name]

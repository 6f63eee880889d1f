"""Keep the process-wide state that Runners and scope switches leave behind local to a test."""
import pytest


@pytest.fixture(autouse=True)
def restore_default_scope():
    """Drop the ``DefaultScope`` instances a test created (a Runner or ``init_default_scope``).

    mmengine builds every ``type`` in the latest default scope, so a leftover
    ``mmseg`` scope would make later ``mmdet`` builds in this process fail.
    """
    from mmengine.registry import DefaultScope
    before = set(DefaultScope._instance_dict)
    yield
    for name in [n for n in DefaultScope._instance_dict if n not in before]:
        del DefaultScope._instance_dict[name]


@pytest.fixture(autouse=True)
def one_thread_each():
    """Every reliability test on one intra-op thread, set again for each test."""
    from utils import torch_threads
    with torch_threads(1):
        yield

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
def one_thread():
    """One intra-op thread: the 2 cores are shared, and oversubscription costs 10x."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

"""Every reliability test on one thread (the default scope is restored by tests/conftest.py)."""
import pytest


@pytest.fixture(autouse=True)
def one_thread_each():
    """Every reliability test on one intra-op thread, set again for each test."""
    from utils import torch_threads
    with torch_threads(1):
        yield

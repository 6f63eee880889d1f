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

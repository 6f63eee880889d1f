"""The number of ATen operators one KCLA block issues on the plain (GPU) path.

On a GPU each operator that computes something is a kernel launch of a few
microseconds of host time; the per-head math of a block runs on ``[B, G]`` and
``[B, C]`` tensors, where launches cost more than the arithmetic. These bounds
fail if that number grows again.

Counting rule (``launches`` of tools/analysis_tools/count_ops.py): every ATen
call counts except views and metadata (outputs that alias an input without
writing it, e.g. view, expand, t, detach, unsqueeze, slice, unbind, and
_unsafe_view; or no tensor output) and allocations that write nothing
(empty*). Counted on CPU with the fused kernels off and the recomputed tail
replayed through autograd, the path CUDA tensors run.
"""
from pathlib import Path

import pytest
import torch
from utils import load_tool

from kcla_mm.ops import KCLA, KCLAState, fused_kernels
from kcla_mm.ops.recompute import autograd_replay

TOOL = Path(__file__).resolve().parents[2] / 'tools' / 'analysis_tools' / 'count_ops.py'


@pytest.fixture(scope='module')
def tool():
    return load_tool(TOOL, 'kcla_count_ops_tool')


def _inputs(requires_grad):
    torch.manual_seed(0)
    layer = KCLA(64, head_dim=16)
    x = torch.rand(2, 64, 8, 8, requires_grad=requires_grad)
    state = KCLAState(torch.rand(2, 64, 8, 8, requires_grad=requires_grad),
                      torch.rand(2, 4, requires_grad=requires_grad))
    return layer, x, state


def test_counting_rule(tool):
    # views and unwritten allocations are not launches; in-place writes are
    with tool.OpCounter() as ops:
        a = torch.empty(4)
        a.fill_(1.0)
        a.view(2, 2).t().unsqueeze(0).expand(3, 2, 2).detach()
        a.exp()
    assert dict(ops.counts) == {'fill_': 1, 'exp': 1}


def test_training_step_of_a_block(tool):
    # a block with an incoming state: the forward of the step and the backward
    # of out.sum() + mean.sum() + log_z.sum() (the loss's own ops included).
    # Before the per-head math was fused: 30 forward, 73 backward.
    layer, x, state = _inputs(True)
    with fused_kernels(False), autograd_replay():
        for _ in range(2):  # the second step is counted
            layer.zero_grad(set_to_none=True)
            with tool.OpCounter() as fwd:
                out, new = layer(x, state)
            loss = out.sum() + new.mean.sum() + new.log_z.sum()
            with tool.OpCounter() as bwd:
                loss.backward()
    assert fwd.total <= 27, dict(fwd.counts)
    assert bwd.total <= 70, dict(bwd.counts)


def test_eval_step_of_a_block(tool):
    # the same block in eval mode without autograd. Before: 28.
    layer, x, state = _inputs(False)
    layer.eval()
    with fused_kernels(False), torch.no_grad():
        layer(x, state)  # the folded norm is cached on the first call
        with tool.OpCounter() as ops:
            layer(x, state)
    assert ops.total <= 25, dict(ops.counts)

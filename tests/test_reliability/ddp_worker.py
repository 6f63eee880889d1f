"""DDP worker: 2 processes with batch 1 each against 1 process with batch 2.

Run with ``python -m torch.distributed.run --standalone --nproc_per_node 2
ddp_worker.py OUT.json`` (gloo, CPU). For every host backbone (mmdet, mmseg)
and layer-attention method, each rank builds the same GroupNorm
KCLA-ResNet-18 in float64 and wraps it in ``DistributedDataParallel`` with
``find_unused_parameters=False`` (mmengine's default); rank ``r`` trains on
sample ``r`` of a fixed batch of 2, with the loss averaged over the sample.
Rank 0 also runs the whole batch in one process and records the largest
difference between the DDP gradients (averaged over ranks) and its own. Two
steps are taken: DDP fails in the second if any parameter went unused in the
first. A control model with one deliberately unused parameter must fail so.
"""
import json
import sys
from typing import Dict

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import kcla_mm  # noqa: F401
from kcla_mm.models.backbones import KCLAResNet, KCLAResNetSeg
from kcla_mm.utils.dist import shutdown_distributed

HOSTS = {'mmdet': KCLAResNet, 'mmseg': KCLAResNetSeg}
METHODS = ('KCLA', 'FullLayerAttention', 'MRLALight')


def build(host: str, method: str) -> nn.Module:
    kw = dict(stem_channels=8) if host == 'mmseg' else {}
    torch.manual_seed(0)
    model = HOSTS[host](depth=18, base_channels=8, head_dim=8, norm_eval=False,
                        norm_cfg=dict(type='GN', num_groups=4), layer_attn=dict(type=method),
                        **kw)
    model.init_weights()
    return model.double().train()


def loss_of(outs) -> torch.Tensor:
    """Mean over samples (and elements) of every stage output: batch-size independent."""
    return sum(o.square().mean() for o in outs)


def grads(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Gradients by name; ``None`` for a parameter that received none."""
    return {n: None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()}


def ddp_two_steps(model: nn.Module, x: torch.Tensor) -> Dict[str, torch.Tensor]:
    ddp = DDP(model, find_unused_parameters=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    first = None
    for _ in range(2):
        opt.zero_grad()
        loss_of(ddp(x)).backward()
        first = grads(model) if first is None else first
        opt.step()
    return first


def main(out_file: str) -> None:
    dist.init_process_group('gloo')
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(1)
    batch = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    results = {}
    for host in HOSTS:
        for method in METHODS:
            ddp_grads = ddp_two_steps(build(host, method), batch[rank:rank + 1])
            if rank == 0:
                single = build(host, method)
                loss_of(single(batch)).backward()
                ref = grads(single)
                results[f'{host}/{method}'] = dict(
                    without_grad=[n for n in ref if ref[n] is None or ddp_grads[n] is None],
                    max_abs_diff=max((ddp_grads[n] - g).abs().max().item()
                                     for n, g in ref.items() if g is not None),
                    max_abs_grad=max(g.abs().max().item() for g in ref.values()
                                     if g is not None),
                    num_params=len(ref))
    control = build('mmdet', 'KCLA')
    control.unused = nn.Parameter(torch.zeros(1, dtype=torch.float64))
    try:
        ddp_two_steps(control, batch[rank:rank + 1])
        control_error = None
    except RuntimeError as e:
        control_error = str(e).splitlines()[0]
    if rank == 0:
        with open(out_file, 'w') as f:
            json.dump(dict(results=results, world_size=dist.get_world_size(),
                           control_error=control_error), f, indent=1)
    shutdown_distributed()  # destroy and let the gloo workers finish before exit


if __name__ == '__main__':
    main(sys.argv[1])

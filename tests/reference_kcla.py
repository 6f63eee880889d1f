"""An independent re-statement of the KCLA reference model, for tests only.

Written from ``docs/method.md`` sections 4, 5 and 8 with the
reference's raw sums ``u`` and ``z`` and the reference's module names, so that
it serves both as the numerical reference for the operator and as the source
of synthetic reference checkpoints for the converter.
"""
import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

#: kcla_mm operator attribute -> reference attribute
OURS_TO_REF = {'wq': 'Wq', 'wk': 'Wk', 'wv': 'Wv', 'norm': 'bn_attention', 'phi': 'head_att',
               'adjust': 'adjust_channel', 'wk_u': 'u_Wk', 'norm_u': 'u_bn'}


def eca_k(c: int) -> int:
    t = int(abs((math.log2(c) + 1) / 2))
    return t if t % 2 else t + 1


def seq(num_heads: int, dtype=torch.float64) -> torch.Tensor:
    lo, hi = 0.7, 1 / 0.7
    if num_heads == 1:
        return torch.tensor([lo], dtype=dtype)
    step = (math.log(hi) - math.log(lo)) / (num_heads - 1)
    return torch.tensor([math.exp(math.log(lo) + g * step) for g in range(num_heads)],
                        dtype=dtype)


def reference_step(m, x, uz, renorm: bool, head_dim: int, clamp=10.0, eps=1e-3):
    """One block of the reference: returns ``(x + o, (u, z))``.

    ``m`` has the reference attributes (Wq, Wk, Wv, bn_attention, head_att and,
    for init layers, adjust_channel, u_Wk, u_bn; adjust_channel may be None).
    """
    b, c, h, w = x.shape
    d = head_dim
    g = c // d
    s = seq(g).to(x.dtype)
    if uz is not None and renorm:
        u, z = uz
        ubar = (u / z).reshape(b, -1, u.shape[-2], u.shape[-1])  # no epsilon
        if ubar.shape[1] != c or ubar.shape[-1] != w:
            ubar = m.adjust_channel(ubar)
        ubar = m.u_bn(ubar)
        ku = m.u_Wk(ubar.mean((2, 3))[:, None]).view(b, g, d)
        zz = torch.exp(torch.clamp(ku.norm(dim=-1) * s, max=clamp))[..., None, None, None]
        uz = (ubar.view(b, g, d, h, w) * zz, zz)
    p = x.mean((2, 3))[:, None]  # [B, 1, C]
    q = m.Wq(p).view(b, g, d)
    k = m.Wk(p).view(b, g, d)
    n = k.norm(dim=-1)
    logit = n * s if clamp is None else torch.clamp(n * s, max=clamp)
    wgt = torch.exp(logit)[..., None, None, None]  # [B, G, 1, 1, 1]
    xg = x.view(b, g, d, h, w)
    u, z = (wgt * xg, wgt) if uz is None else (uz[0] + wgt * xg, uz[1] + wgt)
    v = m.Wv((u / (z + eps)).view(b, c, h, w))
    a = torch.sigmoid(m.head_att((q * k).sum(-1) / n))  # [B, G]
    o = F.relu(m.bn_attention((a[..., None, None, None] * v.view(b, g, d, h, w))
                              .view(b, c, h, w)))
    return x + o, (u, z)


def as_reference(layer) -> SimpleNamespace:
    """View a kcla_mm ``KCLA`` module through the reference attribute names."""
    return SimpleNamespace(**{ref: getattr(layer, ours) for ours, ref in OURS_TO_REF.items()})


class RefAttention(nn.Module):
    """A reference KCLA layer with the reference parameter names and shapes."""

    def __init__(self, c: int, head_dim: int, init: bool):
        super().__init__()
        g = c // head_dim
        k = eca_k(c)
        self.Wq = nn.Conv1d(1, 1, k, padding=(k - 1) // 2, bias=False)
        self.Wk = nn.Conv1d(1, 1, k, padding=(k - 1) // 2, bias=False)
        self.Wv = nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False)
        self.bn_attention = nn.BatchNorm2d(c)
        self.head_att = nn.Linear(g, g, bias=False)
        self.norm_d = nn.Parameter(seq(g, torch.float32).view(1, g, 1, 1, 1),
                                   requires_grad=False)
        if init:
            self.adjust_channel = nn.Conv2d(c // 2, c, 1, stride=2, groups=g, bias=False)
            self.u_Wk = nn.Conv1d(1, 1, k, padding=(k - 1) // 2, bias=False)
            self.u_bn = nn.BatchNorm2d(c)


class RefStage(nn.Module):

    def __init__(self, blocks, attentions):
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.attention = nn.ModuleList(attentions)


class RefKCLAResNet(nn.Module):
    """The reference KCLA-ResNet layout (section 8) built from host blocks.

    ``host`` is a plain host ResNet (``layer_attn=None``) whose stem and blocks
    are reused; the reference adds ``fc`` and the attention layers.
    """

    def __init__(self, host, head_dim: int, renorm_blocks=(0, 11), num_classes=1000):
        super().__init__()
        self.conv1, self.bn1, self.relu, self.maxpool = host.conv1, host.norm1, host.relu, \
            host.maxpool
        self.head_dim = head_dim
        self.renorm_blocks = renorm_blocks
        widths = []
        for s, name in enumerate(host.res_layers):
            blocks = list(getattr(host, name))
            c = blocks[0].conv3.out_channels if hasattr(blocks[0], 'conv3') \
                else blocks[0].conv2.out_channels
            widths.append(c)
            atts = [RefAttention(c, head_dim, init=(i in renorm_blocks))
                    for i in range(len(blocks))]
            self.add_module(f'layer{s + 1}', RefStage(blocks, atts))
        self.fc = nn.Linear(widths[-1], num_classes)
        self.num_stages = len(widths)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        uz, outs = None, []
        for s in range(self.num_stages):
            stage = getattr(self, f'layer{s + 1}')
            for i, (block, att) in enumerate(zip(stage.layers, stage.attention)):
                x = block(x)
                x, uz = reference_step(att, x, uz, renorm=(i in self.renorm_blocks),
                                       head_dim=self.head_dim)
            outs.append(x)
        return tuple(outs)

    def logits(self, x):
        """The reference classifier's scores before the softmax: ``fc`` of the last
        stage's features averaged over all positions."""
        return self.fc(self.forward(x)[-1].mean((2, 3)))

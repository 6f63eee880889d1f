"""kcla_mm.analysis on tiny backbones: key correlation, effective layer weights, checkpoints."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from utils import randomize_norms

from kcla_mm import analysis as A
from kcla_mm.models.backbones import KCLAResNet

pytestmark = pytest.mark.usefixtures('one_thread')


def tiny(method='KCLA', depth=18, seed=0, **kw):
    """BasicBlock stages of 8..64 channels, heads of 8: 1, 2, 4, 8 heads per stage."""
    torch.manual_seed(seed)
    model = KCLAResNet(depth=depth, base_channels=8, head_dim=8,
                       layer_attn=None if method is None else dict(type=method), **kw)
    randomize_norms(model, seed)
    return model.eval()


def images(n=2, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(2, 3, size, size, generator=g) for _ in range(n)]


def block_outputs(model, x):
    """Each block's output x_t (the input of its layer-attention module), by a manual forward."""
    outs = []
    with torch.no_grad():
        h = model._stem(x)
        state = None
        for name in model.res_layers:
            for block, attn in zip(getattr(model, name), getattr(model, f'{name}_attn')):
                h = block(h)
                outs.append(h)
                h, state = attn(h, state)
    return outs


def direct_key(attn, x):
    """k = Wk(GAP(x)) per head, written out: [B, G, d]."""
    p = x.mean((2, 3)).unsqueeze(1)  # [B, 1, C]
    k = F.conv1d(p, attn.wk.weight, padding=attn.wk.padding)
    return k.view(x.shape[0], attn.num_heads, attn.head_dim)


@pytest.mark.parametrize('method', A.METHODS)
def test_key_matrix_symmetric_with_unit_diagonal(method):
    blocks, keys = A.collect_keys(tiny(method), images())
    m = A.key_cosine_matrix(keys)
    assert m.shape == (8, 8) and len(blocks) == 8
    np.testing.assert_allclose(m, m.T, atol=1e-12)
    np.testing.assert_allclose(np.diag(m), 1.0, atol=1e-6)
    assert np.all(np.abs(m) <= 1 + 1e-9)


def test_key_matrix_matches_direct_computation():
    model = tiny('KCLA')
    batches = images()
    _, keys = A.collect_keys(model, batches)
    # Keys by hand, from a manual forward.
    direct = [[] for _ in range(8)]
    for x in batches:
        for t, (h, attn) in enumerate(zip(block_outputs(model, x), model.layer_attn_modules())):
            direct[t].append(direct_key(attn, h))
    direct = [torch.cat(d) for d in direct]
    for a, b in zip(keys, direct):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Cosine by hand: head g of the block with more heads vs head g * G_few // G_many.
    expected = np.zeros((8, 8))
    for i in range(8):
        for j in range(8):
            many, few = (direct[i], direct[j]) if direct[i].shape[1] >= direct[j].shape[1] \
                else (direct[j], direct[i])
            vals = [F.cosine_similarity(many[n, g], few[n, g * few.shape[1] // many.shape[1]],
                                        dim=0).item()
                    for n in range(many.shape[0]) for g in range(many.shape[1])]
            expected[i, j] = np.mean(vals)
    np.testing.assert_allclose(A.key_cosine_matrix(keys), expected, atol=1e-5)


def test_collinear_keys_have_cosine_one():
    # Keys that are positive multiples of one direction per head (``docs/method.md``, section 3).
    u = torch.randn(1, 2, 8)
    keys = [u * s for s in (0.5, 1.0, 3.0)]
    np.testing.assert_allclose(A.key_cosine_matrix(keys), 1.0, atol=1e-12)
    assert A.key_cosine(u, -u) == pytest.approx(-1.0)


@pytest.mark.parametrize('to, frm', [(4, 2), (2, 4), (3, 3), (3, 2), (8, 1)])
def test_head_overlap_rows_sum_to_one(to, frm):
    m = A.head_overlap(to, frm)
    torch.testing.assert_close(m.sum(1), torch.ones(to, dtype=torch.float64))
    if to % frm == 0:  # a wider stage: head g lies in head g * frm // to
        assert torch.equal(m, F.one_hot(torch.arange(to) * frm // to, frm).double())


def test_correlation_summary_within_and_across():
    blocks = [A.BlockInfo(i, s, b, 8, 1, 8) for i, (s, b) in enumerate([(0, 0), (0, 1), (1, 0)])]
    m = np.array([[1.0, 0.8, 0.1], [0.8, 1.0, 0.3], [0.1, 0.3, 1.0]])
    s = A.correlation_summary(m, blocks)
    assert s['within_stage'] == {'layer1': pytest.approx(0.8), 'layer2': None}
    assert s['within'] == pytest.approx(0.8) and s['across'] == pytest.approx(0.2)
    assert 'layer2 n/a' in A.summary_line(s)


def test_plain_resnet_is_refused():
    # A plain ResNet has no keys: the error says how to get them.
    with pytest.raises(ValueError, match='layer_attn'):
        A.collect_keys(tiny(None), images(1))


def _kcla_logits(model, x):
    """Explicit logits min(|k|/tau, clamp), pseudo-layer logits, and the module's log z."""
    logits, pseudo, log_z = [], [], []
    state = None
    with torch.no_grad():
        for h, attn in zip(block_outputs(model, x), model.layer_attn_modules()):
            k = direct_key(attn, h)
            tau = 1 / attn.inv_tau.float()
            logits.append((k.norm(dim=-1) / tau).clamp(max=attn.clamp))
            pseudo.append(attn.renormalize(state, h).log_z if attn.renorm and state is not None
                          else None)
            _, state = attn(h, state)
            log_z.append(state.log_z)
    return logits, pseudo, log_z


def test_kcla_weights_sum_to_one_and_equal_an_explicit_softmax():
    model = tiny('KCLA', depth=50)  # stages of 3, 4, 6, 3 blocks
    x = images(1)[0]
    result = A.layer_weights(model, [x])
    stages = [b.stage for b in result.blocks]
    for t, w in enumerate(result.per_head):
        np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-9)  # rows sum to 1, every head
        assert np.all(w[:, t + 1:] == 0)
    logits, pseudo, log_z = _kcla_logits(model, x)
    weights, _ = A.kcla_layer_weights(logits, pseudo)
    # Stage 1: the softmax over the key-norm logits of blocks 0..t.
    for t in range(3):
        explicit = torch.softmax(torch.stack(logits[:t + 1], -1).double(), -1)  # [B, G, t+1]
        torch.testing.assert_close(weights[t][..., :t + 1], explicit)
    # Stage 2 (init layer at block 3): softmax over [pseudo-layer, blocks 3..t]; the pseudo
    # layer's share is split over blocks 0..2 as their weights at block 2, head g <- g // 2.
    before = weights[2]  # [B, G_old, T]
    heads = torch.arange(weights[3].shape[1]) * before.shape[1] // weights[3].shape[1]
    for t in range(3, 7):
        z = torch.stack([pseudo[3]] + logits[3:t + 1], -1).double()
        explicit = torch.softmax(z, -1)  # [B, G, 1 + t - 2]
        torch.testing.assert_close(weights[t][..., 3:t + 1], explicit[..., 1:])
        torch.testing.assert_close(weights[t][..., :3],
                                   explicit[..., :1] * before[:, heads, :3])
    # The recurrence reproduces the operator's own normaliser log z.
    z_ref = [pseudo[3]]
    for t in range(3, 7):
        z_ref.append(torch.logaddexp(z_ref[-1], logits[t]))
        torch.testing.assert_close(z_ref[-1], log_z[t], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result.matrix, np.stack([w.mean((0, 1)) for w in weights]),
                               atol=1e-6)
    assert stages.count(2) == 6 and result.through_pseudo[0] == 0
    assert 0 < result.through_pseudo[3] < 1


def test_kcla_weights_reject_a_state_of_other_width():
    # Only an init layer adapts the number of heads.
    with pytest.raises(ValueError, match='init layer'):
        A.kcla_layer_weights([torch.zeros(1, 1), torch.zeros(1, 2)], [None, None])


def test_full_attention_weights_restart_per_stage():
    model = tiny('FullLayerAttention', depth=50)
    x = images(1)[0]
    result = A.layer_weights(model, [x])
    m = result.matrix
    np.testing.assert_allclose(m.sum(1), 1.0, atol=1e-9)
    assert np.all(m[3:, :3] == 0)  # stage 2 onwards never sees stage 1
    outs = block_outputs(model, x)
    mods = model.layer_attn_modules()
    t = 5  # layer2.2: softmax over layer2.0 .. layer2.2
    q = F.conv1d(outs[t].mean((2, 3)).unsqueeze(1), mods[t].wq.weight,
                 padding=mods[t].wq.padding).view(x.shape[0], -1, 8)
    ks = torch.stack([direct_key(mods[s], outs[s]) for s in range(3, 6)], -1)  # [B, G, d, 3]
    explicit = torch.softmax(torch.einsum('bgd,bgdt->bgt', q, ks) / math.sqrt(8), -1)
    np.testing.assert_allclose(result.per_head[t][:, 3:6], explicit.mean(0).detach().numpy(),
                               atol=1e-5)


def test_mrla_weights_are_gate_times_product_of_lambdas():
    model = tiny('MRLALight', depth=50)
    mods = model.layer_attn_modules()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in mods:
            if m.lambda_t is not None:
                m.lambda_t.copy_(torch.rand(m.lambda_t.shape, generator=g) * 1.6 - 0.8)
    x = images(1)[0]
    result = A.layer_weights(model, [x])
    outs = block_outputs(model, x)
    gates = []
    with torch.no_grad():
        for h, m in zip(outs, mods):
            q, k = m.keys(h)
            gates.append(torch.sigmoid((q * k).sum(-1) / math.sqrt(8)))  # [B, G]
    t = 12  # layer3.5; its stage starts at block 7
    for s in range(16):
        if not 7 <= s <= t:
            assert np.all(result.per_head[t][:, s] == 0)
            continue
        lam = torch.ones(mods[t].channels)
        for r in range(s + 1, t + 1):
            lam = lam * mods[r].lambda_t.detach().flatten()
        coef = lam.abs() * gates[s].repeat_interleave(8, dim=1)  # [B, C]
        expected = coef.view(x.shape[0], -1, 8).mean((0, 2))  # per head, over images
        np.testing.assert_allclose(result.per_head[t][:, s], expected.numpy(), rtol=1e-5)


def test_mrla_weights_decay_exponentially_with_constant_lambda():
    gates = [torch.ones(1, 1) for _ in range(5)]
    lambdas = [None] + [torch.full((8, ), 0.5)] * 4
    w = A.mrla_layer_weights(gates, lambdas, 8)[-1][0, 0]
    torch.testing.assert_close(w, torch.tensor([1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0],
                                               dtype=torch.float64))


def test_compare_state_dicts_names_keys_and_shapes():
    model = {'a': torch.zeros(2), 'b': torch.zeros(3), 'layer1_attn.0.wk.weight': torch.zeros(1)}
    ckpt = {'a': torch.zeros(2), 'b': torch.zeros(4), 'c': torch.zeros(1)}
    mm = A.compare_state_dicts(model, ckpt)
    assert mm.missing == ['layer1_attn.0.wk.weight'] and mm.unexpected == ['c']
    assert mm.shapes == [('b', (4, ), (3, ))]
    text = mm.describe()
    assert 'b: (4,) vs (3,)' in text and 'layer1_attn.0.wk.weight' in text and 'hint' in text
    assert not A.compare_state_dicts(model, dict(model))


def test_unwrap_state_dict_strips_wrappers():
    sd = A.unwrap_state_dict({'state_dict': {'module.x': torch.zeros(1)}, 'meta': {}})
    assert list(sd) == ['x']
    with pytest.raises(ValueError, match='not a checkpoint'):
        A.unwrap_state_dict([1, 2])


def test_complexity_breakdown_separates_layer_attention():
    model = tiny('KCLA')
    with torch.no_grad():
        flops = A.flop_analyzer(model, (torch.rand(1, 3, 32, 32), )).by_module()
    rows = {r['part'].strip(): r for r in A.complexity_breakdown(model, flops, backbone='')}
    attn = rows['backbone: layer attention']
    assert attn['params'] == sum(p.numel() for n, p in model.named_parameters() if '_attn.' in n)
    assert attn['params'] == sum(rows[f'layer{s}_attn']['params'] for s in range(1, 5))
    assert 0 < attn['flops'] < rows['backbone']['flops']
    assert rows['backbone']['params'] == sum(p.numel() for p in model.parameters())
    assert rows['backbone without layer attention']['flops'] == (rows['backbone']['flops']
                                                                 - attn['flops'])


def test_elementwise_flops_count_the_full_attention_aggregation():
    # FullLayerAttention aggregates with mul/add only: invisible to mmengine's default count.
    model = tiny('FullLayerAttention')
    x = (torch.rand(1, 3, 32, 32), )
    with torch.no_grad():
        with_ew = A.flop_analyzer(model, x).total('layer1_attn.1')
        without = A.flop_analyzer(model, x, elementwise=False).total('layer1_attn.1')
    assert with_ew > without


def test_plots_are_written(tmp_path):
    model = tiny('KCLA')
    blocks, keys = A.collect_keys(model, images(1))
    path = tmp_path / 'kc.png'
    A.plot_key_correlation(A.key_cosine_matrix(keys), blocks, str(path), 'title')
    results = [A.layer_weights(tiny(m), images(1)) for m in A.METHODS]
    path2 = tmp_path / 'lw.png'
    A.plot_layer_weights(results, str(path2), 'title')
    for p in (path, path2):
        data = p.read_bytes()
        assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 5000


def test_kcla_renorm_inside_a_long_stage_starts_a_new_segment():
    # ResNet-101's stage 3 re-normalises at block 11 too (renorm_blocks=(0, 11)).
    model = tiny('KCLA', depth=101)
    result = A.layer_weights(model, images(1, size=32))
    names = [b.name for b in result.blocks]
    r = names.index('layer3.11')
    np.testing.assert_allclose(result.matrix.sum(1), 1.0, atol=1e-9)
    # From layer3.11 on, everything before it arrives through the new pseudo-layer.
    np.testing.assert_allclose(result.through_pseudo[r:names.index('layer4.0')],
                               result.matrix[r:names.index('layer4.0'), :r].sum(1), atol=1e-9)
    assert result.through_pseudo[r - 1] < result.matrix[r - 1, :r - 1].sum()


def test_kcla_state_update_counts_the_same_in_place(monkeypatch):
    # inference writes the new state in place (lerp_): the same FLOPs as lerp
    from kcla_mm.ops import KCLA
    model = tiny('KCLA')
    x = (torch.rand(1, 3, 32, 32), )
    with torch.no_grad():
        model(*x)  # fills the cached eval BN fold, so both counts skip it
        in_place = A.flop_analyzer(model, x).total('layer1_attn.1')
        forward = KCLA.forward
        monkeypatch.setattr(KCLA, 'forward', lambda self, x, state=None, **reuse:
                            forward(self, x, state))
        allocating = A.flop_analyzer(model, x).total('layer1_attn.1')
    assert in_place == allocating > 0

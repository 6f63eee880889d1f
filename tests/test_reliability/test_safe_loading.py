"""A malicious checkpoint is refused on every path kcla_mm loads one, and nothing runs.

The file pickles an object whose ``__reduce__`` calls ``os.system('touch
MARKER')``. Each path (``tools/test.py CONFIG evil.pth``, ``load_from`` and
``--resume`` of ``tools/train.py``, ``init_cfg=dict(type='Pretrained')`` of a
KCLAResNet built in either scope) must raise :class:`UnsafeCheckpointError`
naming ``os.system`` and the opt-in, and the marker must not exist. What
mmengine itself writes (an empty message-hub buffer, builtin values such as
``bytes`` and ``frozenset``) loads.
"""
import os

import pytest
import torch
from mmengine.registry import init_default_scope
from reliability_utils import (TEST, TRAIN, run_script, write_evil_checkpoint, write_seg_config,
                               write_seg_data)

import kcla_mm.host_fixes  # noqa: F401  (the safe loader, as the configs and tools import it)
from kcla_mm.utils.checkpoint import TRUST_ENV, UnsafeCheckpointError

REFUSAL = r'(posix|os)\.system'


@pytest.fixture
def evil(tmp_path, monkeypatch):
    """``(checkpoint path, marker path)``; the opt-in is off."""
    monkeypatch.delenv(TRUST_ENV, raising=False)
    marker = tmp_path / 'pwned'
    return write_evil_checkpoint(str(tmp_path / 'evil.pth'), str(marker)), marker


def assert_refused(excinfo, marker) -> None:
    assert TRUST_ENV in str(excinfo.value) and '--trust-checkpoint' in str(excinfo.value)
    assert not marker.exists(), 'the pickled command ran'


@pytest.fixture
def seg_config(tmp_path):
    data = write_seg_data(str(tmp_path / 'data'))
    return write_seg_config(str(tmp_path / 'tiny_unet.py'), data)


@pytest.mark.slow
@pytest.mark.parametrize('tool, args', [
    (TEST, lambda ckpt: [ckpt]),
    (TRAIN, lambda ckpt: ['--cfg-options', f'load_from={ckpt}']),
    (TRAIN, lambda ckpt: ['--resume', ckpt]),
], ids=['test.py CONFIG CKPT', 'train.py load_from', 'train.py --resume'])
def test_tools_refuse_a_malicious_checkpoint(tmp_path, monkeypatch, evil, seg_config, tool, args):
    ckpt, marker = evil
    monkeypatch.setenv('LOCAL_RANK', '0')  # the tools set it; keep it local to the test
    argv = [seg_config, '--work-dir', str(tmp_path / 'work')] + args(ckpt)
    with pytest.raises(UnsafeCheckpointError, match=REFUSAL) as e:
        run_script(tool, argv, monkeypatch)
    assert_refused(e, marker)


def _backbone_cfg(scope: str, checkpoint: str, prefix=None) -> dict:
    init_cfg = dict(type='Pretrained', checkpoint=checkpoint)
    if prefix is not None:
        init_cfg['prefix'] = prefix
    cfg = dict(type='KCLAResNet', depth=18, base_channels=8, head_dim=8, init_cfg=init_cfg)
    if scope == 'mmseg':
        cfg['stem_channels'] = 8
    return cfg


@pytest.mark.parametrize('prefix', [None, 'backbone.'],
                         ids=['reference-layout probe', 'mmengine PretrainedInit'])
@pytest.mark.parametrize('scope', ['mmdet', 'mmseg'])
def test_pretrained_init_cfg_refuses_a_malicious_checkpoint(evil, scope, prefix):
    ckpt, marker = evil
    init_default_scope(scope)
    from mmengine.registry import MODELS
    backbone = MODELS.build(_backbone_cfg(scope, ckpt, prefix))  # building loads nothing
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match=REFUSAL) as e:
        backbone.init_weights()
    assert_refused(e, marker)


def test_trusting_the_file_is_what_runs_it(evil, monkeypatch):
    # The refusal is the only thing standing between the file and the shell:
    # with the opt-in the same load runs the payload (so the tests above can fail).
    ckpt, marker = evil
    init_default_scope('mmdet')
    from mmengine.registry import MODELS
    backbone = MODELS.build(_backbone_cfg('mmdet', ckpt, 'backbone.'))
    monkeypatch.setenv(TRUST_ENV, '1')
    with pytest.raises(Exception):  # the payload is no state dict
        backbone.init_weights()
    assert marker.exists()


def test_a_history_buffer_that_was_never_updated_loads(tmp_path):
    # its empty history pickles b'' as bytes(): refused before bytes was allowed
    from mmengine.logging import HistoryBuffer, MessageHub
    from mmengine.runner.checkpoint import save_checkpoint

    from kcla_mm.utils.checkpoint import safe_load
    hub = MessageHub('kcla_test_empty_buffer')
    hub.load_state_dict(dict(log_scalars={'train/registered': HistoryBuffer()}, runtime_info={},
                             resumed_keys={'train/registered': True}))
    path = str(tmp_path / 'iter_1.pth')
    save_checkpoint({'meta': {}, 'message_hub': hub.state_dict()}, path)
    buf = safe_load(path)['message_hub']['log_scalars']['train/registered']
    assert isinstance(buf, HistoryBuffer) and buf.data[0].size == 0


HARMLESS = {'bytes': b'\x00\xffraw', 'empty bytes': b'', 'bytearray': bytearray(b'ab'),
            'set': {1, 'a'}, 'frozenset': frozenset({2.5}), 'complex': 1 - 2j,
            'range': range(3, 9, 2), 'slice': slice(1, None, 2)}


@pytest.mark.parametrize('name', list(HARMLESS))
def test_harmless_builtin_values_load(tmp_path, name):
    from kcla_mm.utils.checkpoint import safe_load
    path = tmp_path / 'values.pth'
    torch.save({'meta': {name: HARMLESS[name]}}, path)
    assert safe_load(str(path))['meta'][name] == HARMLESS[name]


def test_the_allow_list_holds_only_value_types_and_named_rebuilders():
    # nothing on the list can run code: classes whose constructors build values,
    # numpy's array and scalar rebuilders, and the restricted getattr
    import numpy as np

    from kcla_mm.utils.checkpoint import _history_buffer_method, allowed_globals
    functions = {f.__qualname__ for f in allowed_globals() if not isinstance(f, type)
                 and not isinstance(f, tuple)}
    assert functions <= {'_reconstruct', 'scalar'}
    assert [f for f in allowed_globals() if isinstance(f, tuple)] == [
        (_history_buffer_method, 'builtins.getattr')]
    modules = {f.__module__.split('.')[0] for f in allowed_globals() if isinstance(f, type)}
    assert modules <= {'builtins', 'collections', 'numpy', 'mmengine'}, modules
    assert not {eval, exec, getattr, setattr, os.system, __import__, type, object} & set(
        f for f in allowed_globals() if not isinstance(f, tuple))
    assert np.ndarray in allowed_globals()

"""Safe checkpoint loading: mmengine's own checkpoints load, pickled code never runs."""
import os

import numpy as np
import pytest
import torch
from mmengine.logging import MessageHub
from mmengine.runner.checkpoint import CheckpointLoader, load_checkpoint, save_checkpoint
from torch import nn

import kcla_mm.host_fixes  # noqa: F401  (the safe loader)
from kcla_mm.utils.checkpoint import TRUST_ENV, UnsafeCheckpointError, safe_load


class Evil:
    """Unpickling this runs a shell command (creates a marker file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f'touch {self.marker}', ))


def mmengine_checkpoint(path):
    hub = MessageHub.get_instance('kcla_test_hub')
    for i in range(3):
        hub.update_scalar('train/loss', float(i))
    hub.update_info('iter', 3)
    ckpt = {
        'meta': {'epoch': 1, 'iter': 3, 'seed': np.int64(7), 'mean': np.array([1.0, 2.0]),
                 'dtype': np.dtype('float32'), 'dataset_meta': {'classes': ('a', 'b')}},
        'state_dict': nn.Linear(2, 2).state_dict(),
        'message_hub': hub.state_dict(),
        'optimizer': torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1).state_dict(),
    }
    save_checkpoint(ckpt, str(path))
    return ckpt


def test_mmengine_checkpoints_load_with_weights_only(tmp_path):
    path = tmp_path / 'epoch_1.pth'
    ref = mmengine_checkpoint(path)
    with pytest.raises(Exception):  # plain torch.load (weights_only=True) refuses them
        torch.load(path)
    got = CheckpointLoader.load_checkpoint(str(path), map_location='cpu')
    assert got['meta']['seed'] == 7 and got['meta']['mean'].tolist() == [1.0, 2.0]
    assert got['message_hub']['log_scalars']['train/loss'].current() == 2.0
    torch.testing.assert_close(got['state_dict']['weight'], ref['state_dict']['weight'])
    model = nn.Linear(2, 2)
    load_checkpoint(model, str(path))
    torch.testing.assert_close(model.weight, ref['state_dict']['weight'])


@pytest.mark.parametrize('via', ['safe_load', 'mmengine'])
def test_malicious_checkpoint_is_refused_and_nothing_runs(tmp_path, via, monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    marker = tmp_path / 'pwned'
    path = tmp_path / 'evil.pth'
    torch.save({'state_dict': {}, 'payload': Evil(marker)}, path)
    with pytest.raises(UnsafeCheckpointError, match='posix.system|os.system') as e:
        if via == 'safe_load':
            safe_load(str(path))
        else:
            load_checkpoint(nn.Linear(2, 2), str(path))
    assert TRUST_ENV in str(e.value)
    assert not marker.exists()


def test_trust_flag_opts_in(tmp_path, monkeypatch):
    path = tmp_path / 'custom.pth'

    class Custom:  # a harmless non-allow-listed type
        pass

    torch.save({'x': torch.ones(1), 'obj': Custom.__name__}, path)
    assert safe_load(str(path))['x'].item() == 1.0
    torch.save({'x': torch.ones(1), 'obj': nn.Linear(1, 1)}, path)
    with pytest.raises(UnsafeCheckpointError, match='torch.nn.modules.linear.Linear'):
        safe_load(str(path))
    monkeypatch.setenv(TRUST_ENV, '1')
    assert isinstance(safe_load(str(path))['obj'], nn.Linear)

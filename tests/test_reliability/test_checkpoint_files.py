"""Checkpoint files: saving is atomic, partial files are refused with a clear error.

mmengine 0.10.7 writes a checkpoint in place (``LocalBackend.put`` opens the
final name with ``'wb'``); :mod:`kcla_mm.host_fixes` registers a local
backend that writes a temporary file, fsyncs it and renames it. A crash at
any point of a save leaves the final name with either the previous complete
file or the new complete one; a failed write names the file.
"""
import errno
import os
import os.path as osp
import pickle
import stat

import pytest
import torch
from mmengine.fileio import get_file_backend
from mmengine.fileio.backends import local_backend, prefix_to_backends
from mmengine.fileio.backends.local_backend import LocalBackend
from mmengine.logging.history_buffer import HistoryBuffer
from mmengine.runner.checkpoint import load_checkpoint, save_checkpoint
from reliability_utils import TRAIN, run_script, write_seg_config, write_seg_data
from torch import nn

import kcla_mm.host_fixes  # noqa: F401  (the safe loader and the atomic save)
from kcla_mm.utils.checkpoint import (CorruptCheckpointError, UnsafeCheckpointError,
                                      atomic_write_bytes, safe_load)


class SimulatedCrash(BaseException):
    """Stands for the process dying (not an ``Exception``: nothing may swallow it)."""


def checkpoint(value: float) -> dict:
    model = nn.Linear(3, 2)
    nn.init.constant_(model.weight, value)
    return {'meta': {'iter': int(value)}, 'state_dict': model.state_dict()}


def half_writing_file(real_file, error=SimulatedCrash):
    """A file object whose ``write`` writes half of the bytes, then raises ``error``."""

    class HalfWriter:

        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(bytes(data[:len(data) // 2]))
            self.f.flush()
            raise error

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    return HalfWriter(real_file)


def test_mmengine_alone_writes_in_place_and_a_crash_destroys_the_old_file(tmp_path, monkeypatch):
    # The reason for the atomic backend: mmengine's own put, crashing mid-write.
    path = str(tmp_path / 'iter_10.pth')
    save_checkpoint(checkpoint(1.0), path)
    monkeypatch.setitem(prefix_to_backends, '', LocalBackend)
    monkeypatch.setattr(local_backend, 'open',
                        lambda *a, **k: half_writing_file(open(*a, **k)), raising=False)
    with pytest.raises(SimulatedCrash):
        save_checkpoint(checkpoint(2.0), path)
    with pytest.raises(CorruptCheckpointError, match='iter_10.pth'):
        safe_load(path)


def _crash_in_write(monkeypatch):
    real = os.fdopen
    monkeypatch.setattr(os, 'fdopen', lambda *a, **k: half_writing_file(real(*a, **k)))


def _crash_in(name):

    def crash(monkeypatch):
        def boom(*args, **kwargs):
            raise SimulatedCrash

        monkeypatch.setattr(os, name, boom)

    return crash


@pytest.mark.parametrize('crash', [_crash_in_write, _crash_in('fsync'), _crash_in('replace')],
                         ids=['mid-write', 'in-fsync', 'before-rename'])
def test_a_crash_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, crash):
    path = tmp_path / 'iter_10.pth'
    save_checkpoint(checkpoint(1.0), str(path))
    crash(monkeypatch)
    with pytest.raises(SimulatedCrash):
        save_checkpoint(checkpoint(2.0), str(path))
    monkeypatch.undo()
    assert safe_load(str(path))['meta']['iter'] == 1  # the old file, complete
    assert os.listdir(tmp_path) == ['iter_10.pth']  # no temporary file left behind


def disk_full_when_writing(monkeypatch, name: str) -> None:
    """Writes of files whose path contains ``name`` fail half-way with ENOSPC."""
    real = os.fdopen

    def fdopen(fd, *args, **kwargs):
        f = real(fd, *args, **kwargs)
        if name in os.readlink(f'/proc/self/fd/{fd}'):
            return half_writing_file(f, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        return f

    monkeypatch.setattr(os, 'fdopen', fdopen)


@pytest.mark.skipif(not osp.isdir('/proc/self/fd'), reason='finds the file of an fd in /proc')
def test_a_full_disk_during_a_save_names_the_file_and_keeps_the_previous_one(
        tmp_path, monkeypatch):
    path = tmp_path / 'iter_10.pth'
    save_checkpoint(checkpoint(1.0), str(path))
    disk_full_when_writing(monkeypatch, 'iter_10.pth')
    with pytest.raises(OSError) as e:
        save_checkpoint(checkpoint(2.0), str(path))
    assert e.value.errno == errno.ENOSPC  # still the disk's error
    assert f'could not write {osp.realpath(path)} (No space left on device)' in str(e.value)
    assert 'the previous file under that name is unchanged' in str(e.value)
    monkeypatch.undo()
    assert safe_load(str(path))['meta']['iter'] == 1
    assert os.listdir(tmp_path) == ['iter_10.pth']


@pytest.mark.slow
@pytest.mark.skipif(not osp.isdir('/proc/self/fd'), reason='finds the file of an fd in /proc')
def test_a_run_whose_disk_fills_up_names_the_checkpoint_and_resumes(tmp_path, monkeypatch):
    cfg = write_seg_config(str(tmp_path / 'tiny_unet.py'), write_seg_data(str(tmp_path / 'd')),
                           max_iters=4, ckpt_interval=2)
    work = tmp_path / 'work'
    monkeypatch.setenv('LOCAL_RANK', '0')
    with monkeypatch.context() as m:
        disk_full_when_writing(m, 'iter_4.pth')
        with pytest.raises(OSError, match=f'could not write {osp.realpath(work)}/iter_4.pth') as e:
            run_script(TRAIN, [cfg, '--work-dir', str(work)], m)
    assert e.value.errno == errno.ENOSPC
    # the previous checkpoint and the pointer to it are intact, nothing half-written
    assert safe_load(str(work / 'iter_2.pth'))['meta']['iter'] == 2
    assert (work / 'last_checkpoint').read_text().strip().endswith('iter_2.pth')
    assert sorted(p.name for p in work.glob('*.pth')) == ['iter_2.pth']
    assert not list(work.glob('.*tmp*'))
    # once there is space again, --resume continues from it
    run_script(TRAIN, [cfg, '--work-dir', str(work), '--resume'], monkeypatch)
    assert safe_load(str(work / 'iter_4.pth'))['meta']['iter'] == 4


def test_a_crash_during_the_first_save_leaves_no_file(tmp_path, monkeypatch):
    _crash_in_write(monkeypatch)
    with pytest.raises(SimulatedCrash):
        save_checkpoint(checkpoint(2.0), str(tmp_path / 'iter_10.pth'))
    assert os.listdir(tmp_path) == []


def test_atomic_save_writes_the_same_bytes_and_loads(tmp_path):
    path = tmp_path / 'sub' / 'epoch_1.pth'  # the folder is created, as mmengine does
    save_checkpoint(checkpoint(3.0), str(path))
    model = nn.Linear(3, 2)
    load_checkpoint(model, str(path))
    assert torch.equal(model.weight, torch.full((2, 3), 3.0))


def test_permissions_of_new_and_replaced_files(tmp_path):
    new = tmp_path / 'new.pth'
    atomic_write_bytes(b'x', new)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(new).st_mode) == 0o666 & ~umask
    os.chmod(new, 0o640)
    atomic_write_bytes(b'y', new)
    assert stat.S_IMODE(os.stat(new).st_mode) == 0o640 and new.read_bytes() == b'y'


def test_a_symlink_keeps_pointing_at_the_replaced_file(tmp_path):
    target = tmp_path / 'store' / 'iter_2.pth'
    target.parent.mkdir()
    target.write_bytes(b'old')
    link = tmp_path / 'latest.pth'
    link.symlink_to(target)
    get_file_backend(str(link)).put(b'new', link)
    assert link.is_symlink() and target.read_bytes() == b'new'


def test_a_pipe_is_written_in_place(tmp_path):
    fifo = str(tmp_path / 'fifo')
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        get_file_backend(fifo).put(b'through the pipe', fifo)
        assert os.read(reader, 100) == b'through the pipe'
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def _saved_bytes(legacy: bool) -> bytes:
    import io
    buf = io.BytesIO()
    torch.save(checkpoint(1.0), buf, _use_new_zipfile_serialization=not legacy)
    return buf.getvalue()


@pytest.mark.parametrize('legacy', [False, True], ids=['zip', 'legacy'])
@pytest.mark.parametrize('fraction', [0.0, 0.01, 0.5, 0.99])
@pytest.mark.parametrize('trust', [False, True])
def test_a_truncated_checkpoint_is_refused_naming_the_file(tmp_path, legacy, fraction, trust):
    data = _saved_bytes(legacy)
    path = tmp_path / 'iter_4.pth'
    path.write_bytes(data[:int(len(data) * fraction)])
    with pytest.raises(CorruptCheckpointError, match=r'iter_4\.pth is not a complete checkpoint'):
        safe_load(str(path), trust=trust)


def test_a_truncated_checkpoint_is_refused_through_mmengine(tmp_path):
    path = tmp_path / 'iter_4.pth'
    data = _saved_bytes(False)
    path.write_bytes(data[:len(data) - 1])
    with pytest.raises(CorruptCheckpointError, match='iter_4.pth'):
        load_checkpoint(nn.Linear(3, 2), str(path))


def test_a_text_file_is_not_a_checkpoint(tmp_path):
    path = tmp_path / 'notes.pth'
    path.write_text('not a checkpoint')
    with pytest.raises(CorruptCheckpointError, match='notes.pth'):
        safe_load(str(path))


class GetattrEscape:
    """Unpickles to ``getattr(HistoryBuffer, '__init__')``: a step towards ``__globals__``."""

    def __reduce__(self):
        return (getattr, (HistoryBuffer, '__init__'))


def test_only_history_buffer_statistics_are_reachable_through_getattr(tmp_path):
    path = tmp_path / 'escape.pth'
    torch.save({'state_dict': {}, 'x': GetattrEscape()}, path)
    with pytest.raises(UnsafeCheckpointError, match='builtins.getattr'):
        safe_load(str(path))
    buf = HistoryBuffer()
    buf.update(1.0)
    assert b'getattr' in pickle.dumps(buf, protocol=2)  # the form mmengine really writes
    ok = tmp_path / 'hub.pth'
    torch.save({'hub': buf}, ok)
    assert safe_load(str(ok))['hub'].mean() == 1.0

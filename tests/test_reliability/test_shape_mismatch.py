"""A checkpoint whose shapes do not fit the model lists the keys and both shapes.

mmengine (``load_checkpoint``, ``init_cfg=dict(type='Pretrained')``,
``load_from``) warns, listing every mismatched key with the checkpoint's and
the model's shape, and keeps the model's values for them: right for
fine-tuning with a new head. Where every tensor must load (testing, resuming)
:class:`CheckpointShapeCheckHook` turns the mismatch into an error before
anything is loaded; ``tools/test.py`` registers it (``--allow-shape-mismatch``
makes it a warning).
"""
import logging
import re

import pytest
import torch
from mmengine.config import Config
from mmengine.logging import MMLogger
from mmengine.registry import init_default_scope
from mmengine.runner import Runner
from mmengine.runner.checkpoint import load_checkpoint
from reliability_utils import TEST, TRAIN, run_script, write_seg_config, write_seg_data

from kcla_mm.models.backbones import KCLAResNet, KCLAResNetSeg
from kcla_mm.utils.checkpoint import CheckpointShapeError, check_checkpoint_shapes
from kcla_mm.utils.hooks import CheckpointShapeCheckHook

MISMATCH = (r'size mismatch for {key}: copying a param with shape torch.Size\({ckpt}\) from '
            r'checkpoint, the shape in current model is torch.Size\({model}\)')


class Captured(logging.Handler):

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.text = ''

    def emit(self, record: logging.LogRecord) -> None:
        self.text += record.getMessage() + '\n'


@pytest.fixture
def current_log():
    """What mmengine's current logger prints during the test."""
    logger = MMLogger.get_current_instance()
    handler = Captured()
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def tiny(cls, base: int, **kw):
    if cls is KCLAResNetSeg:
        kw.setdefault('stem_channels', base)
    return cls(depth=18, base_channels=base, head_dim=8, **kw)


@pytest.fixture
def wider_checkpoint(tmp_path) -> str:
    """Weights of a KCLA-ResNet-18 of base width 16 (the models below have 8)."""
    path = str(tmp_path / 'wider.pth')
    torch.save({'state_dict': tiny(KCLAResNet, 16).state_dict()}, path)
    return path


def test_load_checkpoint_lists_mismatched_keys_and_both_shapes(wider_checkpoint):
    model = tiny(KCLAResNet, 8)
    before = model.conv1.weight.detach().clone()
    logger = logging.getLogger('kcla_test_shapes')
    handler = Captured()
    logger.addHandler(handler)
    try:
        load_checkpoint(model, wider_checkpoint, logger=logger)
    finally:
        logger.removeHandler(handler)
    assert re.search(
        MISMATCH.format(key=r'conv1\.weight', ckpt=r'\[16, 3, 7, 7\]', model=r'\[8, 3, 7, 7\]'),
        handler.text)
    assert 'layer4_attn.0.adjust.weight' in handler.text  # KCLA keys are listed too
    assert torch.equal(model.conv1.weight, before)  # kept: the warning is all there is


@pytest.mark.parametrize('prefix', [None, 'backbone.'])
@pytest.mark.parametrize('scope, cls', [('mmdet', KCLAResNet), ('mmseg', KCLAResNetSeg)])
def test_pretrained_init_cfg_lists_mismatched_keys(tmp_path, current_log, scope, cls, prefix):
    path = str(tmp_path / 'wider.pth')
    sd = tiny(cls, 16).state_dict()
    if prefix:
        sd = {prefix + k: v for k, v in sd.items()}
    torch.save({'state_dict': sd}, path)
    init_default_scope(scope)
    init_cfg = dict(type='Pretrained', checkpoint=path)
    if prefix:
        init_cfg['prefix'] = prefix
    tiny(cls, 8, init_cfg=init_cfg).init_weights()
    assert 'size mismatch for conv1.weight' in current_log.text
    assert 'torch.Size([16, 3, 7, 7])' in current_log.text
    assert 'torch.Size([8, 3, 7, 7])' in current_log.text


def test_check_checkpoint_shapes_names_keys_and_both_shapes():
    model = tiny(KCLAResNet, 8)
    sd = {'module.' + k: v for k, v in tiny(KCLAResNet, 16).state_dict().items()}
    with pytest.raises(CheckpointShapeError,
                       match=r'conv1\.weight: checkpoint \[16, 3, 7, 7\], model \[8, 3, 7, 7\]'):
        check_checkpoint_shapes(model, {'state_dict': sd}, name='wider.pth')
    with pytest.raises(CheckpointShapeError, match=r'\.\.\. and \d+ more'):
        check_checkpoint_shapes(model, sd, limit=3)
    check_checkpoint_shapes(model, model.state_dict())  # a fitting one passes


@pytest.fixture
def seg(tmp_path):
    """(config path, a checkpoint of that segmentor with two tensors of another shape)."""
    cfg_path = write_seg_config(str(tmp_path / 'tiny_unet.py'),
                                write_seg_data(str(tmp_path / 'data')), max_iters=1,
                                ckpt_interval=1)
    cfg = Config.fromfile(cfg_path)
    init_default_scope('mmseg')
    from mmseg.registry import MODELS
    sd = MODELS.build(cfg.model).state_dict()
    sd['backbone.conv1.weight'] = torch.zeros(16, 3, 7, 7)
    sd['decode_head.conv_seg.weight'] = torch.zeros(2, 8, 1, 1)
    ckpt = str(tmp_path / 'mismatched.pth')
    torch.save({'state_dict': sd, 'meta': {}}, ckpt)
    return cfg_path, ckpt


@pytest.mark.slow
def test_train_load_from_prints_keys_and_shapes_and_trains(tmp_path, monkeypatch, seg, capsys):
    cfg_path, ckpt = seg
    work = tmp_path / 'work'
    monkeypatch.setenv('LOCAL_RANK', '0')
    run_script(TRAIN, [cfg_path, '--work-dir', str(work), '--cfg-options', f'load_from={ckpt}'],
               monkeypatch)
    # NOTE: Runner.load_checkpoint passes no logger, so mmengine print()s the list
    # to stdout; it is not in the run's log file.
    text = capsys.readouterr().out
    (log, ) = work.glob('*/*.log')
    assert 'size mismatch' not in log.read_text()
    assert 'size mismatch for backbone.conv1.weight' in text
    assert 'torch.Size([16, 3, 7, 7])' in text and 'torch.Size([8, 3, 7, 7])' in text
    assert 'size mismatch for decode_head.conv_seg.weight' in text
    assert (work / 'iter_1.pth').is_file()  # fine-tuning goes on


def runner_with_check(cfg_path: str, work: str, ckpt: str, resume: bool) -> Runner:
    cfg = Config.fromfile(cfg_path)
    cfg.work_dir, cfg.load_from, cfg.resume = work, ckpt, resume
    runner = Runner.from_cfg(cfg)
    runner.register_hook(CheckpointShapeCheckHook())
    return runner


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['test', 'resume'])
def test_the_shape_check_hook_refuses_before_loading(tmp_path, seg, mode):
    cfg_path, ckpt = seg
    runner = runner_with_check(cfg_path, str(tmp_path / mode), ckpt, resume=mode == 'resume')
    before = runner.model.backbone.conv1.weight.detach().clone()
    with pytest.raises(CheckpointShapeError) as e:
        runner.test() if mode == 'test' else runner.train()
    assert 'backbone.conv1.weight: checkpoint [16, 3, 7, 7], model [8, 3, 7, 7]' in str(e.value)
    assert 'decode_head.conv_seg.weight: checkpoint [2, 8, 1, 1], model [1, 8, 1, 1]' in str(
        e.value)
    if mode == 'test':  # (train() initialises the weights before it loads)
        assert torch.equal(runner.model.backbone.conv1.weight, before)


@pytest.mark.parametrize('allow', [False, True], ids=['default', '--allow-shape-mismatch'])
def test_tools_test_refuses_a_checkpoint_of_another_model(tmp_path, monkeypatch, seg, allow):
    cfg_path, ckpt = seg
    work = tmp_path / 'work'
    monkeypatch.setenv('LOCAL_RANK', '0')
    argv = [cfg_path, ckpt, '--work-dir', str(work)] + (['--allow-shape-mismatch'] * allow)
    listed = ['backbone.conv1.weight: checkpoint [16, 3, 7, 7], model [8, 3, 7, 7]',
              'decode_head.conv_seg.weight: checkpoint [2, 8, 1, 1], model [1, 8, 1, 1]']
    if not allow:
        with pytest.raises(CheckpointShapeError) as e:
            run_script(TEST, argv, monkeypatch)
        assert all(line in str(e.value) for line in listed)
        return
    run_script(TEST, argv, monkeypatch)  # evaluates; the list is a warning in the log
    (log, ) = work.glob('*/*.log')
    text = log.read_text()
    assert 'WARNING' in text and 'does not fit the model' in text
    assert all(line in text for line in listed)
    assert 'mIoU' in text  # and the evaluation ran

"""tools/train.py, tools/test.py and the dist scripts on detection configs.

The fast tests check how the tools turn arguments into a config. The slow
ones train the demo Faster R-CNN and Mask R-CNN (small KCLA-ResNet-18) on a
tiny synthetic COCO set through ``tools/train.py`` in a subprocess, shrunk
with ``--cfg-options``, and test the checkpoint twice with ``tools/test.py``
(and once with mmdet's own ``tools/test.py``): the predictions and metrics of
the test runs and of the validation at the end of training must be identical.
"""
import glob
import importlib.util
import json
import math
import os
import os.path as osp
import pickle
import subprocess
import sys
from typing import Dict, List

import mmdet
import numpy as np
import pytest
import torch
from utils import subprocess_run, torch_threads

from kcla_mm.datasets.synthetic_coco import generate
from kcla_mm.utils.checkpoint import TRUST_ENV

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TRAIN = osp.join(ROOT, 'tools', 'train.py')
TEST = osp.join(ROOT, 'tools', 'test.py')
FASTER = osp.join(ROOT, 'configs', 'kcla', 'demo', 'faster-rcnn_kcla-r18_fpn_synthetic.py')
MASK = osp.join(ROOT, 'configs', 'kcla', 'demo', 'mask-rcnn_kcla-r18_fpn_synthetic.py')
UNET = osp.join(ROOT, 'configs', 'unet', 'unet_kcla-r34_1xb8-300e_isic2017-256x256.py')
#: mmdet's own tools/test.py (installed by mim with the package).
UPSTREAM_TEST = osp.join(osp.dirname(mmdet.__file__), '.mim', 'tools', 'test.py')
SIZE = 64
ITERS = 16


def load_tool(path: str):
    """A tool script as a module (its ``main`` does not run)."""
    spec = importlib.util.spec_from_file_location(f'kcla_tool_{osp.basename(path)[:-3]}', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def train_tool():
    return load_tool(TRAIN)


@pytest.fixture(scope='module')
def test_tool():
    return load_tool(TEST)


# ---------------------------------------------------------------- fast tests
def test_train_arguments_become_config(train_tool, monkeypatch):
    monkeypatch.setenv('LOCAL_RANK', '0')
    args = train_tool.parse_args([FASTER, '--work-dir', 'w', '--amp', '--auto-scale-lr',
                                  '--cfg-options', 'train_cfg.max_iters=7',
                                  'model.backbone.depth=34'])
    cfg = train_tool.build_config(args)
    assert cfg.work_dir == 'w' and cfg.train_cfg.max_iters == 7
    assert cfg.model.backbone.depth == 34
    assert cfg.optim_wrapper.type == 'AmpOptimWrapper'
    assert cfg.optim_wrapper.loss_scale == 'dynamic'
    assert cfg.auto_scale_lr.enable is True
    assert cfg.launcher == 'none' and not cfg.get('resume')


@pytest.mark.parametrize('argv, resume, load_from', [
    (['--resume'], True, None),  # no path: the latest checkpoint of the work dir
    (['--resume', 'a/iter_4.pth'], True, 'a/iter_4.pth'),
    ([], False, None),
])
def test_train_resume(train_tool, monkeypatch, argv, resume, load_from):
    monkeypatch.setenv('LOCAL_RANK', '0')
    cfg = train_tool.build_config(train_tool.parse_args([FASTER] + argv))
    assert bool(cfg.get('resume')) == resume and cfg.get('load_from') == load_from
    # Without --work-dir: ./work_dirs/<config name>
    assert cfg.work_dir == osp.join('./work_dirs', 'faster-rcnn_kcla-r18_fpn_synthetic')


@pytest.mark.parametrize('tool_name, extra', [('train', []), ('test', ['ckpt.pth'])])
def test_both_tools_share_the_runner_options(request, monkeypatch, tool_name, extra):
    """--work-dir, --cfg-options, --launcher and the launcher's --local-rank, in both tools."""
    tool = request.getfixturevalue(f'{tool_name}_tool')
    monkeypatch.delenv('LOCAL_RANK', raising=False)
    args = tool.parse_args([FASTER] + extra + ['--local-rank', '3', '--launcher', 'pytorch',
                                               '--cfg-options', 'model.backbone.depth=34'])
    assert os.environ['LOCAL_RANK'] == '3'
    cfg = tool.build_config(args)
    assert cfg.launcher == 'pytorch' and cfg.model.backbone.depth == 34
    assert cfg.work_dir == osp.join('./work_dirs', 'faster-rcnn_kcla-r18_fpn_synthetic')
    monkeypatch.setenv('LOCAL_RANK', '1')  # set by torchrun: kept
    cfg = tool.build_config(tool.parse_args([FASTER] + extra + ['--work-dir', 'w']))
    assert os.environ['LOCAL_RANK'] == '1' and cfg.work_dir == 'w' and cfg.launcher == 'none'


@pytest.mark.parametrize('tool_name, extra', [('train', []), ('test', ['ckpt.pth'])])
def test_trust_checkpoint_flag_sets_the_opt_in(request, monkeypatch, tool_name, extra):
    tool = request.getfixturevalue(f'{tool_name}_tool')
    seen = {}

    class FakeRunner:
        test_evaluator = None

        def train(self):
            seen['trust'] = os.environ.get(TRUST_ENV)

        test = train

        def register_hook(self, hook, priority='NORMAL'):  # tools/test.py's shape check
            pass

    monkeypatch.setenv(TRUST_ENV, '0')
    monkeypatch.setenv('LOCAL_RANK', '0')
    monkeypatch.setattr(tool, 'build_runner', lambda cfg: FakeRunner())
    tool.main([FASTER] + extra)
    assert seen['trust'] == '0'
    tool.main([FASTER] + extra + ['--trust-checkpoint'])
    assert seen['trust'] == '1'


def test_test_show_dir_follows_the_host(test_tool, monkeypatch):
    monkeypatch.setenv('LOCAL_RANK', '0')
    det = test_tool.build_config(test_tool.parse_args([FASTER, 'c.pth', '--show-dir', 'vis']))
    assert det.load_from == 'c.pth'
    hook = det.default_hooks.visualization
    assert hook.type == 'DetVisualizationHook' and hook.draw and hook.test_out_dir == 'vis'
    seg = test_tool.build_config(test_tool.parse_args([UNET, 'c.pth', '--show-dir', 'vis']))
    assert seg.default_hooks.visualization.draw and seg.visualizer.save_dir == 'vis'


def test_test_out_directory_only_for_segmentation(test_tool, monkeypatch):
    monkeypatch.setenv('LOCAL_RANK', '0')
    with pytest.raises(ValueError, match='must be a .pkl file'):
        test_tool.build_config(test_tool.parse_args([FASTER, 'c.pth', '--out', 'preds']))
    seg = test_tool.build_config(test_tool.parse_args([UNET, 'c.pth', '--out', 'preds']))
    (iou, ) = [e for e in seg.test_evaluator if e.type == 'IoUMetric']
    assert iou.output_dir == 'preds' and iou.keep_results


@pytest.mark.parametrize('script, args, tool', [
    ('dist_train.sh', ['cfg.py', '3', '--work-dir', 'w x'], ['train.py', 'cfg.py']),
    ('dist_test.sh', ['cfg.py', 'c.pth', '3', '--out', 'o.pkl'],
     ['test.py', 'cfg.py', 'c.pth']),
])
def test_dist_scripts_call_torchrun(tmp_path, script, args, tool):
    fake = tmp_path / 'python'
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    fake.chmod(0o755)
    out = tmp_path / 'args.txt'
    env = dict(os.environ, PYTHON=str(fake), PORT='29611', ARGS_OUT=str(out))
    subprocess.run(['bash', osp.join(ROOT, 'tools', script)] + args, check=True, env=env)
    argv = out.read_text().splitlines()
    assert argv[:2] == ['-m', 'torch.distributed.run']
    assert '--nproc_per_node=3' in argv and '--master_port=29611' in argv
    i = argv.index(osp.join(ROOT, 'tools', tool[0]))
    assert argv[i + 1:i + len(tool)] == tool[1:]
    # the launcher, then the extra arguments unchanged (spaces included)
    assert argv[i + len(tool):] == ['--launcher', 'pytorch'] + args[len(tool):]


@pytest.mark.parametrize('script, args, tool', [
    ('slurm_train.sh', ['gpu', 'job', 'cfg.py', 'w x', '--amp'],
     ['train.py', 'cfg.py', '--work-dir', 'w x', '--amp']),
    ('slurm_test.sh', ['gpu', 'job', 'cfg.py', 'c.pth', '--out', 'o.pkl'],
     ['test.py', 'cfg.py', 'c.pth', '--out', 'o.pkl']),
])
def test_slurm_scripts_call_srun(tmp_path, script, args, tool):
    fake = tmp_path / 'srun'
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    fake.chmod(0o755)
    out = tmp_path / 'args.txt'
    env = dict(os.environ, PATH=f'{tmp_path}:{os.environ["PATH"]}', PYTHON='py', GPUS='16',
               SRUN_ARGS='--quotatype=auto --x', ARGS_OUT=str(out))
    subprocess.run(['bash', osp.join(ROOT, 'tools', script)] + args, check=True, env=env)
    argv = out.read_text().splitlines()
    assert argv[:2] == ['-p', 'gpu'] and '--job-name=job' in argv
    # 16 tasks of one GPU each, 8 per node; the extra srun arguments, split
    assert {'--ntasks=16', '--ntasks-per-node=8', '--gres=gpu:8'} <= set(argv)
    assert argv.index('--quotatype=auto') + 1 == argv.index('--x')
    i = argv.index('py')
    assert argv[i + 1:] == ['-u', osp.join(ROOT, 'tools', tool[0])] + tool[1:] + [
        '--launcher', 'slurm']


def test_dist_script_usage(tmp_path):
    proc = subprocess.run(['bash', osp.join(ROOT, 'tools', 'dist_train.sh'), 'cfg.py'],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and 'usage' in proc.stderr


# ---------------------------------------------------------------- end to end
@pytest.fixture(scope='module')
def data_root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp('synthetic_coco'))
    generate(root, num_train=8, num_val=3, size=SIZE, seed=0, min_object=12, max_object=28,
             max_objects=2)
    return root


def shrink_options(data_root: str) -> List[str]:
    """``--cfg-options`` that make a demo config run in seconds on ``data_root``."""
    ann = f'{data_root}/annotations/instances_val2017.json'
    scale = f'({SIZE},{SIZE})'
    options = [f'{loader}.dataset.data_root={data_root}/'
               for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    options += [f'test_evaluator.ann_file={ann}',
                f'train_dataloader.dataset.pipeline.2.scale={scale}',
                f'val_dataloader.dataset.pipeline.1.scale={scale}',
                f'test_dataloader.dataset.pipeline.1.scale={scale}',
                'train_dataloader.batch_size=2',
                f'train_cfg.max_iters={ITERS}', f'train_cfg.val_interval={ITERS}',
                f'default_hooks.checkpoint.interval={ITERS}',
                'param_scheduler.0.end=4', 'param_scheduler.1.begin=4',
                f'param_scheduler.1.end={ITERS}',
                'default_hooks.logger.interval=1', 'log_processor.window_size=1',
                # keep every box, so that the comparisons below compare something
                'model.test_cfg.rcnn.score_thr=0.0']
    return options


def run_tool(argv: List[str], timeout: float = 240) -> None:
    subprocess_run([sys.executable] + argv, timeout=timeout)


def scalars(train_dir: str) -> List[dict]:
    (path, ) = glob.glob(osp.join(train_dir, '*', 'vis_data', 'scalars.json'))
    with open(path) as f:
        return [json.loads(line) for line in f]


def read_test_metrics(work_dir: str) -> Dict[str, float]:
    (path, ) = [p for p in glob.glob(osp.join(work_dir, '*', '*.json'))
                if osp.basename(p) == osp.basename(osp.dirname(p)) + '.json']
    with open(path) as f:
        return {k: v for k, v in json.load(f).items() if k.startswith('coco/')}


def load_predictions(path: str) -> List[dict]:
    with open(path, 'rb') as f:
        return pickle.load(f)


def assert_same_predictions(a: List[dict], b: List[dict]) -> None:
    assert [s['img_id'] for s in a] == [s['img_id'] for s in b]
    for x, y in zip(a, b):
        px, py = x['pred_instances'], y['pred_instances']
        np.testing.assert_allclose(px['bboxes'].numpy(), py['bboxes'].numpy(), atol=1e-4)
        np.testing.assert_allclose(px['scores'].numpy(), py['scores'].numpy(), atol=1e-5)
        assert torch.equal(px['labels'], py['labels'])
        if 'masks' in px:
            assert [m['counts'] for m in px['masks']] == [m['counts'] for m in py['masks']]


VAL_DUMP_CONFIG = '''
_base_ = {base!r}
# validation during training also dumps its predictions, to compare with tools/test.py
val_evaluator = [
    dict(type='CocoMetric', ann_file={ann!r}, metric={metric!r}),
    dict(type='DumpDetResults', out_file_path={dump!r}),
]
'''


@pytest.mark.slow
@pytest.mark.parametrize('base, mask', [(FASTER, False), (MASK, True)],
                         ids=['faster-rcnn', 'mask-rcnn'])
def test_train_then_test_is_reproducible(tmp_path, data_root, test_tool, monkeypatch,
                                         base, mask):
    metric = ['bbox', 'segm'] if mask else 'bbox'
    config = tmp_path / 'config.py'
    config.write_text(VAL_DUMP_CONFIG.format(
        base=base, ann=f'{data_root}/annotations/instances_val2017.json', metric=metric,
        dump=str(tmp_path / 'val.pkl')))
    options = shrink_options(data_root)
    train_dir = str(tmp_path / 'train')
    run_tool([TRAIN, str(config), '--work-dir', train_dir, '--cfg-options', *options])

    checkpoint = osp.join(train_dir, f'iter_{ITERS}.pth')
    assert osp.isfile(checkpoint)
    with open(osp.join(train_dir, 'last_checkpoint')) as f:
        assert f.read().strip() == checkpoint

    lines = scalars(train_dir)
    logs = [line for line in lines if 'loss' in line]
    assert [line['iter'] for line in logs] == list(range(1, ITERS + 1))
    names = [k for k in logs[0] if k.startswith('loss')]
    assert ('loss_mask' in names) == mask
    assert all(math.isfinite(line[k]) for line in logs for k in names)
    # The total loss of a batch of two is noisy (it depends on how many boxes
    # the batch holds); compare halves. The RPN's objectness loss falls steadily.
    losses = np.array([line['loss'] for line in logs])
    half = ITERS // 2
    assert losses[half:].mean() < losses[:half].mean(), f'loss did not decrease: {losses}'
    rpn = np.array([line['loss_rpn_cls'] for line in logs])
    assert rpn[-4:].mean() < 0.7 * rpn[:4].mean(), f'RPN loss did not decrease: {rpn}'
    (val, ) = [{k: v for k, v in line.items() if k.startswith('coco/')}
               for line in lines if 'coco/bbox_mAP' in line]
    assert ('coco/segm_mAP' in val) == mask

    # 1st test: the command line, in a subprocess.
    run_tool([TEST, str(config), checkpoint, '--work-dir', str(tmp_path / 'test1'),
              '--out', str(tmp_path / 'test1.pkl'), '--cfg-options', *options])
    # 2nd test: the same tool in this process (another process, another start).
    monkeypatch.setenv('LOCAL_RANK', '0')
    monkeypatch.delenv(TRUST_ENV, raising=False)
    with torch_threads(1):
        second = test_tool.main([str(config), checkpoint, '--work-dir', str(tmp_path / 'test2'),
                                 '--out', str(tmp_path / 'test2.pkl'), '--cfg-options',
                                 *options])

    first = read_test_metrics(str(tmp_path / 'test1'))
    assert first == val
    assert {k: v for k, v in second.items() if k.startswith('coco/')} == val
    predictions = load_predictions(str(tmp_path / 'test1.pkl'))
    assert len(predictions) == 3
    assert sum(len(p['pred_instances']['scores']) for p in predictions) > 0
    assert_same_predictions(predictions, load_predictions(str(tmp_path / 'val.pkl')))
    assert_same_predictions(predictions, load_predictions(str(tmp_path / 'test2.pkl')))

    if not mask and osp.isfile(UPSTREAM_TEST):
        # mmdet's own test tool works too: the config's custom_imports load kcla_mm.
        run_tool([UPSTREAM_TEST, str(config), checkpoint, '--work-dir',
                  str(tmp_path / 'upstream'), '--cfg-options', *options])
        assert read_test_metrics(str(tmp_path / 'upstream')) == val

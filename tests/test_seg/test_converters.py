"""Dataset converters on synthetic download-shaped folders, including bad inputs."""
import importlib.util
import json
import os
import os.path as osp
import re
import subprocess
import sys

import cv2
import numpy as np
import pytest

from kcla_mm.datasets.synthetic_medical import ISIC_FOLDERS, KVASIR_ROOT, generate

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOLS = osp.join(ROOT, 'tools', 'dataset_converters')


def load_tool(name: str):
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    path = osp.join(TOOLS, f'{name}.py')
    spec = importlib.util.spec_from_file_location(f'converter_{name}', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def isic2017():
    return load_tool('isic2017')


@pytest.fixture(scope='module')
def isic2018():
    return load_tool('isic2018')


@pytest.fixture(scope='module')
def kvasir():
    return load_tool('kvasir_seg')


def split_names(out) -> dict:
    lines = (out / 'splits.txt').read_text().split('\n')
    splits = {}
    for line in filter(None, lines):
        name, split = line.split()
        splits.setdefault(split, []).append(name)
    return splits


def listing(out, split, kind='masks'):
    return sorted(osp.splitext(f)[0] for f in os.listdir(out / kind / split))


def test_isic2017_random_split_is_seeded_7_3(tmp_path, isic2017):
    written = generate('isic2017', str(tmp_path / 'dl'), num=14, num_val=6, num_test=3, size=32)
    out = tmp_path / 'out'
    assert isic2017.main([str(tmp_path / 'dl'), '--out', str(out), '--seed', '3']) == 0
    splits = split_names(out)
    pool = written['Training'] + written['Validation']
    assert len(splits['train']) == 14 and len(splits['val']) == 6  # 7:3 of 20
    assert sorted(splits['train'] + splits['val']) == sorted(pool)
    assert sorted(splits['test']) == sorted(written['Test'])
    for split in ('train', 'val', 'test'):
        assert listing(out, split) == listing(out, split, 'images') == sorted(splits[split])
    # Same seed, same split; another seed, another split.
    assert isic2017.main([str(tmp_path / 'dl'), '--out', str(tmp_path / 'again'),
                          '--seed', '3']) == 0
    assert split_names(tmp_path / 'again') == splits
    assert isic2017.main([str(tmp_path / 'dl'), '--out', str(tmp_path / 'other'),
                          '--seed', '4']) == 0
    assert split_names(tmp_path / 'other')['train'] != splits['train']


def test_isic_masks_become_0_1_pngs_and_stats_are_written(tmp_path, isic2018):
    written = generate('isic2018', str(tmp_path / 'dl'), num=4, num_val=2, num_test=0, size=32)
    out = tmp_path / 'out'
    assert isic2018.main([str(tmp_path / 'dl'), '--out', str(out), '--split', 'official']) == 0
    assert listing(out, 'train') == sorted(written['Training'])
    assert listing(out, 'val') == sorted(written['Validation'])
    name = written['Training'][0]
    gt_folder = ISIC_FOLDERS['isic2018']['Training'][1]
    original = cv2.imread(str(tmp_path / 'dl' / gt_folder / f'{name}_segmentation.png'), 0)
    mask = cv2.imread(str(out / 'masks' / 'train' / f'{name}.png'), cv2.IMREAD_UNCHANGED)
    assert np.array_equal(mask, (original == 255).astype(np.uint8))
    image = cv2.imread(str(out / 'images' / 'train' / f'{name}.png'))
    assert image.shape[:2] == mask.shape
    stats = json.loads((out / 'stats.json').read_text())
    assert stats['counts'] == dict(train=4, val=2, test=0)
    assert len(stats['mean_rgb']) == 3 and all(0 < v < 255 for v in stats['mean_rgb'])


def test_kvasir_jpeg_masks_are_thresholded_and_split_70_30(tmp_path, kvasir):
    written = generate('kvasir', str(tmp_path / 'dl'), num=20, size=48, seed=2)
    out = tmp_path / 'out'
    # SRC may be the folder holding Kvasir-SEG or Kvasir-SEG itself.
    assert kvasir.main([str(tmp_path / 'dl' / KVASIR_ROOT), '--out', str(out)]) == 0
    splits = split_names(out)
    assert len(splits['train']) == 14 and len(splits['val']) == 6
    assert sorted(splits['train'] + splits['val']) == sorted(written['all'])
    name = splits['val'][0]
    jpeg = cv2.imread(str(tmp_path / 'dl' / KVASIR_ROOT / 'masks' / f'{name}.jpg'), 0)
    mask = cv2.imread(str(out / 'masks' / 'val' / f'{name}.png'), cv2.IMREAD_UNCHANGED)
    assert set(np.unique(mask)) == {0, 1}
    assert np.array_equal(mask, (jpeg >= 128).astype(np.uint8))
    # Matching on 255 exactly would lose boundary pixels of the JPEG mask.
    assert (jpeg == 255).sum() < mask.sum()


def test_split_file_round_trip(tmp_path, kvasir):
    generate('kvasir', str(tmp_path / 'dl'), num=10, size=32)
    first = tmp_path / 'first'
    assert kvasir.main([str(tmp_path / 'dl'), '--out', str(first), '--seed', '7']) == 0
    second = tmp_path / 'second'
    assert kvasir.main([str(tmp_path / 'dl'), '--out', str(second),
                        '--split-file', str(first / 'splits.txt')]) == 0
    assert split_names(second) == split_names(first)


def test_split_file_problems_are_named(tmp_path, kvasir, capsys):
    written = generate('kvasir', str(tmp_path / 'dl'), num=4, size=32)
    names = sorted(written['all'])
    split_file = tmp_path / 'split.txt'
    split_file.write_text(f'{names[0]} train\n{names[1]}.jpg val\nnot_there test\n')
    out = tmp_path / 'out'
    assert kvasir.main([str(tmp_path / 'dl'), '--out', str(out),
                        '--split-file', str(split_file)]) == 1
    err = capsys.readouterr().err
    assert 'not_there: listed in the split file' in err
    for name in names[2:]:
        assert f'{name}: not listed in the split file' in err
    assert not out.exists()  # name-level problems are found before anything is written
    split_file.write_text(f'{names[0]} training\n')
    assert kvasir.main([str(tmp_path / 'dl'), '--out', str(out),
                        '--split-file', str(split_file)]) == 1
    assert 'split.txt:1' in capsys.readouterr().err


def make_bad_download(tmp_path, kinds=('no_mask', 'orphan', 'wrong_size', 'broken')):
    """An ISIC 2017 download with the bad inputs ``kinds``; returns (folder, names, written)."""
    dl = tmp_path / 'dl'
    written = generate('isic2017', str(dl), num=8, num_val=2, num_test=0, size=32)
    img_dir, gt_dir = (dl / f for f in ISIC_FOLDERS['isic2017']['Training'])
    bad = dict(zip(('no_mask', 'wrong_size', 'broken'), written['Training'][:3]))
    bad['orphan'] = 'ISIC_9999999'
    mask = cv2.imread(str(gt_dir / f'{bad["wrong_size"]}_segmentation.png'), 0)
    if 'no_mask' in kinds:
        os.remove(gt_dir / f'{bad["no_mask"]}_segmentation.png')
    if 'wrong_size' in kinds:
        cv2.imwrite(str(gt_dir / f'{bad["wrong_size"]}_segmentation.png'), mask[:-3])
    if 'broken' in kinds:
        (img_dir / f'{bad["broken"]}.jpg').write_bytes(b'not a jpeg')
    if 'orphan' in kinds:
        cv2.imwrite(str(gt_dir / f'{bad["orphan"]}_segmentation.png'), mask)
    return dl, {k: v for k, v in bad.items() if k in kinds}, written


def test_unpaired_files_fail_by_name_before_writing(tmp_path, isic2017, capsys):
    dl, bad, _ = make_bad_download(tmp_path)
    out = tmp_path / 'out'
    assert isic2017.main([str(dl), '--out', str(out)]) == 1
    err = capsys.readouterr().err
    assert f'{bad["no_mask"]}: image without mask in Training' in err
    assert f'{bad["orphan"]}: mask without image in Training' in err
    assert not out.exists()


def test_unreadable_and_mis_sized_files_fail_by_name(tmp_path, isic2017, capsys):
    dl, bad, _ = make_bad_download(tmp_path, ('wrong_size', 'broken'))
    out = tmp_path / 'out'
    assert isic2017.main([str(dl), '--out', str(out)]) == 1
    err = capsys.readouterr().err
    assert f'{bad["broken"]}: unreadable image' in err
    sizes = re.search(rf'{bad["wrong_size"]}: mask is (\d+)x(\d+) but the image is (\d+)x(\d+)',
                      err)
    assert sizes and int(sizes[3]) - int(sizes[1]) == 3 and sizes[2] == sizes[4]
    assert 'incomplete' in err
    assert bad['broken'] in (out / 'skipped.txt').read_text()


def test_skip_bad_converts_the_rest_and_lists_the_others(tmp_path, isic2017):
    dl, bad, written = make_bad_download(tmp_path)
    out = tmp_path / 'out'
    assert isic2017.main([str(dl), '--out', str(out), '--skip-bad']) == 0
    skipped = (out / 'skipped.txt').read_text()
    for name in bad.values():
        assert name in skipped
    converted = sum(split_names(out).values(), [])
    good = set(written['Training'] + written['Validation']) - set(bad.values())
    assert sorted(converted) == sorted(good)
    assert json.loads((out / 'stats.json').read_text())['skipped'] == 4


def test_existing_output_needs_overwrite(tmp_path, kvasir, capsys):
    generate('kvasir', str(tmp_path / 'dl'), num=4, size=32)
    out = tmp_path / 'out'
    assert kvasir.main([str(tmp_path / 'dl'), '--out', str(out)]) == 0
    assert kvasir.main([str(tmp_path / 'dl'), '--out', str(out)]) == 1
    assert '--overwrite' in capsys.readouterr().err
    assert kvasir.main([str(tmp_path / 'dl'), '--out', str(out), '--overwrite']) == 0


@pytest.mark.slow
def test_command_line(tmp_path):
    """The script runs as a command (slow: the interpreter imports kcla_mm, mmseg, mmdet)."""
    generate('kvasir', str(tmp_path / 'dl'), num=4, size=32)
    proc = subprocess.run([sys.executable, osp.join(TOOLS, 'kvasir_seg.py'), str(tmp_path / 'dl'),
                           '--out', str(tmp_path / 'out'), '--image-format', 'jpg'],
                          capture_output=True, text=True, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert 'train: 3, val: 1' in proc.stdout and 'model.data_preprocessor.mean' in proc.stdout
    assert all(f.endswith('.jpg') for f in os.listdir(tmp_path / 'out' / 'images' / 'train'))

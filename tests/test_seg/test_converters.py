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
    assert 'not_there: listed as test in the split file' in err
    for name in names[2:]:
        assert f'{name}: not listed in the split file' in err
    assert not out.exists()  # name-level problems are found before anything is written
    split_file.write_text(f'{names[0]} training\n')
    assert kvasir.main([str(tmp_path / 'dl'), '--out', str(out),
                        '--split-file', str(split_file)]) == 1
    assert 'split.txt:1' in capsys.readouterr().err


def test_random_three_way_split_is_seeded_and_keeps_the_train_set(tmp_path, kvasir):
    written = generate('kvasir', str(tmp_path / 'dl'), num=20, size=16)
    two_way, three_way = tmp_path / 'two', tmp_path / 'three'
    assert kvasir.main([str(tmp_path / 'dl'), '--out', str(two_way), '--ratio', '0.6',
                        '--seed', '5']) == 0
    assert kvasir.main([str(tmp_path / 'dl'), '--out', str(three_way), '--ratio', '0.6',
                        '--test-ratio', '0.2', '--seed', '5']) == 0
    splits = split_names(three_way)
    assert {s: len(n) for s, n in splits.items()} == dict(train=12, val=4, test=4)
    assert sorted(sum(splits.values(), [])) == sorted(written['all'])
    # Holding out a test split takes it from val: the train set is the same.
    assert splits['train'] == split_names(two_way)['train']
    for split in ('train', 'val', 'test'):
        assert listing(three_way, split) == listing(three_way, split, 'images') \
            == sorted(splits[split])
    stats = json.loads((three_way / 'stats.json').read_text())
    assert stats['counts'] == dict(train=12, val=4, test=4) and stats['test_ratio'] == 0.2
    # Its splits.txt, test lines included, reproduces it as a split file.
    again = tmp_path / 'again'
    assert kvasir.main([str(tmp_path / 'dl'), '--out', str(again),
                        '--split-file', str(three_way / 'splits.txt')]) == 0
    assert split_names(again) == splits


@pytest.mark.parametrize('args', [
    ['--test-ratio', '0.3'],  # with --ratio 0.7 nothing is left for val
    ['--test-ratio', '-0.1'],
    ['--split', 'kcla-paper', '--test-ratio', '0.1'],  # a named split is taken as published
])
def test_bad_test_ratio_is_a_usage_error(tmp_path, kvasir, capsys, args):
    generate('kvasir', str(tmp_path / 'dl'), num=2, size=16)
    with pytest.raises(SystemExit) as exit_:
        kvasir.main([str(tmp_path / 'dl'), '--out', str(tmp_path / 'out')] + args)
    assert exit_.value.code == 2
    assert '--test-ratio' in capsys.readouterr().err


def test_test_ratio_beside_an_official_test_set_fails(tmp_path, isic2017, capsys):
    # An official Test set is the test split; a random share of the pool would join it.
    generate('isic2017', str(tmp_path / 'dl'), num=4, num_val=2, num_test=2, size=16)
    assert isic2017.main([str(tmp_path / 'dl'), '--out', str(tmp_path / 'out'),
                          '--test-ratio', '0.1']) == 1
    assert "official ['Test']" in capsys.readouterr().err


KCLA_LISTS = osp.join(TOOLS, 'splits', 'kvasir_seg', 'kcla-paper')


def kcla_list(split):
    with open(osp.join(KCLA_LISTS, f'{split}.txt')) as f:
        return [line.strip() for line in f if line.strip()]


def test_kcla_paper_lists_are_700_and_300_kvasir_names():
    train, val = kcla_list('train'), kcla_list('val')
    assert len(train) == len(set(train)) == 700 and len(val) == len(set(val)) == 300
    assert not set(train) & set(val)
    assert all(re.fullmatch(r'c[a-z0-9]{24}\.jpg', n) for n in train + val)
    # First and last lines of the authors' files.
    assert (train[0], train[-1]) == ('cju0qkwl35piu0993l0dewei2.jpg',
                                     'ck2bxqz3evvg20794iiyv5v2m.jpg')
    assert (val[0], val[-1]) == ('cju0qoxqj9q6s0835b43399p4.jpg',
                                 'ck2da7fwcjfis07218r1rvm95.jpg')


def fake_kvasir_download(folder, names):
    """Kvasir-SEG/{images,masks}/NAME.jpg for ``names`` (``NAME.jpg``), all one tiny pair."""
    img, mask = fake_kvasir_download.pair
    for kind, data in (('images', img), ('masks', mask)):
        os.makedirs(folder / KVASIR_ROOT / kind, exist_ok=True)
        for name in names:
            (folder / KVASIR_ROOT / kind / name).write_bytes(data)


fake_kvasir_download.pair = tuple(
    cv2.imencode('.jpg', a)[1].tobytes()
    for a in (np.full((8, 10, 3), 90, np.uint8), np.pad(np.full((4, 4), 255, np.uint8), 3)[:8]))


def test_kcla_paper_split_is_reproduced_from_a_download(tmp_path, kvasir):
    train, val = kcla_list('train'), kcla_list('val')
    fake_kvasir_download(tmp_path / 'dl', sorted(train + val))
    out = tmp_path / 'out'
    assert kvasir.main([str(tmp_path / 'dl'), '--out', str(out), '--split', 'kcla-paper',
                        '--image-format', 'jpg']) == 0
    splits = split_names(out)
    assert set(splits) == {'train', 'val'}
    assert sorted(splits['train']) == sorted(osp.splitext(n)[0] for n in train)
    assert sorted(splits['val']) == sorted(osp.splitext(n)[0] for n in val)
    assert listing(out, 'val', 'images') == sorted(splits['val'])
    assert json.loads((out / 'stats.json').read_text())['split'] == 'kcla-paper'


def test_kcla_paper_names_missing_and_uncovered_images(tmp_path, kvasir, capsys):
    train, val = kcla_list('train'), kcla_list('val')
    missing = [train[5], val[7]]
    extra = 'cju0000000000000000000000.jpg'
    present = [n for n in train + val if n not in missing] + [extra]
    fake_kvasir_download(tmp_path / 'dl', present)
    out = tmp_path / 'out'
    assert kvasir.main([str(tmp_path / 'dl'), '--out', str(out), '--split', 'kcla-paper']) == 1
    err = capsys.readouterr().err
    assert '3 bad inputs' in err
    assert f'{missing[0][:-4]}: listed as train in --split kcla-paper but not found' in err
    assert f'{missing[1][:-4]}: listed as val in --split kcla-paper but not found' in err
    assert f'{extra[:-4]}: not listed in --split kcla-paper' in err
    assert not out.exists()
    # --skip-bad converts the 998 listed images found and lists the other three.
    assert kvasir.main([str(tmp_path / 'dl'), '--out', str(out), '--split', 'kcla-paper',
                        '--skip-bad', '--image-format', 'jpg']) == 0
    splits = split_names(out)
    assert (len(splits['train']), len(splits['val'])) == (699, 299)
    skipped = (out / 'skipped.txt').read_text()
    assert all(n[:-4] in skipped for n in missing + [extra])


def test_named_split_without_its_lists_fails_clearly(tmp_path, kvasir, capsys, monkeypatch):
    monkeypatch.setitem(kvasir.NAMED_SPLITS, 'kcla-paper', str(tmp_path / 'no_lists'))
    fake_kvasir_download(tmp_path / 'dl', ['cju0qkwl35piu0993l0dewei2.jpg'])
    assert kvasir.main([str(tmp_path / 'dl'), '--out', str(tmp_path / 'out'),
                        '--split', 'kcla-paper']) == 1
    err = capsys.readouterr().err
    assert 'not shipped' in err and str(tmp_path / 'no_lists') in err


def test_name_lists_reject_a_name_in_two_splits(tmp_path, kvasir, capsys, monkeypatch):
    lists = tmp_path / 'lists'
    lists.mkdir()
    (lists / 'train.txt').write_text('a.jpg\nb.jpg\n')
    (lists / 'val.txt').write_text('# comment\n\nb.jpg\n')
    monkeypatch.setitem(kvasir.NAMED_SPLITS, 'kcla-paper', str(lists))
    fake_kvasir_download(tmp_path / 'dl', ['a.jpg', 'b.jpg'])
    assert kvasir.main([str(tmp_path / 'dl'), '--out', str(tmp_path / 'out'),
                        '--split', 'kcla-paper']) == 1
    assert f'{lists / "val.txt"}:3: b is also listed at {lists / "train.txt"}:2' \
        in capsys.readouterr().err


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

"""Binary medical segmentation datasets: ISIC 2017, ISIC 2018 (task 1), Kvasir-SEG.

All three read the *prepared* layout written by
``tools/dataset_converters/{isic2017,isic2018,kvasir_seg}.py`` from the
official downloads (the layout of mmseg's medical projects)::

    data_root/
      images/{train,val,test}/NAME.png   (or NAME.jpg)
      masks/{train,val,test}/NAME.png    uint8, 0 = background, 1 = lesion/polyp
      splits.txt                         "NAME SPLIT" per line, as converted

Every mask must have exactly one image and every image a mask; a mismatch is
an error that names the files, never a silently shorter dataset. A split
folder that is missing or holds no image is an error at build time that names
the folder, the layout expected under ``data_root``, the ``data_prefix`` that
selects a split and the converter that writes the layout.
"""
import os
import os.path as osp
from typing import Dict, List, Sequence, Tuple, Union

import mmengine
from mmseg.datasets import BaseSegDataset

#: Image suffixes accepted next to the masks (converters write ``.png``;
#: ``--image-format jpg`` keeps the original JPEG bytes).
IMG_SUFFIXES = ('.png', '.jpg', '.jpeg')

_MAX_NAMES = 10


def _names(items: Sequence[str]) -> str:
    items = sorted(items)
    more = f' and {len(items) - _MAX_NAMES} more' if len(items) > _MAX_NAMES else ''
    return ', '.join(items[:_MAX_NAMES]) + more


class BinaryMedicalDataset(BaseSegDataset):
    """Prepared-layout binary segmentation dataset (background, foreground).

    Args:
        img_suffix: accepted image suffixes; each mask's image is the file with
            the mask's stem and one of them.
        seg_map_suffix: mask suffix.
        reduce_zero_label: must stay False (label 0 is the background class).
        **kwargs: :class:`mmseg.datasets.BaseSegDataset` arguments
            (``data_root``, ``data_prefix=dict(img_path=..., seg_map_path=...)``,
            ``ann_file`` listing names, ``pipeline``, ...).
    """

    METAINFO: Dict = dict(classes=('background', 'foreground'),
                          palette=[[0, 0, 0], [255, 0, 0]])
    #: the converter that writes this dataset's layout (named in errors).
    CONVERTER: str = ''

    def __init__(self,
                 img_suffix: Union[str, Sequence[str]] = IMG_SUFFIXES,
                 seg_map_suffix: str = '.png',
                 reduce_zero_label: bool = False,
                 **kwargs) -> None:
        if reduce_zero_label:
            raise ValueError(f'{type(self).__name__}: reduce_zero_label=True would ignore the '
                             'background class (label 0); masks store 0/1')
        suffixes = (img_suffix, ) if isinstance(img_suffix, str) else tuple(img_suffix)
        # as given, before mmseg joins data_root to it (for the messages)
        self._prefix = dict(kwargs.get('data_prefix', {}))
        super().__init__(img_suffix=suffixes, seg_map_suffix=seg_map_suffix,
                         reduce_zero_label=False, **kwargs)

    def _convert_command(self) -> str:
        return (f'`python {self.CONVERTER} DOWNLOAD_DIR --out {self.data_root or "DATA_ROOT"}`'
                if self.CONVERTER else '')

    def _hint(self) -> str:
        return f'; prepare it with {self._convert_command()}' if self.CONVERTER else ''

    def _layout_help(self) -> str:
        """What this dataset expects under ``data_root`` and how to select a split."""
        root = self.data_root or 'DATA_ROOT'
        splits = ''
        images = osp.join(root, 'images')
        if osp.isdir(images):
            found = sorted(d for d in os.listdir(images) if osp.isdir(osp.join(images, d)))
            splits = f' {images} holds the splits: {", ".join(found) or "none"}.'
        return (f' {type(self).__name__} reads the prepared layout {root}/images/{{split}}/NAME'
                f'{{{",".join(self.img_suffix)}}} with masks {root}/masks/{{split}}/NAME'
                f'{self.seg_map_suffix}; select a split with data_prefix=dict('
                "img_path='images/train', seg_map_path='masks/train') (or 'val', 'test')."
                f'{splits}' + (f' Prepare it with {self._convert_command()}.'
                               if self.CONVERTER else ''))

    def _list_dir(self, path: str, suffixes: Tuple[str, ...], what: str) -> Dict[str, str]:
        if not osp.isdir(path):
            raise FileNotFoundError(f'{type(self).__name__}: {what} directory {path!r} does not '
                                    f'exist.{self._layout_help()}')
        stems: Dict[str, str] = {}
        duplicates = []
        for name in sorted(os.listdir(path)):
            stem, ext = osp.splitext(name)
            if ext.lower() not in suffixes:
                continue
            if stem in stems:
                duplicates.append(f'{stems[stem]}/{name}')
            stems[stem] = name
        if duplicates:
            raise ValueError(f'{type(self).__name__}: {path} holds several {what}s with the same '
                             f'name: {_names(duplicates)}')
        return stems

    def load_data_list(self) -> List[dict]:
        """Pair every mask with its image (or read the names from ``ann_file``).

        Returns:
            One dict per sample with ``img_path``, ``seg_map_path`` and mmseg's
            label fields, sorted by name.
        """
        img_dir = self.data_prefix.get('img_path', None)
        ann_dir = self.data_prefix.get('seg_map_path', None)
        images = self._list_dir(img_dir, tuple(s.lower() for s in self.img_suffix), 'image')
        if not images:
            raise FileNotFoundError(
                f'{type(self).__name__}: no image ({"/".join(self.img_suffix)}) in {img_dir!r} '
                f'(data_root={self.data_root!r}, data_prefix={self._prefix!r}).'
                f'{self._layout_help()}')
        masks = self._list_dir(ann_dir, (self.seg_map_suffix.lower(), ), 'mask') \
            if ann_dir else None
        if self.ann_file:
            if not osp.isfile(self.ann_file):
                raise FileNotFoundError(f'{type(self).__name__}: ann_file {self.ann_file!r} '
                                        'does not exist')
            lines = mmengine.list_from_file(self.ann_file, backend_args=self.backend_args)
            names = [osp.splitext(line.split()[0])[0] for line in lines if line.strip()]
            if not names:
                raise ValueError(f'{type(self).__name__}: ann_file {self.ann_file!r} lists no '
                                 'names (one NAME per line)')
        else:
            names = sorted(masks if masks is not None else images)
        missing_img = [n for n in names if n not in images]
        if missing_img:
            raise FileNotFoundError(f'{type(self).__name__}: no image in {img_dir} for '
                                    f'{len(missing_img)} masks/names: {_names(missing_img)}')
        if masks is not None:
            missing_mask = [n for n in names if n not in masks]
            if not self.ann_file:
                missing_mask += [n for n in images if n not in masks]
            if missing_mask:
                raise FileNotFoundError(f'{type(self).__name__}: no mask in {ann_dir} for '
                                        f'{len(missing_mask)} images: {_names(missing_mask)}')
        data_list = []
        for name in sorted(names):
            info = dict(img_path=osp.join(img_dir, images[name]))
            if masks is not None:
                info['seg_map_path'] = osp.join(ann_dir, masks[name])
            info.update(label_map=self.label_map, reduce_zero_label=False, seg_fields=[])
            data_list.append(info)
        return data_list


class ISIC2017Dataset(BinaryMedicalDataset):
    """ISIC 2017 challenge, part 1 (lesion segmentation), prepared layout.

    Classes ``('background', 'lesion')``. See :class:`BinaryMedicalDataset`.
    """

    METAINFO = dict(classes=('background', 'lesion'), palette=[[0, 0, 0], [255, 0, 0]])
    CONVERTER = 'tools/dataset_converters/isic2017.py'


class ISIC2018Dataset(BinaryMedicalDataset):
    """ISIC 2018 challenge, task 1 (lesion boundary segmentation), prepared layout.

    Classes ``('background', 'lesion')``. See :class:`BinaryMedicalDataset`.
    """

    METAINFO = dict(classes=('background', 'lesion'), palette=[[0, 0, 0], [255, 0, 0]])
    CONVERTER = 'tools/dataset_converters/isic2018.py'


class KvasirSEGDataset(BinaryMedicalDataset):
    """Kvasir-SEG polyp segmentation (1000 images), prepared layout.

    Classes ``('background', 'polyp')``. See :class:`BinaryMedicalDataset`.
    """

    METAINFO = dict(classes=('background', 'polyp'), palette=[[0, 0, 0], [0, 255, 0]])
    CONVERTER = 'tools/dataset_converters/kvasir_seg.py'

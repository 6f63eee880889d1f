"""CIFAR-100 in the official ``cifar-100-python/`` layout, never downloaded.

mmpretrain's ``CIFAR100`` downloads the archive when a file is missing or does
not match the official checksum. :class:`OfflineCIFAR100` reads the same files
with the same loader, but never downloads: a missing file is an error naming
the folder and the official archive, and a file whose md5 differs from the
official one is an error naming it. ``check_md5=False`` accepts files in the
official layout that are not the official ones (the synthetic data of
:mod:`kcla_mm.datasets.synthetic_cls`).
"""
import os.path as osp
from typing import List

import mmengine.dist as dist
from mmengine.fileio import exists, join_path
from mmpretrain.datasets import CIFAR100
from mmpretrain.datasets.utils import check_md5


class OfflineCIFAR100(CIFAR100):
    """mmpretrain's ``CIFAR100`` without the download, with an optional checksum.

    Registered as ``OfflineCIFAR100`` in mmpretrain's ``DATASETS``.

    Args:
        data_root: the folder holding ``cifar-100-python/`` (``train``,
            ``test`` and ``meta`` pickles, as extracted from the official
            ``cifar-100-python.tar.gz``).
        split: ``'train'`` or ``'test'``.
        check_md5: compare each file with the official archive's md5 (default);
            ``False`` for synthetic files in the official layout.
        **kwargs: ``CIFAR100`` arguments (``pipeline``, ``test_mode``, ...);
            ``download=True`` is refused.
    """

    def __init__(self, data_root: str = '', split: str = 'train', check_md5: bool = True,
                 download: bool = False, **kwargs) -> None:
        if download:
            raise ValueError('OfflineCIFAR100 never downloads (download=True was given); '
                             f'extract {self.url} into {data_root!r} instead')
        if split not in ('train', 'test'):
            raise ValueError(f"split must be 'train' or 'test', got split={split!r}")
        if not isinstance(check_md5, bool):
            raise ValueError(f'check_md5 must be True or False, got check_md5={check_md5!r}')
        self.check_md5 = check_md5
        self._md5_checked = False
        super().__init__(data_root=data_root, split=split, download=False, **kwargs)

    def _files(self) -> List[List[str]]:
        meta = [self.meta['filename'], self.meta['md5']]
        return self.train_list + self.test_list + [meta]

    def _check_integrity(self) -> bool:
        """Raise a clear error for a missing or (with ``check_md5``) foreign file."""
        folder = join_path(self.data_prefix['root'], self.base_folder)
        missing = [name for name, _ in self._files() if not exists(join_path(folder, name))]
        if missing:
            raise FileNotFoundError(
                f'CIFAR-100 files {missing} not found in {folder}: download {self.url} '
                f'(md5 {self.tgz_md5}) and extract it into {self.data_prefix["root"]} '
                f'(it creates {self.base_folder}/); kcla_mm never downloads it. For '
                'synthetic data: python -m kcla_mm.datasets.synthetic_cls cifar100 '
                f'--out {self.data_prefix["root"]}, with check_md5=False')
        if self.check_md5 and not self._md5_checked and dist.is_main_process():
            for name, md5 in self._files():
                path = join_path(folder, name)
                if not check_md5(path, md5):
                    raise ValueError(
                        f'{path} is not the official CIFAR-100 file (md5 differs from {md5}); '
                        f'extract it again from {self.url}, or set check_md5=False for '
                        'synthetic data in the official layout')
            self._md5_checked = True
        return True

    def extra_repr(self) -> List[str]:
        folder = osp.join(self.data_prefix['root'], self.base_folder)
        return super().extra_repr() + [
            f'Checksums: \t{"official md5" if self.check_md5 else "off"}', f'Folder: \t{folder}']

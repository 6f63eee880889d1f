"""Loading transforms whose errors name the file they were reading.

mmcv's ``LoadImageFromFile`` and the hosts' ``LoadAnnotations`` let decoder
errors through unchanged, and some of those do not name the file: OpenCV's
``!buf.empty()`` assertion for an empty image file, PIL's ``cannot identify
image file <_io.BytesIO ...>`` for a corrupted mask. In a data set of
thousands of files such an error leaves the user to bisect. The classes here
are those transforms with one change: an error that does not name the file
is re-raised as :class:`UnreadableFileError`, which does (with the original
error's type and message, and the original chained as its cause). Registered
under their own names in each host's ``TRANSFORMS`` (``LoadAnnotations...``
is mmdet's or mmseg's by the config's scope); the project's configs use them::

    dict(type='LoadImageFromFileNamingErrors'),
    dict(type='LoadAnnotationsNamingErrors'),
"""
from typing import List, Optional

from mmcv.transforms import LoadImageFromFile


class UnreadableFileError(OSError):
    """A file of a sample could not be read or decoded; the message names it."""


class _NamingErrors:
    """Mixin: re-raise an error of ``transform`` naming the files it was reading."""

    #: what the files are, for the message
    what = 'file'

    def _paths(self, results: dict) -> List[str]:
        raise NotImplementedError

    def transform(self, results: dict) -> Optional[dict]:
        try:
            return super().transform(results)
        except Exception as e:
            paths = self._paths(results)
            if not paths or any(p in str(e) for p in paths):
                raise  # already named (a missing file, mmcv's "failed to load image: ...")
            raise UnreadableFileError(
                f'cannot read the {self.what} {", ".join(paths)}: {type(e).__name__}: '
                f'{e}'.rstrip()) from e


class LoadImageFromFileNamingErrors(_NamingErrors, LoadImageFromFile):
    """mmcv's ``LoadImageFromFile`` whose errors name ``results['img_path']``.

    Same arguments and results; an empty, truncated or corrupted file raises
    :class:`UnreadableFileError` naming the file (with ``ignore_empty=True``
    the transform returns ``None`` for it, as mmcv's does).
    """

    what = 'image'

    def _paths(self, results: dict) -> List[str]:
        return [str(results['img_path'])] if results.get('img_path') is not None else []


class _AnnotationsNamingErrors(_NamingErrors):
    what = 'annotation file'

    def _paths(self, results: dict) -> List[str]:
        if getattr(self, 'with_seg', False) and results.get('seg_map_path') is not None:
            return [str(results['seg_map_path'])]
        return []


try:
    from mmdet.datasets.transforms import LoadAnnotations as _DetLoadAnnotations
except ImportError:  # mmdet not installed
    pass
else:

    class DetLoadAnnotationsNamingErrors(_AnnotationsNamingErrors, _DetLoadAnnotations):
        """mmdet's ``LoadAnnotations`` whose errors name the ``seg_map_path`` it reads.

        Same arguments and results (boxes, labels and masks come from the
        annotation file already parsed by the data set; only ``with_seg`` reads
        a file per sample).
        """


try:
    from mmseg.datasets.transforms import LoadAnnotations as _SegLoadAnnotations
except ImportError:  # mmseg not installed
    pass
else:

    class SegLoadAnnotationsNamingErrors(_AnnotationsNamingErrors, _SegLoadAnnotations):
        """mmseg's ``LoadAnnotations`` whose errors name the mask file.

        Same arguments and results; an empty, truncated or corrupted mask
        raises :class:`UnreadableFileError` naming the file.
        """

        what = 'mask'

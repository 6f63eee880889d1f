"""Test plugin: freeze a training run in the middle of saving one checkpoint.

Imported by the resume test's config (``custom_imports``). With
``KCLA_TEST_STALL_ON=iter_4.pth`` and ``KCLA_TEST_STALL_MARKER=PATH`` in the
environment, the ``os.replace`` that would move that checkpoint onto its final
name first creates ``PATH`` and then sleeps, so that the test can SIGKILL the
run while the checkpoint exists only as a temporary file. Without the
variables it does nothing.
"""
import os
import os.path as osp
import time

_STALL_ON = os.environ.get('KCLA_TEST_STALL_ON')
_MARKER = os.environ.get('KCLA_TEST_STALL_MARKER')

if _STALL_ON and _MARKER:
    _replace = os.replace

    def _stalling_replace(src, dst, *args, **kwargs):
        if osp.basename(os.fspath(dst)) == _STALL_ON:
            with open(_MARKER, 'w') as f:
                f.write(os.fspath(src))
            time.sleep(600)
        return _replace(src, dst, *args, **kwargs)

    os.replace = _stalling_replace

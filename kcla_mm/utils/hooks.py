"""Runner hooks that make checkpoint problems errors instead of warnings."""
import logging
from typing import Any, Mapping

from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.model import is_model_wrapper

from .checkpoint import CheckpointShapeError, check_checkpoint_shapes


class CheckpointShapeCheckHook(Hook):
    """Refuse a checkpoint whose tensors do not fit the model.

    mmengine loads ``load_from`` and ``--resume`` checkpoints with
    ``strict=False``: a tensor of another shape is skipped with a warning and
    the model keeps its random values, so an evaluation reports numbers of a
    partly untrained model and a resumed run fails later in the optimizer.
    Register this hook where every tensor must load (testing, resuming); not
    for fine-tuning with a new head, where mismatches are intended.
    ``tools/test.py`` registers it.

    Args:
        strict: raise :class:`~kcla_mm.utils.checkpoint.CheckpointShapeError`
            (default); ``False`` logs the same list as a warning and lets
            mmengine load the tensors that fit.

    Example:
        >>> runner.register_hook(CheckpointShapeCheckHook())  # doctest: +SKIP
    """

    priority = 'VERY_HIGH'

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict

    def after_load_checkpoint(self, runner, checkpoint: Mapping[str, Any]) -> None:
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        try:
            check_checkpoint_shapes(model, checkpoint, name='the checkpoint to resume or test')
        except CheckpointShapeError as e:
            if self.strict:
                raise
            print_log(f'{e}\nThese tensors keep the model\'s own (initial) values.',
                      logger='current', level=logging.WARNING)

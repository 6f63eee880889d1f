"""Runner hooks that make checkpoint problems errors instead of warnings."""
from typing import Any, Mapping

from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper

from .checkpoint import check_checkpoint_shapes


class CheckpointShapeCheckHook(Hook):
    """Refuse a checkpoint whose tensors do not fit the model.

    mmengine loads ``load_from`` and ``--resume`` checkpoints with
    ``strict=False``: a tensor of another shape is skipped with a warning and
    the model keeps its random values, so an evaluation reports numbers of a
    partly untrained model and a resumed run fails later in the optimizer.
    Register this hook where every tensor must load (testing, resuming); not
    for fine-tuning with a new head, where mismatches are intended.

    Example:
        >>> runner.register_hook(CheckpointShapeCheckHook())  # doctest: +SKIP
    """

    priority = 'VERY_HIGH'

    def after_load_checkpoint(self, runner, checkpoint: Mapping[str, Any]) -> None:
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        check_checkpoint_shapes(model, checkpoint, name='the checkpoint to resume or test')

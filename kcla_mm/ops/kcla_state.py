"""The state KCLA carries from block to block."""
from typing import NamedTuple

from torch import Tensor


class KCLAState(NamedTuple):
    """Recurrent state of KCLA, stored in a form that cannot overflow.

    The paper keeps raw sums ``u = sum_s w_s x_s`` and ``z = sum_s w_s``,
    which exceed the float16 range after a few blocks (``w`` reaches ``e^10``).
    This state keeps the normalised mean and the log of the normaliser
    instead, updated with the online-softmax (log-sum-exp) rule; ``u`` and ``z``
    are recovered exactly as ``u = mean * exp(log_z)``, ``z = exp(log_z)``
    (``docs/method.md``, section 6; :func:`kcla_mm.ops.kcla_reference.as_raw`).

    Attributes:
        mean: ``u / z``, the softmax-weighted mean of block outputs,
            ``[B, C, H, W]`` in the dtype of the features.
        log_z: ``log z`` per head, ``[B, G]``, float32 (float64 for float64
            features).
    """

    mean: Tensor
    log_z: Tensor

    @property
    def num_bytes(self) -> int:
        """Bytes held by the state's tensors."""
        return sum(t.numel() * t.element_size() for t in self)

"""The Backend members every data-free backend shares (child/backends/quantize.py, name_only.py, torchao_backend.py):
no state crosses layers, no boundary is ever written. A leaf module: backend.py picks the backends, these import it."""
from __future__ import annotations


class DataFree:
    """The Backend members of a data-free backend (every one but the calibrated): no state crosses layers."""

    def begin(self, index: int, boundary, fence: str = "") -> None:
        """Data-free: no state crosses layers."""

    pending = False  # data-free: no boundary, ever

    def settle(self):
        """Data-free: nothing is written in the background."""
        return None

    def commit(self, index: int):
        """Data-free: nothing beyond the shard."""
        return None

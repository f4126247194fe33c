"""FlashCore: fused exact attention for PyTorch, written in Triton."""

from flashcore.api import attention

__all__ = ["__version__", "attention"]
__version__ = "0.1.0"

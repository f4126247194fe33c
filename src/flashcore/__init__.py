"""FlashCore: fused exact attention for PyTorch, written in Triton."""

from flashcore.api import (
    attention,
    attention_varlen,
    attention_with_kvcache,
    scaled_dot_product_attention,
    use_tier,
)
from flashcore.offsets import checked
from flashcore.warmup import warmup

__all__ = [
    "__version__",
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "checked",
    "scaled_dot_product_attention",
    "use_tier",
    "warmup",
]
__version__ = "0.1.0"

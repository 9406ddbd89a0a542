"""What a transformer is: its configuration, the operations every forward pass shares, token
checks, and the training model (an ``nn.Module`` with fused attention)."""

from .config import ModelConfig
from .transformer import Transformer

__all__ = ["ModelConfig", "Transformer"]

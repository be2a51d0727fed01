"""elastic-rt: elastic, fault-tolerant launcher and runtime for multi-node PyTorch training."""

from __future__ import annotations

__version__ = "0.1.0"

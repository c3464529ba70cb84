"""carma: a collocation-aware GPU resource manager for deep-learning training."""

__version__ = "0.1.0"

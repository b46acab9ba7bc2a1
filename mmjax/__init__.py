"""mmjax: a JAX/XLA-first framework for training and serving multimodal LLMs."""

from mmjax.errors import CheckpointError, ConfigError, DataError, MmjaxError

__version__ = "0.1.0"

__all__ = ["MmjaxError", "ConfigError", "DataError", "CheckpointError", "__version__"]

"""Error types: every failure a user can cause names what is wrong and how to fix it."""


class MmjaxError(Exception):
    """Base of all errors raised on purpose by mmjax."""


class ConfigError(MmjaxError):
    """A config key is unknown, has the wrong type, or contradicts another key."""


class DataError(MmjaxError):
    """A data file, record or tokenizer is missing or malformed."""


class ModelError(MmjaxError):
    """The model was called with inputs its config does not fit (image shape, cache length, missing images)."""


class CheckpointError(MmjaxError):
    """A checkpoint is missing, incomplete, or cannot be restored onto this run."""


class DeviceMemoryError(MmjaxError):
    """A compiled step needs more device memory than the device has, or a step ran out of it."""

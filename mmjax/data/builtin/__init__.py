"""Built-in datasets, generated on first use into data.cache_dir."""

from mmjax.data.builtin.shapes import ShapesFiles, ensure_shapes_dataset

__all__ = ["ShapesFiles", "ensure_shapes_dataset"]

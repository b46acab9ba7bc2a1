"""Data: sources, built-in datasets, tokenizer + chat template, image processing, the Grain loader."""

from mmjax.data.builtin.shapes import ShapesFiles, ensure_shapes_dataset
from mmjax.data.image import decode_image, preprocess
from mmjax.data.loader import LoaderStats
from mmjax.data.pipeline import (
                                 DatasetFiles,
                                 EvalSet,
                                 load_eval_examples,
                                 make_train_dataset,
                                 open_dataset,
                                 train_source,
)
from mmjax.data.sources import open_source
from mmjax.data.tokenizer import Tokenizer, train_bpe_tokenizer

__all__ = ["DatasetFiles", "EvalSet", "LoaderStats", "ShapesFiles", "Tokenizer", "decode_image",
           "ensure_shapes_dataset", "load_eval_examples", "make_train_dataset", "open_dataset",
           "open_source", "preprocess", "train_bpe_tokenizer", "train_source"]

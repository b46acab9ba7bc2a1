"""Data: built-in datasets, tokenizer + chat template, image processing, the Grain pipeline."""

from mmjax.data.builtin.shapes import ShapesFiles, ensure_shapes_dataset
from mmjax.data.image import decode_image, preprocess
from mmjax.data.pipeline import EvalSet, load_eval_examples, make_train_dataset, open_dataset
from mmjax.data.tokenizer import Tokenizer, train_bpe_tokenizer

__all__ = ["EvalSet", "ShapesFiles", "Tokenizer", "decode_image", "ensure_shapes_dataset", "load_eval_examples",
           "make_train_dataset", "open_dataset", "preprocess", "train_bpe_tokenizer"]

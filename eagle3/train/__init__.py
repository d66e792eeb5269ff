"""``eagle3 train-draft``: train EAGLE-3 / 3.1 drafts against the runtime's own target model.

One concept per file: :mod:`~eagle3.train.data` (prompts -> token sequences),
:mod:`~eagle3.train.teacher` (aux states + target distributions from the runtime target),
:mod:`~eagle3.train.draft_module` (the trainable draft, equal to the runtime's draft),
:mod:`~eagle3.train.ttt` (training-time test loss, reduced vocabulary),
:mod:`~eagle3.train.export` (the eagle3 draft format), :mod:`~eagle3.train.trainer` (the loop).
"""

from eagle3.train.trainer import TrainOptions, print_summary, train_draft

__all__ = ["TrainOptions", "print_summary", "train_draft"]

"""``eagle3 train-draft``: train EAGLE-3 / 3.1 drafts against the runtime's own target model.

One concept per file: :mod:`~eagle3.train.data` (prompts -> token sequences, lazily),
:mod:`~eagle3.train.teacher` (aux states + target distributions, and the target's own greedy
continuations, from the runtime target), :mod:`~eagle3.train.teacher_cache` (those states on disk,
for the examples the steps use), :mod:`~eagle3.train.draft_module` (the trainable draft, equal to
the runtime's draft), :mod:`~eagle3.train.ttt` (training-time test loss, reduced vocabulary),
:mod:`~eagle3.train.acceptance` (held-out acceptance measured by the runtime),
:mod:`~eagle3.train.adapt` (the ``--adapt`` preset, target fingerprints),
:mod:`~eagle3.train.export` (the eagle3 draft format), :mod:`~eagle3.train.trainer` (the phases).
"""

from eagle3.train.adapt import RECOMMENDED_MARGIN, acceptance_fell, adapt_command, target_fingerprint
from eagle3.train.trainer import TrainOptions, print_summary, train_draft, with_preset

__all__ = ["TrainOptions", "print_summary", "train_draft", "with_preset", "adapt_command", "acceptance_fell",
           "target_fingerprint", "RECOMMENDED_MARGIN"]

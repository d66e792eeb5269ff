"""User-facing errors.

Every error a user can cause (bad input file, bad flag, wrong architecture, ...) is an
:class:`Eagle3Error`. Its message is one line that names the file, tensor or field and what was
expected. The CLI prints it without a traceback (unless ``--debug``) and exits with code 2.
"""

from __future__ import annotations


class Eagle3Error(Exception):
    """Base class of every error meant for a user. ``str(err)`` is one line."""

    exit_code: int = 2

    def __init__(self, message: str) -> None:
        # One line, always: a multi-line message would hide the cause in a CI log.
        super().__init__(" ".join(str(message).split()))


class UsageError(Eagle3Error):
    """Bad or conflicting command-line flags or API arguments."""


class CheckpointError(Eagle3Error):
    """A checkpoint file is missing, truncated, corrupt or inconsistent with its index."""


class FormatError(Eagle3Error):
    """A checkpoint is readable but is not a format eagle3 knows (unknown architecture, bad config)."""


class ShapeError(Eagle3Error):
    """A tensor has the wrong shape or dtype for what the format or the other model requires."""


class OutputExistsError(Eagle3Error):
    """The output path exists and ``--overwrite`` was not given."""


class DownloadError(Eagle3Error):
    """The Hub (or the local cache in offline mode) could not provide a repository."""


class VerifyError(Eagle3Error):
    """A manifest check failed: a file is missing, extra, or its sha256 differs."""


class OutputError(Eagle3Error):
    """The output cannot be written: disk full, read-only file system, no permission."""

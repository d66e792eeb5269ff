"""Get a model from the Hugging Face Hub (or take a local directory) -- ``eagle3 download`` and
the repo-id half of every command that accepts ``PATH_OR_REPO``.

Everything goes through ``huggingface_hub.snapshot_download``; this module only adds what a
several-hundred-GB checkpoint needs on top of it:

* allow-patterns per role (weights, index, configs, tokenizer, chat template) from
  :mod:`eagle3.checkpoint.files`; ``*.py`` remote code only with ``trust_remote_code``;
* a plan before any byte moves: ``snapshot_download(dry_run=True)`` lists the files with their sizes
  from the Hub's file metadata (``X-Linked-Size`` for LFS files) and which ones are already present.
  ``--dry-run`` prints it; otherwise it feeds a free-disk preflight that refuses up front instead of
  failing 400 GB later;
* one-line :class:`~eagle3.errors.DownloadError` messages for the ways a download fails (repo or
  revision not found, gated or unauthorized, Hub unreachable, offline and not cached).

Resume, as huggingface_hub 2.x implements it: a re-run skips every file that is already complete
(cache pointer or ``--local-dir`` metadata present); inside a run, a connection that drops mid-file
is retried with an HTTP ``Range`` from the last 10 MiB chunk written (``DOWNLOAD_CHUNK_SIZE``). The
library deliberately writes each file to a process-unique temporary name and removes it when a run
dies, so a killed run re-fetches the files that were in flight from their start (Xet-backed repos
reuse chunks through hf_xet instead). We do not second-guess that with our own partial-file logic.

Offline (``HF_HUB_OFFLINE=1``) a repo id resolves from the cache, or fails with the cache path named.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3.checkpoint.files import INDEX_FILE, REMOTE_CODE_PATTERNS, download_patterns
from eagle3.errors import DownloadError, UsageError
from eagle3.units import human_bytes

if TYPE_CHECKING:  # the reader imports torch: `eagle3 download` never needs it
    from eagle3.checkpoint import CheckpointReader

__all__ = ["DownloadResult", "FileEntry", "download", "header_view", "is_local", "print_result", "resolve"]


@dataclass(frozen=True)
class FileEntry:
    """One file of a download plan or result."""

    name: str  # path inside the repo / directory, '/'-separated
    size: int | None  # bytes; None when the Hub did not say
    will_download: bool  # False when already present (cache, --local-dir, or a local source)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "will_download": self.will_download}


@dataclass
class DownloadResult:
    """What ``download`` did (or, with ``dry_run``, would do)."""

    source: str  # what the user typed: repo id or path
    path: Path  # snapshot dir, --local-dir, or the local source itself (the would-be path for dry runs)
    local: bool  # the source was a local path: nothing was downloaded
    revision: str | None = None  # as requested (None = the default branch)
    commit: str | None = None  # resolved commit sha, when known
    files: list[FileEntry] = field(default_factory=list)
    dry_run: bool = False
    offline: bool = False  # resolved from the cache / local_dir without asking the Hub
    note: str | None = None  # why, when it was not by choice (Hub unreachable)

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)

    @property
    def download_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files if f.will_download)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "path": str(self.path),
            "local": self.local,
            "revision": self.revision,
            "commit": self.commit,
            "dry_run": self.dry_run,
            "offline": self.offline,
            "note": self.note,
            "num_files": len(self.files),
            "total_bytes": self.total_bytes,
            "download_bytes": self.download_bytes,
            "files": [f.to_json() for f in self.files],
        }


# ---------------------------------------------------------------------------------------------
# local path or repo id
# ---------------------------------------------------------------------------------------------


def _looks_like_path(s: str) -> bool:
    # A repo id is `name` or `owner/name`; anything with a path prefix, more than one '/', or a
    # file extension we read is meant as a path, and a typo in it must not become a Hub lookup.
    return (
        s.startswith((".", "/", "~"))
        or s.count("/") > 1
        or (os.sep != "/" and os.sep in s)
        or s.endswith((".safetensors", ".json"))
    )


def is_local(path_or_repo: str | os.PathLike[str]) -> bool:
    """True when ``path_or_repo`` names an existing file or directory (checked before any Hub id)."""
    return Path(path_or_repo).expanduser().exists()


def _local_or_none(path_or_repo: str | os.PathLike[str]) -> Path | None:
    p = Path(path_or_repo).expanduser()
    if p.exists():
        return p
    s = os.fspath(path_or_repo)
    if isinstance(path_or_repo, Path) or _looks_like_path(s):
        raise UsageError(f"{s}: no such file or directory")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(s)
    except HFValidationError:
        raise UsageError(f"{s!r} is neither an existing path nor a Hub repo id (owner/name)") from None
    return None


def resolve(path_or_repo: str | os.PathLike[str], *, revision: str | None = None,
            cache_dir: str | os.PathLike[str] | None = None, token: str | None = None,
            trust_remote_code: bool = False) -> Path:
    """A local path as is; a repo id -> its local snapshot directory, downloaded (default patterns)
    if needed, or taken from the cache when offline."""
    local = _local_or_none(path_or_repo)
    if local is not None:
        return local
    return download(os.fspath(path_or_repo), revision=revision, cache_dir=cache_dir, token=token,
                    trust_remote_code=trust_remote_code).path


def header_view(path_or_repo: str | os.PathLike[str], *, revision: str | None = None,
                cache_dir: str | os.PathLike[str] | None = None,
                token: str | None = None) -> tuple[Path, CheckpointReader | None]:
    """What ``inspect`` needs without the weights: a local path as is (reader ``None``: read the
    files); for a repo id, the small files (configs, index, tokenizer) in the cache plus a
    header-only :class:`CheckpointReader` built from the shards' safetensors headers, fetched with
    HTTP range requests (``HfApi.get_safetensors_metadata``). Offline, the cached snapshot is used."""
    local = _local_or_none(path_or_repo)
    if local is not None:
        return local, None
    from huggingface_hub import HfApi, constants

    repo = os.fspath(path_or_repo)
    if constants.is_offline_mode():
        return resolve(repo, revision=revision, cache_dir=cache_dir, token=token), None
    small = download(repo, revision=revision, cache_dir=cache_dir, token=token,
                     include=[*download_patterns(weights=False), INDEX_FILE])
    ctx = _ErrorContext(repo, revision, _cache_dir(cache_dir), None, False)
    with ctx.translate():
        meta = HfApi(endpoint=_endpoint(), token=token).get_safetensors_metadata(
            repo, revision=small.commit or revision)
    headers = {
        fname: {name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": list(t.data_offsets)}
                for name, t in fm.tensors.items()}
        for fname, fm in sorted(meta.files_metadata.items())
    }
    from eagle3.checkpoint import CheckpointReader

    return small.path, CheckpointReader.from_headers(small.path, headers)


# ---------------------------------------------------------------------------------------------
# download
# ---------------------------------------------------------------------------------------------


def _patterns(include: Sequence[str] | None, exclude: Sequence[str] | None,
              trust_remote_code: bool) -> tuple[list[str], list[str]]:
    allow = list(include) if include else download_patterns(trust_remote_code=trust_remote_code)
    ignore = list(exclude or [])
    if not trust_remote_code:
        # Even an explicit --include '*' must not fetch code that transformers would then execute.
        ignore += REMOTE_CODE_PATTERNS
    return allow, ignore


def _endpoint() -> str:
    """The Hub URL, read at call time: huggingface_hub freezes HF_ENDPOINT at import, which would
    ignore a value set later in the same process (notebooks, in-process tests)."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    from huggingface_hub import constants

    return Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE).expanduser()


def _existing_ancestor(p: Path) -> Path:
    p = p.absolute()
    while not p.exists() and p.parent != p:
        p = p.parent
    return p


def free_bytes(path: str | os.PathLike[str]) -> tuple[Path, int]:
    """Free bytes on the filesystem that will hold ``path`` (which may not exist yet)."""
    where = _existing_ancestor(Path(path))
    return where, shutil.disk_usage(where).free


def _preflight(repo: str, plan: list[Any], target: Path, to_local_dir: bool) -> None:
    """Refuse before downloading when the files still to be written do not fit on the target disk."""
    def needs_write(f: Any) -> bool:
        # --local-dir: a file found in the HF cache is copied, so it needs room too.
        return bool(f.will_download) or (to_local_dir and not Path(f.local_path).exists())

    todo = [f for f in plan if needs_write(f)]
    need = sum(f.file_size or 0 for f in todo)
    if need == 0:
        return
    where, free = free_bytes(target)
    if need > free:
        raise DownloadError(
            f"not enough free disk space in {where}: {repo} needs {human_bytes(need)} ({need} bytes) "
            f"for {len(todo)} file(s) but only {human_bytes(free)} ({free} bytes) are free"
        )


def _quiet_tqdm() -> type:
    """Progress-bar class for the planning pass (a few HEAD requests, nothing to watch)."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class _Quiet(hf_tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return _Quiet


def download(repo: str, *, revision: str | None = None, local_dir: str | os.PathLike[str] | None = None,
             include: Sequence[str] | None = None, exclude: Sequence[str] | None = None,
             trust_remote_code: bool = False, dry_run: bool = False,
             cache_dir: str | os.PathLike[str] | None = None, token: str | None = None,
             max_workers: int = 8) -> DownloadResult:
    """Download ``repo`` (a Hub repo id) into the HF cache or ``local_dir``; a local path is only
    reported. See the module docstring for patterns, preflight, resume and offline behaviour."""
    local = _local_or_none(repo)
    allow, ignore = _patterns(include, exclude, trust_remote_code)
    if local is not None:
        if local_dir is not None or revision is not None:
            raise UsageError(f"{repo} is a local path: --local-dir and --revision apply to Hub repos only")
        return _report_local(repo, local)

    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.file_download import repo_folder_name

    offline = constants.is_offline_mode()
    cache = _cache_dir(cache_dir)
    kwargs: dict[str, Any] = dict(
        revision=revision, cache_dir=cache, local_dir=local_dir, allow_patterns=allow,
        ignore_patterns=ignore, token=token, max_workers=max_workers, endpoint=_endpoint(),
    )
    ctx = _ErrorContext(repo, revision, cache, Path(local_dir) if local_dir else None, offline)
    with ctx.translate():
        if dry_run and offline:
            raise DownloadError(f"{repo}: --dry-run asks the Hub for file sizes, but HF_HUB_OFFLINE=1")
        plan: list[Any] | None = None
        note: str | None = None
        if not offline:
            try:
                plan = snapshot_download(repo, **kwargs, dry_run=True, tqdm_class=_quiet_tqdm())  # type: ignore[arg-type]
            except _dry_run_error() as e:
                if dry_run:
                    raise (e.__cause__ or e) from None
                # Hub unreachable, or an HTTP error: the real call below falls back to the cache
                # when it can and raises the precise error when it cannot.
                plan = None
                note = f"the Hub at {_endpoint()} could not be used ({_first_line(e.__cause__ or e)}); using the local copy"
        if plan is not None and not plan:
            raise DownloadError(_nothing_matches(ctx.what, include, exclude, trust_remote_code))
        if dry_run:
            assert plan is not None
            return _result_from_plan(repo, revision, plan, local_dir, dry_run=True)
        if plan is not None:
            storage = cache / repo_folder_name(repo_id=repo, repo_type="model")
            _preflight(repo, plan, Path(local_dir) if local_dir else storage / "blobs", local_dir is not None)
        path = Path(snapshot_download(repo, **kwargs))
    if plan is not None:
        res = _result_from_plan(repo, revision, plan, local_dir, dry_run=False)
        res.path = path
        return res
    # Offline or Hub unreachable: describe what the cache (or local_dir) holds.
    commit = path.name if local_dir is None and path.parent.name == "snapshots" else None
    files = [FileEntry(n, s, False) for n, s in _walk(path, allow, ignore)]
    return DownloadResult(repo, path, False, revision, commit, files, offline=True, note=note)


def _nothing_matches(what: str, include: Sequence[str] | None, exclude: Sequence[str] | None,
                     trust_remote_code: bool) -> str:
    if include and not trust_remote_code and any(p.endswith(".py") for p in include):
        return f"{what}: remote code (*.py) is only downloaded with --trust-remote-code"
    pats = f"--include {' '.join(include)}" if include else "the default patterns (weights, configs, tokenizer)"
    if exclude:
        pats += f" minus --exclude {' '.join(exclude)}"
    return f"{what}: no file in the repo matches {pats}"


def _result_from_plan(repo: str, revision: str | None, plan: list[Any],
                      local_dir: str | os.PathLike[str] | None, dry_run: bool) -> DownloadResult:
    files = sorted((FileEntry(f.filename, f.file_size, bool(f.will_download)) for f in plan),
                   key=lambda f: f.name)
    commit = plan[0].commit_hash
    if local_dir is not None:
        path = Path(local_dir).expanduser().absolute()
    else:
        # local_path = <snapshot dir>/<filename>; the plan is never empty here
        path = Path(plan[0].local_path)
        for _ in plan[0].filename.split("/"):
            path = path.parent
    return DownloadResult(repo, path, False, revision, commit, files, dry_run=dry_run)


def _walk(root: Path, allow: list[str] | None, ignore: list[str] | None) -> list[tuple[str, int]]:
    """Files under ``root`` that the patterns select (the HF cache snapshot may hold more)."""
    from huggingface_hub.utils import filter_repo_objects

    if root.is_file():
        return [(root.name, root.stat().st_size)]
    names = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        # --local-dir bookkeeping (.cache/huggingface) is not part of the model
        dirnames[:] = [d for d in dirnames if not (d == ".cache" and Path(dirpath) == root)]
        for fn in filenames:
            names.append((Path(dirpath) / fn).relative_to(root).as_posix())
    keep = filter_repo_objects(sorted(names), allow_patterns=allow, ignore_patterns=ignore)
    return [(n, (root / n).stat().st_size) for n in keep]


def _report_local(source: str, path: Path) -> DownloadResult:
    # A local directory is listed as it is: every file, not just what the patterns would fetch.
    files = [FileEntry(n, s, False) for n, s in _walk(path, None, None)]
    return DownloadResult(source, path, True, files=files)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def _dry_run_error() -> type[BaseException]:
    from huggingface_hub.errors import DryRunError

    return DryRunError


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Network-level exception classes of whichever HTTP client this huggingface_hub uses."""
    out: list[type[BaseException]] = []
    for mod in ("httpx2", "httpx", "requests"):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        cls = getattr(m, "TransportError", None) or getattr(getattr(m, "exceptions", None), "ConnectionError", None)
        if isinstance(cls, type):
            out.append(cls)
    return tuple(out)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@dataclass
class _ErrorContext:
    repo: str
    revision: str | None
    cache: Path
    local_dir: Path | None
    offline: bool

    @property
    def what(self) -> str:
        return self.repo + (f" (revision {self.revision!r})" if self.revision else "")

    @property
    def where(self) -> Path:
        return self.local_dir if self.local_dir is not None else self.cache

    @contextlib.contextmanager
    def translate(self) -> Iterator[None]:
        from huggingface_hub import errors as hfe

        endpoint = _endpoint()
        try:
            yield
        except (DownloadError, UsageError):
            raise
        except hfe.RevisionNotFoundError:
            raise DownloadError(f"{self.repo}: revision {self.revision!r} not found on {endpoint}") from None
        except hfe.GatedRepoError:
            raise DownloadError(
                f"{self.repo} is a gated repo: accept its terms at {endpoint}/{self.repo} and use a token "
                "with access (--token, HF_TOKEN or `hf auth login`)"
            ) from None
        except hfe.RepositoryNotFoundError:
            raise DownloadError(
                f"{self.repo}: repository not found on {endpoint} (check the id; a private repo needs "
                "--token or HF_TOKEN)"
            ) from None
        except hfe.IncompleteSnapshotError as e:
            why = "HF_HUB_OFFLINE=1" if self.offline else f"the Hub at {endpoint} is unreachable"
            raise DownloadError(
                f"{self.what}: the copy in {e.snapshot_path or self.where} is incomplete and {why}; "
                "re-run the download online to finish it"
            ) from None
        except hfe.LocalEntryNotFoundError:
            if self.offline:
                raise DownloadError(
                    f"{self.what} is not in {self.where} and HF_HUB_OFFLINE=1 forbids downloading it; "
                    "run `eagle3 download` once online (or unset HF_HUB_OFFLINE)"
                ) from None
            raise DownloadError(
                f"cannot reach the Hub at {endpoint} and {self.what} is not in {self.where}"
            ) from None
        except hfe.HfHubHTTPError as e:
            status = e.response.status_code if e.response is not None else None
            if status == 401:
                raise DownloadError(f"{self.repo}: unauthorized (HTTP 401) at {endpoint}: the token is invalid") from None
            raise DownloadError(f"{self.repo}: the Hub answered an error: {_first_line(e)}") from None
        except hfe.DryRunError as e:
            raise DownloadError(f"{self.what}: cannot list files on {endpoint}: {_first_line(e.__cause__ or e)}") from None
        except _transport_errors() as e:
            raise DownloadError(f"network error talking to {endpoint} about {self.what}: "
                                f"{type(e).__name__}: {_first_line(e)}") from None
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise DownloadError(f"disk full while downloading {self.what} into {self.where}") from None
            raise DownloadError(f"{self.what}: download failed: {_first_line(e)}") from None


# ---------------------------------------------------------------------------------------------
# printing
# ---------------------------------------------------------------------------------------------


def print_result(result: DownloadResult) -> None:
    """Human summary. Downloads print the directory alone on stdout (so ``$(eagle3 download X)``
    works) and the summary on stderr; dry runs print the file table on stdout."""
    out, err = sys.stdout, sys.stderr
    n = len(result.files)
    if result.dry_run:
        for f in result.files:
            mark = "download" if f.will_download else "present"
            out.write(f"{human_bytes(f.size):>10}  {mark:8}  {f.name}\n")
        at = f" at {result.commit[:12]}" if result.commit else ""
        out.write(
            f"{result.source}{at}: {n} files, {human_bytes(result.total_bytes)} total "
            f"({result.total_bytes} bytes), {human_bytes(result.download_bytes)} to download "
            f"({result.download_bytes} bytes) -> {result.path}\n"
        )
        return
    if result.local:
        err.write(f"{result.source} is a local path: {n} files, {human_bytes(result.total_bytes)}; nothing to download\n")
    else:
        at = f"@{result.commit[:12]}" if result.commit else ""
        how = "from the local copy" if result.offline else f"{human_bytes(result.download_bytes)} downloaded"
        if result.note:
            err.write(f"warning: {result.note}\n")
        err.write(f"{result.source}{at}: {n} files, {human_bytes(result.total_bytes)} ({how})\n")
    out.write(f"{result.path}\n")


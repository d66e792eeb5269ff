"""GSM8K exactly as lm-evaluation-harness's ``gsm8k`` task (version 3.0) defines it.

- Data: ``openai/gsm8k`` ``main`` (train 7473 / test 1319 rows, keys ``question`` / ``answer``). By
  default the copy that ships inside this package (``eagle3/validate/data/gsm8k``: the
  openai/grade-school-math files, gzipped, MIT licence; see the README there), so validation never
  needs the Hub; or a local directory in the same layout (``train.jsonl``, ``test.jsonl``); or
  ``"hub"``: the Hub dataset through huggingface_hub. The whole data set ships, not a sample: lm-eval
  draws each document's few-shot exemplars from the full train split (the draw depends on its
  length), so only the full split reproduces its prompts.
- Prompt: ``num_fewshot`` (5) exemplars drawn from the train split with ``random.Random(1234)``
  (lm-eval's default few-shot seed), ``rnd.sample(train, n)`` once per test document in document
  order; each exemplar is ``"Question: {q}\\nAnswer:" + " " + answer + "\\n\\n"``; then
  ``"Question: {q}\\nAnswer:"``.
- Generation: greedy (temperature 0), stop at ``["Question:", "</s>", "<|im_end|>"]``, 256 new tokens
  (lm-eval's default ``max_gen_toks``), ``seed`` 1234 as lm-eval sends it.
- Scoring: ``strict-match`` takes the first ``#### (-?[0-9.,]+)`` match, ``flexible-extract`` the
  last ``(-?[$0-9.,]{2,})|(-?[0-9]+)`` match (first non-empty group), ``[invalid]`` when none;
  ``exact_match`` removes ``,``, ``$``, everything through the last ``#### `` and a final ``.``
  from prediction and reference, lower-cases both and compares. The standard error is the
  sample standard deviation over ``sqrt(n)`` (lm-eval's ``mean_stderr``).

The tests check every piece against lm-eval's own code (task building, RegexFilter,
``exact_match_hf_evaluate``) rather than against this docstring. lm-eval is not imported at run
time: it is an optional, heavy dependency, and these few definitions are its contract.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.errors import DownloadError, UsageError

HUB_REPO = "openai/gsm8k"
HUB = "hub"  # ``--dataset hub``: the Hub dataset instead of the packaged copy
PACKAGED = "eagle3/validate/data/gsm8k"  # how reports name the packaged copy
HUB_FILES = {"train": "main/train-00000-of-00001.parquet", "test": "main/test-00000-of-00001.parquet"}
NUM_FEWSHOT = 5
FEWSHOT_SEED = 1234  # lm_eval.evaluator's default fewshot_random_seed
REQUEST_SEED = 1234  # lm-eval's TemplateAPI sends "seed": 1234 with every request
MAX_GEN_TOKS = 256  # lm_eval.defaults.DEFAULT_MAX_GEN_TOKS
STOP = ("Question:", "</s>", "<|im_end|>")
TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"
FALLBACK = "[invalid]"
STRICT_PATTERN = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE_PATTERN = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
IGNORE_REGEXES = (",", "\\$", "(?s).*#### ", "\\.$")
FILTERS = ("strict-match", "flexible-extract")


@dataclass(frozen=True)
class Doc:
    question: str
    answer: str  # the full worked solution, ending "#### <number>"


# -- data ----------------------------------------------------------------------------------------
def read_jsonl(path: Path, ok: Callable[[Any], bool], expected: str) -> list[Any]:
    """The rows of a JSON-lines file (blank lines skipped); one line naming the file and line
    number for a row that is not JSON or that ``ok`` refuses (``expected`` says what it wants)."""
    rows = []
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UsageError(f"{path}:{n}: not JSON ({err})") from err
            if not ok(row):
                raise UsageError(f"{path}:{n}: expected {expected}")
            rows.append(row)
    return rows


def _read_jsonl(path: Path) -> list[Doc]:
    """The rows of a GSM8K split file. Parsed once per process and file version: the full split is
    read whatever ``--limit`` (lm-eval's draw needs its length), ~0.1 CPU-s for the packaged copy,
    which a Python API user or a test session validating many times paid on every run."""
    st = path.stat()
    return list(_read_jsonl_once(str(path), st.st_ino, st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=4)  # both splits of two data sets; a file replaced or rewritten is another key
def _read_jsonl_once(path: str, ino: int, size: int, mtime_ns: int) -> tuple[Doc, ...]:
    rows = read_jsonl(Path(path), lambda r: isinstance(r, dict) and "question" in r and "answer" in r,
                      "a JSON object with 'question' and 'answer'")
    docs = tuple(Doc(str(r["question"]), str(r["answer"])) for r in rows)
    if not docs:
        raise UsageError(f"{path}: no rows")
    return docs


def _read_parquet(path: Path) -> list[Doc]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:  # pyarrow comes with the eval extra (lm-eval -> datasets)
        raise UsageError("reading GSM8K from the Hub needs pyarrow: pip install 'eagle3[eval]'") from err
    table = pq.read_table(path, columns=["question", "answer"])
    return [Doc(q, a) for q, a in zip(table.column("question").to_pylist(), table.column("answer").to_pylist(),
                                      strict=True)]


def packaged_files() -> dict[str, Path]:
    """The packaged copy's files (gzipped JSON lines, the openai/grade-school-math layout), by split."""
    from importlib import resources

    root = Path(str(resources.files("eagle3.validate") / "data" / "gsm8k"))
    return {split: root / f"{split}.jsonl.gz" for split in ("train", "test")}


def dataset_name(dataset: str | Path | None) -> str:
    """How a report names where the data came from."""
    if dataset is None:
        return PACKAGED
    return HUB_REPO if str(dataset) == HUB else str(dataset)


def load_dataset(dataset: str | Path | None = None) -> tuple[list[Doc], list[Doc]]:
    """(train, test) from ``dataset``: None for the packaged copy, a directory with train.jsonl and
    test.jsonl, or ``"hub"`` for the Hub dataset ``openai/gsm8k`` (cached by huggingface_hub;
    HF_HUB_OFFLINE=1 uses the cache only)."""
    if dataset is None:
        files = packaged_files()
        return _read_jsonl(files["train"]), _read_jsonl(files["test"])
    if str(dataset) != HUB:
        d = Path(dataset)
        if not d.is_dir():
            raise UsageError(f"--dataset {d}: not a directory (expected train.jsonl and test.jsonl in it)")
        missing = [n for n in ("train.jsonl", "test.jsonl") if not (d / n).is_file()]
        if missing:
            raise UsageError(f"--dataset {d}: missing {', '.join(missing)} (the openai/grade-school-math layout)")
        return _read_jsonl(d / "train.jsonl"), _read_jsonl(d / "test.jsonl")
    from huggingface_hub import hf_hub_download

    out = []
    for split in ("train", "test"):
        try:
            path = hf_hub_download(HUB_REPO, HUB_FILES[split], repo_type="dataset")
        except Exception as err:  # offline, no cache, gated, ...: one line naming the way out
            raise DownloadError(f"cannot get {HUB_REPO} ({split}) from the Hub: {type(err).__name__}: "
                                f"{str(err).splitlines()[0] if str(err) else ''}; pass --dataset DIR "
                                f"(train.jsonl + test.jsonl)") from err
        out.append(_read_parquet(Path(path)))
    return out[0], out[1]


# -- prompts -------------------------------------------------------------------------------------
def doc_to_text(doc: Doc) -> str:
    return f"Question: {doc.question}\nAnswer:"


def exemplar(doc: Doc) -> str:
    """One solved problem as lm-eval writes it into a few-shot prompt."""
    return doc_to_text(doc) + TARGET_DELIMITER + doc.answer + FEWSHOT_DELIMITER


def fewshot_prompt(shots: Sequence[Doc], doc: Doc) -> str:
    """``doc``'s question after the solved problems ``shots``, as lm-eval joins a few-shot prompt."""
    return "".join(exemplar(d) for d in shots) + doc_to_text(doc)


def build_prompts(train: Sequence[Doc], test: Sequence[Doc], num_fewshot: int = NUM_FEWSHOT,
                  limit: int | None = None, seed: int = FEWSHOT_SEED) -> list[str]:
    """The prompts lm-eval sends for the first ``limit`` test documents.

    lm-eval keeps one ``random.Random(seed)`` for the task and calls ``rnd.sample(train, n)``
    per document in document order, so document ``i``'s exemplars depend on the ones before it;
    ``Random.sample`` depends only on the population's length, so sampling indices is the same."""
    if num_fewshot < 0:
        raise UsageError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    if num_fewshot > len(train):
        raise UsageError(f"--num-fewshot {num_fewshot} exceeds the {len(train)} train rows")
    docs = test if limit is None else test[:limit]
    rnd = random.Random(seed)
    prompts = []
    for doc in docs:
        shots = rnd.sample(range(len(train)), num_fewshot) if num_fewshot else []
        prompts.append(fewshot_prompt([train[i] for i in shots], doc))
    return prompts


def request_body(prompt: str, model: str | None, max_tokens: int = MAX_GEN_TOKS) -> dict[str, Any]:
    """The /v1/completions body lm-eval's ``local-completions`` sends for one gsm8k document
    (``do_sample`` is dropped by lm-eval; no EOS string is added: the server stops at EOS)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "stop": list(STOP), "seed": REQUEST_SEED}
    if model is not None:
        body["model"] = model
    return body


# -- scoring -------------------------------------------------------------------------------------
def regex_extract(response: str, pattern: re.Pattern[str], group_select: int = 0, fallback: str = FALLBACK) -> str:
    """lm-eval's ``RegexFilter``: ``findall``, pick ``group_select``, first non-empty group, strip."""
    if not isinstance(response, str):
        response = ""
    matches = pattern.findall(response)
    if not matches:
        return fallback
    match = matches[group_select]
    if isinstance(match, tuple):
        groups = [m for m in match if m]
        match = groups[0] if groups else fallback
    return match.strip()


def strict_match(response: str) -> str:
    return regex_extract(response, STRICT_PATTERN, 0)


def flexible_extract(response: str) -> str:
    return regex_extract(response, FLEXIBLE_PATTERN, -1)


def normalize(text: str) -> str:
    """``exact_match`` with gsm8k's ``regexes_to_ignore`` and ``ignore_case``."""
    for pattern in IGNORE_REGEXES:
        text = re.sub(pattern, "", text)
    return text.lower()


def exact_match(prediction: str, reference: str) -> bool:
    return normalize(prediction) == normalize(reference)


def mean_stderr(values: Sequence[float]) -> float:
    """Sample standard deviation / sqrt(n), as lm-eval reports ``exact_match_stderr``."""
    n = len(values)
    if n < 2:
        return float("nan")
    mu = sum(values) / n
    return math.sqrt(sum((x - mu) ** 2 for x in values) / (n - 1)) / math.sqrt(n)


@dataclass
class Scored:
    strict: str
    flexible: str
    strict_correct: bool
    flexible_correct: bool


def score_one(completion: str, doc: Doc) -> Scored:
    s, f = strict_match(completion), flexible_extract(completion)
    return Scored(s, f, exact_match(s, doc.answer), exact_match(f, doc.answer))


def accuracy(scored: Sequence[Scored]) -> dict[str, dict[str, float]]:
    """``{"strict-match": {"exact_match", "stderr"}, "flexible-extract": {...}}``."""
    out = {}
    for name, attr in (("strict-match", "strict_correct"), ("flexible-extract", "flexible_correct")):
        vals = [1.0 if getattr(s, attr) else 0.0 for s in scored]
        out[name] = {"exact_match": sum(vals) / len(vals) if vals else float("nan"), "stderr": mean_stderr(vals)}
    return out

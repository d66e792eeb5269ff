"""The two-pass reference comparison: a served model against its source, through any
OpenAI-compatible server (eagle3, vLLM, SGLang, ATOM).

Kimi-K2.5's source checkpoint and its quantized copy do not fit on one node together, so the
comparison runs in two passes, the way llama.cpp's ``perplexity --kl-divergence`` records the base
model's logits once and compares later:

1. :func:`record` (``eagle3 validate --record-reference REF`` against the source's server): per
   prompt, the prompt's token ids (the server's ``/tokenize``, or a local tokenizer), the source's
   greedy continuation as token ids and its top-N log-probabilities at every generated position,
   the continuation's text (scored later for answer flips) and, per workload, the speculative
   acceptance the server reports. Written as gzipped JSON lines (:func:`write`).
2. :func:`teacher_force` (``eagle3 validate --reference REF`` against the served model): the
   recorded prompt + continuation is sent back as one token-id prompt with ``echo``, ``logprobs: N``
   and ``max_tokens: 1`` (lm-eval's loglikelihood request; SGLang refuses ``max_tokens: 0``), which
   returns the served model's top-N at every recorded position under the source's context;
   :func:`compare` turns both into the numbers of :mod:`eagle3.validate.quality`.

Token identity: the requests ask for ``return_tokens_as_token_ids`` (vLLM's and eagle3's
``"token_id:123"`` strings: detokenized strings collide) and ``return_token_ids`` (vLLM and SGLang:
the ids beside the text). A server that answers with token text only is compared by text, and a
reference recorded one way cannot be compared the other way (one line, exit 2).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from eagle3.errors import UsageError
from eagle3.validate.endpoint import api_root, client_options, headers

FORMAT = "eagle3.reference"
VERSION = 1
DEFAULT_LOGPROBS = 20  # vLLM's default --max-logprobs: the most every engine returns by default
REQUEST_SEED = 1234
_TIMEOUT_S = 6 * 3600.0
_TOKEN_ID_PREFIX = "token_id:"


class ReferenceError(UsageError):
    """A reference file or a server that cannot take part in the comparison (exit 2)."""


class PromptItem(Protocol):
    """What the comparison needs of one validation item (:class:`eagle3.validate.workloads.Item`)."""

    workload: str
    id: str
    category: str | None
    prompt: str | None  # completion prompt text, or None for a chat item
    messages: Any  # the first turn's chat messages (rendered by the server's chat template), or None
    followups: tuple[str, ...]  # later user turns
    stop: tuple[str, ...]
    max_tokens: int

    @property
    def num_turns(self) -> int: ...

    def messages_for(self, answers: Sequence[str] = ()) -> list[dict[str, Any]]: ...


def prompt_digest(item: PromptItem) -> str:
    """sha256 of what the item sends (prompt text, or messages and later user turns), and of how
    much it may generate: "the same prompts"."""
    payload = {"prompt": item.prompt, "messages": list(item.messages) if item.messages is not None else None,
               "followups": list(item.followups), "stop": list(item.stop), "max_tokens": item.max_tokens}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


@dataclass
class TurnPrompt:
    """One request of an item: the text prompt, or the conversation up to turn ``turn``."""

    prompt: str | None
    messages: list[dict[str, Any]] | None


def turn_prompt(item: PromptItem, answers: Sequence[str]) -> TurnPrompt:
    """Turn ``len(answers)`` of ``item``; later turns carry the source's own earlier answers (the
    served model is compared under the source's conversation, as under its context)."""
    if item.prompt is not None:
        return TurnPrompt(item.prompt, None)
    return TurnPrompt(None, item.messages_for(answers))


# -- the file ------------------------------------------------------------------------------------
@dataclass
class RefItem:
    """One prompt of the reference: the source's greedy continuation and its top-N per position."""

    workload: str
    id: str
    turn: int  # 0: the first request of the item; MT-Bench's second turn is 1
    category: str | None
    prompt_sha256: str
    prompt_ids: list[int]
    tokens: list[Any]  # token ids, or token texts for a server that gives no ids
    top: list[dict[Any, float]]  # per position: token -> logprob (the source's top N)
    text: str
    finish_reason: str | None = None

    @property
    def key(self) -> tuple[str, str, int]:
        return self.workload, self.id, self.turn


@dataclass
class Reference:
    header: dict[str, Any]
    items: list[RefItem] = field(default_factory=list)

    @property
    def logprobs(self) -> int:
        return int(self.header["logprobs"])

    @property
    def token_ids(self) -> bool:
        return bool(self.header.get("token_ids", True))

    def by_key(self) -> dict[tuple[str, str, int], RefItem]:
        return {it.key: it for it in self.items}


def _encode_top(top: dict[Any, float]) -> list[list[Any]]:
    # JSON objects have string keys only: a list of pairs keeps int ids ints
    return [[k, v] for k, v in top.items()]


def write(path: Path, ref: Reference) -> None:
    """Gzipped JSON lines (header first, one line per prompt), written aside and renamed."""
    from eagle3.checkpoint.jsonio import strict_json
    from eagle3.checkpoint.rawio import write_aside

    def lines(tmp: Path) -> None:
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            f.write(json.dumps(strict_json(dict(ref.header, items=len(ref.items))), allow_nan=False) + "\n")
            for it in ref.items:
                row = asdict(it)
                row["top"] = [_encode_top(t) for t in it.top]
                f.write(json.dumps(row) + "\n")

    write_aside(Path(path), lines)


_ITEM_FIELDS = {"workload": str, "id": str, "turn": int, "prompt_sha256": str, "prompt_ids": list, "tokens": list,
                "top": list, "text": str}


def read(path: Path) -> Reference:
    """The reference at ``path``; one line naming the file, line and field when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise ReferenceError(f"--reference {path}: no such file (record one with --record-reference)")
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise ReferenceError(f"{path}: not a reference file eagle3 wrote (gzipped JSON lines): {err}") from err
    rows = []
    for n, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ReferenceError(f"{path}:{n}: not JSON ({err})") from err
    if not rows or not isinstance(rows[0], dict) or rows[0].get("format") != FORMAT:
        raise ReferenceError(f"{path}: not an eagle3 reference (its first line has no \"format\": \"{FORMAT}\")")
    header = rows[0]
    if header.get("version") != VERSION:
        raise ReferenceError(f"{path}: reference format version {header.get('version')!r}; this eagle3 reads {VERSION}")
    if not isinstance(header.get("logprobs"), int) or header["logprobs"] < 1:
        raise ReferenceError(f"{path}:1: field 'logprobs' must be a positive integer")
    acceptance = header.get("acceptance", {})
    if not isinstance(acceptance, dict) or not all(v is None or isinstance(v, dict) for v in acceptance.values()):
        raise ReferenceError(f"{path}:1: field 'acceptance' must be an object of per-workload counters")
    if header.get("items") != len(rows) - 1:
        raise ReferenceError(f"{path}: header says {header.get('items')} prompts, the file has {len(rows) - 1} "
                             f"(truncated?)")
    items = [_item(path, n, row) for n, row in enumerate(rows[1:], 2)]
    return Reference(header, items)


def _item(path: Path, n: int, row: Any) -> RefItem:
    if not isinstance(row, dict):
        raise ReferenceError(f"{path}:{n}: expected a JSON object")
    for name, typ in _ITEM_FIELDS.items():
        if not isinstance(row.get(name), typ):
            raise ReferenceError(f"{path}:{n}: field {name!r} must be a {typ.__name__}")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in row["prompt_ids"]):
        raise ReferenceError(f"{path}:{n}: field 'prompt_ids' must be a list of token ids (integers >= 0)")
    if not all(isinstance(t, (int, str)) and not isinstance(t, bool) for t in row["tokens"]):
        raise ReferenceError(f"{path}:{n}: field 'tokens' must be a list of token ids or token texts")
    if len(row["top"]) != len(row["tokens"]):
        raise ReferenceError(f"{path}:{n}: {len(row['tokens'])} tokens but {len(row['top'])} top-logprob entries")
    try:
        top = [{(k if isinstance(k, str) else int(k)): float(v) for k, v in pairs} for pairs in row["top"]]
    except (TypeError, ValueError) as err:
        raise ReferenceError(f"{path}:{n}: field 'top' must be lists of [token, logprob] pairs") from err
    return RefItem(row["workload"], row["id"], row["turn"], row.get("category"), row["prompt_sha256"],
                   list(row["prompt_ids"]), list(row["tokens"]), top, row["text"],
                   row.get("finish_reason"))


# -- talking to a server -------------------------------------------------------------------------
class ServerError(ReferenceError):
    """The server cannot take part (no logprobs, no token ids, refuses N...)."""


def _token_key(tok: Any) -> Any:
    """``"token_id:123"`` -> 123; anything else is a token's text."""
    if isinstance(tok, str) and tok.startswith(_TOKEN_ID_PREFIX) and tok[len(_TOKEN_ID_PREFIX):].isdigit():
        return int(tok[len(_TOKEN_ID_PREFIX):])
    return tok


def _top_map(entry: Any) -> dict[Any, float]:
    if not isinstance(entry, dict):
        return {}
    return {_token_key(k): float(v) for k, v in entry.items() if v is not None}


@dataclass
class Client:
    """The few endpoints the comparison uses, on one server."""

    base_url: str
    model: str | None
    api_key: str | None = None
    tokenizer: Any = None  # a local tokenizer (``--tokenizer DIR``) instead of the server's /tokenize
    concurrency: int = 8

    def _http(self) -> Any:
        import httpx

        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        return httpx.AsyncClient(timeout=httpx.Timeout(_TIMEOUT_S, connect=30.0), limits=limits,
                                 **client_options(self.base_url))

    async def _post(self, client: Any, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        r = await client.post(api_root(self.base_url) + path, json=body, headers=headers(self.api_key))
        try:
            data = r.json()
        except ValueError:
            data = {"error": {"message": r.text[:300]}}
        return r.status_code, data

    async def prompt_ids(self, client: Any, item: TurnPrompt) -> list[int]:
        """The item's prompt as the server tokenizes it (``/tokenize``, vLLM's and eagle3's; SGLang's
        ``/v1/tokenize`` takes text only), or as the local tokenizer does."""
        if self.tokenizer is not None:
            return _local_ids(self.tokenizer, item)
        body: dict[str, Any] = ({"prompt": item.prompt, "add_special_tokens": False} if item.messages is None
                                else {"messages": item.messages, "add_generation_prompt": True})
        if self.model:
            body["model"] = self.model
        last = ""
        for path in ("/tokenize", "/v1/tokenize"):
            status, data = await self._post(client, path, body)
            if status == 200 and isinstance(data, dict) and isinstance(data.get("tokens"), list):
                return [int(t) for t in data["tokens"]]
            last = f"{path}: HTTP {status}: {_message(data)}"
        what = "chat messages" if item.messages is not None else "prompts"
        raise ServerError(f"{self.base_url} cannot tokenize {what} ({last}); pass --tokenizer DIR "
                          f"(the model's tokenizer directory)")

    def completion_body(self, prompt_ids: list[int], n: int, **extra: Any) -> dict[str, Any]:
        body = {"prompt": prompt_ids, "temperature": 0.0, "logprobs": n, "seed": REQUEST_SEED,
                "return_tokens_as_token_ids": True, "return_token_ids": True, **extra}
        if self.model:
            body["model"] = self.model
        return body

    async def complete(self, client: Any, body: dict[str, Any]) -> dict[str, Any]:
        status, data = await self._post(client, "/v1/completions", body)
        if status != 200:
            raise ServerError(f"{self.base_url}/v1/completions refused a logprobs request: HTTP {status}: "
                              f"{_message(data)}")
        choices = data.get("choices") if isinstance(data, dict) else None
        if not choices or not isinstance(choices[0], dict):
            raise ServerError(f"{self.base_url}/v1/completions: a response without choices")
        return choices[0]

    def map(self, fn: Callable[[Any, Any], Awaitable[Any]], items: Sequence[Any],
            progress: Callable[[int, int], None] | None = None) -> list[Any]:
        """``await fn(http, item)`` for every item, at most ``concurrency`` at once; results in item
        order; ``progress(done, total)`` after each."""
        async def main() -> list[Any]:
            sem = asyncio.Semaphore(self.concurrency)
            done = 0

            async def one(http: Any, item: Any) -> Any:
                nonlocal done
                async with sem:
                    out = await fn(http, item)
                done += 1
                if progress is not None:
                    progress(done, len(items))
                return out

            async with self._http() as http:
                return list(await asyncio.gather(*(one(http, it) for it in items)))

        return asyncio.run(main())


def _message(data: Any) -> str:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message"))
    if isinstance(data, dict) and "message" in data:
        return str(data["message"])
    return str(data)[:300]


def _local_ids(tokenizer: Any, item: TurnPrompt) -> list[int]:
    if item.messages is not None:
        text = tokenizer.apply_chat_template(item.messages, tokenize=False, add_generation_prompt=True)
    else:
        text = item.prompt or ""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _logprobs_of(choice: dict[str, Any], where: str) -> dict[str, Any]:
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or not isinstance(lp.get("top_logprobs"), list):
        raise ServerError(f"{where}: the server returned no logprobs (it needs OpenAI completions "
                          f"logprobs: eagle3, vLLM and SGLang have them)")
    return lp


# -- pass 1: record ------------------------------------------------------------------------------
def record(client: Client, items: Sequence[PromptItem], n: int,
           progress: Callable[[int, int], None] | None = None) -> list[list[RefItem]]:
    """The source's greedy continuation of every turn of every item with its top-``n`` per
    position; per item, per turn (a turn after the first carries the source's earlier answers)."""
    async def one(http: Any, item: PromptItem) -> list[RefItem]:
        out: list[RefItem] = []
        for turn in range(item.num_turns):
            tp = turn_prompt(item, [r.text for r in out])
            ids = await client.prompt_ids(http, tp)
            body = client.completion_body(ids, n, max_tokens=item.max_tokens, stop=list(item.stop))
            choice = await client.complete(http, body)
            out.append(_recorded(choice, item, turn, ids, f"{client.base_url} ({item.id}, turn {turn + 1})"))
        return out

    return client.map(one, items, progress)


def _recorded(choice: dict[str, Any], item: PromptItem, turn: int, ids: list[int], where: str) -> RefItem:
    lp = _logprobs_of(choice, where)
    toks = [_token_key(t) for t in lp.get("tokens") or []]
    if isinstance(choice.get("token_ids"), list) and not all(isinstance(t, int) for t in toks):
        toks_ids = [int(t) for t in choice["token_ids"]]
        if len(toks_ids) == len(toks):
            toks = toks_ids  # ids beside text tokens (SGLang / vLLM return_token_ids)
    top = [_top_map(e) for e in lp["top_logprobs"]]
    lps = lp.get("token_logprobs") or [None] * len(toks)
    if len(top) != len(toks) or len(lps) != len(toks):
        raise ServerError(f"{where}: logprobs cover {len(top)} positions for {len(toks)} tokens")
    for t, tp, v in zip(toks, top, lps, strict=True):
        if v is not None and t not in tp:
            tp[t] = float(v)  # the chosen token is part of the distribution we compare
    return RefItem(item.workload, item.id, turn, item.category, prompt_digest(item), ids, toks, top,
                   str(choice.get("text") or ""), choice.get("finish_reason"))


def new_header(client: Client, n: int, server_info: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "logprobs": n, "model": client.model,
            "base_url": client.base_url, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "server": server_info or {}, "acceptance": {}}


# -- pass 2: check, teacher-force, compare -------------------------------------------------------
def match_items(ref: Reference, items: Sequence[PromptItem], path: Path | str) -> list[list[RefItem]]:
    """The reference's record of every turn of each item, in the items' order; one line when the
    reference was recorded on other prompts."""
    by_key = ref.by_key()
    out = []
    for it in items:
        turns = []
        for turn in range(it.num_turns):
            r = by_key.get((it.workload, it.id, turn))
            if r is None:
                raise ReferenceError(f"--reference {path}: recorded on other prompts: it has no {it.id}"
                                     + (f" turn {turn + 1}" if turn else "")
                                     + " (record it with the same --task / --limit / --num-fewshot / --max-tokens)")
            if r.prompt_sha256 != prompt_digest(it):
                raise ReferenceError(f"--reference {path}: recorded on other prompts: {it.id} differs from the "
                                     f"prompt recorded (same --task / --num-fewshot / --max-tokens / data?)")
            turns.append(r)
        out.append(turns)
    return out


def check_logprobs(ref: Reference, n: int | None, path: Path | str) -> int:
    """The N to request: the reference's; another explicit N is refused (KLD over other N differs)."""
    if n is not None and n != ref.logprobs:
        raise ReferenceError(f"--logprobs {n}: the reference {path} was recorded with {ref.logprobs} logprobs per "
                             f"position; compare with the same N")
    return ref.logprobs


def check_tokenizer(client: Client, items: Sequence[PromptItem], refs: Sequence[Sequence[RefItem]],
                    path: Path | str) -> None:
    """The served model must tokenize every prompt as the source did (else it is another tokenizer,
    and positions would not line up); later turns with the source's earlier answers."""
    pairs = [(turn_prompt(it, [r.text for r in rs[:t]]), rs[t]) for it, rs in zip(items, refs, strict=True)
             for t in range(len(rs))]
    for ids, (_, r) in zip(client.map(client.prompt_ids, [tp for tp, _ in pairs]), pairs, strict=True):
        if ids != r.prompt_ids:
            at = next((i for i, (a, b) in enumerate(zip(ids, r.prompt_ids, strict=False)) if a != b),
                      min(len(ids), len(r.prompt_ids)))
            raise ReferenceError(f"--reference {path}: {client.base_url} tokenizes {r.id}"
                                 + (f" turn {r.turn + 1}" if r.turn else "")
                                 + f" differently from the source (first difference at token {at}; {len(ids)} vs "
                                 f"{len(r.prompt_ids)} tokens): another tokenizer")


def teacher_force(client: Client, refs: Sequence[RefItem], n: int, token_ids: bool = True,
                  progress: Callable[[int, int], None] | None = None) -> list[list[dict[Any, float]]]:
    """The served model's top-``n`` at every recorded position, under the source's context."""
    async def one(http: Any, r: RefItem) -> list[dict[Any, float]]:
        if not r.tokens:
            return []
        if not all(isinstance(t, int) for t in r.tokens):
            raise ReferenceError(f"the reference's {r.workload} prompt {r.id} has token texts, not ids: "
                                 f"it cannot be sent back as a token-id prompt")
        body = client.completion_body(r.prompt_ids + list(r.tokens), n, max_tokens=1, echo=True)
        choice = await client.complete(http, body)
        return _forced(choice, r, n, token_ids, f"{client.base_url} ({r.workload} {r.id})")

    return client.map(one, refs, progress)


def _forced(choice: dict[str, Any], r: RefItem, n: int, token_ids: bool, where: str) -> list[dict[Any, float]]:
    lp = _logprobs_of(choice, where)
    tops, lps = lp["top_logprobs"], lp.get("token_logprobs") or []
    p, m = len(r.prompt_ids), len(r.tokens)
    if len(tops) < p + m or len(lps) < p + m:
        raise ServerError(f"{where}: echo returned {len(tops)} positions for a {p + m}-token prompt "
                          f"(the server must return the prompt's logprobs with echo)")
    served = []
    for j in range(m):
        top = _top_map(tops[p + j])
        if token_ids and top and not all(isinstance(k, int) for k in top):
            raise ServerError(f"{where}: the server returns token texts, not token ids, but the reference was "
                              f"recorded with ids (return_tokens_as_token_ids)")
        if len(top) < min(n, 1):
            raise ServerError(f"{where}: no top logprobs at prompt position {p + j}")
        if lps[p + j] is not None:
            top.setdefault(r.tokens[j], float(lps[p + j]))
        served.append(top)
    return served


@dataclass
class Thresholds:
    """Pass / fail of the comparison. The defaults are the edge of llama.cpp's "visible drift" band
    (mean KLD above 0.04 with 90% or fewer same top tokens: a Q3_K_M-class quant; a Q4_K_M-class
    one sits near 0.01 / 95%), and 5% of scored answers flipping (a rotation fix in gemma.cpp took
    flips from 6.0% to 2.4% at a mean KLD of 0.049)."""

    max_kld: float = 0.04  # mean per-token KLD over every compared position
    min_top1: float = 0.90  # fraction of positions whose served argmax is the source's token
    max_flips: float = 0.05  # fraction of scored answers whose correctness changed (either way)
    # A quantized target whose draft accepts this much less than on the source is worth adapting the
    # draft to (train-draft --adapt): a report line, not a failure. train-draft's own margin
    # (eagle3.train.adapt.RECOMMENDED_MARGIN, docs/train_draft.md: on the tiny pair W4A8 moved the
    # accept length +2.3% / +0.6%, MXFP4 cost 3.6-3.9%); not imported, train already imports validate.
    accept_drop: float = 0.02  # relative drop of the mean accept length

    def check(self) -> None:
        for name, v in (("--max-kld", self.max_kld), ("--min-top1", self.min_top1),
                        ("--max-flips", self.max_flips)):
            if not (v >= 0.0) or (name != "--max-kld" and v > 1.0):
                raise UsageError(f"{name} must be {'>= 0' if name == '--max-kld' else 'in [0, 1]'}, got {v}")


KLD_EDGES = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, float("inf"))
KLD_METHOD = ("KL(source || served) per generated position over the source's top-N tokens plus one bucket "
              "for the rest of the vocabulary (a lower bound of the full KL when the served top-N holds the "
              "source's; missing entries get a bounded share of the served tail)")


@dataclass
class WorkloadComparison:
    """One workload's side by side: the reference's turns, the served model's top-N at their
    positions, and each item's scored answer on both sides (None: not scored)."""

    name: str
    refs: list[RefItem]  # every turn of every item
    served: list[list[dict[Any, float]]]  # per turn: the served top-N per position
    source_correct: list[bool | None]  # per item
    served_correct: list[bool | None]


def _block(parts: Sequence[WorkloadComparison]) -> dict[str, Any]:
    from eagle3.validate import quality

    per_token: list[float] = []
    top1: list[bool] = []
    firsts: list[int | None] = []
    scored: list[tuple[bool, bool]] = []
    for part in parts:
        for r, s in zip(part.refs, part.served, strict=True):
            c = quality.compare_sequence(r.tokens, r.top, s)
            per_token += c.kld
            top1 += c.top1
            firsts.append(c.first_divergence)
        scored += [(a, b) for a, b in zip(part.source_correct, part.served_correct, strict=True)
                   if a is not None and b is not None]
    return {"kld": quality.kld_summary(per_token), "top1_agreement": sum(top1) / len(top1) if top1 else None,
            "divergence": quality.divergence_summary(firsts),
            "flips": quality.flips([a for a, _ in scored], [b for _, b in scored]) if scored else None,
            "per_token_kld": per_token}


def _accept_length(spec: dict[str, Any] | None) -> float | None:
    v = (spec or {}).get("mean_acceptance_length")
    return float(v) if isinstance(v, (int, float)) else None


def compare(ref: Reference, path: Path | str, parts: Sequence[WorkloadComparison],
            served_acceptance: dict[str, dict[str, Any] | None], thresholds: Thresholds,
            adapt_command: str | None = None) -> dict[str, Any]:
    """The report's ``reference`` section: overall and per-workload numbers, failures naming the
    metric, and a note when the draft accepts clearly less than on the source."""
    from eagle3.validate import quality

    overall = _block(parts)
    workloads: dict[str, Any] = {}
    for part in parts:
        block = _block([part])
        block.pop("per_token_kld")
        src, got = (ref.header.get("acceptance") or {}).get(part.name), served_acceptance.get(part.name)
        a, b = _accept_length(src), _accept_length(got)
        block["acceptance"] = {"source": src, "served": got,
                               "accept_length_change": (b - a) / a if a and b is not None else None}
        workloads[part.name] = block
    per_token = overall.pop("per_token_kld")
    failures = []
    k = overall["kld"]["mean"]
    if overall["kld"]["tokens"] and not k <= thresholds.max_kld:
        failures.append(f"mean per-token KLD vs the source {k:.4g} > --max-kld {thresholds.max_kld}")
    t1 = overall["top1_agreement"]
    if t1 is not None and t1 < thresholds.min_top1:
        failures.append(f"top-1 agreement with the source {t1:.4f} < --min-top1 {thresholds.min_top1}")
    fl = overall["flips"]
    if fl is not None and fl["flip_rate"] is not None and fl["flip_rate"] > thresholds.max_flips:
        failures.append(f"answer flips vs the source {fl['flips']} of {fl['questions']} ({fl['flip_rate']:.3f}) > "
                        f"--max-flips {thresholds.max_flips}")
    notes = []
    for name, w in workloads.items():
        ch = w["acceptance"]["accept_length_change"]
        if ch is not None and ch < -thresholds.accept_drop:
            line = (f"{name}: the draft's mean accept length is {100 * -ch:.1f}% below the source's "
                    f"(more than {100 * thresholds.accept_drop:.0f}%): adapt the draft to this target")
            notes.append(line + (f": {adapt_command}" if adapt_command else ""))
    return {"path": str(path), "source": {k2: ref.header.get(k2) for k2 in ("model", "base_url", "server", "created")},
            "logprobs": ref.logprobs, "kld_method": KLD_METHOD, **overall, "workloads": workloads,
            "kld_histogram": {"edges": [e if e != float("inf") else None for e in KLD_EDGES],  # JSON has no inf
                              "counts": quality.histogram(per_token, KLD_EDGES)},
            "thresholds": asdict(thresholds), "failures": failures, "notes": notes, "passed": not failures}


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The text summary of the ``reference`` block."""
    block = report.get("reference")
    if not block:
        return []
    k, d, f = block["kld"], block["divergence"], block["flips"]
    # serve --activation-quant none: the weights' share of the loss, said on the line that reports it
    weight_only = ", activations unquantized" if (report.get("server") or {}).get("activation_quant") == "none" else ""
    lines = [f"vs the source ({block['source'].get('model')}, top-{block['logprobs']} logprobs, {k['tokens']} tokens"
             f"{weight_only}): "
             f"KLD mean {_fmt(k['mean'], '.4g')} p99 {_fmt(k['p99'], '.4g')} max {_fmt(k['max'], '.4g')}  top-1 "
             f"agreement {_fmt(block['top1_agreement'], '.4f')}  identical continuations {d['identical']}/"
             f"{d['sequences']}"
             + (f", the others leave the source's text at token {_fmt(d['mean_first_divergence'], '.1f')} on average"
                if d["mean_first_divergence"] is not None else "")]
    if f:
        ci = f["accuracy_delta_ci95"]
        lines.append(f"  answer flips: {f['right_to_wrong']} right->wrong, {f['wrong_to_right']} wrong->right of "
                     f"{f['questions']}; accuracy {_fmt(f['source_accuracy'], '.4f')} -> {_fmt(f['served_accuracy'], '.4f')} "
                     f"(delta {_fmt(f['accuracy_delta'], '+.4f')}"
                     + (f", 95% CI [{ci[0]:+.4f}, {ci[1]:+.4f}])" if ci else ")"))
    for name, w in block["workloads"].items():
        a = w["acceptance"]
        src, got = (a["source"] or {}).get("mean_acceptance_length"), (a["served"] or {}).get("mean_acceptance_length")
        lines.append(f"  {name}: KLD mean {_fmt(w['kld']['mean'], '.4g')}, top-1 {_fmt(w['top1_agreement'], '.4f')}; "
                     f"mean accept length source {_fmt(src)} -> served {_fmt(got)}"
                     + (f" ({100 * a['accept_length_change']:+.1f}%)" if a["accept_length_change"] is not None else ""))
    lines += [f"  note: {n}" for n in block["notes"]]
    return lines

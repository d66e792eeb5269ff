"""The two-pass comparison against a source (``validate --record-reference`` / ``--reference``) with
eagle3 servers on both sides, and the refusals: other prompts, another N, another tokenizer, a
server without logprobs, a damaged reference file."""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from eagle3.cli import main
from eagle3.validate import reference as refmod

COMMON = ["--task", "gsm8k", "--limit", "3", "--num-fewshot", "1", "--max-tokens", "10"]


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(["validate", *args])
    out = capsys.readouterr()
    return int(e.value.code or 0), out.out, out.err


@pytest.fixture(scope="module")
def recorded(plain_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy target (no draft) recorded as the source."""
    path = tmp_path_factory.mktemp("ref") / "ref.jsonl.gz"
    with pytest.raises(SystemExit) as e:
        main(["validate", "--base-url", plain_server[0], *COMMON, "--record-reference", str(path)])
    assert (e.value.code or 0) == 0
    return path


def test_recorded_reference_holds_the_greedy_tokens_and_their_top_n(recorded: Path, plain_server: Any) -> None:
    ref = refmod.read(recorded)
    assert ref.logprobs == refmod.DEFAULT_LOGPROBS and len(ref.items) == 3
    llm = plain_server[1]
    for item in ref.items:
        assert item.workload == "gsm8k" and item.turn == 0 and 1 <= len(item.tokens) <= 10
        assert all(isinstance(t, int) for t in item.tokens) and len(item.top) == len(item.tokens)
        # each position's top-N has N entries, and the greedy token is its most likely one
        assert all(len(t) == ref.logprobs for t in item.top)
        assert [max(t, key=t.get) for t in item.top] == item.tokens
        # the recording equals the engine's own greedy output
        out = llm.generate([item.prompt_ids], _greedy(len(item.tokens)))[0]
        assert list(out.token_ids) == item.tokens


def _greedy(n: int) -> Any:
    from eagle3.runtime.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_the_same_target_speculative_or_not_matches_its_reference_exactly(
        recorded: Path, spec_server: Any, plain_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "r.json"
    code, out, err = _run(["--base-url", spec_server[0], "--baseline-url", plain_server[0], *COMMON,
                           "--reference", str(recorded), "--report", str(report)], capsys)
    assert code == 0, out + err
    full = json.loads(report.read_text())
    assert Path(full["figure"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # with the KLD histogram panel
    r = full["reference"]
    assert r["kld"]["mean"] == 0.0 and r["kld"]["max"] == 0.0 and r["top1_agreement"] == 1.0
    assert r["divergence"]["identical"] == r["divergence"]["sequences"] == 3
    assert r["flips"]["flips"] == 0 and r["passed"] and r["logprobs"] == 20
    assert r["kld_histogram"]["counts"][0] == r["kld"]["tokens"] > 0
    gsm = r["workloads"]["gsm8k"]
    assert gsm["acceptance"]["source"] is None  # recorded without a draft
    assert gsm["acceptance"]["served"]["mean_acceptance_length"] >= 1.0
    assert "vs the source" in out and "result: PASS" in out


def test_another_model_fails_the_default_thresholds_naming_the_metric(
        recorded: Path, other_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "r.json"
    code, out, _ = _run(["--base-url", other_server[0], *COMMON, "--reference", str(recorded),
                         "--report", str(report)], capsys)
    assert code == 1
    r = json.loads(report.read_text())
    block = r["reference"]
    assert block["kld"]["mean"] > 0.04 and block["top1_agreement"] < 0.9
    assert block["divergence"]["identical"] < 3
    assert any("--max-kld" in f for f in r["failures"]) and any("--min-top1" in f for f in r["failures"])
    assert "FAIL: mean per-token KLD vs the source" in out
    # generous thresholds pass the same comparison
    code, _, _ = _run(["--base-url", other_server[0], *COMMON, "--reference", str(recorded), "--max-kld", "100",
                       "--min-top1", "0", "--max-flips", "1"], capsys)
    assert code == 0


def test_refusals(recorded: Path, plain_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = plain_server[0]
    ref = ["--reference", str(recorded)]
    cases = [
        # other prompts: more of them, another few-shot count
        (["--base-url", url, *COMMON[:2], "--limit", "4", "--num-fewshot", "1", "--max-tokens", "10", *ref],
         "recorded on other prompts"),
        (["--base-url", url, *COMMON[:4], "--num-fewshot", "2", "--max-tokens", "10", *ref],
         "recorded on other prompts"),
        (["--base-url", url, *COMMON, *ref, "--logprobs", "5"], "recorded with 20 logprobs"),
        (["--base-url", url, *COMMON, "--max-kld", "0.1"], "go with --reference"),
        (["--base-url", url, *COMMON, *ref, "--record-reference", str(tmp_path / "x.gz")], "give one"),
        (["--base-url", url, *COMMON, "--record-reference", str(recorded)], "--overwrite"),
        (["--base-url", url, *COMMON, *ref, "--min-top1", "1.5"], "--min-top1 must be in [0, 1]"),
    ]
    for args, msg in cases:
        code, _, err = _run(args, capsys)
        assert code == 2 and msg in err and "Traceback" not in err, (args, err)


def _rewrite(src: Path, dst: Path, edit: Any) -> Path:
    lines = gzip.decompress(src.read_bytes()).decode().splitlines()
    with gzip.open(dst, "wt") as f:
        f.write("\n".join(edit(lines)) + "\n")
    return dst


def test_another_tokenizer_is_refused(recorded: Path, plain_server: Any, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A reference whose prompt ids are not what this server's tokenizer makes of the prompts."""
    def retokenized(lines: list[str]) -> list[str]:
        row = json.loads(lines[1])
        row["prompt_ids"][3] = (row["prompt_ids"][3] + 1) % 1000
        return [lines[0], json.dumps(row), *lines[2:]]

    other = _rewrite(recorded, tmp_path / "other-tok.jsonl.gz", retokenized)
    code, _, err = _run(["--base-url", plain_server[0], *COMMON, "--reference", str(other)], capsys)
    assert code == 2 and "another tokenizer" in err and "first difference at token 3" in err


def test_damaged_reference_files(recorded: Path, plain_server: Any, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    not_gzip = tmp_path / "plain.jsonl.gz"
    not_gzip.write_text('{"format": "eagle3.reference"}\n')
    truncated = _rewrite(recorded, tmp_path / "short.jsonl.gz", lambda lines: lines[:-1])
    bad_field = _rewrite(recorded, tmp_path / "bad.jsonl.gz",
                         lambda lines: [lines[0], lines[1].replace('"tokens": [', '"tokens": "x", "_": ['), *lines[2:]])
    other = _rewrite(recorded, tmp_path / "other.jsonl.gz", lambda lines: ['{"format": "something"}', *lines[1:]])
    bad_ids = _rewrite(recorded, tmp_path / "ids.jsonl.gz",
                       lambda lines: [lines[0], lines[1].replace('"prompt_ids": [', '"prompt_ids": ["a", '), *lines[2:]])
    bad_acc = _rewrite(recorded, tmp_path / "acc.jsonl.gz",
                       lambda lines: [lines[0].replace('"acceptance": {', '"acceptance": {"x": [1], '), *lines[1:]])
    for path, msg in ((not_gzip, "not a reference file eagle3 wrote"), (truncated, "truncated"),
                      (bad_field, f"{bad_field}:2: field 'tokens' must be a list"),
                      (bad_ids, f"{bad_ids}:2: field 'prompt_ids' must be a list of token ids"),
                      (bad_acc, f"{bad_acc}:1: field 'acceptance'"),
                      (other, "not an eagle3 reference"), (tmp_path / "missing.gz", "no such file")):
        code, _, err = _run(["--base-url", plain_server[0], *COMMON, "--reference", str(path)], capsys)
        assert code == 2 and msg in err, (path, err)


class _NoLogprobs(BaseHTTPRequestHandler):
    """An OpenAI-compatible server that answers completions without logprobs."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = {"object": "list", "data": [{"id": "x"}]} if self.path == "/v1/models" else {}
        self._reply(200 if body else 404, body)

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/tokenize":
            return self._reply(200, {"tokens": [1, 2, 3], "count": 3})
        self._reply(200, {"choices": [{"index": 0, "text": "5", "logprobs": None, "finish_reason": "stop"}]})

    def _reply(self, code: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def no_logprobs_server() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _NoLogprobs)
    # shutdown() waits for serve_forever's next poll: 0.5 s by default, idle, at every teardown
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_a_server_without_logprobs_is_refused(no_logprobs_server: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["--base-url", no_logprobs_server, *COMMON, "--record-reference",
                         str(tmp_path / "r.jsonl.gz")], capsys)
    assert code == 2 and "returned no logprobs" in err
    assert not (tmp_path / "r.jsonl.gz").exists() and not list(tmp_path.glob("*.partial"))


def _double_one_layers_scales(src: Path, dst: Path, layer: int = 2) -> int:
    """A copy of a quantized checkpoint with one layer's expert down_proj weight scales doubled (a
    broken export): every other file as it is."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    changed = 0
    for f in sorted(dst.glob("*.safetensors")):
        tensors = load_file(f)
        keys = [k for k in tensors if k.startswith(f"model.layers.{layer}.") and k.endswith("down_proj.weight_scale")]
        for k in keys:
            tensors[k] = tensors[k] * 2
        if keys:
            save_file(tensors, f, metadata={"format": "pt"})
            changed += len(keys)
    return changed


@pytest.mark.slow
def test_quantized_trained_targets_against_their_source(trained_pair: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The trained tiny target (INT4 experts) as the source: its bf16 dequantization is the same
    model (KLD exactly 0, top-1 100%, no flips); W4A8 and MXFP4 move it, MXFP4 more; W4A8 with one
    layer's weight scales doubled fails the default --max-kld (exit 1). One model loaded at a time,
    the reference recorded once by `serve --record-reference`."""
    from eagle3.testing import trained

    source = trained_pair / trained.NAME
    targets = {"bf16": tmp_path / "bf16", "w4a8": tmp_path / "w4a8", "mxfp4": tmp_path / "mxfp4"}
    for argv in (["convert", str(source), str(targets["bf16"]), "--text-only", "--dequantize", "bf16", "--quiet"],
                 ["quantize", str(targets["bf16"]), str(targets["w4a8"]), "--recipe", "w4a8", "--quiet"],
                 ["quantize", str(targets["bf16"]), str(targets["mxfp4"]), "--recipe", "mxfp4", "--quiet"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert (e.value.code or 0) == 0, argv
    targets["w4a8-doubled"] = tmp_path / "w4a8-doubled"
    assert _double_one_layers_scales(targets["w4a8"], targets["w4a8-doubled"]) > 0
    # 1-shot prompts (one exemplar fewer in every prompt, prefilled in every run and again to teacher-force):
    # the 72 compared positions are the same count, and they order the targets as clearly (measured,
    # KLD / top-1: w4a8 0.001 / 0.99, mxfp4 0.015 / 0.93, w4a8 doubled 0.087 / 0.83; 2-shot: 0.0007 / 1.0,
    # 0.018 / 0.90, 0.119 / 0.86)
    flags = ["--validate", "gsm8k", "--limit", "3", "--num-fewshot", "1", "--max-tokens", "24", "--no-baseline"]
    ref = tmp_path / "ref.jsonl.gz"
    with pytest.raises(SystemExit) as e:
        main(["serve", str(source), *flags, "--record-reference", str(ref)])
    assert (e.value.code or 0) == 0
    capsys.readouterr()
    got = {}
    for name, path in targets.items():
        report = tmp_path / f"{name}.json"
        with pytest.raises(SystemExit) as e:
            main(["serve", str(path), *flags, "--reference", str(ref), "--report", str(report)])
        got[name] = (int(e.value.code or 0), json.loads(report.read_text()))
        capsys.readouterr()
    code, r = got["bf16"]
    block = r["reference"]
    assert code == 0 and block["kld"]["max"] == 0.0 and block["top1_agreement"] == 1.0
    assert block["divergence"]["identical"] == 3 and block["flips"]["flips"] == 0
    kld = {n: g[1]["reference"]["kld"]["mean"] for n, g in got.items()}
    top1 = {n: g[1]["reference"]["top1_agreement"] for n, g in got.items()}
    assert 0.0 < kld["w4a8"] < kld["mxfp4"] < kld["w4a8-doubled"]
    assert top1["w4a8"] >= top1["mxfp4"] > top1["w4a8-doubled"]
    assert got["w4a8"][0] == 0  # inside the default thresholds (measured: KLD 0.001, top-1 0.99)
    code, r = got["w4a8-doubled"]
    assert code == 1 and any(f.startswith("mean per-token KLD vs the source") and "--max-kld 0.04" in f
                             for f in r["failures"])


def test_return_token_ids_in_completions(plain_server: Any) -> None:
    """vLLM's / SGLang's ``return_token_ids``: the prompt's and the output's ids beside the text,
    whole and streamed (the prompt's ids in the first chunk, each chunk its new ids)."""
    import httpx

    url = plain_server[0]
    prompt = "Question: 2 + 3 = ?\nAnswer:"
    ids = httpx.post(url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "logprobs": 1, "return_tokens_as_token_ids": True}
    c = httpx.post(url + "/v1/completions", json=body).json()["choices"][0]
    assert c["prompt_token_ids"] == ids and len(c["token_ids"]) == 6
    assert [f"token_id:{t}" for t in c["token_ids"]] == c["logprobs"]["tokens"]
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    firsts = [ch["choices"][0] for ch in chunks if ch["choices"]]
    assert firsts[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in f for f in firsts[1:])
    assert [t for f in firsts for t in f["token_ids"]] == c["token_ids"]


def test_a_draft_that_accepts_less_on_the_served_model_gets_the_adapt_command() -> None:
    """The draft-fit note: past the margin (2% of the mean accept length) the report names the
    workload and prints the command that adapts the draft; within it, nothing."""
    ref = refmod.Reference({"format": refmod.FORMAT, "version": refmod.VERSION, "logprobs": 2,
                            "acceptance": {"gsm8k": {"mean_acceptance_length": 3.10},
                                           "mtbench": {"mean_acceptance_length": 2.50}}})
    item = refmod.RefItem("gsm8k", "gsm8k/0", 0, None, "x", [1], [5], [{5: -0.1, 6: -2.4}], "t")
    parts = [refmod.WorkloadComparison("gsm8k", [item], [[{5: -0.1, 6: -2.4}]], [None], [None]),
             refmod.WorkloadComparison("mtbench", [item], [[{5: -0.1, 6: -2.4}]], [None], [None])]
    served = {"gsm8k": {"mean_acceptance_length": 2.98}, "mtbench": {"mean_acceptance_length": 2.47}}
    out = refmod.compare(ref, "ref.gz", parts, served, refmod.Thresholds(), "eagle3 train-draft Q OUT "
                         "--init-from D --adapt")
    assert out["passed"] and len(out["notes"]) == 1
    assert out["notes"][0].startswith("gsm8k: the draft's mean accept length is 3.9% below the source's")
    assert out["notes"][0].endswith("eagle3 train-draft Q OUT --init-from D --adapt")
    assert out["workloads"]["mtbench"]["acceptance"]["accept_length_change"] == pytest.approx(-0.012)


def test_serve_reference_src_dir_takes_thresholds_and_checks_where_the_recording_goes(
        tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``serve --validate --reference SRC_DIR``: the thresholds and --logprobs go with it, and
    --record-reference is an output like any other (never over a file without --overwrite, never
    inside the source), refused before a model is loaded."""
    import shutil

    source = tmp_path / "source"
    shutil.copytree(tiny_dir / "kimi-k2.5", source)
    config = (source / "config.json").read_bytes()
    existing = tmp_path / "kept.jsonl.gz"
    existing.write_bytes(b"not eagle3's")
    serve = ["serve", str(tiny_dir / "kimi-k2.5"), "--draft", str(tiny_dir / "kimi-k2.5-eagle3"), "--validate", "gsm8k",
             "--limit", "1", "--reference", str(source), "--max-kld", "0.1", "--logprobs", "5"]
    for extra, msg in (([str(existing)], "exists; pass --overwrite"),
                       ([str(source / "config.json"), "--overwrite"], str(source))):
        with pytest.raises(SystemExit) as e:
            main([*serve, "--record-reference", *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and "loading" not in err, err
    assert existing.read_bytes() == b"not eagle3's" and (source / "config.json").read_bytes() == config

"""``eagle3 validate`` and ``eagle3 bench``: a running (or in-process) server measured from the client side.

``validate`` measures a server someone else started (any OpenAI-compatible one): it has no engine
flags (``serve --validate`` is the validation with the bundled engine). ``bench`` has them all
(:mod:`eagle3.cli.engine_flags`): with TARGET it serves in-process with that EngineConfig."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from eagle3.cli.app import app
from eagle3.cli.engine_flags import EngineFlags, engine_options
from eagle3.cli.options import (
    CODE_HELP,
    CONCURRENCY_HELP,
    LIMIT_HELP,
    LOGPROBS_HELP,
    MAX_FLIPS_HELP,
    MAX_KLD_HELP,
    MAX_TOKENS_HELP,
    MIN_TOP1_HELP,
    RECORD_REF_HELP,
    REFERENCE_HELP,
    TASK_HELP,
    TOKENIZER_REF_HELP,
    exit_on_report,
)


@app.command("validate")
def validate_cmd(
    base_url: Annotated[str, typer.Option(help="The server, e.g. http://127.0.0.1:8000 (any OpenAI-compatible server).")],
    task: Annotated[str, typer.Option(help=TASK_HELP)] = "gsm8k",
    model: Annotated[str | None, typer.Option(help="Model id to request (default: the first of /v1/models).")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="EAGLE3_API_KEY", help="Bearer token for the server.")] = None,
    baseline_url: Annotated[str | None, typer.Option(help="The same target without speculation: lossless check and speedup.")] = None,
    limit: Annotated[int | None, typer.Option(help=LIMIT_HELP)] = None,
    num_fewshot: Annotated[int, typer.Option(help="gsm8k: few-shot exemplars.")] = 5,
    concurrency: Annotated[str, typer.Option(help=CONCURRENCY_HELP)] = "1",
    dataset: Annotated[Path | None, typer.Option(help="gsm8k: directory with train.jsonl + test.jsonl (default: the copy eagle3 ships; hub: the Hub dataset openai/gsm8k).")] = None,
    max_tokens: Annotated[int | None, typer.Option(help=MAX_TOKENS_HELP)] = None,
    allow_code_execution: Annotated[bool, typer.Option(help=CODE_HELP)] = False,
    report: Annotated[Path | None, typer.Option(help="Write the JSON report here (+ .png figure).")] = None,
    figure: Annotated[Path | None, typer.Option(help="The figure's path (default: REPORT with .png).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing report / figure.")] = False,
    min_accuracy: Annotated[float | None, typer.Option(help="Fail (exit 1) when a workload's accuracy (gsm8k exact match, humaneval pass@1) is below this.")] = None,
    accuracy_filter: Annotated[str, typer.Option(help="gsm8k: strict-match|flexible-extract for --min-accuracy.")] = "strict-match",
    min_acceptance: Annotated[float | None, typer.Option(help="Fail (exit 1) when a workload's acceptance rate is below this.")] = None,
    record_reference: Annotated[Path | None, typer.Option(help=RECORD_REF_HELP)] = None,
    reference: Annotated[Path | None, typer.Option(help=REFERENCE_HELP)] = None,
    logprobs: Annotated[int | None, typer.Option(help=LOGPROBS_HELP)] = None,
    tokenizer: Annotated[Path | None, typer.Option(help=TOKENIZER_REF_HELP)] = None,
    max_kld: Annotated[float | None, typer.Option(help=MAX_KLD_HELP)] = None,
    min_top1: Annotated[float | None, typer.Option(help=MIN_TOP1_HELP)] = None,
    max_flips: Annotated[float | None, typer.Option(help=MAX_FLIPS_HELP)] = None,
) -> None:
    """Validate a running OpenAI-compatible server (vLLM, SGLang, ATOM, eagle3) on one or more workloads.

    GSM8K and HumanEval are sent as lm-eval's tasks send them, MT-Bench through the model's chat template;
    speculative acceptance is read from the server's /metrics around each workload and MT-Bench category.
    Exit code 1 on a missed threshold, a failed request or (with --baseline-url) a changed greedy answer.
    The server is someone else's: validate has no engine options (serve --validate validates the
    bundled runtime with them).

    Examples:

    \b
    eagle3 validate --base-url http://127.0.0.1:8000 --limit 200 --concurrency 16 --report r.json
    eagle3 validate --base-url http://127.0.0.1:8000 --baseline-url http://127.0.0.1:8001 --task gsm8k,humaneval,mtbench --limit 20 --concurrency 1,8,32 --report r.json

    Quantized vs its source, in two passes (the two models need not fit on one node together):

    \b
    eagle3 validate --base-url http://SOURCE:8000 --task gsm8k,mtbench --limit 50 --record-reference ref.jsonl.gz
    eagle3 validate --base-url http://QUANTIZED:8000 --task gsm8k,mtbench --limit 50 --reference ref.jsonl.gz --report r.json
    """
    from eagle3 import validate as val
    from eagle3.errors import UsageError
    from eagle3.validate.report import summary_lines

    vopts = val.ValidateOptions(task=task, limit=limit, num_fewshot=num_fewshot, concurrency=concurrency,
                                dataset=dataset, max_tokens=max_tokens, model=model, api_key=api_key, report=report,
                                figure=figure, overwrite=overwrite, min_accuracy=min_accuracy,
                                min_acceptance=min_acceptance, accuracy_filter=accuracy_filter,
                                allow_code_execution=allow_code_execution, record_reference=record_reference,
                                reference=reference, logprobs=logprobs, tokenizer=tokenizer, max_kld=max_kld,
                                min_top1=min_top1, max_flips=max_flips, echo=lambda s: typer.echo(s, err=True))
    if record_reference is not None and (baseline_url or report or figure):
        raise UsageError("--record-reference records the source and stops: no --baseline-url / --report / --figure")
    prep = val.prepare(vopts)
    if record_reference is not None:
        from eagle3.validate import twopass

        typer.echo(f"validate: recording the reference of {prep.describe()} item(s) from {base_url}", err=True)
        ref = twopass.record(base_url, prep, vopts, record_reference, {"engine": "external"})
        for line in twopass.record_summary(ref, record_reference):
            typer.echo(line)
        return
    loaded = None
    if reference is not None:
        from eagle3.validate import twopass

        loaded = twopass.load(reference, prep, vopts)  # before anything is sent: the same prompts, the same N
    typer.echo(f"validate: {prep.describe()} item(s), {prep.num_requests} request(s) per pass", err=True)
    run = val.evaluate(base_url, prep, vopts)
    sections = []
    if loaded is not None:
        forced = twopass.teacher_force(base_url, loaded, prep, vopts, run.model)
        import shlex

        from eagle3.train.adapt import adapt_command

        # the paths are the user's to fill in: an external server does not say where its models are
        adapt = shlex.join(adapt_command("QUANTIZED_DIR", "ADAPTED_DRAFT_DIR", "DRAFT_DIR"))
        sections.append(twopass.section(loaded, forced, prep, run, vopts, adapt))
    base = val.evaluate(baseline_url, prep, vopts, "baseline") if baseline_url else None
    result = val.finish(run, base, prep, vopts, {"engine": "external"}, sections=sections)
    exit_on_report(result, summary_lines(result) + ([f"report: {report}"] if report else []))


@app.command()
@engine_options("Engine options (with TARGET: the in-process server; docs/architecture.md)")
def bench(
    target: Annotated[Path | None, typer.Argument(help="Serve this target in-process and benchmark it (or use --base-url).")] = None,
    draft: Annotated[Path | None, typer.Option(help="With TARGET: EAGLE-3 draft directory.")] = None,
    base_url: Annotated[str | None, typer.Option(help="A running OpenAI-compatible server.")] = None,
    model: Annotated[str | None, typer.Option(help="Model id to request (default: the first of /v1/models).")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="EAGLE3_API_KEY", help="Bearer token for the server.")] = None,
    dataset: Annotated[str, typer.Option(help="random|gsm8k prompts.")] = "random",
    dataset_path: Annotated[Path | None, typer.Option(help="gsm8k: directory with train.jsonl + test.jsonl.")] = None,
    tokenizer: Annotated[Path | None, typer.Option(help="random: tokenizer directory (default: TARGET).")] = None,
    input_len: Annotated[int, typer.Option(help="random: prompt tokens.")] = 256,
    output_len: Annotated[int, typer.Option(help="New tokens per request (random: exactly, with ignore_eos).")] = 128,
    num_prompts: Annotated[int, typer.Option(help="Requests per concurrency level.")] = 32,
    concurrency: Annotated[str, typer.Option(help="Concurrency levels, e.g. 1,4,16.")] = "1",
    report: Annotated[Path | None, typer.Option(help="Write the results as JSON.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing report.")] = False,
    *,
    engine_flags: EngineFlags,
) -> None:
    """Serving benchmark: TTFT / TPOT / ITL / E2EL / throughput as `vllm bench serve` defines them.

    With TARGET the bundled runtime serves in-process with the engine options (EngineConfig's, as
    serve takes them); with --base-url a running server is measured as it is (only --seed applies:
    it seeds the random prompts).

    Examples:

    \b
    eagle3 bench --base-url http://127.0.0.1:8000 --tokenizer ./Kimi-K2.5 --concurrency 1,8,32
    eagle3 bench ./tiny/kimi-k2.5 --draft ./tiny/kimi-k2.5-eagle3 --input-len 64 --output-len 32
    """
    from eagle3.errors import UsageError
    from eagle3.validate import bench as b
    from eagle3.validate.report import write_json_atomic

    if (target is None) == (base_url is None):
        raise UsageError("give either TARGET (served in-process) or --base-url")
    if base_url is not None:
        # the engine flags describe an in-process server; a running one is benchmarked as it is
        # (--seed also seeds the random prompts, so it is the one that stays)
        given = (["--draft"] if draft is not None else []) + engine_flags.given(exclude=("seed",))
        if given:
            raise UsageError(f"{', '.join(given)} go with TARGET (served in-process), not with --base-url")
    eopts = engine_flags.config(draft) if target is not None else None
    if report is not None:
        from eagle3.checkpoint import check_output_path

        check_output_path(report, [target, draft, dataset_path, tokenizer], what="report")
        if report.is_dir():
            raise UsageError(f"{report}: --report names a directory; give a file path")
        if report.exists() and not overwrite:
            raise UsageError(f"{report} exists; pass --overwrite to replace it")
    opts = b.BenchOptions(dataset=dataset, dataset_path=dataset_path, input_len=input_len, output_len=output_len,
                          num_prompts=num_prompts, concurrency=b.parse_levels(concurrency),
                          seed=engine_flags.value("seed"), model=model,
                          api_key=api_key)
    opts.check()
    if target is not None and eopts is not None and (engine_flags.torchrun_rank is not None or eopts.node_rank != 0):
        # this node's ranks only: node 0 benchmarks. Before the tokenizer: a headless node sends no
        # prompt, and loading one there cost transformers' import (~1 CPU-s) and the load, per node.
        from eagle3.serve import launcher

        raise typer.Exit(launcher.run_headless(target, eopts, engine_flags.torchrun_rank))
    tok = None
    if tokenizer is not None or target is not None:
        from eagle3.runtime.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer or target, engine_flags.value("trust_remote_code"))
    if target is not None and eopts is not None:
        from eagle3.serve import launcher

        llm = launcher.build_llm(target, draft, eopts)
        try:
            api = launcher.build_app(llm, target.resolve().name, root=str(target))
            with launcher.ServerThread(api) as url:
                result = b.run_bench(url, opts, tok)
                result["tensor_parallel_size"] = eopts.tensor_parallel_size
                result.update(launcher.engine_info(llm))
        finally:
            launcher.close_llm(llm)
    else:
        result = b.run_bench(base_url, opts, tok)
    for line in b.bench_lines(result):
        typer.echo(line)
    if report is not None:
        write_json_atomic(report, result)
        typer.echo(f"report: {report}")

"""``eagle3 validate`` and ``eagle3 bench``: a running (or in-process) server measured from the client side."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from eagle3.cli.app import app
from eagle3.cli.options import (
    CODE_HELP,
    CONCURRENCY_HELP,
    DIST_INIT_ADDR_HELP,
    ENFORCE_EAGER_HELP,
    ENGINE,
    KERNEL_BACKEND_HELP,
    KV_CACHE_DTYPE_HELP,
    LIMIT_HELP,
    LOGPROBS_HELP,
    MAX_FLIPS_HELP,
    MAX_KLD_HELP,
    MAX_SPEC_HELP,
    MAX_TOKENS_HELP,
    MIN_TOP1_HELP,
    NNODES_HELP,
    NODE_RANK_HELP,
    NUM_SPEC_HELP,
    RECORD_REF_HELP,
    REFERENCE_HELP,
    TASK_HELP,
    TOKENIZER_REF_HELP,
    TREE_NODES_HELP,
    TREE_TOPK_HELP,
    check_kernel_backend,
    exit_on_report,
    node_layout,
    parse_speculative,
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

    Examples: eagle3 validate --base-url http://127.0.0.1:8000 --limit 200 --concurrency 16 --report r.json

    eagle3 validate --base-url http://127.0.0.1:8000 --baseline-url http://127.0.0.1:8001 --task gsm8k,humaneval,mtbench --limit 20 --concurrency 1,8,32 --report r.json

    Quantized vs its source, in two passes (the two models need not fit on one node together):
    eagle3 validate --base-url http://SOURCE:8000 --task gsm8k,mtbench --limit 50 --record-reference ref.jsonl.gz
    then eagle3 validate --base-url http://QUANTIZED:8000 --task gsm8k,mtbench --limit 50 --reference ref.jsonl.gz --report r.json

    GSM8K and HumanEval are sent as lm-eval's tasks send them, MT-Bench through the model's chat template;
    speculative acceptance is read from the server's /metrics around each workload and MT-Bench category.
    Exit code 1 on a missed threshold, a failed request or (with --baseline-url) a changed greedy answer.
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
        sections.append(twopass.section(loaded, forced, prep, run, vopts))
    base = val.evaluate(baseline_url, prep, vopts, "baseline") if baseline_url else None
    result = val.finish(run, base, prep, vopts, {"engine": "external"}, sections=sections)
    exit_on_report(result, summary_lines(result) + ([f"report: {report}"] if report else []))


@app.command()
def bench(
    target: Annotated[Path | None, typer.Argument(help="Serve this target in-process and benchmark it (or use --base-url).")] = None,
    draft: Annotated[Path | None, typer.Option(help="With TARGET: EAGLE-3 draft directory.")] = None,
    num_speculative_tokens: Annotated[str, typer.Option(help="With TARGET: " + NUM_SPEC_HELP)] = str(ENGINE.num_speculative_tokens),
    max_speculative_tokens: Annotated[int | None, typer.Option(help="With TARGET: " + MAX_SPEC_HELP)] = None,
    speculative_eagle_topk: Annotated[int, typer.Option(help="With TARGET: " + TREE_TOPK_HELP)] = ENGINE.speculative_eagle_topk,
    speculative_num_draft_tokens: Annotated[int | None, typer.Option(help="With TARGET: " + TREE_NODES_HELP)] = None,
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
    seed: Annotated[int, typer.Option(help="Random prompts seed.")] = 0,
    report: Annotated[Path | None, typer.Option(help="Write the results as JSON.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing report.")] = False,
    device: Annotated[str, typer.Option(help="With TARGET: cpu, cuda, ...")] = ENGINE.device,
    dtype: Annotated[str, typer.Option(help="With TARGET: bfloat16|float16|float32.")] = ENGINE.dtype,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow code shipped with the model to run.")] = ENGINE.trust_remote_code,
    tensor_parallel_size: Annotated[int, typer.Option(help="With TARGET: tensor parallel size (worker processes).")] = ENGINE.tensor_parallel_size,
    nnodes: Annotated[int, typer.Option(help="With TARGET: " + NNODES_HELP)] = ENGINE.nnodes,
    node_rank: Annotated[int, typer.Option(help="With TARGET: " + NODE_RANK_HELP)] = ENGINE.node_rank,
    dist_init_addr: Annotated[str | None, typer.Option(help="With TARGET: " + DIST_INIT_ADDR_HELP)] = ENGINE.dist_init_addr,
    kernel_backend: Annotated[str, typer.Option(help="With TARGET: " + KERNEL_BACKEND_HELP)] = ENGINE.backend,
    enforce_eager: Annotated[bool, typer.Option(help="With TARGET: " + ENFORCE_EAGER_HELP)] = ENGINE.enforce_eager,
    kv_cache_dtype: Annotated[str, typer.Option(help="With TARGET: " + KV_CACHE_DTYPE_HELP)] = ENGINE.kv_cache_dtype,
) -> None:
    """Serving benchmark: TTFT / TPOT / ITL / E2EL / throughput as `vllm bench serve` defines them.

    Examples: eagle3 bench --base-url http://127.0.0.1:8000 --tokenizer ./Kimi-K2.5 --concurrency 1,8,32

    eagle3 bench ./tiny/kimi-k2.5 --draft ./tiny/kimi-k2.5-eagle3 --input-len 64 --output-len 32
    """
    from eagle3.errors import UsageError
    from eagle3.validate import bench as b
    from eagle3.validate.report import write_json_atomic

    if (target is None) == (base_url is None):
        raise UsageError("give either TARGET (served in-process) or --base-url")
    if base_url is not None:
        # the engine flags describe an in-process server; a running one is benchmarked as it is
        engine_flags = {"--draft": draft is not None, "--max-speculative-tokens": max_speculative_tokens is not None,
                        "--num-speculative-tokens": num_speculative_tokens != str(ENGINE.num_speculative_tokens),
                        "--device": device != ENGINE.device, "--dtype": dtype != ENGINE.dtype,
                        "--tensor-parallel-size": tensor_parallel_size != ENGINE.tensor_parallel_size,
                        "--kernel-backend": kernel_backend != ENGINE.backend,
                        "--enforce-eager": enforce_eager != ENGINE.enforce_eager,
                        "--kv-cache-dtype": kv_cache_dtype != ENGINE.kv_cache_dtype}
        given = [flag for flag, set_ in engine_flags.items() if set_]
        if given:
            raise UsageError(f"{', '.join(given)} go with TARGET (served in-process), not with --base-url")
    spec_k, max_k = parse_speculative(num_speculative_tokens, max_speculative_tokens, draft)
    if report is not None:
        from eagle3.checkpoint import check_output_path

        check_output_path(report, [target, draft, dataset_path, tokenizer], what="report")
        if report.is_dir():
            raise UsageError(f"{report}: --report names a directory; give a file path")
        if report.exists() and not overwrite:
            raise UsageError(f"{report} exists; pass --overwrite to replace it")
    opts = b.BenchOptions(dataset=dataset, dataset_path=dataset_path, input_len=input_len, output_len=output_len,
                          num_prompts=num_prompts, concurrency=b.parse_levels(concurrency), seed=seed, model=model,
                          api_key=api_key)
    opts.check()
    tok = None
    if tokenizer is not None or target is not None:
        from eagle3.runtime.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer or target, trust_remote_code)
    if target is not None:
        from eagle3.serve import launcher

        nodes, headless_rank = node_layout(tensor_parallel_size, nnodes, node_rank, dist_init_addr, device)
        eopts = launcher.EngineOptions(num_speculative_tokens=spec_k, max_speculative_tokens=max_k, dtype=dtype,
                                       trust_remote_code=trust_remote_code,
                                       backend=check_kernel_backend(kernel_backend), enforce_eager=enforce_eager,
                                       speculative_eagle_topk=speculative_eagle_topk,
                                       speculative_num_draft_tokens=speculative_num_draft_tokens,
                                       kv_cache_dtype=kv_cache_dtype, **nodes)
        if headless_rank is not None or eopts.node_rank != 0:  # this node's ranks only: node 0 benchmarks
            raise typer.Exit(launcher.run_headless(target, eopts, headless_rank))
        tensor_parallel_size = eopts.tensor_parallel_size
        llm = launcher.build_llm(target, draft, eopts)
        try:
            api = launcher.build_app(llm, target.resolve().name, root=str(target))
            with launcher.ServerThread(api) as url:
                result = b.run_bench(url, opts, tok)
                result["tensor_parallel_size"] = tensor_parallel_size
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

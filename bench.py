# Throughput, latency and acceptance sweeps: every (method, K, batch size) runs the same prompts in
# the same process, after a warm-up, beside plain decoding (and optionally transformers). The
# methods take turns, repeat after repeat, and each ratio to plain is the median of the ratios
# within a repeat: a slow spell of a shared machine hits every method alike. Speed claims live here,
# never in unit tests. It must never mix numbers from different runs, dtypes or machines into one
# ratio.
import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from nanospec import LLM, SamplingParams, read_prompts_file, spec_metrics

# The built-in workloads, in examples/. 'grounded': 16 functions of Python's standard library (3.11)
# to rewrite with comments, an input-grounded workload where prompt lookup should shine. 'chat':
# general-assistant requests written for nanospec, train_speculator.py's offline training set
# (topics x kinds of task, any 60 in a row cover every topic and every task). MT-bench stays held
# apart for evaluation.
WORKLOADS = {"grounded": "bench_grounded.jsonl", "chat": "chat.jsonl"}


def read_workload(spec: str, chat_tokenizer=None) -> list[str]:
    """A built-in workload's prompts, or a JSONL file's, in the chat template of a tokenizer that
    has one."""
    path = Path(__file__).with_name("examples") / WORKLOADS[spec] if spec in WORKLOADS else spec
    prompts = read_prompts_file(path)
    if chat_tokenizer and chat_tokenizer.chat_template:
        prompts = [
            chat_tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts
        ]
    return prompts


def run_nanospec(llm: LLM, prompts, params):
    """One run of all prompts submitted at once (batch = len(prompts))."""
    llm.k_histogram.clear()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_progress=False)
    elapsed = time.perf_counter() - start
    return {
        "tok_s": sum(len(o.token_ids) for o in outs) / elapsed,
        "req_s": len(prompts) / elapsed,
        "output_tokens": sum(len(o.token_ids) for o in outs),
        **{
            f"{name}_p{q}": float(np.percentile([getattr(o, name) for o in outs], q))
            for name in ("ttft", "tpot")
            for q in (50, 90)
        },
        # Time from each request's first token to its last, per token after the first: decoding
        # alone.
        "decode_ms_per_token": 1000
        * sum(o.latency - o.ttft for o in outs)
        / max(sum(len(o.token_ids) - 1 for o in outs), 1),
        # drafted, accepted, mean_accepted_length, nodes_per_step, per position
        **spec_metrics(outs),
        "k_per_step": dict(llm.k_histogram),
        "token_ids": [o.token_ids for o in outs],  # compared with plain decoding's, then dropped
    }


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput, with every run's throughput and acceptance, in order (from
    the second on, the same requests again: the suffix proposer remembers)."""
    median = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
    return {
        **median,
        "tok_s_runs": [r["tok_s"] for r in runs],
        "mean_accepted_length_runs": [r["mean_accepted_length"] for r in runs],
    }


def run_hf(model, tokenizer, prompts, batch_size, max_tokens, repeat, prompt_lookup=None):
    """transformers generate on the same prompts, batch_size at a time as padded batches (prompt
    lookup only supports batch 1). Counts real tokens: up to and including each row's first EOS."""
    tokenizer.padding_side = "left"
    kwargs = dict(
        max_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        # None: generate's default, no prompt lookup
        prompt_lookup_num_tokens=prompt_lookup,
    )
    warm = tokenizer(prompts[:1], return_tensors="pt", add_special_tokens=False).to(model.device)
    model.generate(**warm, **{**kwargs, "max_new_tokens": 4})
    runs = []
    for _ in range(repeat):
        num_tokens, start = 0, time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            batch = tokenizer(
                prompts[i : i + batch_size],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            ).to(model.device)
            with torch.inference_mode():
                new = model.generate(**batch, **kwargs)[:, batch["input_ids"].shape[1] :]
            is_eos = new == tokenizer.eos_token_id
            num_tokens += sum(
                int(row.nonzero()[0]) + 1 if row.any() else len(row) for row in is_eos
            )
        runs.append(num_tokens / (time.perf_counter() - start))
    return {"tok_s": float(np.median(runs)), "tok_s_runs": runs}


def machine_info(dtype, device):
    import kernels

    cpuinfo = open("/proc/cpuinfo").read().splitlines() if os.path.exists("/proc/cpuinfo") else []
    cpu = next(
        (row.partition(":")[2].strip() for row in cpuinfo if row.startswith("model name")),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "isa": kernels.cpu_isa(),
        "kernels": kernels.kernels_summary(device),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "dtype": str(dtype)[6:],
        "python": platform.python_version(),
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="nanospec throughput / acceptance sweeps")
    p.add_argument(
        "--model", default="default", help="model folder, or 'default' (SmolLM2-135M-Instruct)"
    )
    p.add_argument(
        "--draft", default="none,ngram", help="comma list of: none, ngram, suffix, PATH, mlp:PATH"
    )
    p.add_argument("--num-spec-tokens", default="4", help="comma list of K values and/or 'auto'")
    p.add_argument(
        "--spec-tree-nodes", default="0", help="comma list of tree node budgets (0: chains)"
    )
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument(
        "--workload", default="grounded", help="'grounded', 'chat' (built in) or a JSONL file"
    )
    p.add_argument(
        "--num-prompts", type=int, default=0, help="prompts per run (default: the batch size)"
    )
    p.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=True, help="apply chat template"
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--dtype", default="auto", help="auto (for the hardware), float32, bfloat16, float16"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--baseline", choices=["none", "hf"], default="none")
    p.add_argument("--spec-disable-batch-size", type=int)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", help="write every raw number here")
    return p.parse_args(argv)


def main(argv=None):
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    args = parse_args(argv)
    model = None if args.model == "default" else args.model
    drafts = args.draft.split(",")
    ks = [k if k == "auto" else int(k) for k in args.num_spec_tokens.split(",")]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    trees = [int(n) for n in args.spec_tree_nodes.split(",")]
    configs = [("none", 0, 0)] * ("none" in drafts) + [
        (d, k, n)
        for d in drafts
        if d != "none"
        for k in ks
        for n in (trees if d in ("ngram", "suffix") else [0])
    ]
    results = []
    base = LLM(model, dtype=args.dtype, device=args.device, max_num_seqs=max(batch_sizes))
    workload = read_workload(args.workload, base.tokenizer if args.chat else None)
    hf = None
    if args.baseline == "hf":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        hf = (
            AutoModelForCausalLM.from_pretrained(base.model_path, dtype=base.dtype)
            .to(args.device)
            .eval(),
            AutoTokenizer.from_pretrained(base.model_path),
        )
    engines = [
        base
        if draft == "none"
        else LLM(
            model,
            dtype=base.dtype,
            device=args.device,
            draft=draft,
            num_spec_tokens=k,
            max_num_seqs=max(batch_sizes),
            spec_tree_nodes=nodes,
            spec_disable_batch_size=args.spec_disable_batch_size,
        )
        for draft, k, nodes in configs
    ]
    with Progress(transient=True) as progress:
        task = progress.add_task(
            "benchmarking", total=len(configs) * len(batch_sizes) * args.repeat
        )
        for b in batch_sizes:
            prompts = [workload[i % len(workload)] for i in range(args.num_prompts or b)]
            for llm in engines:
                llm.scheduler.max_num_seqs = b
                # warm-up, on a prompt of its own: the suffix proposer remembers finished requests
                llm.generate(["Hello"], SamplingParams(max_tokens=8), use_progress=False)
            runs = [[] for _ in engines]
            for _ in range(args.repeat):  # the methods take turns
                for llm, config_runs in zip(engines, runs):
                    config_runs.append(run_nanospec(llm, prompts, params))
                    progress.advance(task)
            for (draft, k, nodes), config_runs in zip(configs, runs):
                row = {
                    "method": draft,
                    "k": k,
                    "tree": nodes,
                    "batch": b,
                    **median_run(config_runs),
                }
                if hf and (
                    draft == "none" or draft == "ngram" and not nodes and b == 1 and k != "auto"
                ):
                    row["hf_tok_s"] = run_hf(
                        *hf,
                        prompts,
                        b,
                        args.max_tokens,
                        args.repeat,
                        prompt_lookup=k if draft == "ngram" else None,
                    )["tok_s"]
                results.append(row)
    plain = {r["batch"]: r for r in results if r["method"] == "none"}
    plain_ids = {b: r["token_ids"] for b, r in plain.items()}
    for r in results:
        # ref: plain decoding at this batch size
        token_ids, ref = r.pop("token_ids"), plain.get(r["batch"])
        r["identical_to_plain"] = token_ids == plain_ids[r["batch"]] if ref else None
        # the median of the repeats' ratios: each repeat ran every method within moments of the
        # others
        r["speedup_vs_plain"] = (
            np.median(np.divide(r["tok_s_runs"], ref["tok_s_runs"])) if ref else None
        )
        r["decode_speedup_vs_plain"] = (
            ref["decode_ms_per_token"] / r["decode_ms_per_token"] if ref else None
        )
        r["speedup_vs_hf"] = r["tok_s"] / r["hf_tok_s"] if r.get("hf_tok_s") else None
    machine = machine_info(base.dtype, args.device)
    table = Table(
        title=f"nanospec bench · {args.model} · {machine['dtype']} · {args.workload} · "
        f"max_tokens {args.max_tokens} · {machine['cpu']} · {machine['kernels']}"
    )
    for col in (
        "method",
        "K",
        "tree",
        "batch",
        "= plain",
        "tok/s",
        "req/s",
        "TTFT p50/p90 ms",
        "TPOT p50/p90 ms",
        "mean acc len",
        "acc/pos",
        "K per step",
        "x plain",
        "x plain decode",
        "hf tok/s",
        "x hf",
    ):
        table.add_column(
            col, justify="left" if col in ("method", "acc/pos", "K per step") else "right"
        )
    fmt = lambda x, f="{:.2f}": "-" if x is None else f.format(x)  # noqa: E731
    ms = lambda r, key, f: f"{1000 * r[key + '_p50']:{f}}/{1000 * r[key + '_p90']:{f}}"
    for r in results:
        same = {True: "yes", False: "NO", None: "-"}[r["identical_to_plain"]]
        table.add_row(
            os.path.basename(r["method"].rstrip("/")),
            str(r["k"]),
            str(r["tree"]),
            str(r["batch"]),
            same,
            f"{r['tok_s']:.1f}",
            f"{r['req_s']:.2f}",
            ms(r, "ttft", ".0f"),
            ms(r, "tpot", ".1f"),
            fmt(r["mean_accepted_length"]),
            " ".join(f"{a:.2f}" for a in r["acceptance_per_position"]),
            " ".join(f"{k}:{n}" for k, n in sorted(r["k_per_step"].items())) if r["k"] else "",
            fmt(r["speedup_vs_plain"]),
            fmt(r["decode_speedup_vs_plain"]),
            fmt(r.get("hf_tok_s"), "{:.1f}"),
            fmt(r["speedup_vs_hf"]),
        )
    Console(width=220).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

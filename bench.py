# Throughput, latency and acceptance sweeps: every (method, K, batch size) runs the same prompts in
# the same process, after a warm-up, beside plain decoding (and optionally transformers). The
# methods take turns, repeat after repeat, and each ratio to plain is the median of the ratios
# within a repeat: a slow spell of a shared machine hits every method alike. Speed claims live here,
# never in unit tests. It must never mix numbers from different runs, dtypes or machines into one
# ratio.
import argparse
import copy
import json
import os
import platform
import re
import subprocess
import sys
import time
import timeit
from pathlib import Path

import numpy as np
import torch

import kernels
from nanospec import LLM, SamplingParams, read_prompts_file, spec_metrics, turn_prompt_ids

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
        prompts = [chat_tokenizer.apply_chat_template(p) for p in prompts]
    return prompts


def run_nanospec(llm: LLM, prompts, params):
    """One run of all prompts submitted at once (batch: at most the engine's max_num_seqs)."""
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


def run_hf(model, tokenizer, prompts, batch_size, args, prompt_lookup=None) -> float:
    """tok/s of transformers generate on the same prompts, batch_size at a time as padded batches
    (prompt lookup only supports batch 1), up to --max-tokens; counts real tokens: up to and
    including each row's first EOS. Repeated --repeat times (the median)."""
    tokenizer.padding_side = "left"
    kwargs = dict(
        max_new_tokens=args.max_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        # None: generate's default, no prompt lookup
        prompt_lookup_num_tokens=prompt_lookup,
    )
    encoding = dict(return_tensors="pt", padding=True, add_special_tokens=False)
    warm = tokenizer(prompts[:1], **encoding).to(model.device)
    model.generate(**warm, **{**kwargs, "max_new_tokens": 4})

    def num_tokens(i: int) -> int:  # of the batch from prompt i
        batch = tokenizer(prompts[i : i + batch_size], **encoding).to(model.device)
        with torch.inference_mode():
            new = model.generate(**batch, **kwargs)[:, batch["input_ids"].shape[1] :]
        is_eos = new == tokenizer.eos_token_id
        return sum(int(row.nonzero()[0]) + 1 if row.any() else len(row) for row in is_eos)

    batches = range(0, len(prompts), batch_size)
    return float(np.median([tok_s(num_tokens, batches) for _ in range(args.repeat)]))


def run_llama_cpp(gguf: str, llm: LLM, prompts, args) -> float:
    """tok/s of llama.cpp (llama-cpp-python, installed apart: README, "Benchmarks") on the same
    token ids, one prompt at a time (its Python API decodes one sequence), greedy, each stopping
    where nanospec's would (its EOS ids or --max-tokens); counted as run_hf counts, repeated
    --repeat times (the median)."""
    from llama_cpp import Llama

    prompt_ids = [llm.tokenizer.encode(p) for p in prompts]
    threads, context = torch.get_num_threads(), max(map(len, prompt_ids)) + args.max_tokens
    llama = Llama(gguf, n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False)
    next(llama.generate(prompt_ids[0], temp=0.0))  # warm-up

    def num_tokens(ids: list[int]) -> int:
        llama.reset()  # no prefix kept from the prompt before: nanospec's runs cache none
        # (the generator decodes a token when asked for it: none past the last one counted)
        for n, token in enumerate(llama.generate(ids, temp=0.0), 1):
            if token in llm.eos_ids or n == args.max_tokens:
                break
        return n

    return float(np.median([tok_s(num_tokens, prompt_ids) for _ in range(args.repeat)]))


def tok_s(num_tokens, items) -> float:
    """One timed run of num_tokens(item) over every item (it generates, and counts what it
    generated): tokens per second (run_hf, run_llama_cpp)."""
    start = time.perf_counter()
    return sum(map(num_tokens, items)) / (time.perf_counter() - start)


TURN = "{} prompt tokens ({} cached), {} out: TTFT {:.3f} s, {:.1f} tok/s"


def turn_numbers(out) -> tuple:
    """A turn's prompt tokens, those a prefix-cache hit supplied, output tokens, TTFT, tok/s."""
    n = len(out.token_ids)
    return len(out.prompt_token_ids), out.num_cached_tokens, n, out.ttft, n / out.latency


def two_turns(args, model, settings, params) -> list:
    """Two-turn conversations at batch 1 (MT-bench's rows have two 'turns'): turn 1 on an engine
    with prefix caching, then turn 2 (the chat template over turn 1's question and answer and the
    second question, extending turn 1's prompt and answer token for token, as --chat does) on it
    and, right after, on one without: a slow spell of a shared machine hits both alike. Returns
    each conversation's turn_numbers() of turn 1, turn 2 and turn 2 without caching."""
    caching = [dict(settings, enable_prefix_caching=on) for on in (True, False)]
    engines = [LLM(model, dtype=args.dtype, **s) for s in caching]
    llm = engines[0]
    for engine in engines:  # warm-up
        engine.generate(["Hello"], SamplingParams(max_tokens=8), use_progress=False)
    rows, identical = [], True
    for line in open(args.workload).readlines()[: args.num_prompts or 5]:
        turns = [{"role": "user", "content": q} for q in json.loads(line)["turns"][:2]]
        text = llm.tokenizer.apply_chat_template(turns[:1])
        ids = llm.tokenizer.encode(text)
        (first,) = llm.generate([ids], params, use_progress=False)
        history = [turns[0], {"role": "assistant", "content": first.text}, turns[1]]
        ids = turn_prompt_ids(llm, llm.tokenizer.apply_chat_template(history), (text, ids, first))
        second = [e.generate([ids], params, use_progress=False)[0] for e in engines]
        rows.append([turn_numbers(out) for out in (first, *second)])
        identical &= second[0].token_ids == second[1].token_ids  # prefix caching is exact
        names = ("turn 1", "turn 2", "turn 2 without caching")
        print(" | ".join(f"{name}: " + TURN.format(*n) for name, n in zip(names, rows[-1])))
    ratios = [without[3] / cached[3] for _, cached, without in rows]
    # the hit rate over both turns on the engine with caching
    cached, prompt = (sum(r[turn][i] for r in rows for turn in (0, 1)) for i in (1, 0))
    print(
        f"turn 2's TTFT {np.median(ratios):.1f}x shorter with prefix caching (median of "
        f"{len(ratios)}); prefix-cache hit rate {cached / prompt:.0%}; identical: {identical}"
    )
    return rows


def machine_info(dtype, device):
    return {
        "cpu": kernels.cpu_info("model name") or platform.processor(),
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
    # 'default': the embedded SmolLM2-135M-Instruct
    p.add_argument("--model", default="default", help="model folder, or 'default'")
    p.add_argument(
        "--draft", default="none,ngram", help="comma list of: none, ngram, suffix, PATH, mlp:PATH"
    )
    p.add_argument("--num-spec-tokens", default="4", help="comma list of K values and/or 'auto'")
    p.add_argument(
        "--spec-tree-nodes", default="0", help="comma list of tree node budgets (0: chains)"
    )
    p.add_argument("--batch-sizes", default="1,4,16")
    # built in: 'grounded' and 'chat' (examples/); a file: JSONL rows with 'prompt' or 'turns'
    p.add_argument("--workload", default="grounded", help="'grounded', 'chat' or a JSONL file")
    # default: the batch size (with --two-turns: 5 conversations)
    p.add_argument("--num-prompts", type=int, default=0, help="prompts per run")
    p.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=True, help="apply chat template"
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    # auto: for the hardware (kernels.auto_dtype)
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    # beside each row: transformers' tok/s at the row's batch size and method (hf: plain, or
    # prompt lookup for n-gram at a fixed K), or llama.cpp's plain decoding beside every row of
    # batch 1 (a GGUF file of the same model, e.g. convert_hf_to_gguf.py --outtype f16)
    p.add_argument("--baseline", default="none", help="none, hf (transformers) or a .gguf file")
    p.add_argument("--spec-disable-batch-size", type=int)
    p.add_argument("--repeat", type=int, default=3)
    # --workload's rows with two 'turns' (MT-bench), at batch 1, plain decoding: turn 2's time to
    # first token with prefix caching and without, and the hit rate (two_turns())
    p.add_argument("--two-turns", action="store_true", help="two-turn chats: TTFT with the cache")
    p.add_argument("--json", help="write every raw number here")
    return p.parse_args(argv)


def main(argv=None):
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    args = parse_args(argv)
    gguf = args.baseline if args.baseline.endswith(".gguf") else None
    if not gguf and args.baseline not in ("none", "hf"):
        raise SystemExit(f"--baseline: none, hf or a .gguf file, not {args.baseline!r}")
    model = None if args.model == "default" else args.model
    drafts = args.draft.split(",")
    ks = [k if k == "auto" else int(k) for k in args.num_spec_tokens.split(",")]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    trees = [int(n) for n in args.spec_tree_nodes.split(",")]
    methods = [d for d in drafts if d != "none"]
    configs = [("none", 0, 0)] * ("none" in drafts) + [
        (d, k, n) for d in methods for k in ks for n in (trees if d in ("ngram", "suffix") else [0])
    ]
    results = []
    # Prefix caching off: every repeat runs the same prompts, and a repeat served from the cache
    # would time a different workload than the first (and than earlier sessions' numbers).
    settings = dict(device=args.device, max_num_seqs=max(batch_sizes), enable_prefix_caching=False)
    settings["spec_disable_batch_size"] = args.spec_disable_batch_size
    if args.two_turns:
        return two_turns(args, model, settings, params)
    base = LLM(model, dtype=args.dtype, **settings)
    workload = read_workload(args.workload, base.tokenizer if args.chat else None)
    hf = None
    if args.baseline == "hf":
        try:  # (Hugging Face's `kernels` package installed: transformers imports our kernels.py)
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as error:
            message = f"--baseline hf: transformers does not import: {error} (README)"
            raise SystemExit(message) from error

        hf_model = AutoModelForCausalLM.from_pretrained(base.model_path, dtype=base.dtype)
        hf = (hf_model.to(args.device).eval(), AutoTokenizer.from_pretrained(base.model_path))
    engines = [
        LLM(model, dtype=args.dtype, draft=d, num_spec_tokens=k, spec_tree_nodes=n, **settings)
        if d != "none"
        else base
        for d, k, n in configs
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
            llama = run_llama_cpp(gguf, base, prompts, args) if gguf and b == 1 else None
            for (draft, k, nodes), config_runs in zip(configs, runs):
                row = dict(method=draft, k=k, tree=nodes, batch=b, **median_run(config_runs))
                row["base_tok_s"] = llama
                if hf and (
                    draft == "none" or draft == "ngram" and not nodes and b == 1 and k != "auto"
                ):
                    lookup = k if draft == "ngram" else None
                    row["base_tok_s"] = run_hf(*hf, prompts, b, args, lookup)
                results.append(row)
    plain = {r["batch"]: r for r in results if r["method"] == "none"}
    plain_ids = {b: r["token_ids"] for b, r in plain.items()}
    for r in results:
        # ref: plain decoding at this batch size
        token_ids, ref = r.pop("token_ids"), plain.get(r["batch"])
        r["identical_to_plain"] = r["speedup_vs_plain"] = r["decode_speedup_vs_plain"] = None
        if ref:
            r["identical_to_plain"] = token_ids == plain_ids[r["batch"]]
            # the median of the repeats' ratios: each repeat ran every method within moments of
            # the others
            r["speedup_vs_plain"] = np.median(np.divide(r["tok_s_runs"], ref["tok_s_runs"]))
            r["decode_speedup_vs_plain"] = ref["decode_ms_per_token"] / r["decode_ms_per_token"]
        r["speedup_vs_base"] = r["tok_s"] / r["base_tok_s"] if r["base_tok_s"] else None
    machine = machine_info(base.dtype, args.device)
    table = Table(
        title=f"nanospec bench · {args.model} · {machine['dtype']} · {args.workload} · "
        f"max_tokens {args.max_tokens} · {machine['cpu']} · {machine['kernels']}"
    )
    columns = "method,K,tree,batch,= plain,tok/s,req/s,TTFT p50/p90 ms,TPOT p50/p90 ms,mean acc len"
    columns += ",acc/pos,K per step,x plain,x plain decode,base tok/s,x base"
    left = ("method", "acc/pos", "K per step")  # text; the rest, numbers, right-aligned
    for col in columns.split(","):
        table.add_column(col, justify="left" if col in left else "right")
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
            fmt(r["base_tok_s"], "{:.1f}"),
            fmt(r["speedup_vs_base"]),
        )
    Console(width=220).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine, "results": results}, f, indent=1)


# ---------------------------------------------------------------------------------------------
# `python bench.py kernels`: the CPU kernels against this machine's own limits, in one process.
def best_of(fn, repeat: int = 5) -> float:
    """The fastest of `repeat` timed calls, seconds (the minimum: noise only ever adds time)."""
    return min(timeit.repeat(fn, number=1, repeat=repeat))


def taking_turns(fns: dict, rounds: int = 5, repeat: int = 2) -> dict:
    """{name: (seconds, ratio)}: each fn's best of `repeat` calls, the fns taking turns for
    `rounds` rounds; seconds the median over the rounds, ratio the median of its ratio to the first
    fn's in the same round. On a shared machine a burst of other work spoils a round, not a whole
    measurement: measured one after the other, the same T=1 forward once took 15.0 ms at context
    100 and 13.2 at context 700, and T=5's ratio to it read 1.05x in one run and 1.61x in the next
    (a Zen 4 VM, session 24)."""
    times = np.array([[best_of(fn, repeat) for fn in fns.values()] for _ in range(rounds)])
    return dict(zip(fns, zip(np.median(times, 0), np.median(times / times[:, :1], 0))))


def loop_instructions(library: str, function: str = "linear._omp_fn.0") -> list[tuple[int, int]]:
    """(instructions, FMAs) of each innermost loop of the tiles in the disassembly of `function`:
    a number that does not depend on how wide this machine's core is. A loop is a backward jump;
    innermost: no other loop inside it; a tile's: it has FMAs and no division (the MLP's gating,
    which copies the rows before the tiles, has both: silu's exponential and its quotient)."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", library], capture_output=True)
    body = listing.stdout.decode().split(f"<{function}>:\n", 1)[1].split("\n\n", 1)[0]
    rows = [re.match(r"\s*([0-9a-f]+):\s+(\S+)\s*([0-9a-f]*)", line) for line in body.splitlines()]
    code = [(int(m[1], 16), m[2], m[3]) for m in rows if m]
    index = {address: i for i, (address, _, _) in enumerate(code)}
    loops = [
        (index[int(target, 16)], i)
        for i, (address, op, target) in enumerate(code)
        if op.startswith("j") and target and int(target, 16) <= address
    ]
    inner = [
        (a, b) for a, b in loops if not any(a <= c < d <= b and (c, d) != (a, b) for c, d in loops)
    ]
    spans = [[op for _, op, _ in code[a : b + 1]] for a, b in inner]
    spans = [ops for ops in spans if not any(op.startswith("vdiv") for op in ops)]
    # (AVX512-BF16's vdpbf16ps counts as a FMA: one instruction, a pair of k a lane)
    counts = [(len(s), sum(op.startswith(("vfmadd", "vdpbf16ps")) for op in s)) for s in spans]
    return [(instructions, fmas) for instructions, fmas in counts if fmas]


def bench_kernels(argv=None):
    """Linears at M=1 (weight-read GB/s beside a plain read of the same bytes), M=64 and 256
    (GFLOP/s beside torch's fp32 GEMM and, on bf16 CPUs, oneDNN's bf16 GEMM and the avx512bf16
    build's dot product over the same bf16 weights), whole forwards of T=1, 5, 9 at contexts 100
    to 4,000, and the instructions per FMA of the linear's loops; what is compared takes turns
    (taking_turns)."""
    from goodput import time_forward
    from sequence import Sequence

    p = argparse.ArgumentParser(description="nanospec CPU kernels against this machine's limits")
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    args = p.parse_args(argv)
    llm = LLM(args.model, dtype=args.dtype, kv_cache_gib=0.25)
    packed = [m for m in llm.model.modules() if getattr(m, "packed", None) is not None]
    linears = list({id(m.packed): m for m in packed}.values())  # (a tied weight counts once)
    weight_bytes = sum(m.packed.numel() * m.packed.element_size() for m in linears)
    macs = sum(m.in_features * m.out_features for m in linears)

    def run_linears(rows: int, layers=linears, dtype=llm.dtype):
        xs = {m.in_features: torch.randn(rows, m.in_features, dtype=dtype) for m in layers}
        return lambda: [m(xs[m.in_features]) for m in layers]

    print(
        f"{machine_info(llm.dtype, 'cpu')['cpu']} · {kernels.kernels_summary('cpu')} · "
        f"{llm.dtype}{kernels.dtypes_summary(llm.model, llm.kv_dtype)}"
    )
    print(f"{len(linears)} linears, {weight_bytes / 1e6:.0f} MB of weights")
    reads = taking_turns(
        {"plain": lambda: [m.packed.view(torch.float32).sum() for m in linears], 1: run_linears(1)}
    )
    plain_read, linear_1 = reads["plain"][0], reads[1][0]
    print(
        f"M=1: {weight_bytes / linear_1 / 1e9:.1f} GB/s ({1e3 * linear_1:.1f} ms); a plain read "
        f"of the same bytes: {weight_bytes / plain_read / 1e9:.1f} GB/s"
    )
    shapes = [(m.in_features, m.out_features) for m in linears]
    fp32_layers = [torch.nn.Linear(*shape, bias=False).requires_grad_(False) for shape in shapes]
    bf16_native = kernels.torch_bf16_native()  # (AVX512-BF16 without AMX too: Zen 4-5)
    bf16_layers = [layer.bfloat16() for layer in map(copy.deepcopy, fp32_layers)]
    # the avx512bf16 build's dot product on the same bf16 weights, packed only where it runs
    dot = kernels.cpu_kernels().isa == "avx512bf16"
    bf16_weights = [m.weight for m in bf16_layers]
    bf16_dot = [kernels.Linear(w, None, kernels.pack_weight(w)) for w in bf16_weights if dot]
    # NANOSPEC_ISA shrinks nanospec's build, and ATen's and oneDNN's take their own variables, but
    # MKL, which runs torch's fp32 GEMM, follows MKL_ENABLE_INSTRUCTIONS alone: without it an avx2
    # run is compared with AVX-512 code (session 56 found a table's 0.66x was that).
    if os.environ.get("NANOSPEC_ISA") and not os.environ.get("MKL_ENABLE_INSTRUCTIONS"):
        print("(torch's fp32 GEMM runs MKL's widest code: MKL_ENABLE_INSTRUCTIONS=AVX2 holds it)")
    for rows in (64, 256):
        gemms = {"nanospec": run_linears(rows)}
        gemms["torch fp32 GEMM"] = run_linears(rows, fp32_layers, torch.float32)
        if bf16_native:
            gemms["oneDNN bf16 GEMM"] = run_linears(rows, bf16_layers, torch.bfloat16)
        if dot:
            gemms["nanospec bf16 (dot product)"] = run_linears(rows, bf16_dot, torch.bfloat16)
        speeds = {n: 2 * rows * macs / s / 1e9 for n, (s, _) in taking_turns(gemms, 3, 1).items()}
        print(f"M={rows}, GFLOP/s: " + ", ".join(f"{n} {v:.0f}" for n, v in speeds.items()))
    # Contexts 100 and 700 (the decode and summarization steps), 1000-4000 (long chats):
    # what a context adds to a step over the same T at context 100 is, nearly all, attention's.
    probe = Sequence(list(range(1000, 1000 + 4010)), SamplingParams(), llm.device)
    assert llm.blocks.ensure_slots(probe, len(probe)), "the KV pool is too small for the probe"
    for start in range(0, 4000, 500):  # the cache holds every context
        time_forward(llm, probe, 500, start)
    whole_table = probe.block_table

    def forward(t: int, context: int) -> float:
        # As a real step's: a table just past the step's tokens, 9 at most (attention splits its
        # work by the table's segments; a 4,010-token table at context 100 saw 8 of them, where a
        # step sees 1)
        probe.block_table = whole_table[: llm.blocks.blocks_for(context + 9)]
        return time_forward(llm, probe, t, context)

    for context in (100, 700, 1000, 2000, 4000):
        # Each T beside the same T at context 100, all taking turns: attention's share is what the
        # context adds, read from forwards timed seconds apart, not minutes (measured one context
        # after another, T=1's share read 31% at 700 tokens and 18% at 1,000 in one run)
        contexts = dict.fromkeys((context, 100))
        steps = {(t, c): lambda t=t, c=c: forward(t, c) for c in contexts for t in (1, 5, 9)}
        times = taking_turns(steps)
        print(
            f"forward, context {context}: "
            + ", ".join(
                f"T={t} {1e3 * s:.1f} ms ({ratio:.2f}x, attention ~"
                f"{max(s - times[t, 100][0], 0) / s:.0%})"
                for (t, c), (s, ratio) in times.items()
                if c == context
            )
        )
    probe.block_table = whole_table
    llm.blocks.free(probe)
    # Each tile shape and dtype is its own loop: the widest tiles (most FMAs) are what decode,
    # verify and prefill spend their time in. (On AVX-512 the widest listed are prefill's tiles of
    # two panels at 9-16 rows, compiled but never called: cpu_kernels.c, ROWS. The two-panel tile
    # that runs, 8 rows, is a loop of 32 FMAs.)
    loops = sorted(set(loop_instructions(kernels.cpu_kernels()._name)), key=lambda c: -c[1])
    per_fma = sorted(i / f for i, f in loops)
    print(
        f"linear's {len(loops)} inner loops: {per_fma[0]:.2f}-{per_fma[-1]:.2f} instructions a FMA "
        f"(median {per_fma[len(loops) // 2]:.2f}); the widest: "
        + ", ".join(f"{i} for {f} FMAs" for i, f in loops[:4])
    )


if __name__ == "__main__":
    bench_kernels(sys.argv[2:]) if sys.argv[1:2] == ["kernels"] else main()

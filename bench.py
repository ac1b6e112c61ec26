# Throughput, latency and acceptance sweeps: every (method, K, batch size) runs the same prompts in the
# same process, after a warm-up, with repeats and medians, beside plain decoding (and optionally
# transformers). Speed claims live here, never in unit tests. It must never mix numbers from
# different runs, dtypes or machines into one ratio.
import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

from nanospec import LLM, SamplingParams, spec_metrics

# Functions of Python's standard library: an input-grounded workload any machine can build offline
# (the model is asked to rewrite code that is in its prompt, where prompt lookup should shine).
GROUNDED_SOURCES = ["textwrap.dedent", "shlex.split", "fnmatch.translate", "json.dumps", "base64.b64encode",
                    "string.capwords", "statistics.median", "heapq.merge", "heapq.nlargest",
                    "textwrap.indent", "calendar.isleap", "colorsys.rgb_to_hsv", "glob.escape",
                    "difflib.get_close_matches", "difflib.unified_diff", "html.escape"]


TASKS = ["Rewrite this function with a short comment above each block. Show the whole function.",
         "Explain step by step what this function does.",
         "Write a docstring for this function, then show the function with the docstring added."]
STDLIB_MODULES = ["textwrap", "shlex", "fnmatch", "json.encoder", "base64", "string", "statistics", "heapq",
                  "calendar", "colorsys", "glob", "difflib", "html", "csv", "argparse", "ipaddress", "urllib.parse",
                  "email.utils", "gettext", "tokenize", "dataclasses", "functools", "pprint", "configparser",
                  "zipfile", "tarfile", "random", "fractions", "decimal", "quopri", "uu", "netrc", "mimetypes"]


def code_prompt(func, task: str) -> str:
    return f"Here is a Python function:\n\n```python\n{inspect.getsource(func)}```\n\n{task}"


def grounded_workload() -> list[str]:
    import importlib
    return [code_prompt(getattr(importlib.import_module(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]), TASKS[0])
            for name in GROUNDED_SOURCES]


def stdlib_workload() -> list[str]:
    """Training prompts for train_speculator.py: short functions of many stdlib modules, three kinds of
    task, never one of the GROUNDED_SOURCES (those stay held apart for evaluation)."""
    import importlib
    import warnings
    prompts = []
    for module_name in STDLIB_MODULES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
        for name, func in inspect.getmembers(module, inspect.isfunction):
            if func.__module__ != module.__name__ or f"{module_name}.{name}" in GROUNDED_SOURCES:
                continue
            if 4 <= len(inspect.getsource(func).splitlines()) <= 40:
                prompts.append(code_prompt(func, TASKS[len(prompts) % len(TASKS)]))
    return prompts


DOC_TASKS = ["Explain this documentation to a beginner, with an example.", "Summarize this text in a few sentences.",
             "Write three questions a student might ask about this text, and answer them."]
SKIPPED_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "pydoc_data", "lib2to3"}


def docs_workload() -> list[str]:
    """Training text for train_speculator.py: docstrings of the standard library (modules, classes and
    functions of at least 300 characters), each asked about in a request. Never used for evaluation."""
    import importlib
    import warnings
    prompts = []
    for module_name in sorted(sys.stdlib_module_names - SKIPPED_MODULES):
        if module_name.startswith("_"):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(module_name)
            except Exception:  # platform-specific or broken on this machine
                continue
        members = [module] + [m for _, m in inspect.getmembers(module, inspect.isclass) + inspect.getmembers(
            module, inspect.isfunction) if m.__module__ == module_name]  # defined here, not imported
        for member in members:
            doc = inspect.getdoc(member) or ""
            if len(doc) >= 300:
                prompts.append(f"{doc[:2000]}\n\n{DOC_TASKS[len(prompts) % len(DOC_TASKS)]}")
    return prompts


# General-assistant requests for train_speculator.py: topics x kinds of task, written for nanospec so a
# speculator can learn the target's chat answers offline. MT-bench stays held apart for evaluation.
CHAT_TOPICS = ["photosynthesis", "the French Revolution", "machine learning", "climate change", "black holes",
               "the stock market", "healthy eating", "remote work", "electric cars", "the Roman Empire",
               "social media", "vaccines", "solar power", "the human brain", "volcanoes", "coffee", "chess",
               "jazz", "ancient Egypt", "quantum computers", "recycling", "time management", "public speaking",
               "gardening", "the water cycle", "democracy", "the internet", "sleep", "meditation", "dinosaurs",
               "the Moon landing", "friendship", "city planning", "coral reefs", "the Renaissance", "inflation",
               "earthquakes", "video games", "bees", "the printing press", "running a marathon", "learning a language",
               "saving money", "the Olympic Games", "rainforests", "space travel", "Shakespeare", "smartphones",
               "honey", "the immune system", "a small bakery", "job interviews", "volunteering", "the ocean",
               "trains", "mountains", "music lessons", "a rainy day", "robots", "the history of maps"]
CHAT_TASKS = ["Write a short story about {}.", "Explain {} to a ten-year-old.", "What are the pros and cons of {}?",
              "Write a poem about {}.", "Give me five practical tips related to {}.", "Write a blog post about {}.",
              "Describe the history of {} in three paragraphs.", "Write a persuasive speech about {}.",
              "Create a quiz with three questions about {}, with answers.", "Summarize what everyone should know about {}.",
              "Write a dialogue between a teacher and a student about {}.", "Write a product description inspired by {}."]


def chat_workload() -> list[str]:
    """Training prompts for train_speculator.py: every topic with every kind of task, in an order where
    any 60 consecutive prompts cover every topic and every task (prompt i: topic i % 60, task (i + i // 60) % 12)."""
    n = len(CHAT_TOPICS)
    return [CHAT_TASKS[(i + i // n) % len(CHAT_TASKS)].format(CHAT_TOPICS[i % n]) for i in range(n * len(CHAT_TASKS))]


def read_workload(spec: str) -> list[str]:
    builtin = {"grounded": grounded_workload, "stdlib": stdlib_workload, "docs": docs_workload, "chat": chat_workload}
    if spec in builtin:
        return builtin[spec]()
    with open(spec) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row["prompt"] if "prompt" in row else row["turns"][0] for row in rows]


def percentile(xs, q):
    return float(np.percentile(xs, q)) if xs else 0.0


def run_nanospec(llm: LLM, prompts, params, repeat):
    """Median-throughput run of all prompts submitted at once (batch = len(prompts))."""
    runs = []
    for _ in range(repeat):
        llm.k_histogram.clear()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_progress=False)
        elapsed = time.perf_counter() - start
        runs.append((sum(len(o.token_ids) for o in outs) / elapsed, elapsed, outs, dict(llm.k_histogram)))
    tok_s, elapsed, outs, k_hist = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    drafted = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    steps = sum(o.num_spec_steps for o in outs)
    return {
        "tok_s": tok_s, "req_s": len(prompts) / elapsed, "tok_s_runs": [r[0] for r in runs],
        "output_tokens": sum(len(o.token_ids) for o in outs),
        "ttft_p50": percentile([o.ttft for o in outs], 50), "ttft_p90": percentile([o.ttft for o in outs], 90),
        "tpot_p50": percentile([o.tpot for o in outs], 50), "tpot_p90": percentile([o.tpot for o in outs], 90),
        # Time from each request's first token to its last, per token after the first: decoding alone.
        "decode_ms_per_token": 1000 * sum(o.latency - o.ttft for o in outs)
                               / max(sum(len(o.token_ids) - 1 for o in outs), 1),
        "drafted": drafted, "accepted": accepted,
        "mean_accepted_length": 1 + accepted / steps if steps else None,
        # per run, in order: from the second on, the same requests again (the suffix proposer remembers)
        "mean_accepted_length_runs": [1 + sum(o.num_accepted_tokens for o in r[2])
                                      / max(sum(o.num_spec_steps for o in r[2]), 1) for r in runs],
        "nodes_per_step": drafted / steps if steps else None,
        "acceptance_per_position": spec_metrics(outs)["acceptance_per_position"],
        "k_per_step": k_hist,
        "token_ids": [o.token_ids for o in outs],  # compared with plain decoding's, then dropped
    }


def run_hf(model, tokenizer, prompts, batch_size, max_tokens, repeat, prompt_lookup=None):
    """transformers generate on the same prompts, batch_size at a time as padded batches (prompt lookup
    only supports batch 1). Counts real tokens: up to and including each row's first EOS."""
    tokenizer.padding_side = "left"
    kwargs = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup
    warm = tokenizer(prompts[:1], return_tensors="pt", add_special_tokens=False)
    model.generate(**warm, **{**kwargs, "max_new_tokens": 4})
    runs = []
    for _ in range(repeat):
        num_tokens, start = 0, time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            batch = tokenizer(prompts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                new = model.generate(**batch, **kwargs)[:, batch["input_ids"].shape[1]:]
            is_eos = new == tokenizer.eos_token_id
            num_tokens += sum(int(row.nonzero()[0]) + 1 if row.any() else len(row) for row in is_eos)
        runs.append(num_tokens / (time.perf_counter() - start))
    return {"tok_s": statistics.median(runs), "tok_s_runs": runs}


def machine_info(dtype):
    import kernels
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return {"cpu": cpu, "isa": kernels.cpu_isa(), "kernels": kernels.kernels_summary(dtype, "cpu"),
            "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "dtype": dtype,
            "python": platform.python_version()}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="nanospec throughput / acceptance sweeps ('bench.py kernels' times kernels)")
    p.add_argument("--model", default="default", help="model folder, or 'default' (embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default="none,ngram", help="comma list of: none, ngram, suffix, PATH, mlp:PATH")
    p.add_argument("--num-spec-tokens", default="4", help="comma list of K values and/or 'auto'")
    p.add_argument("--spec-tree-nodes", default="0", help="comma list of tree node budgets (0: chains)")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--workload", default="grounded", help="'grounded', 'stdlib', 'docs', 'chat' (built in) or a JSONL file")
    p.add_argument("--num-prompts", type=int, default=0, help="prompts per run (default: the batch size)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True, help="apply the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--baseline", choices=["none", "hf"], default="none")
    p.add_argument("--spec-disable-batch-size", type=int)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", help="write every raw number here")
    return p.parse_args(argv)


def sweep(args):
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table
    model = None if args.model == "default" else args.model
    drafts = args.draft.split(",")
    ks = [k if k == "auto" else int(k) for k in args.num_spec_tokens.split(",")]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    trees = [int(n) for n in args.spec_tree_nodes.split(",")]
    configs = [("none", 0, 0)] * ("none" in drafts) + [(d, k, n) for d in drafts if d != "none" for k in ks
                                                       for n in (trees if d in ("ngram", "suffix") else [0])]
    results = []
    base = LLM(model, dtype=args.dtype, max_num_seqs=max(batch_sizes))
    all_prompts = read_workload(args.workload)
    if args.chat and base.tokenizer and base.tokenizer.chat_template:
        all_prompts = [base.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in all_prompts]
    hf = None
    if args.baseline == "hf":
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from models.gguf import default_model_path
        path = model or default_model_path()
        hf = (AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval(),
              AutoTokenizer.from_pretrained(path))
    with Progress(transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(configs) * len(batch_sizes))
        for draft, k, nodes in configs:
            spec = dict(draft=draft, num_spec_tokens=k, spec_disable_batch_size=args.spec_disable_batch_size,
                        spec_tree_nodes=nodes)
            llm = base if draft == "none" else LLM(model, dtype=args.dtype, max_num_seqs=max(batch_sizes),
                                                   **spec)
            for b in batch_sizes:
                n = args.num_prompts or b
                prompts = [all_prompts[i % len(all_prompts)] for i in range(n)]
                llm.max_num_seqs = b
                # warm-up, on a prompt of its own: the suffix proposer remembers finished requests
                llm.generate(["Hello"], SamplingParams(max_tokens=8), use_progress=False)
                row = {"method": draft, "k": k, "tree": nodes, "batch": b,
                       **run_nanospec(llm, prompts, params, args.repeat)}
                if hf and (draft == "none" or draft == "ngram" and not nodes and b == 1 and k != "auto"):
                    row["hf_tok_s"] = run_hf(*hf, prompts, b, args.max_tokens, args.repeat,
                                             prompt_lookup=k if draft == "ngram" else None)["tok_s"]
                results.append(row)
                progress.advance(task)
    plain = {r["batch"]: r for r in results if r["method"] == "none"}
    plain_ids = {b: r["token_ids"] for b, r in plain.items()}
    for r in results:
        token_ids = r.pop("token_ids")
        r["identical_to_plain"] = token_ids == plain_ids[r["batch"]] if r["batch"] in plain_ids else None
    for r in results:
        r["speedup_vs_plain"] = r["tok_s"] / plain[r["batch"]]["tok_s"] if r["batch"] in plain else None
        r["decode_speedup_vs_plain"] = plain[r["batch"]]["decode_ms_per_token"] / r["decode_ms_per_token"] \
            if r["batch"] in plain else None
        r["speedup_vs_hf"] = r["tok_s"] / r["hf_tok_s"] if r.get("hf_tok_s") else None
    machine = machine_info(args.dtype)
    table = Table(title=f"nanospec bench · {args.model} · {args.dtype} · {args.workload} · max_tokens "
                        f"{args.max_tokens} · {machine['cpu']} · {machine['kernels']}")
    for col in ("method", "K", "tree", "batch", "= plain", "tok/s", "req/s", "TTFT p50/p90 ms",
                "TPOT p50/p90 ms", "mean acc len", "acc/pos", "K per step", "x plain", "x plain decode", "hf tok/s", "x hf"):
        table.add_column(col, justify="left" if col in ("method", "acc/pos", "K per step") else "right")
    fmt = lambda x, f="{:.2f}": "-" if x is None else f.format(x)  # noqa: E731
    for r in results:
        same = {True: "yes", False: "NO", None: "-"}[r["identical_to_plain"]]
        table.add_row(os.path.basename(r["method"].rstrip("/")), str(r["k"]), str(r["tree"]), str(r["batch"]),
                      same, f"{r['tok_s']:.1f}",
                      f"{r['req_s']:.2f}", f"{1000 * r['ttft_p50']:.0f}/{1000 * r['ttft_p90']:.0f}",
                      f"{1000 * r['tpot_p50']:.1f}/{1000 * r['tpot_p90']:.1f}", fmt(r["mean_accepted_length"]),
                      " ".join(f"{a:.2f}" for a in r["acceptance_per_position"]),
                      " ".join(f"{k}:{n}" for k, n in sorted(r["k_per_step"].items())) if r["k"] else "",
                      fmt(r["speedup_vs_plain"]), fmt(r["decode_speedup_vs_plain"]), fmt(r.get("hf_tok_s"), "{:.1f}"),
                      fmt(r["speedup_vs_hf"]))
    Console(width=220).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine, "results": results}, f, indent=1)


def bench_kernels():
    """Each Triton kernel against its torch reference on CUDA (triton's do_bench, median)."""
    if not torch.cuda.is_available():
        print("bench.py kernels: no CUDA device here; the Triton kernels are only timed on a GPU.")
        return
    import triton
    import kernels
    dev, dtype = "cuda", torch.bfloat16
    num_kv, group, head_dim, block_size = 8, 4, 128, 16
    copy = torch.empty(2**28, dtype=torch.uint8, device=dev)
    copy_gbs = 2 * copy.numel() / triton.testing.do_bench(lambda: copy.clone()) / 1e6
    print(f"{torch.cuda.get_device_name()}: device copy bandwidth {copy_gbs:.0f} GB/s")
    for q_len in (1, 5):
        for batch in (1, 8, 64):
            for context in (512, 2048, 8192):
                blocks_per_seq = context // block_size
                kc = torch.randn(batch * blocks_per_seq, block_size, num_kv, head_dim, device=dev, dtype=dtype)
                vc = torch.randn_like(kc)
                tables = torch.arange(batch * blocks_per_seq, device=dev, dtype=torch.int32).view(batch, -1)
                seq_lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
                qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32) * q_len
                q = torch.randn(batch * q_len, num_kv * group, head_dim, device=dev, dtype=dtype)
                args = (q, kc, vc, tables, seq_lens, qsl, head_dim ** -0.5, q_len, context)
                t_triton = triton.testing.do_bench(lambda: kernels.triton_paged_attention(*args))
                t_torch = triton.testing.do_bench(lambda: kernels.torch_paged_attention(*args))
                gbs = 2 * kc.numel() * kc.element_size() / t_triton / 1e6
                tflops = 4 * batch * q_len * num_kv * group * context * head_dim / t_triton / 1e9
                print(f"paged_attention q_len {q_len} batch {batch:3d} ctx {context:5d}: triton {1000 * t_triton:8.1f} us "
                      f"({gbs:6.0f} GB/s, {tflops:5.1f} TFLOP/s)  torch {1000 * t_torch:8.1f} us")
    # Elementwise kernels on 4096 tokens: bandwidth is what they can achieve (bytes read + written).
    tokens, hidden, heads = 4096, 4096, 32
    x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    w = torch.randn(hidden, device=dev, dtype=dtype)
    q_k = torch.randn(tokens, heads + num_kv, head_dim, device=dev, dtype=dtype)  # a layer's q and k heads
    k = q_k[:, heads:]
    cos_sin = torch.randn(tokens, head_dim, device=dev, dtype=dtype)
    k_cache = torch.zeros(tokens // block_size, block_size, num_kv, head_dim, device=dev, dtype=dtype)
    slots = torch.randperm(tokens, device=dev)
    vocab, k_max, batch = 128 * 1024, 4, 64
    probs = torch.softmax(torch.randn(batch, k_max + 1, vocab, device=dev), -1)
    sample_args = (probs, torch.randint(vocab, (batch, k_max), device=dev), probs[:, :k_max].clone(),
                   torch.full((batch,), k_max, device=dev), torch.rand(batch, k_max, device=dev),
                   torch.empty(batch, vocab, device=dev).exponential_())
    cases = [("rms_norm", (x, w, 1e-6), 2 * x.nbytes), ("silu_mul", (x,), 1.5 * x.nbytes),
             ("rotary", (q_k, cos_sin), 2 * q_k.nbytes),
             ("store_kv", (k, k, k_cache, k_cache.clone(), slots), 4 * k.nbytes),
             ("rejection_sample", sample_args, 2 * probs.nbytes)]
    for name, args, nbytes in cases:
        t = triton.testing.do_bench(lambda: getattr(kernels, f"triton_{name}")(*args))
        r = triton.testing.do_bench(lambda: getattr(kernels, f"torch_{name}")(*args))
        print(f"{name}: triton {1000 * t:.1f} us ({nbytes / t / 1e6:.0f} GB/s)  torch {1000 * r:.1f} us")


# Targets of `bench.py kernels --compile-only`: GPUTarget arguments, and the shared memory a block may use.
COMPILE_TARGETS = {"sm_80": (("cuda", 80, 32), 163 << 10), "sm_90": (("cuda", 90, 32), 227 << 10),
                   "gfx942": (("hip", "gfx942", 64), 64 << 10)}


def compile_cases():
    """The launches the Triton wrappers make (recorded on meta tensors) for fp32/fp16/bf16, head_dim 64 and
    128, GQA groups 1, 3, 8, block sizes 1 and 16, split KV (contexts over KV_SEGMENT) and
    unsplit, one-hot and probability drafts (probabilities are fp32 in the engine)."""
    import kernels
    kernels.meta_launches.clear()
    meta = lambda *shape, dtype=torch.float32: torch.empty(shape, dtype=dtype, device="meta")
    longs = lambda *shape: meta(*shape, dtype=torch.int64)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for d, group, kv, bs, q_len, batch, ctx in ((64, 1, 8, 16, 1, 64, 512), (128, 8, 2, 1, 1, 1, 8192),
                                                     (128, 3, 4, 16, 9, 4, 2048), (64, 8, 8, 1, 8, 64, 1024)):
            q_k = meta(batch * q_len, kv * (group + 1), d, dtype=dtype)  # a layer's q and k heads
            cache = meta(ctx, bs, kv, d, dtype=dtype)
            kernels.triton_rotary(q_k, meta(batch * q_len, d, dtype=dtype))
            kernels.triton_store_kv(q_k[:, -kv:], q_k[:, -kv:], cache, cache, longs(batch * q_len))
            tree = (longs(batch * q_len), longs(batch * q_len, 5)) if q_len == 9 else ()  # a draft tree
            kernels.triton_paged_attention(q_k[:, :-kv], cache, cache, longs(batch, ctx // bs), longs(batch),
                                           longs(batch + 1), d ** -0.5, q_len, ctx, *tree)
        for hidden, residual in ((576, None), (8192, meta(4, 8192, dtype=dtype))):
            kernels.triton_rms_norm(meta(4, hidden, dtype=dtype), meta(hidden, dtype=dtype), 1e-6, residual)
            kernels.triton_silu_mul(meta(4, 2 * hidden, dtype=dtype))
    for draft_probs in (None, meta(8, 4, 151936)):
        kernels.triton_rejection_sample(meta(8, 5, 151936), longs(8, 4), draft_probs, longs(8), meta(8, 4),
                                        meta(8, 151936))
    return list(kernels.meta_launches)


def compile_launch(case: int, target: str) -> dict:
    """triton.compile one recorded launch, specialised by Triton's own launch binder (argument types, ints
    equal to 1, 16-byte alignment). Registers and stack bytes (spills, in practice) per thread come from
    cuobjdump on NVIDIA and from the code object's notes on AMD."""
    import re, subprocess, tempfile, triton
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    kernel, args, options = compile_cases()[case]
    target = triton.backends.compiler.GPUTarget(*COMPILE_TARGETS[target][0])
    backend = make_backend(target)
    bind = create_function_from_signature(kernel.signature, kernel.params, backend)
    opts, signature, constexprs, attrs = kernel._pack_args(backend, options, *bind(*args, **options))
    source = ASTSource(kernel, signature, constexprs, attrs)
    compiled = triton.compile(source, target=target, options=opts.__dict__)
    if target.backend == "hip":
        usage = compiled.asm["amdgcn"].replace(".vgpr_count:", "REG:").replace("; ScratchSize:", "STACK:")
    else:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"]), f.flush()
            usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                                   capture_output=True, text=True, check=True).stdout
    regs, stack = (int(re.search(rf"{key}\s*(\d+)", usage)[1]) for key in ("REG:", "STACK:"))
    name, dtype = kernel.__name__.strip("_").removesuffix("_kernel"), signature[kernel.arg_names[0]][1:]
    return dict(kernel=name, dtype=dtype, shared=compiled.metadata.shared, regs=regs, stack=stack,
                constexprs={kernel.arg_names[i]: v for (i,), v in constexprs.items()})


def compile_all():
    """Every recorded launch compiled for every target (gfx942 only if this triton can), 2 processes."""
    import concurrent.futures, multiprocessing
    assert os.environ.get("TRITON_INTERPRET") != "1", "unset TRITON_INTERPRET: it compiles nothing"
    skipped = {}
    try:
        compile_launch(0, "gfx942")
    except Exception as e:  # noqa: BLE001 - whatever the reason, this wheel cannot target AMD
        skipped["gfx942"] = f"this triton cannot compile for gfx942: {type(e).__name__}: {e}"[:300]
    jobs = [(case, t) for t in COMPILE_TARGETS if t not in skipped for case in range(len(compile_cases()))]
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        rows = pool.map(compile_launch, *zip(*jobs))
        return [dict(row, target=target) for row, (_, target) in zip(rows, jobs)], skipped


def compile_kernels():
    """bench.py kernels --compile-only: one table row per kernel x target x dtype, on any machine."""
    rows, skipped = compile_all()
    print("| kernel | target | dtype | launches | max shared B | limit B | max regs | max stack B (spills) |")
    print("|---|---|---|---|---|---|---|---|")
    for key in dict.fromkeys((r["kernel"], r["target"], r["dtype"]) for r in rows):
        group = [r for r in rows if (r["kernel"], r["target"], r["dtype"]) == key]
        most = {field: max(r[field] for r in group) for field in ("shared", "regs", "stack")}
        print(f"| {' | '.join(key)} | {len(group)} | {most['shared']} | {COMPILE_TARGETS[key[1]][1]} | "
              f"{most['regs']} | {most['stack']} |")
    for target, reason in skipped.items():
        print(f"{target} skipped: {reason}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["kernels"]:
        return compile_kernels() if "--compile-only" in argv else bench_kernels()
    sweep(parse_args(argv))


if __name__ == "__main__":
    main()

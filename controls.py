# controls: the sampling controls beyond temperature / top-k / top-p (repetition, presence and
# frequency penalties, min_p, logit_bias, allowed_token_ids) and structured output (JSON schema,
# regex, Lark grammar, choice) through llguidance. Each is a function of a logits row and the token
# history before it, nothing else: under speculation, verify row j is processed with the history
# plain decoding would have there (output so far + the path's earlier drafts), so it gets plain
# decoding's numbers bit for bit. It must never read the step, the batch or another row.
import functools
import json
import math

import numpy as np
import torch

from models import require

STRUCTURED = ("json_schema", "regex", "grammar", "choice")


def check_params(params, checks: dict):
    """SamplingParams.__post_init__'s checks: its own (`checks`, name -> valid), then those of the
    controls, with vLLM's ranges."""
    bias, allowed = params.logit_bias or {}, params.allowed_token_ids
    checks |= {
        "repetition_penalty": 0 < params.repetition_penalty < math.inf,
        "presence_penalty": -2 <= params.presence_penalty <= 2,
        "frequency_penalty": -2 <= params.frequency_penalty <= 2,
        "min_p": 0 <= params.min_p <= 1,
        "logit_bias": all(isinstance(t, int) and -100 <= b <= 100 for t, b in bias.items()),
        "allowed_token_ids": allowed is None
        or allowed
        and all(isinstance(t, int) for t in allowed),
        "choice": params.choice is None or params.choice and all(params.choice),
    }
    for name, ok in checks.items():
        require(ok, f"SamplingParams.{name} has an invalid value: {getattr(params, name)!r}")
    given = [name for name in STRUCTURED if getattr(params, name) is not None]
    require(len(given) <= 1, f"SamplingParams: {' and '.join(given)} given, at most one may be")


def check_vocab(params, vocab_size: int):
    """Token ids must index the model's logits: checked where the vocabulary is known."""
    for name in ("logit_bias", "allowed_token_ids"):
        outside = [t for t in getattr(params, name) or () if not 0 <= t < vocab_size]
        require(
            not outside,
            f"SamplingParams.{name} has token ids outside the vocabulary "
            f"(0..{vocab_size - 1}): {outside[:5]}",
        )


def has_controls(params) -> bool:
    """Whether process_logits changes anything for these params (else the raw rows are used)."""
    return (
        params.repetition_penalty != 1
        or params.presence_penalty != 0
        or params.frequency_penalty != 0
        or params.min_p > 0
        or bool(params.logit_bias)
        or params.allowed_token_ids is not None
    )


def process_logits(
    logits: torch.Tensor, history: list[int], num_prompt_tokens: int, params
) -> torch.Tensor:
    """One row of logits [V] -> float32 logits after the controls, in vLLM's order (the grammar's
    mask comes first, in apply(): a fill with -inf commutes with this one): allowed_token_ids,
    logit_bias, the penalties (repetition over `history`, prompt and output; presence and
    frequency over the output, history after the prompt), then min_p on the temperature-scaled
    distribution. Forbidden tokens get -inf."""
    logits = logits.float().clone()
    if params.allowed_token_ids is not None:
        outside = torch.ones_like(logits, dtype=torch.bool)
        outside[params.allowed_token_ids] = False
        logits.masked_fill_(outside, -math.inf)
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias))
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
    if params.repetition_penalty != 1:
        seen = torch.tensor(history, dtype=torch.long).unique()
        x = logits[seen]
        penalty = params.repetition_penalty
        logits[seen] = torch.where(x > 0, x / penalty, x * penalty)
    if params.presence_penalty != 0 or params.frequency_penalty != 0:
        output = history[num_prompt_tokens:]
        ids, counts = torch.tensor(output, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= params.frequency_penalty * counts + params.presence_penalty
    if params.min_p > 0 and params.temperature > 0:
        # p < min_p * max p, in logits: no softmax, and nothing that depends on other rows
        floor = logits.max() + params.temperature * math.log(params.min_p)
        logits.masked_fill_(logits < floor, -math.inf)
    return logits


def row_paths(drafts: list[int], parents: list[int]) -> list[list[int]]:
    """Per verify row (the last token's, then one per draft node): the drafts from the last token
    to it, which plain decoding would have emitted before sampling there."""
    paths = [[]]
    for token, parent in zip(drafts, parents):
        paths.append(paths[parent + 1] + [token])
    return paths


def apply(owners: list[tuple], logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] after each request's grammar and controls. owners: (sequence, paths) in row
    order, one path per row (row_paths): the row is processed with the history sequence.token_ids
    + path, plain decoding's at that position. Returns logits itself when nothing applies, else
    a float32 copy (the raw rows stay for logprobs)."""
    if not any(seq.grammar is not None or has_controls(seq.params) for seq, _ in owners):
        return logits
    logits, start = logits.to(torch.float32, copy=True), 0
    for seq, paths in owners:
        if seq.grammar is not None:  # one fill for all the request's rows: no per-row copies
            logits[start : start + len(paths)].masked_fill_(
                seq.grammar.forbidden_after(paths), -math.inf
            )
        for row, path in enumerate(paths if has_controls(seq.params) else [], start):
            history = seq.token_ids + path
            logits[row] = process_logits(logits[row], history, seq.num_prompt_tokens, seq.params)
        start += len(paths)
    return logits


# ---------------------------------------------------------------------------------------------
# Structured output: llguidance (README, "Dependencies"): a matcher per request, fed the committed
# tokens; drafts are fed to copies of it for their masks.
def check_request(engine, params) -> "Grammar | None":
    """add_request's checks of the controls that need the engine's model (token ids in the
    vocabulary, the grammar compiles): a ValueError naming the field, before the request joins a
    batch. Returns the request's compiled grammar, if it has one."""
    vocab_size = engine.model.vocab_size
    check_vocab(params, vocab_size)
    if all(getattr(params, name) is None for name in STRUCTURED):
        return None
    require(engine.tokenizer is not None, "structured output needs the model's tokenizer.json")
    json_text, eos_ids = engine.tokenizer.tokenizer.to_str(), tuple(sorted(engine.eos_ids))
    return Grammar(grammar_tokenizer(json_text, vocab_size, eos_ids), params)


@functools.cache
def grammar_tokenizer(tokenizer_json: str, vocab_size: int, eos_ids: tuple):
    """llguidance's view of the vocabulary (~0.3 s to build: one per tokenizer)."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids))


def prune_drafts(items):
    """Cut the drafts each ScheduledSeq's grammar forbids, before verification; count them apart
    (Sequence.num_pruned). Model drafts are chains: their probabilities keep the kept prefix.
    One-hot drafts (n-gram, suffix) give way to the tokens the grammar forces (a JSON key and its
    quotes, in the tokenizer's own split) where those reach deeper: the model, masked, can only
    say the same bytes, and it says them in that split almost always."""
    for it in items:
        if it.samples and it.seq.grammar:
            num_drafts = len(it.drafts)
            it.drafts, it.parents = it.seq.grammar.prune(it.drafts, it.parents)
            it.seq.num_pruned += num_drafts - len(it.drafts)
            forced = it.seq.grammar.matcher.compute_ff_tokens()[: it.max_depth]  # ~10 us
            if it.draft_probs is not None:
                it.draft_probs = it.draft_probs[: len(it.drafts)]
            elif len(forced) > it.depth():
                it.drafts, it.parents = forced, list(range(-1, len(forced) - 1))


def grammar_source(field: str, value) -> str:
    """The llguidance grammar of a request's structured output (field: one of STRUCTURED). JSON
    comes out as json.dumps writes it (", " and ": "), with no free whitespace to loop on."""
    from llguidance import LLMatcher

    if field == "json_schema":
        schema = value if isinstance(value, str) else json.dumps(value)
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        return LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if field == "regex":
        return LLMatcher.grammar_from_regex(value)
    if field == "grammar":
        return LLMatcher.grammar_from_lark(value)
    return LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, value)))  # choice


class Grammar:
    """One request's grammar state: the matcher holds exactly the request's committed tokens."""

    def __init__(self, ll_tokenizer, params):
        from llguidance import LLMatcher

        field = next(name for name in STRUCTURED if getattr(params, name) is not None)
        try:
            self.matcher = LLMatcher(
                ll_tokenizer, grammar_source(field, getattr(params, field)), log_level=0
            )
            problem = self.matcher.get_error()
        except ValueError as error:  # e.g. a JSON schema that is not JSON
            problem = str(error)
        require(not problem, f"SamplingParams.{field} cannot be compiled: {problem}")
        self.vocab_size = ll_tokenizer.vocab_size

    def prune(self, drafts: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
        """Cut the drafts the grammar forbids after their root-to-node path, with their subtrees,
        before they take a verify row. Returns the kept drafts and their parents re-indexed."""
        kept, kept_parents, index, paths = [], [], {-1: -1}, {-1: []}
        for i, (token, parent) in enumerate(zip(drafts, parents)):
            path = paths[parent] + [token] if parent in index else []
            if path and self.matcher.validate_tokens(path) == len(path):  # consumes nothing
                paths[i], index[i] = path, len(kept)
                kept.append(token)
                kept_parents.append(index[parent])
        return kept, kept_parents

    def forbidden_after(self, paths: list[list[int]]) -> torch.Tensor:
        """[len(paths), V] bool: the tokens the grammar forbids after the committed tokens and
        each path (grammar-valid). Each path is fed to a copy of the matcher (~1 us), never to the
        matcher itself: rolling llguidance 1.9 back over the grammar's end, where its last literal
        is the EOS token's own text, restored one token too few, and the next step's masks were
        those of a draft that was never committed. Tokens after the grammar's end are not fed:
        plain decoding stops there, so what their rows give is never emitted."""
        masks = []
        for path in paths:
            matcher = self.matcher.deep_copy()
            for token in path:
                if matcher.is_stopped():
                    break
                matcher.consume_token(token)
            masks.append(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8))
        # One unpacking for all rows, of the complement: no [V] negation, no copy into torch.
        bits = np.unpackbits(~np.stack(masks), axis=1, count=self.vocab_size, bitorder="little")
        return torch.from_numpy(bits.view(np.bool_))

    def commit(self, token: int) -> bool:
        """Feed one emitted token; True when it ends the grammar (the request then stops)."""
        self.matcher.consume_token(token)
        return self.matcher.is_stopped()

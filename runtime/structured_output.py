"""Constrained decoding: a grammar per request (JSON schema, regex, choice, Lark/GBNF), a token
mask per step computed on the host while the device runs the model, applied in the sampler.

The library is llguidance (pinned in pyproject): it compiles a schema in milliseconds and
computes a 128k-vocabulary mask in tens of microseconds, and it covers the widest set of
real-world schemas (JSONSchemaBench). Three pieces:

- `GrammarCompiler` turns `StructuredOutputsParams` into a compiled matcher, on its own
  threads with a time limit and an LRU cache: the server compiles while the request is still
  its own (a bad or slow grammar is a 400 naming the field; the engine never waits on it), and
  the engine then finds the compiled grammar in the cache.
- `StructuredOutputs` keeps one matcher per sequence (siblings of n > 1 each their own),
  feeds it the sequence's accepted tokens, and fills the step's bitmask.
- The engine (runtime/engine.py) launches a constrained step's forward first and samples it
  only after the previous step's tokens have advanced the matchers: the mask is computed while
  the forward runs (async scheduling stays on).

A grammar follows the reasoning (EngineConfig.reasoning_parser): until the sequence's reasoning
parser sees the reasoning end, the sequence samples freely; the grammar applies to what comes
after (from the first token when the prompt already closed the reasoning part).
Preemption needs nothing: recompute keeps a request's output tokens, so its matcher stays.

Speculative decoding: a constrained request's drafts are cut to what its grammar allows
(`check_drafts`), and its verification rows get a mask each, the grammar advanced through the
drafts before that row and rolled back (llguidance's draft-token fill). A draft that would
complete the grammar is cut too, so that completion can only come from the target's own
token, where the request then ends as it would without speculation; while the output is still
reasoning, no drafts (the grammar's start inside a run of drafts is not known in advance).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from compile_engine.runtime.sampling_params import StructuredOutputsParams

log = logging.getLogger(__name__)

# JSON is generated compactly: free whitespace lets a small model emit newlines forever inside
# a valid object (greedy decoding finds such loops). The separators stay llguidance's "," and
# ":": with ": " (1.9.1) the mask after a token holding a key's closing quote and the colon,
# such as '":', allowed only ':' and the next token broke the grammar.
_JSON_OPTIONS = {"whitespace_flexible": False}
MASK_TIMES_KEPT = 4096  # per-step mask fill times kept for the benchmarks' percentiles


class GrammarError(ValueError):
    """A request's grammar or schema cannot be used; `param` names its field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked: compiling does that)."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    kind = spec.kind
    matcher = llguidance.LLMatcher
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else spec.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        return matcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return matcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        )
    try:
        lark = any_to_lark(spec.grammar)  # GBNF/EBNF is converted, Lark passes through
    except Exception as exc:
        raise GrammarError(f"{spec.param}: the grammar does not parse: {exc}", spec.param) from None
    return matcher.grammar_from_lark(lark)


def grammar_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """llguidance's view of an HF fast tokenizer: each token's bytes, read off its JSON.

    A byte-level BPE (GPT-2's, SmolLM2's, Llama 3's) is given a plain ByteLevel decoder:
    transformers' GGUF conversion writes a decoder chain (ByteFallback, Fuse, Replace,
    ByteLevel) that llguidance does not read as byte-level, and it then took 'Ġ"' for two
    characters instead of a space and a quote, and let raw newlines into JSON strings."""
    import copy

    import llguidance

    backend = copy.copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if any(p.get("type") == "ByteLevel" for p in parts):
        spec["decoder"] = {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": True,
        }
    eos = list(eos_token_ids) or [hf_tokenizer.eos_token_id]
    return llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=eos)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe. A compile that outlives
    `timeout_s` is refused; its thread finishes on its own (llguidance's fuel limits bound
    it), and the same constraint asked again waits for that same compile."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        timeout_s: float = 5.0,
        cache_size: int = 256,
        threads: int = 2,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self.timeout_s = timeout_s
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._vocabulary: Future | None = None
        self.compile_times: deque[float] = deque(maxlen=MASK_TIMES_KEPT)

    def vocabulary(self) -> Future:
        """llguidance's view of the vocabulary, built once on a grammar thread when the first
        grammar asks (0.7 s for a 49k vocabulary, seconds for 128k on a busy CPU: it does not
        count against a grammar's time limit, and an engine without grammars never pays it)."""
        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = self._pool.submit(self._build_vocabulary)
            return self._vocabulary

    def tokenizer(self):
        return self.vocabulary().result()

    def _build_vocabulary(self):
        if self._hf_tokenizer is None:
            raise GrammarError(
                "structured output needs the model's tokenizer; this model has none",
                "structured_outputs",
            )
        return grammar_tokenizer(self._hf_tokenizer, self.vocab_size, self._eos)

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The compiled matcher of `spec` (its initial state; copy it per sequence), as a
        future: done at once on a cache hit."""
        self.vocabulary()  # queued ahead of every compile, which waits for it on its thread
        key = spec.key()
        with self._lock:
            future = self._compiled.get(key)
            if future is not None:
                self._compiled.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._compiled[key] = future
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        future.add_done_callback(lambda f, key=key: self._forget_failure(key, f))
        return future

    def compile(self, spec: StructuredOutputsParams):
        """`submit`, waiting at most timeout_s once the vocabulary is built (the engine
        thread's path: the server has compiled the grammar already, so this is a cache hit
        there)."""
        self.tokenizer()
        future = self.submit(spec)
        try:
            return future.result(timeout=self.timeout_s)
        except TimeoutError:
            raise self.timeout_error(spec) from None

    def timeout_error(self, spec: StructuredOutputsParams) -> GrammarError:
        return GrammarError(
            f"{spec.param}: the grammar took longer than {self.timeout_s:g} s to compile; "
            "simplify it (fewer alternatives, smaller repetition bounds)",
            spec.param,
        )

    def _forget_failure(self, key: tuple[str, str], future: Future) -> None:
        # A refused grammar is not kept: it holds no matcher, only an error to raise again.
        if future.exception() is not None:
            with self._lock:
                if self._compiled.get(key) is future:
                    del self._compiled[key]

    def _compile(self, spec: StructuredOutputsParams):
        import llguidance

        started = time.perf_counter()
        tokenizer = self.tokenizer()
        try:
            grammar = grammar_text(spec)
        except GrammarError:
            raise
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"{spec.param}: {exc}", spec.param) from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(
                f"{spec.param}: the {spec.kind.replace('_', ' ')} cannot be compiled: "
                f"{matcher.get_error()}",
                spec.param,
            )
        # One mask here, on the grammar thread: the copies each sequence takes inherit what it
        # built, so their first masks cost ~10 us instead of 20-100 (and the first grammar of a
        # vocabulary's ~2 ms of one-time set-up is not paid in a step).
        matcher.compute_bitmask()
        if matcher.is_error():  # a grammar that admits nothing
            raise GrammarError(f"{spec.param}: {matcher.get_error()}", spec.param)
        self.compile_times.append(time.perf_counter() - started)
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(slots=True)
class _State:
    matcher: Any  # llguidance.LLMatcher
    reasoning: Any  # the sequence's ReasoningParser while the output is still reasoning, or None
    consumed: int = 0  # output tokens the matcher has been given
    text_seen: int = 0  # output characters the reasoning parser has been given


@dataclass(slots=True)
class StructuredOutputs:
    """The engine's per-sequence grammar state (engine thread only)."""

    compiler: GrammarCompiler
    reasoning: type | None = None  # the ReasoningParser class, if one is configured
    states: dict[str, _State] = field(default_factory=dict)
    mask_times: deque = field(default_factory=lambda: deque(maxlen=MASK_TIMES_KEPT))
    _executor: Any = None
    _buffers: list = field(default_factory=lambda: [None, None])
    _turn: int = 0

    def add(
        self, request_ids: list[str], spec: StructuredOutputsParams, prompt_tail: str = ""
    ) -> None:
        """Give each sequence of a request a matcher; raises GrammarError. `prompt_tail` is
        the end of the prompt's text: a reasoning part closed there (Qwen3's enable_thinking
        off renders an empty one) means the grammar applies from the first token."""
        template = self.compiler.compile(spec)
        reasoning = self.reasoning
        if reasoning is not None:
            end, start = prompt_tail.rfind(reasoning.end_tag), prompt_tail.rfind("<think>")
            if end >= 0 and end > start:
                reasoning = None
        for rid in request_ids:
            parser = reasoning() if reasoning is not None else None
            self.states[rid] = _State(template.deep_copy(), parser)

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def constrains(self, requests: list) -> bool:
        states = self.states
        return bool(states) and any(r.request_id in states for r in requests)

    def advance(self, request, text: str) -> bool:
        """Feed the sequence's newly accepted output tokens (`text`: its output so far, for
        the reasoning end); True when the grammar is complete or broken, so the sequence
        ends ("stop")."""
        state = self.states.get(request.request_id)
        if state is None:
            return False
        tokens = request.output_token_ids
        if state.reasoning is not None:
            state.reasoning.feed(text[state.text_seen :])
            state.text_seen = len(text)
            if state.reasoning.ended:
                state.reasoning, state.consumed = None, len(tokens)  # the grammar starts now
            return False
        new = tokens[state.consumed :]
        state.consumed = len(tokens)
        matcher = state.matcher
        eos = request.eos_token_id
        for token in new:
            if matcher.is_stopped():
                break
            if not matcher.consume_token(token) and token != eos:
                log.warning(
                    "request %s: token %d broke its grammar (%s); ending it",
                    request.request_id,
                    token,
                    matcher.get_error(),
                )
                return True
        return matcher.is_stopped()

    def check_drafts(self, request) -> None:
        """Cut `request.spec_token_ids` to the drafts its grammar accepts, before the one that
        would complete it (module docstring); none while its output is still reasoning."""
        state = self.states.get(request.request_id)
        drafts = request.spec_token_ids
        if state is None or not drafts:
            return
        if state.reasoning is not None or state.matcher.is_stopped():
            request.spec_token_ids = []
            return
        matcher = state.matcher
        valid = matcher.validate_tokens(drafts)
        kept = 0
        for token in drafts[:valid]:
            matcher.consume_token(token)
            if matcher.is_stopped():
                break
            kept += 1
        matcher.rollback(min(valid, kept + 1))
        request.spec_token_ids = drafts[:kept]

    def bitmask(self, requests: list, drafts: list[list[int]] | None = None) -> torch.Tensor | None:
        """[S, ceil(V / 32)] int32 on the host: bit t of row i allows token t; rows without an
        active grammar allow everything. None when no row is constrained. With `drafts` (a
        list per request, speculative decoding) a request has 1 + len(drafts) rows,
        [R, ceil(V / 32)]: its row j masks the token after its first j drafts.

        The rows are filled in place, by llguidance's threads, in one of two buffers used in
        turn (pinned on CUDA machines, so that the sampler's copy to the device does not wait):
        a buffer is written again only two steps later, after the step that read it has been
        collected. Allocating the mask each step cost more than computing it (a 1 MB
        torch.full took milliseconds on a busy CPU)."""
        drafts = drafts if drafts is not None else [[] for _ in requests]
        starts = [0]
        for own in drafts:
            starts.append(starts[-1] + 1 + len(own))
        rows = [
            (state.matcher, i)
            for i, r in enumerate(requests)
            if (state := self.states.get(r.request_id)) is not None
            and state.reasoning is None
            and not state.matcher.is_stopped()
        ]
        if not rows:
            return None
        started = time.perf_counter()
        mask = self._next_buffer(starts[-1])
        constrained = {i for _, i in rows}
        for i in range(len(requests)):
            # Rows no grammar fills allow everything: every row of an unconstrained request,
            # and those after a draft the grammar refused (check_drafts leaves none).
            first = starts[i] if i not in constrained else starts[i] + 1
            if first < starts[i + 1]:
                mask[first : starts[i + 1]] = -1
        words = mask.shape[1]
        # The executor's own calls (llguidance.torch wraps them, but importing that module
        # compiles a torch function and costs seconds on the first mask).
        plain = [(matcher, starts[i]) for matcher, i in rows if not drafts[i]]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, mask.data_ptr(), words * 4, starts[-1])
        speculated = [(matcher, starts[i], list(drafts[i])) for matcher, i in rows if drafts[i]]
        if speculated:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                speculated, mask.data_ptr(), words * 4, starts[-1]
            )
        self.mask_times.append(time.perf_counter() - started)
        return mask

    def _next_buffer(self, num_rows: int) -> torch.Tensor:
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        self._turn ^= 1
        buffer = self._buffers[self._turn]
        if buffer is None or buffer.shape[0] < num_rows:
            words = (self.compiler.vocab_size + 31) // 32
            pinned = torch.cuda.is_available()
            buffer = torch.empty((num_rows, words), dtype=torch.int32, pin_memory=pinned)
            self._buffers[self._turn] = buffer
        return buffer[:num_rows]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [S, V] with every token whose bit is clear in `bitmask` [S, W] set to -inf
    (a new tensor: the caller's logits stay as they were)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)  # [S, 32 W]
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:
        pad = allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])
        allowed = torch.cat([allowed, pad], dim=1)
    return logits.masked_fill(~allowed[:, :vocab], float("-inf"))

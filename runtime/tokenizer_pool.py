"""The server's tokenizer work (prompts, chat templates, echo, /tokenize, /detokenize) on a small
pool of threads, each with its own copy of the engine's tokenizer; the cheap bound that refuses a
prompt too long to fit before anything tokenizes it, and the count of a prefix that refuses one
the bound lets through after tokenizing O(max_model_len) of it, not all of it.

Why a pool: on the engine thread, one ~8 MB prompt froze every stream for 8 s while it was
tokenized (issue 31). Why copies: a HF fast tokenizer must not be used from two threads at once
(its Rust core is borrowed mutably when truncation or padding change, and an encode releases the
GIL mid-borrow), so each worker owns a deep copy made once, on the engine thread, at start-up; the
engine's own instance stays with its incremental detokenizer on the engine thread.

The GIL, measured on the 2-core CPU while another thread counted its own longest gap: HF's
`encode` goes through the Rust `encode_batch`, which releases it (a 1 MB encode, 1.1 s, left the
other thread a 17 ms gap); the Rust `decode` does not (1.4M ids held it 0.31 s), `decode_batch`
does (16 ms), so long decodes go through `decode_batch` where it decodes as `decode` does.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import os
import queue
import re
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# Below this many ids `decode` holds the GIL for under ~5 ms; above, decode_batch releases it.
_LONG_DECODE = 8192
# Every pattern transformers' clean_up_tokenization rewrites: a tokenizer whose decode_batch
# decodes these as its decode does applies no clean-up, so decode_batch is exact for it.
_CLEANUP_PROBE = "a . b ? c ! d , e ' f n't g 'm h 's i 've j 're k"
# Unicode normalization (NFC composes a Hangul syllable's three 3-byte jamo into one 3-byte
# character) and lowercasing (the 3-byte Kelvin sign becomes "k") shrink text at most 3 times.
_UNICODE_SHRINK = 3
_UNICODE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
# Pre-tokenizers that split or map text but drop none of it.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation"})
# Split regexes (Llama 3's, Qwen 2's) that, like ByteLevel's own (GPT-2's), settle each word from
# the text up to one character past the run of one class it ends: see `prefix_tokens`.
_SETTLED_SPLITS = frozenset(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|" + digits
    + r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    for digits in (r"\p{N}{1,3}", r"\p{N}")
)  # fmt: skip
# Where a prefix may be cut: between two ASCII letters, which no normalizer here changes or joins.
_CUT = re.compile(r"[A-Za-z]{2}")
_CUT_SEARCH = 4096  # characters past the wanted length searched for a cut
# How much nicer than the engine a worker runs (Linux, where niceness is per thread). A long
# decode or encode releases the GIL but still needs a core, and where the cores are few (CI's 2)
# it slows the engine's intra-op threads: a 1M-id decode beside a 2-thread step took the steps'
# mean from 23 to 78 ms at the same niceness and to 32 ms at +10 (the decode 0.6 s -> 0.7 s).
WORKER_NICENESS = 10


class TokenizerPool:
    """`workers` threads, each using only its own copy of a tokenizer. `run(fn)` calls
    `fn(tokenizer)` on one of them; a caller cancelled while its job waits drops the job.
    Build it with `TokenizerPool.build` on the thread that owns the tokenizer."""

    def __init__(
        self, tokenizers: list[Any], long_decode_exact: bool, prefix_added: list[str] | None = None
    ) -> None:
        if not tokenizers:
            raise ValueError("a tokenizer pool needs at least one tokenizer")
        self.tokenizers = list(tokenizers)  # the copies, one per worker thread
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for tokenizer in tokenizers:
            self._free.put(tokenizer)
        self._local = threading.local()
        # The executor starts at most len(tokenizers) threads, each adopting one copy for good.
        self._executor = ThreadPoolExecutor(
            len(tokenizers), thread_name_prefix="tokenizer", initializer=self._adopt
        )
        self._long_decode_exact = long_decode_exact
        # Added tokens' texts if a prefix's count bounds the whole text's (`prefix_tokens`).
        self._prefix_added = prefix_added
        self.workers = len(tokenizers)
        self.pending = 0  # jobs queued or running; read by /metrics, changed on the event loop

    @classmethod
    def build(cls, tokenizer: Any, workers: int) -> TokenizerPool:
        """A pool of `workers` independent deep copies of `tokenizer`. Run where nothing else
        uses `tokenizer` at the same time (the engine thread): copying reads its Rust core."""
        if workers < 1:
            raise ValueError(f"tokenizer workers must be >= 1, got {workers}")
        made = [copy.deepcopy(tokenizer) for _ in range(workers)]
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and any(c.backend_tokenizer is backend for c in made):
            raise RuntimeError("copying the tokenizer shared its Rust core; cannot pool it")
        exact = False
        if backend is not None:
            # Probed on the original: the copies are not in use yet either way.
            probe = tokenizer.encode(_CLEANUP_PROBE, add_special_tokens=False)
            batch = backend.decode_batch([probe], skip_special_tokens=False)[0]
            exact = batch == tokenizer.decode(probe)
        return cls(made, exact, counts_by_prefix(tokenizer))

    def _adopt(self) -> None:
        self._local.tokenizer = self._free.get_nowait()
        if sys.platform == "linux":  # elsewhere setpriority would renice the whole process
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICENESS)

    def _call(self, fn: Callable[[Any], _T]) -> _T:
        return fn(self._local.tokenizer)

    async def run(self, fn: Callable[[Any], _T]) -> _T:
        loop = asyncio.get_running_loop()
        self.pending += 1
        try:
            return await loop.run_in_executor(self._executor, self._call, fn)
        finally:
            self.pending -= 1

    def decode(self, tokenizer: Any, token_ids: list[int]) -> str:
        """`tokenizer.decode(token_ids)` (a worker's tokenizer), without holding the GIL
        through a long one."""
        if len(token_ids) <= _LONG_DECODE or not self._long_decode_exact:
            return tokenizer.decode(token_ids)
        return tokenizer.backend_tokenizer.decode_batch([token_ids], skip_special_tokens=False)[0]

    def count_prefix(self, tokenizer: Any, text: str, at: int) -> tuple[int, int] | None:
        """(at least how many tokens `text` is, the prefix's length that proves it) from a prefix
        of about `at` characters (a worker's tokenizer); None where no prefix is sound."""
        if self._prefix_added is None or len(text) <= at:
            return None
        longest = max(map(len, self._prefix_added), default=0)
        for match in _CUT.finditer(text, at, at + _CUT_SEARCH):
            cut = match.start() + 1
            window = text[max(0, cut - longest + 1) : cut + longest - 1]
            if not any(added in window for added in self._prefix_added):
                return prefix_tokens(tokenizer, text, cut), cut
        return None

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def counts_by_prefix(tokenizer: Any) -> list[str] | None:
    """The added tokens' texts if `prefix_tokens` is sound for `tokenizer`, else None: a
    deterministic BPE whose normalizer only maps characters (ASCII letters to ASCII letters)
    and whose pre-tokenizer splits words by a regex that `_SETTLED_SPLITS` vouches for."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout"):
        return None
    if not _maps_characters(spec.get("normalizer")) or not _splits_settled(
        spec.get("pre_tokenizer")
    ):
        return None
    return [t["content"] for t in spec.get("added_tokens") or [] if t.get("content")]


def prefix_tokens(tokenizer: Any, text: str, cut: int) -> int:
    """How many tokens the words of `text[:cut]` before the one that holds `cut` are; no more
    than `text` is, where `counts_by_prefix(tokenizer)` holds, text[cut - 1] and text[cut] are
    ASCII letters and no added token spans `cut`.

    Why: BPE tokenizes each word on its own, so words settled alike in the prefix and the text
    are tokens alike. The regexes split left to right, and each word is settled by the text up
    to one character past the run (letters, digits, spaces, other) it ends; the cut's word
    starts at most one character before its run of letters (`start`), so every word ending
    earlier read no character at or past `cut`. A token ending before `start - 1` is in one.
    The encode goes through encode_batch, which releases the GIL."""
    start = cut - 1
    while start > 0 and text[start - 1].isalpha():
        start -= 1
    encoding = tokenizer.backend_tokenizer.encode_batch([text[:cut]], add_special_tokens=False)[0]
    return sum(1 for _, end in encoding.offsets if end < start - 1)


def _maps_characters(normalizer: dict | None) -> bool:
    if normalizer is None:
        return True
    if normalizer.get("type") == "Sequence":
        return all(_maps_characters(n) for n in normalizer.get("normalizers", []))
    return normalizer.get("type") in _UNICODE_NORMALIZERS


def _splits_settled(pre: dict | None) -> bool:
    """Whether `pre` splits words only by settled regexes, at least one, and drops no text."""
    parts = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre]
    splits = 0
    for part in parts:
        kind = (part or {}).get("type")
        if kind == "ByteLevel":
            splits += bool(part.get("use_regex", True))
        elif kind == "Split":
            pattern = part.get("pattern") or {}
            settled = pattern.get("Regex") in _SETTLED_SPLITS and not part.get("invert")
            if not settled or part.get("behavior") != "Isolated":
                return False
            splits += 1
        elif kind != "Digits":
            return False
    return splits > 0


def bytes_per_token(tokenizer: Any, token_texts: list[str]) -> int | None:
    """At most how many UTF-8 bytes of prompt text one token of `tokenizer` can stand for, or
    None where no such bound is sound; from the vocabulary's decoded texts (`token_texts`).

    A prompt of B bytes is then at least ceil(B / bound) tokens. The bound holds for a BPE model
    whose normalizer and pre-tokenizer drop no text and whose unknown characters cannot fuse
    into one token (byte-level BPE: Llama 3, Qwen, SmolLM2; SentencePiece BPE with byte
    fallback: Llama 2): every token then covers the text it decodes to, plus the leading space
    a lone token's decode may drop (the +1), times what normalization can shrink text by.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not token_texts:
        return None
    spec = json.loads(backend.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer")
    if model.get("type") != "BPE":
        return _no_bound(f"a {model.get('type')} model can map a long run of text to one token")
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return _no_bound("an added token absorbs the whitespace beside it")
    byte_level = "ByteLevel" in json.dumps(pre)
    if model.get("fuse_unk") and not (model.get("byte_fallback") or byte_level):
        return _no_bound("unknown characters fuse into one token")
    if not _keeps_text(pre):
        return _no_bound("the pre-tokenizer drops text")
    shrink = _shrink(spec.get("normalizer"))
    if shrink is None:
        return _no_bound("the normalizer can drop text")
    return (max(len(t.encode()) for t in token_texts) + 1) * shrink


def min_tokens(size: int, per_token: int) -> int:
    """The fewest tokens a text of `size` bytes (or characters, which are no more) can be."""
    return math.ceil(size / per_token)


def _no_bound(reason: str) -> None:
    log.info("no cheap prompt length bound for this tokenizer: %s", reason)
    return None


def _keeps_text(pre: dict | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers", []))
    if kind == "Split":
        return pre.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _shrink(normalizer: dict | None) -> int | None:
    """How many times `normalizer` can shrink a text's bytes at most; None if unbounded."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            inner = _shrink(part)
            if inner is None:
                return None
            factor *= inner
        return factor
    if kind == "Prepend":
        return 1
    if kind == "Replace":
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content") or ""
        if "String" not in pattern or not content:  # a regex can collapse any run
            return None
        return max(1, math.ceil(len(pattern["String"].encode()) / len(content.encode())))
    if kind in _UNICODE_NORMALIZERS:
        return _UNICODE_SHRINK
    return None

"""Structured outputs: a request's grammar compiled with xgrammar, and cached.

`GrammarCompiler` compiles a `GrammarSpec` (engine/structured_spec.py: the request's
``structured_outputs`` checked and made canonical) on a small thread pool off the engine
thread, with a time bound and a cache bounded by entries and bytes; a grammar that does not
compile is an `InvalidRequestError` naming ``structured_outputs.<kind>`` with xgrammar's reason.

One compiler per engine (built from the engine's tokenizer, the model's vocabulary size,
the width of its logits, and its EOS ids), shared with the engine's `PromptChecker` so that the
edge check compiles once for both; a gateway's checker builds its own. What a running request
does with its grammar (matcher, token masks) is engine/structured_state.py.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .request import InvalidRequestError
from .structured_spec import GrammarSpec

if TYPE_CHECKING:
    import xgrammar as xgr

    from .tokenizer import Tokenizer

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_CACHE_ENTRIES = 512
DEFAULT_CACHE_BYTES = 256 << 20
DEFAULT_THREADS = 2
DEFAULT_NICE = 10  # the compile threads' CPU niceness (`_yield_to_the_step`)
_MAX_FRESH = 1024  # compile times kept for `fresh_compile_ms` (the latest compiles)

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: " and may hold a failed check's text
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:.]+\]\s*\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: .*? is false:\s*")
# One character of a length-bounded JSON string as xgrammar 0.2.9 prints it, and what it must be
_BOUNDED_CHAR = r'[^\"\\\r\n]'
_JSON_CHAR = r'[^\0-\x1f\"\\]'

def _yield_to_the_step(nice: int) -> None:
    """A compile thread runs at CPU niceness ``nice`` (Linux threads have their own): the request
    waiting for its grammar waits a little longer, while the engine step, which every other
    stream waits on, keeps the cores. At the same priority, a compile beside a step's OpenMP
    threads holds one of them off its core and every parallel op waits for it: 16 new grammars
    made the running streams' ITL p99 8x what it is with the grammars cached (2 cores,
    bench/structured.py); at nice 10, 1.05x (docs/PERFORMANCE.md). xgrammar's own compile threads,
    started from this one, inherit it. Lowering a thread's priority needs no privilege; where it
    fails nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):  # not Linux, or a sandbox that forbids it
        pass


def choice_grammar(choices: list[str]) -> str:
    """xgrammar EBNF whose sentences are exactly ``choices``."""
    def literal(s: str) -> str:
        out = []
        for ch in s:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\x{ord(ch):02x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    return "root ::= " + " | ".join(literal(c) for c in dict.fromkeys(choices))


def looks_like_lark(grammar: str) -> bool:
    """xgrammar's EBNF defines rules with ``::=``; a grammar without one is read as Lark."""
    return "::=" not in grammar


def xgrammar_reason(exc: BaseException) -> str:
    """xgrammar's message without its C++ time, file and line."""
    text = str(exc).strip()
    text = _CPP_PREFIX.sub("", text)
    text = _CHECK_PREFIX.sub("", text)
    return text.strip() or exc.__class__.__name__


@dataclass
class CompilerStats:
    """What a worker exports about its compiler (`GrammarCompiler.stats`)."""

    hits: int = 0  # specs found compiled (or being compiled) already
    misses: int = 0  # compiles started
    compile_errors: int = 0
    timeouts: int = 0  # waits that gave up at the time bound
    compile_seconds: float = 0.0
    entries: int = 0
    bytes: int = 0
    evictions: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Vocab:
    """What the compiler and the matchers need of the model (built once, lazily)."""

    compiler: xgr.GrammarCompiler
    vocab_size: int = 0
    eos_token_ids: list[int] = field(default_factory=list)


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one model on a small thread pool, with a cache.

    ``tokenizer``: the engine's (engine/tokenizer.py); ``vocab_size``: the width of the
    model's logits (the token masks cover it all; ids the tokenizer lacks are never allowed);
    ``eos_token_ids``: the model's EOS ids, the grammar's stop tokens (EOS is allowed exactly
    when the grammar can end). Thread-safe: the edge check and the engine thread share it.
    ``before_compile``, for tests only, runs in the pool thread before each compile (to hold
    one back)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int], *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, cache_entries: int = DEFAULT_CACHE_ENTRIES,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, threads: int = DEFAULT_THREADS, nice: int = DEFAULT_NICE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.timeout_s = timeout_s
        self.cache_entries = cache_entries
        self.cache_bytes = cache_bytes
        self.threads = threads
        self.before_compile: Callable[[GrammarSpec], None] | None = None
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar",
                                        initializer=_yield_to_the_step, initargs=(nice,))
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        self._vocab: _Vocab | None = None
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._inflight: dict[str, Future] = {}
        # Grammars compiled and not asked for since: their compile ms (`fresh_compile_ms`)
        self._fresh: OrderedDict[str, float] = OrderedDict()
        self._stats = CompilerStats()

    def close(self) -> None:
        """Stop taking compiles (one under way finishes in its thread)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- compiling ------------------------------------------------------------------
    def submit(self, spec: GrammarSpec) -> Future:
        """A future of the compiled grammar (`xgrammar.CompiledGrammar`), or of the
        `InvalidRequestError` naming ``spec.field``; cached, and one compile per spec at a time."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self._fresh.pop(key, None)
                self._stats.hits += 1
                done: Future = Future()
                done.set_result(hit)
                return done
            fut = self._inflight.get(key)
            if fut is not None:
                self._stats.hits += 1
                return fut
            self._stats.misses += 1
            fut = self._pool.submit(self._compile, spec)
            self._inflight[key] = fut
        fut.add_done_callback(lambda _f: self._done(key))
        return fut

    def _done(self, key: str) -> None:
        with self._lock:
            self._inflight.pop(key, None)

    def compile(self, spec: GrammarSpec, timeout_s: float | None = None) -> xgr.CompiledGrammar:
        """Compile (or find) ``spec``, waiting at most ``timeout_s`` (default: the compiler's
        bound); `InvalidRequestError` when it does not compile or not in time."""
        return self.wait(self.submit(spec), timeout_s)

    def wait(self, fut: Future, timeout_s: float | None = None) -> xgr.CompiledGrammar:
        """The result of a `submit`, waiting at most ``timeout_s`` (default: the bound)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            return fut.result(timeout=max(0.0, limit))
        except FutureTimeout:
            self.note_timeout()
            raise InvalidRequestError(
                "structured_outputs", f"the grammar did not compile within {self.timeout_s:g} s") from None

    def fresh_compile_ms(self, spec: GrammarSpec) -> float:
        """What compiling ``spec`` took, if it was compiled for this request: nothing has asked
        for it since its compile (0 otherwise). The router prices a remote prefill with it
        (`RequestFeatures.grammar_compile_ms`): the edge compiled a grammar new here, and the
        prefill worker, whose cache is not known, is taken to compile it again."""
        with self._lock:
            return self._fresh.get(spec.key, 0.0)

    def note_timeout(self) -> None:
        with self._lock:
            self._stats.timeouts += 1

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        hook = self.before_compile
        if hook is not None:
            hook(spec)
        vocab = self.vocab()
        t0 = time.perf_counter()
        try:
            compiled = self._run(vocab.compiler, spec)
        except InvalidRequestError:
            self._count_error(time.perf_counter() - t0)
            raise
        except Exception as exc:  # noqa: BLE001  (xgrammar's RuntimeError / ValueError / its own types)
            self._count_error(time.perf_counter() - t0)
            raise InvalidRequestError(spec.field, xgrammar_reason(exc)) from None
        dt = time.perf_counter() - t0
        size = int(compiled.memory_size_bytes)
        with self._lock:
            self._stats.compile_seconds += dt
            self._fresh[spec.key] = dt * 1e3
            while len(self._fresh) > _MAX_FRESH:
                self._fresh.popitem(last=False)
            if size <= self.cache_bytes and self.cache_entries > 0:
                self._cache[spec.key] = compiled
                self._sizes[spec.key] = size
                self._stats.bytes += size
                while len(self._cache) > self.cache_entries or self._stats.bytes > self.cache_bytes:
                    old, _ = self._cache.popitem(last=False)
                    self._stats.bytes -= self._sizes.pop(old)
                    self._stats.evictions += 1
        return compiled

    def _count_error(self, dt: float) -> None:
        with self._lock:
            self._stats.compile_errors += 1
            self._stats.compile_seconds += dt

    @staticmethod
    def _run(c: xgr.GrammarCompiler, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind == "json":
            return _compile_json_schema(c, spec)
        if spec.kind == "json_object":  # any JSON object (OpenAI's json_object mode), not any JSON value
            return c.compile_json_schema('{"type": "object"}', any_whitespace=spec.any_whitespace)
        if spec.kind == "regex":
            return c.compile_regex(spec.source)
        if spec.kind == "choice":
            return c.compile_grammar(choice_grammar(json.loads(spec.source)))
        if spec.kind == "grammar":
            if looks_like_lark(spec.source):
                return c.compile_lark(spec.source)
            return c.compile_grammar(spec.source)
        if spec.kind == "structural_tag":
            return _compile_structural_tag(c, spec)
        raise InvalidRequestError("structured_outputs", f"unknown kind {spec.kind!r}")

    # -- the model's vocabulary -------------------------------------------------------------
    def vocab(self) -> _Vocab:
        """xgrammar's view of the model's tokenizer, built on first use (it imports xgrammar and
        transformers: about two seconds, in a pool thread or the edge check's)."""
        if self._vocab is not None:
            return self._vocab
        with self._init_lock:
            if self._vocab is None:
                import tokenizers
                import transformers
                import xgrammar as xgr

                hf = transformers.PreTrainedTokenizerFast(
                    tokenizer_object=tokenizers.Tokenizer.from_str(self.tokenizer._tk.to_str()))
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_token_ids or None)
                compiler = xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=False)
                self._vocab = _Vocab(compiler, self.vocab_size, list(info.stop_token_ids))
            return self._vocab

    # -- counters -----------------------------------------------------------------------
    def stats(self) -> dict:
        """hits, misses, compile_errors, timeouts, compile_seconds, entries, bytes, evictions."""
        with self._lock:
            self._stats.entries = len(self._cache)
            return self._stats.as_dict()


def _compile_json_schema(c: xgr.GrammarCompiler, spec: GrammarSpec) -> xgr.CompiledGrammar:
    """A JSON schema's grammar. xgrammar 0.2.9 writes a string with minLength/maxLength as a
    repetition of `_BOUNDED_CHAR`, which lets raw control characters (U+0000-U+001F but CR and
    LF) into the string: output strict JSON parsers refuse (xgrammar issue #800). Those rules
    are compiled with `_JSON_CHAR` instead, the character class of its other strings."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(spec.source, any_whitespace=spec.any_whitespace,
                                           strict_mode=spec.strict)
    text = str(grammar)
    if _BOUNDED_CHAR in text:
        return c.compile_grammar(text.replace(_BOUNDED_CHAR, _JSON_CHAR))
    return c.compile_grammar(grammar)


def _compile_structural_tag(c: xgr.GrammarCompiler, spec: GrammarSpec) -> xgr.CompiledGrammar:
    """xgrammar's structural tag (``{"type": "structural_tag", "format": ...}``), or the older
    form vLLM also takes: ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``."""
    import xgrammar as xgr

    tag = json.loads(spec.source)
    if "structures" in tag and "triggers" in tag:
        structures, triggers = tag["structures"], tag["triggers"]
        if not isinstance(structures, list) or not isinstance(triggers, list) \
                or not all(isinstance(t, str) for t in triggers):
            raise InvalidRequestError(spec.field, "structures and triggers must be lists")
        items = []
        for s in structures:
            if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("begin", "end")):
                raise InvalidRequestError(spec.field, "each structure needs begin and end strings and a schema")
            schema = s.get("schema", {})
            items.append(xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(schema), end=s["end"]))
        return c.compile_structural_tag(items, triggers)
    return c.compile_structural_tag(spec.source)


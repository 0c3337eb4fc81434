"""A request's constraint -> an llguidance grammar -> a ``CompiledGrammar``, cached by its hash.

Compiling is the expensive part (milliseconds for a typical schema, up to llguidance's fuel for
a hostile one) and a workload repeats the same few schemas, so compiled grammars are kept in a
bounded LRU keyed by a digest of the constraint. Every sequence then starts from a copy of the
cached matcher (``CompiledGrammar.new_state``), which costs microseconds.

``compile`` is thread-safe and drops the GIL while llguidance works: the server runs it in a
worker thread, off the event loop and off the engine thread, before the request is queued.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import torch

from loraplex.platform.engine.errors import StructuredOutputError
from loraplex.platform.engine.sampling_params import StructuredOutputsParams
from loraplex.platform.engine.structured.bounds import (
    MAX_CHOICES,
    MAX_SCHEMA_BYTES,
    parser_limits,
    schema_shape_problem,
)
from loraplex.platform.engine.structured.state import GrammarState

CACHE_ENTRIES = 256
"""Most compiled grammars kept (least recently used go first)."""
CACHE_BYTES = 64 << 20
"""Most bytes of grammar text kept: a proxy for the compiled grammars' memory."""
_JSON_OPTIONS: dict[str, Any] = {
    # Fixed separators and no free whitespace: a small model given "any whitespace" may emit
    # newlines until max_tokens, and an answer that never closes does not parse.
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint: a matcher in its start state that sequences copy."""

    key: str
    """Digest of the constraint (the cache key)."""
    kind: str
    grammar: str
    """llguidance's grammar text (what was compiled)."""
    _prototype: llguidance.LLMatcher
    _eos: frozenset[int]

    def new_state(self) -> GrammarState:
        """A fresh grammar state for one sequence (a copy of the start state)."""
        return GrammarState(self._prototype.deep_copy(), self._eos)


def constraint_key(spec: StructuredOutputsParams) -> str:
    """A digest naming the constraint: equal constraints (dict key order aside) share it."""
    value: Any = getattr(spec, spec.kind)
    if spec.kind == "json" and isinstance(value, str):
        with contextlib.suppress(ValueError):  # compile refuses it; the raw text still names it
            value = json.loads(value)
    text = json.dumps([spec.kind, value, spec.whitespace_pattern], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class GrammarCompiler:
    """Compiles constraints for one tokenizer; an LRU of compiled grammars (thread-safe)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        """The model's vocabulary (logits width): may exceed the tokenizer's."""
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self.hits = 0
        self.misses = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (built on first use: about 0.3 s)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, eos_token=self._eos or None
                )
            return self._tokenizer

    @property
    def mask_words(self) -> int:
        """32-bit words of one token mask (llguidance's bitmask layout)."""
        return (self.tokenizer.vocab_size + 31) // 32

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``spec`` (from the cache when seen before); raises
        ``StructuredOutputError`` naming the problem when it is over the bounds or invalid."""
        key = constraint_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        compiled = self._compile(spec, key)
        with self._lock:
            self.misses += 1
            if key not in self._cache:
                self._cache[key] = compiled
                self._cache_bytes += len(compiled.grammar)
                while len(self._cache) > CACHE_ENTRIES or (
                    self._cache_bytes > CACHE_BYTES and len(self._cache) > 1
                ):
                    _, old = self._cache.popitem(last=False)
                    self._cache_bytes -= len(old.grammar)
            return self._cache[key]

    def _compile(self, spec: StructuredOutputsParams, key: str) -> CompiledGrammar:
        grammar = self._grammar_text(spec)
        tokenizer = self.tokenizer
        try:
            matcher = llguidance.LLMatcher(tokenizer, grammar, limits=parser_limits(), log_level=0)
        except (ValueError, TypeError, RuntimeError) as exc:  # llguidance documents none; be sure
            raise StructuredOutputError(_problem(spec, str(exc)), param=spec.param) from None
        if matcher.is_error():
            raise StructuredOutputError(_problem(spec, matcher.get_error()), param=spec.param)
        # A grammar that admits nothing (e.g. a $ref to itself) compiles; its first mask is empty.
        mask = torch.zeros(1, (tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        if matcher.is_error() or not bool(mask.any()):
            why = matcher.get_error() or "it admits no output at all"
            raise StructuredOutputError(_problem(spec, why), param=spec.param)
        return CompiledGrammar(key, spec.kind, grammar, matcher, frozenset(tokenizer.eos_tokens))

    def _grammar_text(self, spec: StructuredOutputsParams) -> str:
        kind = spec.kind
        G = llguidance.LLMatcher
        if kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if kind == "json_object" else spec.json
            if isinstance(schema, str):
                _check_size(len(schema.encode("utf-8", "surrogatepass")), spec)
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise StructuredOutputError(
                        f"{spec.param}: the JSON schema is not valid JSON: {exc}", param=spec.param
                    ) from None
            else:
                _check_size(len(json.dumps(schema, ensure_ascii=False)), spec)
            if not isinstance(schema, dict | bool):
                raise StructuredOutputError(
                    f"{spec.param}: a JSON schema must be an object (or true / false)", param=spec.param
                )
            shape = schema_shape_problem(schema)
            if shape is not None:
                raise StructuredOutputError(f"{spec.param}: {shape}", param=spec.param)
            options = dict(_JSON_OPTIONS)
            if spec.whitespace_pattern is not None:
                options = {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern}
            try:
                return G.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]
            except (ValueError, TypeError) as exc:
                raise StructuredOutputError(f"{spec.param}: {exc}", param=spec.param) from None
        if kind == "regex":
            assert spec.regex is not None
            _check_size(len(spec.regex), spec)
            return G.grammar_from_regex(spec.regex)
        if kind == "grammar":
            assert spec.grammar is not None
            _check_size(len(spec.grammar), spec)
            return G.grammar_from_lark(spec.grammar)
        choices = list(spec.choice or [])
        if len(choices) > MAX_CHOICES:
            raise StructuredOutputError(
                f"{spec.param}: choice has {len(choices)} entries, over the limit of {MAX_CHOICES}",
                param=spec.param,
            )
        _check_size(sum(len(c) for c in choices), spec)
        # Lark string literals take JSON's escapes: any text becomes one exact literal.
        return G.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _check_size(num_bytes: int, spec: StructuredOutputsParams) -> None:
    if num_bytes > MAX_SCHEMA_BYTES:
        raise StructuredOutputError(
            f"{spec.param}: the {spec.kind} constraint has {num_bytes} bytes, over the limit of "
            f"{MAX_SCHEMA_BYTES}",
            param=spec.param,
        )


_PLAIN_WORDS = {
    "NoExtensionBias": (
        "it admits no output at all: a rule that refers only to itself (such as a $ref cycle "
        "with no way out) matches nothing"
    ),
}
"""llguidance errors that are internal names, in words a caller can act on (the name kept after)."""


def _problem(spec: StructuredOutputsParams, error: str) -> str:
    first = error.strip().splitlines()[0] if error.strip() else "invalid"
    for name, words in _PLAIN_WORDS.items():
        if name in first:
            first = f"{words} (llguidance: {first})"
    what = {"json": "JSON schema", "json_object": "JSON object grammar"}.get(spec.kind, spec.kind)
    return f"{spec.param}: the {what} cannot be used: {first[:500]}"

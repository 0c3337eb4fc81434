"""Guided decoding (structured outputs): grammars compiled from a request's constraint, a
per-sequence grammar state, and the allowed-token masks applied to the logits.

| module | owns |
|---|---|
| ``bounds`` | the limits a tenant's schema is held to before and while it compiles |
| ``compiler`` | ``GrammarCompiler``: constraint -> llguidance grammar -> ``CompiledGrammar`` (LRU cache) |
| ``state`` | ``GrammarState``: one sequence's matcher (accept tokens, ``rollback(n)``, its mask) |
| ``masks`` | ``GrammarMasker``: a step's masks, computed on a worker thread beside the forward |

The backend is llguidance (the engine behind OpenAI's JSON-schema mode): its compiler and
matchers drop the GIL, its lexer is derivative based (no backtracking regex), and its
parser limits (``LLParserLimits``) bound the work of a compile and of each mask.
"""

from loraplex.platform.engine.structured.compiler import CompiledGrammar, GrammarCompiler
from loraplex.platform.engine.structured.masks import GrammarMasker, StepMasks
from loraplex.platform.engine.structured.state import GrammarState

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarMasker", "GrammarState", "StepMasks"]

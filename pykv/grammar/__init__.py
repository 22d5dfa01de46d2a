"""Grammar-constrained generation: llama.cpp's GBNF grammars (gbnf.py: LlamaGrammar, the JSON
grammar, binding a grammar to a vocabulary) and JSON Schema to GBNF (json_schema.py)."""
from .gbnf import JSON_GBNF, LlamaGrammar, as_grammar, bind, response_format_grammar

__all__ = ["JSON_GBNF", "LlamaGrammar", "as_grammar", "bind", "response_format_grammar"]

"""Structured outputs: a request's output constrained to a JSON schema, regex, choice or EBNF grammar.

params.py validates what the user asked for (and parses it, so bad specs fail at once); compiler.py compiles
grammars against the model's vocabulary on a thread pool, with an LRU cache; matcher.py follows one request's
tokens; bitmask.py turns a step's matchers into a token mask on the logits. See docs/structured_outputs.md.
"""

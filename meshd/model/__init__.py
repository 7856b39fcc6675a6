"""Model runtime: Llama-family decoder, lazy checkpoint loading, stages with a positional KV
cache, MTP heads, tokenizer and chat template. No networking: see docs/model-runtime.md.

Import the submodules directly (`meshd.model.stage`, `meshd.model.checkpoint`, ...); this
package imports nothing itself, so locating the built-in model's files stays cheap.
"""

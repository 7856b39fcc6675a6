"""The training program of meshd's built-in model; not part of the product (`meshd`).

`corpus` (the standard library, the tokenizer, edit documents from `edits`, each phase's
batches), `model` (Llama plus MTP depths), `losses`, `loop` (the four phases, resumable),
`export` (the Hugging Face directory), `cli` (`python -m meshd_train`); `evaluate` and `mix`
score and blend exported directories. docs/model.md has the runs and their figures.
"""

"""The training run's numbers: `TrainConfig` (written verbatim into training_info.json) and
the seconds-long `TINY` run the tests use."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainConfig:
    """Every number that shapes the run; written verbatim into training_info.json."""

    seed: int = 1234
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    context_tokens: int = 256
    mtp_depths: int = 2
    mtp_loss_weight: float = 0.5
    batch_sequences: int = 24
    steps: int = 1000
    warmup_steps: int = 50
    lr_peak: float = 2.5e-3
    lr_final_fraction: float = 0.1
    weight_decay: float = 0.1
    grad_clip_norm: float = 1.0
    heldout_per_mille: int = 25
    chat_fraction_of_bytes: float = 0.12
    max_file_bytes: int = 200_000
    max_files: int = 0  # 0 = whole corpus; the tiny test run uses a handful
    threads: int = 2
    bf16_autocast: bool = True
    log_every_steps: int = 10
    checkpoint_every_steps: int = 50
    # Phase 2, after `steps`: sequence-level unlikelihood (Welleck et al. 2019, "Neural Text
    # Generation with Unlikelihood Training"). Each step greedily continues training prompts
    # with the model itself and pushes down the probability of every token that completes an
    # n-gram already seen in that sequence (a loop), next to a normal MLE batch. Greedy
    # decoding of small models falls into loops; MLE alone does not teach it not to.
    ul_steps: int = 160
    ul_lr: float = 3e-4
    ul_batch_sequences: int = 16
    ul_prompt_tokens: int = 32
    ul_new_tokens: int = 96
    ul_ngram: int = 6
    ul_weight: float = 1.0
    ul_mle_batch_sequences: int = 16
    # Phase 3, after phase 2: code edits and a longer context. The stdlib rarely repeats a
    # function with a change, so phases 1-2 never taught the model to copy its prompt back
    # edited, and code-editing prompts outgrow 256 tokens. Each step mixes plain windows of
    # `edit_context_tokens` with edit documents (`meshd_train.edits`) starting at a document start.
    # The phase starts from the phase-2 weights rounded to bf16 (what the shipped file
    # holds) with a fresh optimizer, so `--init-from` a phase-2 directory gives the same bytes.
    edit_steps: int = 300
    edit_context_tokens: int = 1024
    edit_plain_sequences: int = 2
    edit_sample_sequences: int = 5
    # Phase 4: copying is repeating. After phase 3 the model loops on 10 of 10 held-out greedy
    # continuations (measured), so phase 2's unlikelihood comes back on this many of its own
    # continuations per step, next to phase 3's batches, at phase 2's flat lr and weight; it
    # counts only n-grams the model itself generated. (Run from the start of phase 3 instead,
    # it kept copying from ever forming: 0 of 8 held-out bodies' lines repeated after 90 steps;
    # counting the prompt's n-grams too did the same.) Like phase 3, it starts from the
    # exported (bf16) weights with a fresh optimizer.
    edit_ul_steps: int = 150
    edit_ul_sequences: int = 12
    # Phase 4's unlikelihood weight, and how many earlier occurrences of an n-gram (in the
    # model's own continuation) make a repeat of it a loop: 1 marks every repeat, 2 lets a
    # span come back once (a copy, a repeated line) and marks the third time (a loop).
    edit_ul_weight: float = 1.0
    edit_ul_min_seen: int = 1
    # fp32: on a CPU without bf16 units (AVX2 only) autocast made a step 20x slower.
    edit_bf16_autocast: bool = False
    edit_lr: float = 1e-3
    edit_warmup_steps: int = 20
    edit_max_function_chars: int = 1800


TINY = TrainConfig(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    context_tokens=32,
    batch_sequences=4,
    steps=3,
    warmup_steps=1,
    max_files=6,
    log_every_steps=1,
    checkpoint_every_steps=0,
    ul_steps=2,
    ul_batch_sequences=2,
    ul_prompt_tokens=8,
    ul_new_tokens=8,
    ul_ngram=2,
    ul_mle_batch_sequences=2,
    edit_steps=2,
    edit_context_tokens=48,
    edit_plain_sequences=1,
    edit_sample_sequences=1,
    edit_warmup_steps=1,
    edit_max_function_chars=400,
    edit_ul_steps=2,
    edit_ul_sequences=2,
)

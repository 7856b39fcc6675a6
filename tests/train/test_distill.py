"""`python -m meshd_train distill`: a draft distilled from the built-in model, loadable as one."""

from __future__ import annotations

import json
from pathlib import Path

from meshd.model.builtin import builtin_model_dir
from meshd.speculative.config import SpecConfig
from meshd.speculative.draft import DraftModel, DraftProposer, check_draft_tokenizer
from meshd_train.cli import main


def test_a_tiny_distillation_exports_a_draft_the_runtime_drafts_with(tmp_path: Path) -> None:
    out = tmp_path / "draft"
    main(["distill", "--tiny", "--out", str(out)])
    info = json.loads((out / "training_info.json").read_text())
    assert info["steps_completed"] == 3 and info["distilled_from"] == "builtin"
    assert 0.0 <= info["heldout_argmax_agreement"] <= 1.0
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 0 and config["tie_word_embeddings"]
    check_draft_tokenizer(builtin_model_dir(), out)  # the built-in model's own tokenizer
    proposer = DraftProposer(SpecConfig(), DraftModel.load(out))
    proposer.reset([10, 11, 12, 13])
    drafts = proposer.propose(3)
    assert 1 <= len(drafts) <= 3 and all(0 <= t < 4096 for t in drafts)
    proposer.close()

"""A node configured with an old quantization name holds, offers and plans the block format it
stands for, under that format's name (peers compare quantizations by name)."""

from __future__ import annotations

import pathlib

import pytest

from meshd.config import load_config
from meshd.model.builtin import builtin_model_dir
from meshd.node.basis import NodeBasis
from tests.node.daemons import SECRET


@pytest.mark.parametrize(("given", "held"), [("int8", "q8_0"), ("int4", "q4_k"), ("q4_0", "q4_0")])
def test_a_node_names_the_format_an_old_name_stands_for(
    tmp_path: pathlib.Path, given: str, held: str
) -> None:
    config = load_config(
        {"mesh_secret": SECRET, "mdns.enabled": False, "quantization": given},
        {"MESHD_STATE_DIR": str(tmp_path / "state")},
        None,
    )
    basis = NodeBasis.load(config, str(builtin_model_dir()))
    assert basis.quantization == held
    assert basis.models[0].shape.quantization == held

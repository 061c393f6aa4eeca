"""The unsharded build (``model.build_model``: meta device, then ``materialize`` on the CPU): Llama's own init
rule, local weights from either file format, and one-line errors for files of another model."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from open_diloco.errors import ConfigError
from open_diloco.model import build_model
from tests.conftest import TINY_MODEL


def test_fresh_weights_follow_transformers_init_rule():
    ours = build_model(TINY_MODEL, seed=0)
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL), dtype=torch.float32)
    for (name, mine), (other_name, other) in zip(
        ours.named_parameters(), theirs.named_parameters(), strict=True
    ):
        assert name == other_name
        if other.dim() == 1:  # the norms: ones, exactly
            assert torch.equal(mine, other), name
        else:
            assert mine.std().item() == pytest.approx(other.std().item(), rel=0.05), name
            assert abs(mine.mean().item()) < 1e-3, name
    pad = ours.config.pad_token_id
    assert not ours.model.embed_tokens.weight[pad].any()  # the padding token's embedding is zero, as theirs
    for (name, mine), (_, other) in zip(ours.named_buffers(), theirs.named_buffers(), strict=True):
        assert torch.equal(mine, other), name  # the rotary frequencies, recomputed
    assert build_model(TINY_MODEL, seed=1).lm_head.weight[0, 0] != ours.lm_head.weight[0, 0]


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pytorch_model.bin"])
def test_local_weights_are_read_from_either_format(tmp_path, safe):
    model = build_model(TINY_MODEL, seed=2)
    model.save_pretrained(tmp_path, safe_serialization=safe)
    loaded = build_model(tmp_path, seed=99)
    for (name, mine), (_, saved) in zip(loaded.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(mine, saved), name


def test_weights_of_another_model_are_one_line(tmp_path):
    build_model(TINY_MODEL, seed=0).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
    with pytest.raises(ConfigError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(512, 128\)"):
        build_model(tmp_path, seed=0)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 7}))
    with pytest.raises(
        ConfigError, match="the weight files have no 'model.layers.6.self_attn.q_proj.weight'"
    ):
        build_model(tmp_path, seed=0)

"""Model loading: clear one-line errors for every way a model path can be wrong."""
from __future__ import annotations

import json
import shutil

import pytest

from lyanna.engines.loading import load_target
from lyanna.errors import LyannaError

from .conftest import make_tiny_model


def test_missing_path():
    with pytest.raises(LyannaError, match="not found"):
        load_target("/no/such/model")


def test_unsupported_architecture(tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LyannaError, match="GPT2LMHeadModel.*not supported"):
        load_target(tmp_path / "m")


@pytest.mark.parametrize(
    "edit,needle",
    [
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "change with the sequence length"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                              "original_max_position_embeddings": 128}}, "scales cos/sin"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
          "sliding_window": 8, "max_window_layers": 1}, "only some layers"),
    ],
)
def test_configs_the_engine_cannot_honour_are_refused(tmp_path, tiny_model_dir, edit, needle):
    """transformers reads these configs; the engine would compute something else, so loading refuses them."""
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg.update(edit)
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LyannaError, match=needle) as err:
        load_target(tmp_path / "m")
    assert "\n" not in str(err.value)


def test_truncated_weights_name_the_file(tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(LyannaError) as err:
        load_target(tmp_path / "m")
    msg = str(err.value)
    assert str(weights) in msg and "truncated or corrupt" in msg and "\n" not in msg


def test_no_safetensors(tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(LyannaError, match="no safetensors"):
        load_target(tmp_path / "m")


def test_missing_config_and_non_gguf_file(tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    (tmp_path / "m" / "config.json").unlink()
    with pytest.raises(LyannaError, match="config.json"):
        load_target(tmp_path / "m")
    with pytest.raises(LyannaError, match="not a .gguf"):
        load_target(tmp_path / "m" / "model.safetensors")


def test_missing_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    from lyanna.decoding.decoder import Decoder

    d = make_tiny_model(tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(LyannaError, match="up_proj.weight.*missing"):
        Decoder(load_target(d))


@pytest.mark.slow
def test_default_model_is_cached_and_fp32(default_target):
    assert (default_target.path / ".complete").is_file()
    assert (default_target.path / "model.safetensors").is_file()
    c = default_target.config
    assert (c.num_layers, c.hidden_size, c.vocab_size) == (30, 576, 49152)
    assert default_target.weights["model.embed_tokens.weight"].dtype.name == "float32"
    assert 2 in c.eos_token_ids


@pytest.mark.slow
@pytest.mark.parametrize("arch,dropped", [("lyanna", ["ti.hot", "norm.weight"]), ("eagle", ["layer.mlp.up_proj.weight"])])
def test_partial_draft_checkpoint_names_what_is_missing(tmp_path, default_decoder, arch, dropped):
    """A head file that lost tensors is refused with one line naming them, not a raw KeyError."""
    from safetensors.numpy import load_file, save_file

    from lyanna.decoding.decoder import DRAFTS_DIR

    head = shutil.copytree(DRAFTS_DIR / default_decoder.target.name / arch, tmp_path / arch)
    tensors = load_file(str(head / "model.safetensors"))
    for name in dropped:
        tensors.pop(name)
    save_file(tensors, str(head / "model.safetensors"))
    methods = dict(default_decoder.drafters)
    with pytest.raises(LyannaError) as err:
        default_decoder.load_draft(str(head))
    msg = str(err.value)
    assert "incomplete" in msg and all(name in msg for name in dropped) and "\n" not in msg
    assert default_decoder.drafters == methods  # the shipped heads stay as they were

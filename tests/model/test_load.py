"""mmkv.load: tiny models, save/load through the real-checkpoint path, fingerprints, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig

import mmkv
from mmkv.model import model_fingerprint
from mmkv.model.registry import resolve_alias
from tests.conftest import random_image


def test_tiny_handles_expose_family_layout_rule_and_fingerprint(tiny_by_name):
    """Both tiny models report their family, layout, position rule, dtype, device and a 64-hex fingerprint."""
    q25, q3 = tiny_by_name["tiny-qwen2.5-vl"], tiny_by_name["tiny-qwen3-vl"]
    assert (q25.family.name, q25.rotary.kind, q25.rotary.mrope_section) == (
        "qwen2_5_vl",
        "sectioned",
        (2, 3, 3),
    )
    assert (q3.family.name, q3.rotary.kind, q3.rotary.mrope_section) == ("qwen3_vl", "interleaved", (4, 2, 2))
    for handle in (q25, q3):
        assert handle.position_rule.merge_size == 2
        assert handle.dtype == torch.float32 and handle.device.type == "cpu"
        assert len(handle.fingerprint) == 64 and int(handle.fingerprint, 16) >= 0
        assert handle.tokenizer is handle.processor.tokenizer
    assert q25.fingerprint != q3.fingerprint


def test_fingerprint_is_stable_and_sensitive(tiny_by_name):
    """Rebuilding gives the same fingerprint; one changed weight or another dtype changes it."""
    handle = tiny_by_name["tiny-qwen3-vl"]
    again = mmkv.load("tiny-qwen3-vl", device="cpu")
    assert again.fingerprint == handle.fingerprint
    with torch.no_grad():
        again.model.lm_head.weight[0, 0] += 1.0
    assert model_fingerprint(again.model) != handle.fingerprint
    assert mmkv.load("tiny-qwen3-vl", device="cpu", dtype=torch.bfloat16).fingerprint != handle.fingerprint


def test_save_and_load_round_trip_through_the_checkpoint_path(tiny, tmp_path):
    """A saved tiny model loads back from its directory with the same fingerprint, token ids and logits."""
    directory = tiny.save(tmp_path / "ckpt")
    assert (directory / "config.json").is_file() and list(directory.glob("*.safetensors"))
    assert (directory / "chat_template.jinja").is_file() and (
        directory / "preprocessor_config.json"
    ).is_file()
    loaded = mmkv.load(directory, device="cpu")
    assert loaded.family == tiny.family and loaded.fingerprint == tiny.fingerprint
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    image = random_image(5, (4, 4), tiny.processor.patch_size)
    inputs = [h.processor(h.processor.apply_chat_template(messages), [image]) for h in (tiny, loaded)]
    assert torch.equal(inputs[0]["input_ids"], inputs[1]["input_ids"])
    assert torch.equal(inputs[0]["pixel_values"], inputs[1]["pixel_values"])
    with torch.inference_mode():
        logits = [h.model(**x).logits for h, x in zip((tiny, loaded), inputs, strict=True)]
    for h in (tiny, loaded):
        h.model.model.rope_deltas = None
    assert torch.equal(logits[0], logits[1])


def test_aliases_map_to_hub_ids():
    """Aliases resolve to the released instruct checkpoints; other names pass through."""
    assert resolve_alias("qwen3-vl-8b") == "Qwen/Qwen3-VL-8B-Instruct"
    assert resolve_alias("Qwen2.5-VL-7B") == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert resolve_alias("someone/some-model") == "someone/some-model"


_LOAD_MISSING = """
import sys, time, mmkv
waits = []
time.sleep = waits.append  # retry back-offs are recorded, not waited: their sum is what "fast" means here
try:
    mmkv.load(sys.argv[1])
except mmkv.ModelNotFoundError as e:
    print(f"{sum(waits):.2f}"); print(e)
else:
    print("LOADED")
"""


@pytest.mark.parametrize(
    "env",
    [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}],
    ids=["offline", "unreachable-hub"],
)
def test_missing_real_checkpoint_fails_fast_with_instructions(tmp_path, env):
    """qwen3-vl-8b absent (empty HF cache, no hub): ModelNotFoundError without retrying (no back-off wait at
    all: counted, not timed, so a busy machine cannot fail it), naming the hub id and the fix."""
    full_env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), **env}
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_MISSING, "qwen3-vl-8b"],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=1800,  # a hang guard only
    )
    assert out.returncode == 0, out.stderr
    waited, message = out.stdout.split("\n", 1)
    assert float(waited) == 0.0
    assert "Qwen/Qwen3-VL-8B-Instruct" in message and "hf download Qwen/Qwen3-VL-8B-Instruct" in message
    assert "--model DIR" in message and "huggingface-cli" not in message


def test_missing_local_directory_and_shipped_name_raise(tmp_path):
    """A path that does not exist raises ModelNotFoundError (a FileNotFoundError) without touching the hub."""
    with pytest.raises(mmkv.ModelNotFoundError, match="no such directory"):
        mmkv.load(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError):
        mmkv.load("./does-not-exist")


def test_other_architecture_is_rejected(tmp_path):
    """A checkpoint of another model type raises UnsupportedModelError naming it."""
    LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(tmp_path)
    with pytest.raises(mmkv.UnsupportedModelError, match="'llama'"):
        mmkv.load(tmp_path)


def test_a_tiny_tokenizer_holds_exactly_its_familys_special_tokens(tiny):
    """The added tokens are the family's, first and in order, and no other family's control token slipped in
    (a GLM tokenizer with Qwen's <|im_end|> would take that text as a control token)."""
    specials = list(tiny.family.special_tokens)
    added = tiny.tokenizer.get_added_vocab()
    assert sorted(added, key=added.get) == specials and [added[t] for t in specials] == list(
        range(len(specials))
    )
    assert tiny.tokenizer.eos_token == tiny.family.end_of_turn

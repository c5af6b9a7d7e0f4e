"""GLM-4.1V and GLM-4.5V through their family module: what differs from Qwen, checked against the models' own code.

The family-generic properties (positions against ``get_rope_index`` on random layouts, re-rotation against the
model's rotary embedding, ``kv`` == full recompute in the same context, the session, the engine, the stores)
run on ``tiny-glm-4.1v`` and ``tiny-glm-4.5v`` through the ``tiny`` fixture with every other family; this
module holds what only GLM has: partial rotary, the image processor's own resize, the refusal of tools, the
released names, a checkpoint directory loaded back, and ``mmkv serve`` answering with it.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize as glm_smart_resize

import mmkv
from mmkv.model.families import FAMILIES, family_of
from mmkv.mrope import rerotate
from tests.conftest import random_image

GLM_MODELS = ["tiny-glm-4.1v", "tiny-glm-4.5v"]


@pytest.fixture(scope="module", params=GLM_MODELS)
def glm(request) -> mmkv.ModelHandle:
    return mmkv.load(request.param, device="cpu")


def test_the_families_have_the_released_layouts(glm):
    """GLM-4.1V pairs adjacent channels, GLM-4.5V the halves; both rotate half of each head, sectioned."""
    expected = {"glm4v": "adjacent", "glm4v_moe": "half"}[glm.model.config.model_type]
    rotary = glm.rotary
    assert (rotary.kind, rotary.pairing, rotary.rotary_dim * 2) == ("sectioned", expected, rotary.head_dim)
    assert family_of(glm.model.config.model_type) is glm.family and not glm.family.has_deepstack


def test_channels_past_the_rotary_half_are_returned_bit_for_bit(glm):
    """Re-rotation turns only the first R channels; the position-free half comes back unchanged, any delta."""
    keys = torch.randn(2, 1, 2, 7, glm.rotary.head_dim, generator=torch.Generator().manual_seed(3))
    r = glm.rotary.rotary_dim
    for delta in (1, 57, -3, (4, 0, -2)):
        moved = rerotate(keys, delta, glm.rotary)
        assert torch.equal(moved[..., r:], keys[..., r:]) and not torch.equal(moved[..., :r], keys[..., :r])


@pytest.mark.parametrize("size", [(37, 53), (700, 300), (20, 300), (13, 13), (120, 1000)])
def test_image_grid_is_glms_own_resize(glm, size):
    """The grid from an image's size alone is GLM's ``smart_resize`` (two frames against the bounds, small
    images scaled up), which is not Qwen's: 1000 x 1000 under the same bounds differs."""
    proc = glm.processor
    image = random_image(0, (1, 1), 1).resize(size)
    grid = list(proc.image_grid(image))
    assert grid == proc.preprocess_images([image]).image_grid_thw[0].tolist()
    low, high = proc.pixel_bounds
    h, w = glm_smart_resize(2, size[1], size[0], 2, proc.patch_size * 2, low, high)
    assert grid == [1, h // proc.patch_size, w // proc.patch_size]


def test_tools_are_refused_clearly_and_change_nothing(glm):
    """Tools declared, a tool call in the history or a tool result: each refused with UnsupportedInputError
    naming the family; the session still answers once they are gone."""
    tool = {"type": "function", "function": {"name": "click", "parameters": {"type": "object"}}}
    from mmkv.messages import ToolCall

    cases = [
        (lambda s: None, [tool]),
        (lambda s: s.add_tool_calls([ToolCall("c1", "click", "{}")]), None),
        (lambda s: (s.add_tool_calls([ToolCall("c1", "click", "{}")]), s.add_tool_result("c1", "done")), None),
    ]
    for add, tools in cases:
        session = mmkv.Session(glm, tools=tools)
        session.add_text("Start.")
        add(session)
        before = session.messages
        with pytest.raises(mmkv.UnsupportedInputError, match=f"{glm.family.label}.*tool-call format"):
            session.ask("Next?", max_new_tokens=2)
        assert session.messages == before  # the refused question was not appended
    session = mmkv.Session(glm)
    session.add_image(random_image(1, (4, 6), glm.processor.patch_size))
    assert session.ask("Next?", max_new_tokens=2).finish_reason in ("stop", "length")


def test_released_names_resolve_and_fail_clearly_without_weights(monkeypatch, tmp_path):
    """The aliases name the released hub ids; with no weights here, loading one fails with the hub id and
    the fix, before any download (offline)."""
    from mmkv.model.registry import ALIASES

    assert ALIASES["glm-4.1v-9b-thinking"] == "zai-org/GLM-4.1V-9B-Thinking"
    assert ALIASES["glm-4.5v"] == "zai-org/GLM-4.5V"
    assert {"glm4v", "glm4v_moe"} <= set(FAMILIES)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    for name in ("glm-4.5v", "glm-4.1v-9b-thinking"):
        with pytest.raises(mmkv.ModelNotFoundError, match=ALIASES[name].replace(".", r"\.")):
            mmkv.load(name)


def test_a_saved_checkpoint_loads_back_through_the_real_path(glm, tmp_path):
    """``save`` then ``mmkv.load(directory)`` (config -> family -> class, GLM's image processor and template):
    the same fingerprint, layout, grids and next-token logits."""
    directory = glm.save(tmp_path / "ckpt")
    loaded = mmkv.load(directory, device="cpu")
    assert loaded.family is glm.family and loaded.fingerprint == glm.fingerprint
    assert loaded.rotary.pairing == glm.rotary.pairing and loaded.rotary.head_dim == glm.rotary.head_dim
    image = random_image(4, (6, 4), glm.processor.patch_size)
    assert loaded.processor.image_grid(image) == glm.processor.image_grid(image)
    logits = []
    for handle in (glm, loaded):
        session = mmkv.Session(handle, reuse="none")
        session.add_image(image)
        logits.append(session.next_token_logits("What is shown?"))
    assert torch.equal(logits[0], logits[1])


@pytest.mark.server
def test_mmkv_serve_answers_with_glm_and_reuses_its_images(tmp_path):
    """``mmkv serve --model tiny-glm-4.1v``: a resent history is served from the live pool, a moved image is
    a store hit, an answer under kv in the same context equals reuse "none", and tools are a 400 naming
    the family."""
    import openai

    from tests.serve.conftest import InProcessServer, image_part, user

    server = InProcessServer(["--model", "tiny-glm-4.1v", "--device", "cpu"], tmp_path / "server.log")
    with server:
        client = server.client()

        def ask(messages, **kwargs):
            return client.chat.completions.create(
                model="tiny-glm-4.1v", messages=messages, max_tokens=6, temperature=0, **kwargs
            )

        first_messages = [user(image_part(2, (4, 6)), "Step 1: what is on the screen?")]
        first = ask(first_messages)
        second = ask([*first_messages, {"role": "assistant", "content": first.choices[0].message.content},
                      user("Step 2: and now?")])  # fmt: skip
        assert [i["source"] for i in second.model_extra["mmkv"]["images"]] == ["live"]
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        other = [{"role": "system", "content": "Another system prompt."}, *first_messages]
        kv, none = ask(other), ask(other, extra_body={"mmkv": {"reuse": "none"}})
        assert kv.choices[0].message.content == none.choices[0].message.content
        tool = {"type": "function", "function": {"name": "click", "parameters": {"type": "object"}}}
        with pytest.raises(openai.BadRequestError, match="GLM-4.1V.*tool-call format"):
            ask(first_messages, tools=[tool])

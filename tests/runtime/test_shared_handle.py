"""One ``ModelHandle`` shared by sessions on several threads: nothing a call does to the model, its processor or
its tokenizer can reach another call (eager-attention and layer-cut variants instead of swaps and cuts)."""

from __future__ import annotations

import threading

import torch

import mmkv
from mmkv.text import precompile

from ..conftest import random_image

POLICY = "Policy. account_role: {role}. Approve only what the role allows; log every action and every reason."


def _editor_script(handle: mmkv.ModelHandle, rounds: int) -> list[torch.Tensor]:
    """A session that edits a field by selective recompute ranked by KV deviation (the two-layer variant) and
    by attention (the eager variant), precompiles segments and splices them, recording logits as it goes."""
    session = mmkv.Session(handle)
    session.add_text(POLICY, role="system", fields={"role": "admin"})
    session.add_image(random_image(11, (4, 4), handle.processor.patch_size))
    session.add_text("What is the next action?")
    session.prefill()
    out = []
    for r in range(rounds):
        value = "viewer" if r % 2 == 0 else "admin"
        session.edit("role", value, "selective", k=4, rank="deviation" if r % 2 == 0 else "attention")
        segment = precompile(
            handle, f"Skill {r}: to close a dialog, click {{button{r}}}.", {f"button{r}": f"Close{r}"}
        )
        session.add_segment(segment, seam=1)
        out.append(session.next_token_logits(f"And now, step {r}?"))
    return out


def _asker_script(handle: mmkv.ModelHandle, rounds: int) -> list[torch.Tensor]:
    """A session asking about new screenshots turn after turn (kv reuse, a window of two)."""
    session = mmkv.Session(handle, reuse="kv", window=2)
    out = []
    for r in range(rounds):
        session.add_image(random_image(100 + r, (4, 6), handle.processor.patch_size))
        out.append(session.next_token_logits(f"What changed on screen {r}?"))
        session.ask("Anything else?", max_new_tokens=3)
    return out


def test_two_sessions_sharing_a_handle_on_two_threads_equal_a_serial_run(tiny):
    """An editing session (deviation and attention rankings, precompiles) and an asking session run together
    on two threads over one handle: every logit equals what each gives when run alone, and the handle's
    model is unchanged afterwards (same attention implementation, same layers, same positions bound)."""
    rounds = 3
    config = tiny.model.config.get_text_config()
    before = (config._attn_implementation, len(tiny.model.model.language_model.layers), tiny.max_positions)
    serial = {"edit": _editor_script(tiny, rounds), "ask": _asker_script(tiny, rounds)}
    results: dict[str, list[torch.Tensor]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run(name, script):
        try:
            barrier.wait()
            results[name] = script(tiny, rounds)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=item) for item in (("edit", _editor_script), ("ask", _asker_script))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for name in serial:
        for got, expected in zip(results[name], serial[name], strict=True):
            assert torch.equal(got, expected), (name, (got - expected).abs().max())
    after = (config._attn_implementation, len(tiny.model.model.language_model.layers), tiny.max_positions)
    assert after == before


def test_variants_share_the_weights_and_leave_the_model_alone(tiny):
    """The eager and layer-cut variants hold the very tensors of the model (no copy), are made once, and do not
    change the model's config or layers."""
    eager, cut = tiny.variant(eager=True), tiny.variant(num_layers=1)
    assert tiny.variant(eager=True) is eager and tiny.variant() is tiny.model
    params = dict(tiny.model.named_parameters())
    for variant in (eager, cut):
        for name, tensor in variant.named_parameters():
            assert tensor is params[name]
    assert eager.config.get_text_config()._attn_implementation == "eager"
    assert len(cut.model.language_model.layers) == 1
    assert tiny.model.config.get_text_config()._attn_implementation != "eager" or eager is tiny.model
    assert len(tiny.model.model.language_model.layers) == tiny.num_layers

"""mmkv.envs.DesktopApp: deterministic per seed, the right call per state (read back off the pixels and the
history by an independent reader), wrong calls change nothing, history matters, pictures split by content."""

from __future__ import annotations

import jsonschema
import numpy as np
import pytest

from mmkv.envs import POLICY, DesktopApp, FunctionCall, expert_episode
from mmkv.envs.screens import DIALOG_FRAME
from mmkv.synthetic import COLOURS, FIELD_FILL, picture_digest, picture_split

SEEDS = range(60)


def _pixels_have(image, colour) -> bool:
    return bool((np.asarray(image).reshape(-1, 3) == colour).all(1).any())


def _reader(policy: str, texts: list[str], image) -> FunctionCall:
    """The right call worked out from what an agent sees: the policy's role (or the latest sign-in), the
    tickets escalated and not yet closed (from the tool results), and the screenshot's pixels."""
    role = "admin" if "account_role: admin." in policy else "viewer"
    escalated: set[str] = set()
    for text in texts:
        if "account_role is now " in text:
            role = text.split("account_role is now ")[1].split(".")[0]
        words = text.replace(".", "").split()
        for verb, marker in (("Escalated", escalated.add), ("Closed", escalated.discard)):
            if verb in words and words[words.index(verb) + 1] == "ticket":
                marker(words[words.index(verb) + 2])
    opened = [t.split("Opened ticket ")[-1].split(".")[0] for t in texts if "Opened ticket " in t][-1]
    if _pixels_have(image, DIALOG_FRAME):
        return FunctionCall("click", {"target": "ok"})
    if opened in escalated:
        return FunctionCall("click", {"target": "close"})
    if _pixels_have(image, COLOURS["red"]):
        return (
            FunctionCall("click", {"target": "approve"})
            if role == "admin"
            else FunctionCall("escalate", {"item": "ticket"})
        )
    if _pixels_have(image, FIELD_FILL):
        return FunctionCall("click", {"target": "submit"})
    return FunctionCall("fill", {"field": "note", "text": role})


def test_the_right_call_follows_from_the_screen_the_policy_and_the_history():
    """Over 60 episodes, a reader that sees only the policy, the tool results and the screenshot names the
    app's expected call at every step; every kind of decision and both kinds of history occur."""
    kinds, history = set(), 0
    for seed in SEEDS:
        episode = expert_episode(seed)
        texts, image = [episode.task], episode.first_image
        assert 4 <= len(episode.steps) <= 10
        for step in episode.steps:
            assert _reader(episode.system, texts, image) == step.call, (seed, texts)
            kinds.add(step.kind)
            history += step.uses_history
            texts.append(step.result)
            image = step.image
        assert texts[-1].endswith("The queue is empty.")
    assert kinds == {"approve", "escalate", "fill", "submit", "ok", "close"} and history >= 10


def test_episodes_are_deterministic_per_seed_and_split():
    """The same (seed, split) gives the same texts, calls and pixels; another seed or split gives another."""
    a, b = expert_episode(5), expert_episode(5)
    assert (
        a.system == b.system and a.task == b.task and [s.call for s in a.steps] == [s.call for s in b.steps]
    )
    assert [picture_digest(s.image) for s in a.steps] == [picture_digest(s.image) for s in b.steps]
    assert picture_digest(a.first_image) == picture_digest(b.first_image)
    assert picture_digest(expert_episode(6).first_image) != picture_digest(a.first_image)
    assert picture_digest(expert_episode(5, "heldout").first_image) != picture_digest(a.first_image)


def test_a_returning_ticket_is_the_same_picture_and_is_closed():
    """An escalated ticket that comes back shows exactly its first screen again, and the right call is close."""
    found = 0
    for seed in SEEDS:
        episode = expert_episode(seed)
        screens = [episode.first_image, *(s.image for s in episode.steps)]
        for k, step in enumerate(episode.steps):
            if step.kind == "close":
                first_seen = [i for i in range(k) if picture_digest(screens[i]) == picture_digest(screens[k])]
                assert first_seen and episode.steps[first_seen[0]].kind == "escalate"
                found += 1
    assert found >= 3


def test_a_role_signed_in_again_changes_later_decisions():
    """After "account_role is now X", a red badge or an empty field is decided for X, not the policy's role."""
    changed = 0
    for seed in SEEDS:
        episode = expert_episode(seed)
        role = None
        for step in episode.steps:
            if role and step.kind in ("approve", "escalate", "fill"):
                assert step.uses_history
                if step.kind == "fill":
                    assert step.call.arguments["text"] == role
                else:
                    assert (step.kind == "approve") == (role == "admin")
                changed += 1
            if "account_role is now " in step.result:
                role = step.result.split("account_role is now ")[1].split(".")[0]
    assert changed >= 3


def test_a_wrong_call_changes_nothing_and_episodes_are_bounded():
    """A wrong call returns an error, the same screenshot and the same expected call; after max_steps calls
    the episode is over and further steps raise."""
    app = DesktopApp()
    first = app.reset(3)
    expected = app.expected_call()
    result = app.step("click", {"target": "nowhere"})
    assert not result.is_right and result.text.startswith("Error:") and result.expected == expected
    assert picture_digest(result.image) == picture_digest(first.image) and app.expected_call() == expected
    while not app.done:
        app.step("escalate", {"item": "nothing"})
    assert app.num_steps == app.max_steps == app.right_path_steps + 3 and not app.success
    with pytest.raises(RuntimeError, match="over"):
        app.step("click", {"target": "ok"})


def test_playing_right_succeeds_and_the_policy_is_the_system_message():
    app = DesktopApp("heldout")
    app.reset(11)
    assert app.policy == POLICY.format(role=app.role) or "account_role" in app.policy
    while not app.done:
        call = app.expected_call()
        assert app.step(call.name, call.arguments).is_right
    assert app.success and app.expected_call() is None and app.num_steps == app.right_path_steps


def test_every_right_call_validates_against_its_tool_schema():
    """The expected calls' arguments satisfy the JSON schema of the tool they name (what constrained decoding
    and the server's validation will check)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in DesktopApp().tools()}
    assert set(schemas) == {"click", "fill", "escalate"}
    for seed in range(20):
        for step in expert_episode(seed).steps:
            jsonschema.validate(step.call.arguments, schemas[step.call.name])


def test_held_out_episodes_show_only_held_out_pictures():
    """Every screen of a held-out episode hashes to the held-out split, every training screen to the training
    split: no held-out picture is ever shown in training, whatever the seeds."""

    def digests(split, seeds):
        out = set()
        for seed in seeds:
            e = expert_episode(seed, split)
            out |= {picture_digest(i) for i in [e.first_image, *(s.image for s in e.steps)]}
        return out

    heldout, train = digests("heldout", range(15)), digests("train", range(40))
    assert {picture_split(d) for d in heldout} == {"heldout"} and {picture_split(d) for d in train} == {
        "train"
    }
    assert not heldout & train and len(heldout) > 60

"""The demo without a browser: its handlers (``app.demo``), state (``app.backend``) and what the page shows
(``app.format``) on the tiny Qwen3-VL model."""

from __future__ import annotations

import copy
import html
import io

import gradio as gr
import numpy as np
import pytest
from matplotlib.figure import Figure
from PIL import Image

import app.backend as backend_module
from app import demo
from app.backend import COLD_LABEL, ChatState, DemoBackend, EmptyMessageError, TurnSettings, default_model
from app.format import STATS_ROWS, display_text, format_turn, ttft_figure
from app.trajectory import QUESTIONS, TRAJECTORY
from mmkv import MmkvError, load_image
from mmkv.synthetic import synthetic_screenshot

from .conftest import MAX_PIXELS, NEW_TOKENS, SCREEN_1, SCREEN_2

SETTINGS = TurnSettings(max_new_tokens=NEW_TOKENS)  # what the handlers use with the default controls


def send(chat: ChatState, text: str, files=(), history=None, *, reuse="kv", seam=1, window=0, compare=False,
         system=""):  # fmt: skip
    """Call the demo's submit handler as the page does; returns its outputs."""
    message = {"text": text, "files": [str(path) for path in files]}
    return demo.respond(message, history or [], chat, reuse, float(seam), float(window), compare, system)


def stats_table(markdown: str) -> dict[str, dict[str, str]]:
    """The stats panel's table as ``{counter: {column header: cell}}``."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    headers = [cell.strip() for cell in lines[0].strip("|").split("|")][1:]
    table = {}
    for line in lines[2:]:
        counter, *cells = [cell.strip() for cell in line.strip("|").split("|")]
        table[counter] = dict(zip(headers, cells, strict=True))
    return table


# ------------------------------------------------------------------------------------------- bad input
def _write_bad(kind: str, tmp_path):
    """A bad upload of ``kind`` under ``tmp_path``."""
    if kind == "bad bytes":
        path = tmp_path / "noise.png"
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 512, dtype=np.uint8).tobytes())
    elif kind == "truncated png":
        path = tmp_path / "truncated.png"
        data = io.BytesIO()
        synthetic_screenshot(7, (64, 48)).save(data, format="PNG")
        path.write_bytes(data.getvalue()[: len(data.getvalue()) // 2])
    elif kind == "oversized":
        path = tmp_path / "big.png"
        synthetic_screenshot(7, (400, 400)).save(path)  # 160,000 pixels > MAX_PIXELS
    elif kind == "not an image":
        path = tmp_path / "notes.txt"
        path.write_text("click the OK button\n")
    else:
        raise AssertionError(kind)
    return path


@pytest.mark.parametrize(
    ("kind", "with_good_first"),
    [("bad bytes", False), ("truncated png", False), ("oversized", False), ("not an image", False)]
    + [("truncated png", True), ("oversized", True)],
)
def test_bad_image_raises_gr_error_and_keeps_the_conversation(backend, tmp_path, kind, with_good_first):
    """A bad upload (alone, or after a good one) raises gr.Error carrying mmkv's message, adds nothing, and
    the next turn answers exactly as in a chat that never saw it."""
    bad = _write_bad(kind, tmp_path)
    with pytest.raises(MmkvError) as expected:
        load_image(bad, max_pixels=MAX_PIXELS)
    chat, control = backend.new_chat(), DemoBackend("tiny-qwen3-vl", max_image_pixels=MAX_PIXELS).new_chat()
    for c in (chat, control):
        send(c, "What is on the screen?", [SCREEN_1])
    messages_before = copy.deepcopy(chat.session.messages)
    prompt_before = chat.session.render("probe")[0]

    files = [SCREEN_2, bad] if with_good_first else [bad]
    with pytest.raises(gr.Error) as checked:  # the page's first step
        demo.check_message({"text": "And this one?", "files": [str(f) for f in files]}, chat)
    with pytest.raises(gr.Error) as raised:
        send(chat, "And this one?", files)
    # mmkv's reason, with the upload's temporary path shown as the file's name only
    assert str(expected.value).replace(str(bad), "the file") in html.unescape(raised.value.message)
    assert str(bad.parent) not in html.unescape(raised.value.message)
    assert checked.value.message == raised.value.message
    assert bad.name in html.unescape(raised.value.message)
    assert chat.session.messages == messages_before
    assert len(chat.session.images) == 1 and len(chat.turns) == 1
    assert np.array_equal(chat.session.render("probe")[0], prompt_before)

    _, history, log, _, _ = send(chat, "What next?", [SCREEN_2])
    reference = control.turn("What next?", [SCREEN_2], SETTINGS)
    assert chat.turns[-1].number == 2 and log.startswith("**turn 2 [kv]")
    assert chat.turns[-1].answer.token_ids == reference.answer.token_ids
    assert [r.source for r in chat.turns[-1].answer.images] == ["live", "computed"]
    assert history[-1] == {"role": "assistant", "content": display_text(reference.answer.text)}


@pytest.mark.parametrize("text", ["", "   \n"])
def test_empty_message_raises_gr_error_and_changes_nothing(backend, text):
    """An empty (or blank) message raises gr.Error with the app's message even with an image attached; the
    image is not added and the chat still answers."""
    chat = backend.new_chat()
    send(chat, "What is on the screen?", [SCREEN_1])
    messages_before = copy.deepcopy(chat.session.messages)
    with pytest.raises(gr.Error) as raised:
        send(chat, text, [SCREEN_2])
    with pytest.raises(gr.Error) as checked:
        demo.check_message({"text": text, "files": [str(SCREEN_2)]}, chat)
    assert checked.value.message == raised.value.message
    with pytest.raises(EmptyMessageError) as expected:
        chat.turn(text, [SCREEN_2], SETTINGS)
    assert html.unescape(raised.value.message) == str(expected.value)
    assert "empty" in raised.value.message
    assert chat.session.messages == messages_before and len(chat.session.images) == 1
    with pytest.raises(gr.Error):
        demo.check_message(None, chat)  # what a cleared box sends
    with pytest.raises(gr.Error):
        demo.respond(None, [], chat, "kv", 1.0, 0.0, False)
    send(chat, "Still there?")
    assert len(chat.turns) == 2 and len(chat.session.images) == 1


# ----------------------------------------------------------------------------------------- cache hits
def test_same_image_twice_reports_a_store_hit(backend):
    """The second upload of the same screenshot is a memory-tier hit of the KV store, shown in the turn log;
    the first upload and a text-only turn are not reported as hits."""
    chat, outputs, history = backend.new_chat(), [], []
    for text, files in [("What is on the screen?", [SCREEN_1]), ("Why?", []), ("Back again?", [SCREEN_1])]:
        outputs.append(send(chat, text, files, history))
        history = outputs[-1][1]
    logs = [log for _, _, log, _, _ in outputs]
    assert "1 image: 1 computed" in logs[0] and "cache hit" not in logs[0]
    assert "1 image: 1 kept (live prefix)" in logs[1] and "cache hit" not in logs[1].split("\n")[0]
    assert logs[2].startswith("**turn 3 [kv]: 2 images: 1 kept (live prefix), 1 cache hit (memory) ·")
    sources = [r.source for r in chat.turns[-1].answer.images]
    assert sources == ["live", "memory"]
    assert chat.turns[-1].answer.images[0].digest == chat.turns[-1].answer.images[1].digest
    table = stats_table(outputs[-1][3])
    assert table["hits"]["KV · memory"] == "1" and table["misses"]["KV · memory"] == "1"
    roles = ["user", "user", "assistant", "user", "assistant", "user", "user", "assistant"]
    assert [m["role"] for m in history] == roles
    assert history[0]["content"] == history[5]["content"] == {"path": str(SCREEN_1)}
    assert history[-1]["content"] == display_text(chat.turns[-1].answer.text)


def test_persistent_store_hits_on_disk_after_a_restart(tmp_path):
    """With a store directory, a new backend (a restarted demo) finds the screenshot on disk."""
    first = DemoBackend("tiny-qwen3-vl", store_dir=tmp_path / "store").new_chat()
    first.turn("What is on the screen?", [SCREEN_1], SETTINGS)
    first.backend.kv_store.close()
    first.backend.encoder_store.close()
    second = DemoBackend("tiny-qwen3-vl", store_dir=tmp_path / "store")
    record = second.new_chat().turn("What is on the screen?", [SCREEN_1], SETTINGS)
    assert [r.source for r in record.answer.images] == ["disk"]
    assert "1 image: 1 cache hit (disk)" in format_turn(record)
    assert (tmp_path / "store" / "encoder").is_dir()
    table = stats_table(demo.show_stats(second.new_chat()))
    assert table["hits"]["KV · disk"] == "1" and table["entries"]["KV · disk"] == "1"
    assert table["corrupt"]["KV · disk"] == "0" and table["write errors"]["KV · disk"] == "0"


def test_compare_times_a_cold_recompute_without_touching_the_store(backend):
    """With compare on, a turn also reports a cold TTFT (and the speedup); the cold run adds no store traffic."""
    chat = backend.new_chat()
    send(chat, "What is on the screen?", [SCREEN_1])
    before = backend.kv_store.stats(), backend.encoder_store.stats()
    _, _, log, _, _ = send(chat, "Again?", [SCREEN_1], compare=True)
    record = chat.turns[-1]
    assert record.cold_ttft_s is not None and record.cold_ttft_s > 0
    assert f"vs {record.cold_ttft_ms:.1f} ms (none, cold)" in log
    kv_after, encoder_after = backend.kv_store.stats(), backend.encoder_store.stats()
    assert kv_after.memory.hits == before[0].memory.hits + 1  # the real turn's hit only
    assert kv_after.memory.misses == before[0].memory.misses
    assert encoder_after == before[1]


def test_settings_apply_to_the_next_turn_and_keep_the_conversation(backend):
    """Changing policy and window forks the session: the conversation is kept, the new settings are used."""
    chat = backend.new_chat()
    send(chat, "First?", [SCREEN_1])
    send(chat, "Second?", [SCREEN_2])
    _, _, log, _, _ = send(chat, "Third?", reuse="encoder", window=1, seam=0)
    config = chat.session.config
    assert (config.reuse, config.window, config.seam) == ("encoder", 1, 0)
    assert len(chat.session.images) == 2
    assert [m["role"] for m in chat.session.messages] == ["user", "assistant"] * 3
    assert log.startswith("**turn 3 [encoder]:") and "1 earlier image outside the window" in log
    assert [r.index for r in chat.turns[-1].answer.images] == [1]


# ---------------------------------------------------------------------------------------------- clearing
def test_clear_session_forgets_the_chat_but_not_the_store(backend):
    """Clear session empties the history, turns and conversation; the store still serves the screenshot."""
    chat = backend.new_chat()
    send(chat, "What is on the screen?", [SCREEN_1])
    history, log, stats, figure = demo.clear_session(chat)
    assert history == [] and chat.turns == [] and chat.session is None  # the next turn starts a new session
    assert log.startswith("*No turns yet") and not figure.axes[0].lines
    assert stats_table(stats)["entries"]["KV · memory"] == "1"
    _, _, log, _, _ = send(chat, "Seen it?", [SCREEN_1])
    assert log.startswith("**turn 1 [kv]: 1 image: 1 cache hit (memory)")


def test_clear_store_empties_both_stores(backend):
    """Clear store empties both stores (counters kept); the same screenshot is then computed again."""
    chat = backend.new_chat()
    send(chat, "What is on the screen?", [SCREEN_1])
    table = stats_table(demo.clear_store(chat))
    assert table["entries"]["KV · memory"] == "0" and table["entries"]["encoder · memory"] == "0"
    assert table["bytes"]["KV · memory"] == "0 B" and table["misses"]["KV · memory"] == "1"
    record = backend.new_chat().turn("Seen it?", [SCREEN_1], SETTINGS)
    assert [r.source for r in record.answer.images] == ["computed"]


# ------------------------------------------------------------------------------------------- panels
def test_stats_panel_lists_every_counter_per_store_and_tier(backend, tmp_path):
    """The stats table has a row per counter and a column per store and tier (disk ones with --store)."""
    table = stats_table(demo.show_stats(backend.new_chat()))
    assert list(table) == list(STATS_ROWS)
    assert list(table["hits"]) == ["KV · memory", "encoder · memory"]
    persistent = DemoBackend("tiny-qwen3-vl", store_dir=tmp_path)
    columns = list(stats_table(demo.show_stats(persistent.new_chat()))["corrupt"])
    assert columns == [
        "KV · memory",
        "KV · disk",
        "encoder · memory",
        "encoder · disk",
    ]


def test_plot_has_one_line_per_measured_policy(backend):
    """The TTFT figure draws one line per policy turns were answered with, plus the cold line where measured,
    each at the right turns and values."""
    assert isinstance(ttft_figure([]), Figure) and not ttft_figure([]).axes[0].lines
    chat = backend.new_chat()
    send(chat, "One?", [SCREEN_1], compare=True)
    send(chat, "Two?", compare=True)
    _, _, _, _, figure = send(chat, "Three?", [SCREEN_1], reuse="encoder")
    assert isinstance(figure, Figure)
    lines = {line.get_label(): line for line in figure.axes[0].lines}
    assert set(lines) == {"reuse kv", "reuse encoder", COLD_LABEL}
    assert list(lines["reuse kv"].get_xdata()) == [1, 2] and list(lines["reuse encoder"].get_xdata()) == [3]
    assert list(lines[COLD_LABEL].get_xdata()) == [1, 2]
    assert np.allclose(lines["reuse kv"].get_ydata(), [t.ttft_ms for t in chat.turns[:2]])
    assert np.allclose(lines[COLD_LABEL].get_ydata(), [t.cold_ttft_ms for t in chat.turns[:2]])


# --------------------------------------------------------------------------------------------- pieces
def test_backend_is_shared_by_the_per_session_state_copies(backend):
    """gr.State deep-copies the new chat per browser session: the copy shares the backend, not the model."""
    chat = copy.deepcopy(backend.new_chat())
    assert chat.backend is backend and chat.session is None and not backend.is_loaded


def test_default_model_prefers_the_shipped_small_checkpoint(tmp_path, monkeypatch):
    """small-qwen3-vl when its checkpoint directory exists, else tiny-qwen3-vl."""
    monkeypatch.setattr(backend_module, "SHIPPED_DIR", tmp_path)
    assert default_model() == "tiny-qwen3-vl"
    (tmp_path / "small-qwen3-vl").mkdir()
    assert default_model() == "small-qwen3-vl"


def test_display_text_hides_control_characters():
    """Control characters from random-weight models are shown as U+FFFD; an empty answer says so."""
    assert display_text("a\x1cb\x02\nc") == "a\ufffdb\ufffd\nc"
    assert display_text(" \n") == "(empty answer)"


def test_turn_settings_are_validated():
    """Bad control values are refused."""
    with pytest.raises(ValueError, match="reuse"):
        TurnSettings(reuse="all")
    with pytest.raises(ValueError):
        TurnSettings(window=-1)
    assert TurnSettings(window=0).session_window is None and TurnSettings(window=3).session_window == 3


def test_example_images_are_the_generator_output(tmp_path, monkeypatch):
    """The committed example PNGs are exactly what ``write_example_images`` draws (regenerate if not), and the
    trajectory's last step revisits its first screen."""
    from app import trajectory

    committed = {s.image: np.asarray(Image.open(s.path).convert("RGB")) for s in [*TRAJECTORY, *QUESTIONS]}
    monkeypatch.setattr(trajectory, "EXAMPLES_DIR", tmp_path)
    drawn = {p.name: np.asarray(Image.open(p).convert("RGB")) for p in trajectory.write_example_images()}
    assert set(committed) <= set(drawn)
    assert all(np.array_equal(committed[name], drawn[name]) for name in committed)
    assert TRAJECTORY[-1].image == TRAJECTORY[0].image


def test_the_shipped_model_answers_every_example_as_expected():
    """Driven like the page drives it (system prompt, latest turn only), small-qwen3-vl gives each example's
    expected answer, and the revisit step's screenshot is a cache hit."""
    backend = DemoBackend("small-qwen3-vl", device="cpu")
    for group in (TRAJECTORY, QUESTIONS):
        chat = backend.new_chat()
        for step in group:
            settings = TurnSettings(system=step.system, last_turn_only=True, max_new_tokens=8)
            record = chat.turn(step.text, [step.path], settings)
            assert record.answer.text == step.expected, step.label
    assert [r.source for r in chat.turns[0].answer.images] == ["computed"]
    trajectory_chat = backend.new_chat()
    for step in TRAJECTORY:
        record = trajectory_chat.turn(step.text, [step.path], TurnSettings(system=step.system, last_turn_only=True,
                                                                           max_new_tokens=8))  # fmt: skip
    assert "cache hit (memory)" in format_turn(record)


def test_a_new_system_prompt_starts_a_new_conversation(backend):
    """The page's system prompt: used from the first turn; a different one starts over (history cleared)."""
    chat = backend.new_chat()
    send(chat, "Hello?", [SCREEN_1], system="Rule one.")
    assert chat.session.messages[0] == {"role": "system", "content": [{"type": "text", "text": "Rule one.",
                                                                      "item_id": 0}]}  # fmt: skip
    send(chat, "Again?", [], system="Rule two.")
    assert [m["role"] for m in chat.session.messages] == ["system", "user", "assistant"]
    assert chat.session.messages[0]["content"][0]["text"] == "Rule two."


def test_streaming_yields_the_growing_answer_then_the_panels(backend):
    """respond_stream yields the answer as it grows (the last assistant message's text) and ends with the
    panels; its final history equals respond's."""
    chat = backend.new_chat()
    outputs = list(demo.respond_stream({"text": "What is it?", "files": [str(SCREEN_1)]}, [], chat, "kv", 1.0,
                                       0.0, False))  # fmt: skip
    assert len(outputs) >= 2 and outputs[-1][1][-1]["role"] == "assistant"
    final = outputs[-1][1][-1]["content"]
    assert final == display_text(chat.turns[-1].answer.text)


def test_a_text_file_named_png_gets_one_clean_message(backend, tmp_path):
    """A text file with a .png name: one message naming the file, no temporary path, no object repr."""
    path = tmp_path / "notes.png"
    path.write_text("just some text")
    with pytest.raises(MmkvError) as info:
        backend.new_chat().check("What is it?", [path])
    message = str(info.value)
    assert message.startswith("notes.png: ") and str(tmp_path) not in message and "<_io" not in message


def test_build_demo_makes_blocks():
    """The module builds its page at import; build_demo builds one over a given backend."""
    assert isinstance(demo.demo, gr.Blocks)
    assert isinstance(demo.build_demo(DemoBackend("tiny-qwen3-vl")), gr.Blocks)

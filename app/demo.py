"""The mmkv trajectory demo: a multimodal chat over one ``mmkv.Session`` per browser session that shows, for
every turn, which images were cache hits and from which tier, the time to first token with reuse and, on
request, the same turn's TTFT without reuse (a cold full recompute), next to the store's counters and a plot.

Works offline on the CPU. Run::

    python app/demo.py                              # small-qwen3-vl if shipped, else tiny-qwen3-vl
    mmkv demo                                       # the same, from the mmkv command
    python app/demo.py --model tiny-qwen2.5-vl --port 7861 --max-new-tokens 8
    python app/demo.py --store /tmp/mmkv-store      # persistent stores: a restarted demo hits on "disk"
    python app/demo.py --write-examples             # (re)make the example screenshots in app/examples/

then open http://127.0.0.1:7860 and click through the example trajectory under the message box. From Python::

    from app.demo import build_demo
    from app.backend import DemoBackend
    build_demo(DemoBackend("tiny-qwen3-vl")).launch()

The handlers are thin: the chat state lives in ``app/backend.py``, the reports and the plot in ``app/format.py``,
all KV work in ``mmkv``.
"""

from __future__ import annotations

import argparse
import html
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gradio as gr
from matplotlib.figure import Figure

if __package__ in (None, ""):  # run as a script (python app/demo.py): make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.backend import POLICIES, ChatState, DemoBackend, EmptyMessageError, TurnSettings, default_model  # noqa: E402
from app.format import display_text, format_stats, format_turn_log, ttft_figure  # noqa: E402
from app.trajectory import EXAMPLES_DIR, POLICY, QUESTIONS, TRAJECTORY, write_example_images  # noqa: E402
from mmkv import MmkvError  # noqa: E402

MAX_NEW_TOKENS = 32  # answer length bound (--max-new-tokens)

# Browsers fire no "change" when the file picker selects the file the input already holds, so re-sending the same
# screenshot (the point of this demo) would silently attach nothing: empty the input after each pick.
RESET_FILE_INPUT_JS = """() => {
    document.addEventListener("change", (event) => {
        const input = event.target;
        if (input instanceof HTMLInputElement && input.type === "file" && input.closest("#message")) {
            setTimeout(() => { input.value = ""; }, 0);
        }
    }, true);
}"""

INTRO = """# mmkv: never pay twice for the same picture
Attach (or paste) screenshots and ask about them. Each turn reports where every image's KV came from: **kept**
in the live prefix, a **cache hit** in the shared store (memory or disk tier), or **computed**; and its time to
first token with reuse against a cold full recompute. Re-send a screenshot you sent before to see a hit."""


# ---------------------------------------------------------------------------------------------- handlers
@contextmanager
def user_errors() -> Iterator[None]:
    """Show mmkv's input errors (and an empty message) as ``gr.Error`` with the same text."""
    try:
        yield
    except (MmkvError, EmptyMessageError) as exc:
        raise gr.Error(html.escape(str(exc)), print_exception=False) from exc


def _text_and_files(message: dict | None) -> tuple[str, list[str]]:
    return (message or {}).get("text") or "", list((message or {}).get("files") or [])


def check_message(message: dict | None, chat: ChatState) -> None:
    """Refuse a message the chat cannot take (``gr.Error``: empty, or a bad image) before ``respond`` runs, so
    the error shows as a toast only. Changes nothing."""
    with user_errors():
        chat.check(*_text_and_files(message))


def respond_stream(
    message: dict | None,
    history: list[dict],
    chat: ChatState,
    reuse: str,
    seam: float,
    window: float,
    compare: bool,
    system: str = "",
    last_turn_only: bool = False,
) -> Iterator[tuple]:
    """Send one message (its images, then its text), streaming the answer: yields the cleared input, the
    history (the answer growing) and the panels. A bad image or an empty message raises ``gr.Error`` with
    mmkv's message and changes nothing; a new system prompt starts a new conversation (history cleared)."""
    text, files = _text_and_files(message)
    settings = TurnSettings(reuse, int(seam), int(window), bool(compare), MAX_NEW_TOKENS, system or "",
                            bool(last_turn_only))  # fmt: skip
    if chat.session is not None and (system or "") != chat.system:
        history = []  # the chat restarts with the new system prompt
    new = [{"role": "user", "content": {"path": str(path)}} for path in files]
    new += [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
    answer = ""
    with user_errors():
        for piece in chat.stream_turn(text, files, settings):
            if isinstance(piece, str):
                answer += piece
                new[-1] = {"role": "assistant", "content": display_text(answer) if answer else "…"}
                yield gr.skip(), [*history, *new], gr.skip(), gr.skip(), gr.skip()
            else:
                new[-1] = {"role": "assistant", "content": display_text(piece.answer.text)}
    yield None, [*history, *new], *panels(chat)


def respond(message, history, chat, reuse, seam, window, compare, system="", last_turn_only=False) -> tuple:
    """``respond_stream`` run to the end: the final outputs (what tests and scripts call)."""
    *_, last = respond_stream(message, history, chat, reuse, seam, window, compare, system, last_turn_only)
    return last


def panels(chat: ChatState) -> tuple[str, str, Figure]:
    """The turn log, the store statistics and the TTFT plot for ``chat``."""
    return format_turn_log(chat.turns), format_stats(chat.backend), ttft_figure(chat.turns)


def clear_session(chat: ChatState) -> tuple[list[dict], str, str, Figure]:
    """Forget this browser session's conversation and turns (the shared store keeps its entries)."""
    chat.clear()
    return [], *panels(chat)


def clear_store(chat: ChatState) -> str:
    """Empty the shared stores (memory and disk); returns the new statistics."""
    chat.backend.clear_store()
    return format_stats(chat.backend)


def show_stats(chat: ChatState) -> str:
    """The shared stores' statistics (other browser sessions change them too)."""
    return format_stats(chat.backend)


# ------------------------------------------------------------------------------------------------ layout
def build_demo(backend: DemoBackend | None = None) -> gr.Blocks:
    """The demo's page over ``backend`` (default: ``DemoBackend()``, the default model, in-memory stores)."""
    backend = backend or DemoBackend()
    with gr.Blocks(title="mmkv demo", analytics_enabled=False) as demo:
        chat = gr.State(backend.new_chat)  # called once per browser session
        gr.Markdown(f"{INTRO}\n\n{backend.describe()}", elem_id="model-line")
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(label="Trajectory", height=440, elem_id="chatbot")
                message = gr.MultimodalTextbox(
                    file_count="multiple",
                    file_types=["image"],
                    placeholder="Attach or paste screenshots, then ask about them (Enter sends)",
                    show_label=False,
                    elem_id="message",
                )
                turn_log = gr.Markdown(format_turn_log([]), elem_id="turn-log")
                system = gr.Textbox(
                    value=POLICY if backend.is_shipped_small else "", label="System prompt", lines=2,
                    info="the agent's policy; changing it starts a new conversation", elem_id="system",
                )  # fmt: skip
                gr.Examples(
                    [[{"text": s.text, "files": [str(s.path)]}, s.system] for s in TRAJECTORY],
                    inputs=[message, system],
                    example_labels=[s.label for s in TRAJECTORY],
                    label="Example trajectory (expected answers): click a step, then press Enter",
                    elem_id="trajectory-examples",
                )
                gr.Examples(
                    [[{"text": s.text, "files": [str(s.path)]}, s.system] for s in QUESTIONS],
                    inputs=[message, system],
                    example_labels=[s.label for s in QUESTIONS],
                    label="Picture questions it was trained on (no system prompt)",
                )
            with gr.Column(scale=2):
                reuse = gr.Radio(
                    list(POLICIES),
                    value="kv",
                    label="Reuse policy",
                    info="kv: splice cached KV · encoder: reuse vision outputs · none: recompute images",
                )
                seam = gr.Slider(
                    0,
                    16,
                    value=1,
                    step=1,
                    label="Seam tokens",
                    info="kv: leading tokens of a spliced image recomputed in context",
                )
                window = gr.Slider(
                    0,
                    16,
                    value=0,
                    step=1,
                    label="Screenshot window",
                    info="keep the last N images in the prompt (0 = all)",
                )
                compare = gr.Checkbox(
                    value=True, label="Also time each turn without reuse (cold full recompute)"
                )
                last_turn_only = gr.Checkbox(
                    value=backend.is_shipped_small, label="Prompt holds the latest turn only",
                    info="the shipped small models were trained on single turns; the cache keeps every image",
                )  # fmt: skip
                with gr.Row():
                    clear_chat_button = gr.Button("Clear session")
                    clear_store_button = gr.Button("Clear store", variant="stop")
                plot = gr.Plot(ttft_figure([]), format="png", show_label=False, elem_id="ttft-plot")
                stats = gr.Markdown(elem_id="store-stats")
        # Check first, with no outputs: a refused message shows only a toast (an event that fails marks each
        # of its outputs "Error" and blanks them).
        message.submit(check_message, [message, chat], None).success(
            respond_stream,
            [message, chatbot, chat, reuse, seam, window, compare, system, last_turn_only],
            [message, chatbot, turn_log, stats, plot],
        )
        clear_chat_button.click(clear_session, chat, [chatbot, turn_log, stats, plot])
        clear_store_button.click(clear_store, chat, stats)
        demo.load(show_stats, chat, stats)
        demo.load(None, js=RESET_FILE_INPUT_JS)
    return demo


# The default page (what `gradio app/demo.py` reloads); `__main__` below rebuilds it from the arguments.
demo = build_demo()

if __name__ == "__main__":
    from mmkv.cli import install_error_hook

    install_error_hook("app/demo.py")
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--model", default=default_model(), help="a name mmkv.load takes (default: %(default)s)"
    )
    parser.add_argument("--store", default=None, help="directory that makes the stores persistent")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=7860, help="port to serve on (default: %(default)s)")
    parser.add_argument("--device", default=None, help="torch device for the model (default: mmkv.load's)")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help="answer length bound")
    parser.add_argument("--write-examples", action="store_true", help="(re)write app/examples/*.png and exit")
    args = parser.parse_args()
    MAX_NEW_TOKENS = args.max_new_tokens
    if args.write_examples:
        print("\n".join(str(path) for path in write_example_images()))
        raise SystemExit(0)
    backend = DemoBackend(args.model, args.store, device=args.device)
    print(f"loading {backend.model_name} ...", flush=True)
    backend.load()  # now: a missing checkpoint fails (one line, exit 2) before the page is served
    demo = build_demo(backend)
    demo.launch(server_name=args.host, server_port=args.port, allowed_paths=[str(EXAMPLES_DIR)])

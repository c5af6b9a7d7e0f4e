"""The mmkv demo: a vision-language agent acting on a simulated desktop through tool calls, and a multimodal chat.

**Agent episode** (the first tab): an episode of the simulated ticket desk (``mmkv.envs.DesktopApp``) driven by
the model through tool calls (``app/episode.py``): per step the app's screenshot, the model's call, whether it
was the right one, the tool's result, the time to first token and where each screenshot's KV came from (kept in
the live prefix, a cache hit in the store once the window of screenshots slid, or computed), charted against
what the same prompt takes without reuse (a ``reuse="none"`` twin of the conversation, timed before each step).
The policy panel shows the account_role in force (a dialog's close can sign the agent in again as another). Step
through it or run it; a reuse policy chosen mid-episode applies from the next step (its row says so), and a
Step after the end says so and changes nothing.

**Chat** (the second tab): a multimodal chat over one ``mmkv.Session`` per browser session that shows, for every
turn, which images were cache hits and from which tier, the time to first token with reuse and, on request, the
same turn's TTFT without reuse (a cold full recompute), next to the store's counters and a plot.

Works offline on the CPU. Run::

    python app/demo.py                              # small-qwen3-vl if shipped, else tiny-qwen3-vl
    mmkv demo                                       # the same, from the mmkv command
    python app/demo.py --model tiny-qwen2.5-vl --port 7861 --max-new-tokens 8
    python app/demo.py --store /tmp/mmkv-store      # persistent stores: a restarted demo hits on "disk"
    python app/demo.py --write-examples             # (re)make the example screenshots in app/examples/

then open http://127.0.0.1:7860: press "Run episode" (or "Step"), or type a question in the Chat tab. From
Python::

    from app.demo import build_demo
    from app.backend import DemoBackend
    build_demo(DemoBackend("tiny-qwen3-vl")).launch(css=CSS)

The handlers are thin: the chat state lives in ``app/backend.py``, the episode in ``app/episode.py``, the reports
and the plot in ``app/format.py``, all KV work in ``mmkv``.
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

from app.backend import ChatState, DemoBackend, EmptyMessageError, TurnSettings, default_model  # noqa: E402
from app.episode import EpisodeRun, EpisodeSettings  # noqa: E402
from app.format import (  # noqa: E402
    display_text,
    episode_over_message,
    episode_ttft_figure,
    format_episode_log,
    format_episode_policy,
    format_episode_status,
    format_stats,
    format_turn_log,
    ttft_figure,
)
from app.trajectory import (  # noqa: E402
    DEMO_EPISODE_SEED,
    EXAMPLES_DIR,
    POLICY,
    QUESTIONS,
    TRAJECTORY,
    write_example_images,
)
from mmkv import MmkvError  # noqa: E402
from mmkv.policy import REUSE_POLICIES  # noqa: E402

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

# Tables wrap at spaces only (Gradio's prose tables may break inside a word, e.g. "TT-FT" in a narrow header).
CSS = """
#episode-log table th, #episode-log table td { word-break: normal; overflow-wrap: normal; hyphens: none; }
#episode-log table th { white-space: normal; vertical-align: bottom; }
"""

INTRO = """# mmkv: never pay twice for the same picture
**Agent episode**: the model acts on a simulated ticket desk through tool calls (click, fill, escalate); each
tool result carries the next screenshot and the prompt keeps the last few. Per step: the call, whether it was
right, the time to first token and where every screenshot's KV came from: **kept** in the live prefix, a **cache
hit** in the shared store (spliced at its new position once the window slid), or **computed**.
**Chat**: attach screenshots and ask about them; re-send one you sent before to see a hit."""


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


def episode_outputs(run: EpisodeRun) -> tuple:
    """The episode tab's outputs: the screen now, the step table, the status line, the policy in force, the
    screenshots so far, the stores' statistics and the TTFT chart (with reuse and without, per step)."""
    shots = [] if not run.started else [run.first_screenshot, *(step.screenshot for step in run.steps)]
    return (run.screenshot, format_episode_log(run.steps), format_episode_status(run), format_episode_policy(run),
            shots, format_stats(run.backend), episode_ttft_figure(run.steps))  # fmt: skip


def new_episode(run: EpisodeRun, seed: float, window: float, reuse: str) -> tuple:
    """Start the episode of ``seed`` with the tab's window and reuse policy."""
    with user_errors():
        run.reset(int(seed), EpisodeSettings(window=int(window), reuse=reuse))
    return episode_outputs(run)


def step_episode(run: EpisodeRun, seed: float, window: float, reuse: str) -> tuple:
    """One step under ``reuse`` (an episode is started first if none is running). After the end: a warning
    that says so, and the panels as they were."""
    if not run.started:
        new_episode(run, seed, window, reuse)
    if run.done:
        gr.Warning(episode_over_message(run))
        return episode_outputs(run)
    run.request_reuse(reuse)
    run.step()
    return episode_outputs(run)


def run_episode(run: EpisodeRun, seed: float, window: float, reuse: str) -> Iterator[tuple]:
    """Every remaining step (an episode is started first if none is running or the last one is over), the page
    updated after each; a reuse policy chosen meanwhile applies from the next step (``change_reuse``)."""
    if not run.started or run.done:
        new_episode(run, seed, window, reuse)
        yield episode_outputs(run)
    run.request_reuse(reuse)
    for _ in run.run():
        yield episode_outputs(run)


def change_reuse(run: EpisodeRun, reuse: str) -> str:
    """The reuse radio changed: the episode answers with ``reuse`` from its next step (said in a toast and the
    status line, which is returned); before an episode, the next one starts with it."""
    run.request_reuse(reuse)
    if run.pending_reuse is not None:
        gr.Info(f"Reuse policy {reuse}: applies from the next step (step {len(run.steps) + 1}).")
    return format_episode_status(run)


# ------------------------------------------------------------------------------------------------ layout
def build_demo(backend: DemoBackend | None = None) -> gr.Blocks:
    """The demo's page over ``backend`` (default: ``DemoBackend()``, the default model, in-memory stores)."""
    backend = backend or DemoBackend()
    with gr.Blocks(title="mmkv demo", analytics_enabled=False) as demo:
        chat = gr.State(backend.new_chat)  # called once per browser session
        episode = gr.State(lambda: EpisodeRun(backend))
        gr.Markdown(f"{INTRO}\n\n{backend.describe()}", elem_id="model-line")
        with gr.Tabs():
            with gr.Tab("Agent episode", elem_id="episode-tab"):
                with gr.Row():
                    with gr.Column(scale=3):
                        screen = gr.Image(label="The app's screen now", type="pil", interactive=False, height=300,
                                          elem_id="screen")  # fmt: skip
                        episode_plot = gr.Plot(episode_ttft_figure([]), format="png", show_label=False,
                                               elem_id="episode-ttft-plot")  # fmt: skip
                    with gr.Column(scale=2):
                        seed = gr.Number(DEMO_EPISODE_SEED, precision=0, label="Episode seed (held-out pictures)",
                                         elem_id="episode-seed")  # fmt: skip
                        episode_window = gr.Slider(1, 6, value=3, step=1, label="Screenshots kept in the prompt",
                                                   info="applies from the next New episode")  # fmt: skip
                        episode_reuse = gr.Radio(list(REUSE_POLICIES), value="kv", label="Reuse policy",
                                                 info="a change applies from the next step", elem_id="episode-reuse")  # fmt: skip
                        with gr.Row():
                            new_button = gr.Button("New episode", elem_id="episode-new")
                            step_button = gr.Button("Step", elem_id="episode-step")
                            run_button = gr.Button("Run episode", variant="primary", elem_id="episode-run")
                        episode_status = gr.Markdown("*No episode yet.*", elem_id="episode-status")
                        policy = gr.Markdown(elem_id="episode-policy")
                        screens = gr.Gallery(
                            label="Screenshots so far", columns=4, height=220, elem_id="episode-screens"
                        )
                # full width below: the step table has 10 columns
                episode_log = gr.Markdown(format_episode_log([]), elem_id="episode-log")
            with gr.Tab("Chat", elem_id="chat-tab"):
                with gr.Row():
                    with gr.Column(scale=3):
                        chatbot = gr.Chatbot(label="Trajectory", height=440, elem_id="chatbot")
                        message = gr.MultimodalTextbox(
                            file_count="multiple", file_types=["image"], show_label=False, elem_id="message",
                            placeholder="Attach or paste screenshots, then ask about them (Enter sends)",
                        )  # fmt: skip
                        turn_log = gr.Markdown(format_turn_log([]), elem_id="turn-log")
                        system = gr.Textbox(
                            value=POLICY if backend.is_shipped_small else "", label="System prompt", lines=2,
                            info="the agent's policy; changing it starts a new conversation", elem_id="system",
                        )  # fmt: skip
                        gr.Examples(
                            [[{"text": s.text, "files": [str(s.path)]}, s.system] for s in TRAJECTORY],
                            inputs=[message, system], example_labels=[s.label for s in TRAJECTORY],
                            label="Single screens, as the task suite asks (expected answers): click one, press Enter",
                            elem_id="trajectory-examples",
                        )  # fmt: skip
                        gr.Examples(
                            [[{"text": s.text, "files": [str(s.path)]}, s.system] for s in QUESTIONS],
                            inputs=[message, system], example_labels=[s.label for s in QUESTIONS],
                            label="Picture questions it was trained on (no system prompt)",
                        )  # fmt: skip
                    with gr.Column(scale=2):
                        reuse = gr.Radio(
                            list(REUSE_POLICIES), value="kv", label="Reuse policy",
                            info="kv: splice cached KV · encoder: reuse vision outputs · none: recompute images",
                        )  # fmt: skip
                        seam = gr.Slider(0, 16, value=1, step=1, label="Seam tokens",
                                         info="kv: leading tokens of a spliced image recomputed in context")  # fmt: skip
                        window = gr.Slider(0, 16, value=0, step=1, label="Screenshot window",
                                           info="keep the last N images in the prompt (0 = all)")  # fmt: skip
                        compare = gr.Checkbox(
                            value=True, label="Also time each turn without reuse (cold full recompute)"
                        )
                        last_turn_only = gr.Checkbox(
                            value=backend.is_shipped_small, label="Prompt holds the latest turn only",
                            info="the suite's single-screen questions are single turns; the cache keeps every image",
                        )  # fmt: skip
                        with gr.Row():
                            clear_chat_button = gr.Button("Clear session")
                            clear_store_button = gr.Button("Clear store", variant="stop")
                        plot = gr.Plot(ttft_figure([]), format="png", show_label=False, elem_id="ttft-plot")
        stats = gr.Markdown(elem_id="store-stats")
        episode_inputs = [episode, seed, episode_window, episode_reuse]
        episode_panels = [screen, episode_log, episode_status, policy, screens, stats, episode_plot]
        new_button.click(new_episode, episode_inputs, episode_panels)
        step_button.click(step_episode, episode_inputs, episode_panels)
        run_button.click(run_episode, episode_inputs, episode_panels)
        episode_reuse.input(change_reuse, [episode, episode_reuse], episode_status)
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
    demo.launch(server_name=args.host, server_port=args.port, allowed_paths=[str(EXAMPLES_DIR)], css=CSS)

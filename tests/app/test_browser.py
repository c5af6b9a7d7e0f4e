"""The demo in a real browser: ``app/demo.py`` served in a subprocess, driven with Debian's chromium through
Playwright (never a downloaded browser; no network). Skipped only when ``/usr/bin/chromium`` is missing.

The full-page screenshot is written under pytest's ``tmp_path`` and copied to ``$MMKV_ARTIFACTS/demo.png``
when that variable is set.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from app.format import EPISODE_COLUMNS
from app.trajectory import DEMO_EPISODE_CALLS, DEMO_EPISODE_SEED, TRAJECTORY

from .conftest import REPO, SCREEN_1

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Hang guards, not speed bounds: a busy machine may take many times the idle figures (a server up in ~10 s, an
# answer on the tiny model in a fraction of a second); the test fails only when nothing happens at all.
START_TIMEOUT_S = 900  # the server's import and model load
TURN_TIMEOUT_MS = 600_000  # one answer on the tiny model

# Gradio 6 DOM, read off the served page: elem_ids set in app/demo.py, data-testids from Gradio's components.
MESSAGE_FILE_INPUT = "#message input[type=file]"
MESSAGE_TEXT = "#message textarea"
MESSAGE_SUBMIT = "#message [data-testid=submit-button]"
UPLOADED_THUMBNAIL = "#message .thumbnail-item img[src*='gradio_api/file=']"  # shown once the upload is done
BOT_MESSAGE = "#chatbot [data-testid=bot]"
USER_MESSAGE = "#chatbot [data-testid=user]"
TURN_LOG = "#turn-log"
ERROR_TOAST = "[data-testid=toast-body].error"
WARNING_TOAST = "[data-testid=toast-body].warning"
EPISODE_ROWS = "#episode-log table tbody tr"
EPISODE_STATUS = "#episode-status"
IMAGES_CELL = EPISODE_COLUMNS.index("images: KV from")  # the step table's column of the images' sources


def _open_chat(page) -> None:
    """Show the Chat tab (the page opens on the agent episode)."""
    page.get_by_role("tab", name="Chat").click()
    page.wait_for_selector(MESSAGE_TEXT)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_demo(tmp_path: Path, model: str) -> tuple[subprocess.Popen, str]:
    """``app/demo.py --model MODEL`` serving on a free port (its URL), waited for. A port taken by another
    process between choosing it and binding it (other suites on the machine) is retried on a new one, at most
    three times; any other exit fails the test with the demo's log."""
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1")
    for attempt in range(3):
        port, path = _free_port(), tmp_path / f"server-{attempt}.log"
        with path.open("w") as log:
            process = subprocess.Popen(
                [sys.executable, str(REPO / "app/demo.py"), "--model", model, "--port", str(port)]
                + ["--max-new-tokens", "8"],
                cwd=tmp_path,  # not the repository: the example files must be served from anywhere
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        url, deadline = f"http://127.0.0.1:{port}/", time.monotonic() + START_TIMEOUT_S
        while process.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return process, url
            except OSError:
                pass
            if time.monotonic() > deadline:
                _stop(process)
                pytest.fail(f"the demo did not serve within {START_TIMEOUT_S} s")
            time.sleep(0.5)
        text = path.read_text()
        if "Cannot find empty port" not in text:
            pytest.fail(f"the demo exited with {process.returncode}:\n{text}")
    pytest.fail("three free ports were taken before the demo could bind them")


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module", params=["tiny-qwen3-vl"])
def server(tmp_path_factory, request):
    """The demo of ``<param>`` on a free port, one per model for the module's tests (each test opens its own
    page: a Gradio session of its own, and pictures no other test sends); yields its URL, stops it afterwards."""
    process, url = _start_demo(tmp_path_factory.mktemp("demo"), request.param)
    try:
        yield url
    finally:
        _stop(process)


@contextmanager
def _page(url: str, height: int):
    """A headless chromium page at ``url`` (1400 x ``height``), each wait bounded by TURN_TIMEOUT_MS; closed
    after."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": height})
            page.set_default_timeout(TURN_TIMEOUT_MS)
            page.goto(url, wait_until="domcontentloaded")
            yield page
        finally:
            browser.close()


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"Debian's chromium is not installed at {CHROMIUM}")
def test_trajectory_in_the_browser(server, tmp_path):
    """Upload a screenshot and ask, ask again, re-upload the same screenshot and ask: every turn shows an
    answer, only the re-upload is a cache hit, and an empty message shows mmkv's error without a turn."""
    from playwright.sync_api import expect

    with _page(server, height=1000) as page:
        _open_chat(page)

        def send(text: str, image: Path | None, turn: int) -> str:
            """Attach ``image`` (if any), type ``text``, submit; returns the turn log once answered."""
            if image is not None:
                page.set_input_files(MESSAGE_FILE_INPUT, str(image))
                page.wait_for_selector(UPLOADED_THUMBNAIL)
            page.fill(MESSAGE_TEXT, text)
            page.click(MESSAGE_SUBMIT)
            expect(page.locator(BOT_MESSAGE)).to_have_count(turn)
            expect(page.locator(TURN_LOG)).to_contain_text(f"turn {turn} [kv]")
            assert page.locator(BOT_MESSAGE).nth(turn - 1).inner_text().strip()
            expect(page.locator(MESSAGE_TEXT)).to_have_value("")  # the box is cleared
            return page.locator(TURN_LOG).inner_text()

        latest = send("What is on the screen?", SCREEN_1, 1).splitlines()[0]
        assert "1 image: 1 computed" in latest and "cache hit" not in latest
        latest = send("What should I click?", None, 2).splitlines()[0]
        assert "1 image: 1 kept (live prefix)" in latest and "cache hit" not in latest
        latest = send("I am back on the first screen. Now?", SCREEN_1, 3).splitlines()[0]
        assert "1 cache hit (memory)" in latest
        assert "(none, cold)" in latest  # the compare checkbox is on by default
        expect(page.locator(USER_MESSAGE).locator("img")).to_have_count(2)
        shot = tmp_path / "demo.png"
        page.screenshot(path=str(shot), full_page=True)

        page.click(MESSAGE_SUBMIT)  # an empty message: an error toast, no new turn
        expect(page.locator(ERROR_TOAST)).to_contain_text("the message is empty")
        expect(page.locator(BOT_MESSAGE)).to_have_count(3)
        expect(page.locator("#store-stats")).to_contain_text("hits")
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")
    if os.environ.get("MMKV_ARTIFACTS"):
        target = Path(os.environ["MMKV_ARTIFACTS"])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, target / "demo.png")
        print(f"screenshot: {target / 'demo.png'}")


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"Debian's chromium is not installed at {CHROMIUM}")
@pytest.mark.parametrize("server", ["small-qwen3-vl"], indirect=True, scope="module")
def test_the_example_trajectory_answers_as_expected(server, tmp_path):
    """On the shipped model: click each example step of the trajectory and send it; every answer is the
    expected one shown on its button, and the revisit step's screenshot is a cache hit. The page's screenshot
    goes to $MMKV_ARTIFACTS/demo-trajectory.png."""
    from playwright.sync_api import expect

    with _page(server, height=1400) as page:
        _open_chat(page)
        expect(page.locator("#model-line")).to_contain_text("cannot chat")
        for turn, step in enumerate(TRAJECTORY, start=1):
            page.get_by_text(step.label, exact=True).click()
            expect(page.locator(MESSAGE_TEXT)).to_have_value(step.text)
            page.wait_for_selector(UPLOADED_THUMBNAIL)
            page.click(MESSAGE_SUBMIT)
            expect(page.locator(BOT_MESSAGE)).to_have_count(turn)
            expect(page.locator(TURN_LOG)).to_contain_text(f"turn {turn} [kv]")
            expect(page.locator(BOT_MESSAGE).nth(turn - 1)).to_have_text(step.expected)
        latest = page.locator(TURN_LOG).inner_text().splitlines()[0]
        assert "cache hit (memory)" in latest, latest
        shot = tmp_path / "demo-trajectory.png"
        page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("MMKV_ARTIFACTS"):
        target = Path(os.environ["MMKV_ARTIFACTS"])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, target / "demo-trajectory.png")


def _episode_in_the_browser(url: str, artifact: Path, name: str) -> list[list[str]]:
    """Open the page, press Run episode, wait until the episode is over, press Step once more (a warning that
    it ended; the table, status, screen and chart stay); returns the step table's cells per row (the page's
    screenshot saved to ``artifact`` and, with $MMKV_ARTIFACTS, copied there as ``name``)."""
    from playwright.sync_api import expect

    with _page(url, height=1400) as page:
        page.wait_for_selector("#episode-run")
        expect(page.locator("#episode-seed input")).to_have_value(str(DEMO_EPISODE_SEED))
        page.click("#episode-run")
        expect(page.locator(EPISODE_STATUS)).to_contain_text("done", timeout=TURN_TIMEOUT_MS * 3)
        expect(page.locator("#screen img")).to_have_count(1)
        rows = page.locator(EPISODE_ROWS)
        cells = [
            [c.strip() for c in rows.nth(i).locator("td").all_inner_texts()] for i in range(rows.count())
        ]
        status = page.locator(EPISODE_STATUS).inner_text()
        expect(page.locator("#episode-ttft-plot img")).to_have_count(1)
        page.click("#episode-step")  # after the end: a warning, every panel as it was
        expect(page.locator(WARNING_TOAST)).to_contain_text("has ended")
        expect(rows).to_have_count(len(cells))
        expect(page.locator(EPISODE_STATUS)).to_have_text(status)
        expect(page.locator("#screen img")).to_have_count(1)
        expect(page.locator("#episode-ttft-plot img")).to_have_count(1)
        page.screenshot(path=str(artifact), full_page=True)
    if os.environ.get("MMKV_ARTIFACTS"):
        target = Path(os.environ["MMKV_ARTIFACTS"])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(artifact, target / name)
    return cells


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"Debian's chromium is not installed at {CHROMIUM}")
def test_the_agent_episode_in_the_browser(server, tmp_path):
    """Run episode on the tiny model: the page shows one row per step whose call, verdict and right call are
    what the same episode gives in process (the same deterministic weights and code), the first screenshot
    computed, the second step keeping it live, and from the fourth step on (window 3 slid) a store hit."""
    from app.backend import DemoBackend
    from app.episode import EpisodeRun

    run = EpisodeRun(DemoBackend("tiny-qwen3-vl", device="cpu"))
    run.reset(DEMO_EPISODE_SEED)
    expected = list(run.run())
    cells = _episode_in_the_browser(server, tmp_path / "demo-episode.png", "demo-episode.png")
    assert len(cells) == len(expected) >= 1
    for row, step in zip(cells, expected, strict=True):
        assert row[0] == str(step.number) and row[1] == (step.call or "(no call)") and row[3] == step.expected
        assert row[2] == ("✓" if step.is_right else "✗")
    assert cells[0][IMAGES_CELL] == "1 image: 1 computed"
    if len(cells) > 1:
        assert "1 kept (live prefix)" in cells[1][IMAGES_CELL]
    assert all("cache hit (memory)" in row[IMAGES_CELL] for row in cells[3:])


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"Debian's chromium is not installed at {CHROMIUM}")
@pytest.mark.parametrize("server", ["small-qwen3-vl"], indirect=True, scope="module")
def test_the_shipped_model_runs_the_demo_episode(server, tmp_path):
    """On the retrained shipped model: every step's call is the expected one (DEMO_EPISODE_CALLS) and right, and
    from the fourth step on the earliest screenshot in the prompt is a store hit."""
    template = REPO / "checkpoints" / "small-qwen3-vl" / "chat_template.jinja"
    if "tool_call" not in template.read_text():
        pytest.skip("the shipped checkpoint does not call tools yet")
    cells = _episode_in_the_browser(server, tmp_path / "demo-episode-shipped.png", "demo-episode-shipped.png")
    assert [row[1] for row in cells] == list(DEMO_EPISODE_CALLS)
    assert all(row[2] == "✓" for row in cells)
    assert all("cache hit (memory)" in row[IMAGES_CELL] for row in cells[3:])

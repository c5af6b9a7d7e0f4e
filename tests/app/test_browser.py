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
from pathlib import Path

import pytest

from app.trajectory import TRAJECTORY

from .conftest import REPO, SCREEN_1

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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(params=["tiny-qwen3-vl"])
def server(tmp_path, request):
    """``app/demo.py --model <param>`` on a free port; yields its URL, stops it afterwards."""
    port = _free_port()
    log = (tmp_path / "server.log").open("w")
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [sys.executable, str(REPO / "app/demo.py"), "--model", request.param, "--port", str(port)]
        + ["--max-new-tokens", "8"],
        cwd=tmp_path,  # not the repository: the example files must be served from anywhere
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(
                    f"the demo exited with {process.returncode}:\n{(tmp_path / 'server.log').read_text()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the demo did not serve within {START_TIMEOUT_S} s")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"Debian's chromium is not installed at {CHROMIUM}")
def test_trajectory_in_the_browser(server, tmp_path):
    """Upload a screenshot and ask, ask again, re-upload the same screenshot and ask: every turn shows an
    answer, only the re-upload is a cache hit, and an empty message shows mmkv's error without a turn."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(TURN_TIMEOUT_MS)
            page.goto(server, wait_until="domcontentloaded")
            page.wait_for_selector(MESSAGE_TEXT)

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
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")
    if os.environ.get("MMKV_ARTIFACTS"):
        target = Path(os.environ["MMKV_ARTIFACTS"])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, target / "demo.png")
        print(f"screenshot: {target / 'demo.png'}")


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"Debian's chromium is not installed at {CHROMIUM}")
@pytest.mark.parametrize("server", ["small-qwen3-vl"], indirect=True)
def test_the_example_trajectory_answers_as_expected(server, tmp_path):
    """On the shipped model: click each example step of the trajectory and send it; every answer is the
    expected one shown on its button, and the revisit step's screenshot is a cache hit. The page's screenshot
    goes to $MMKV_ARTIFACTS/demo-trajectory.png."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1400})
            page.set_default_timeout(TURN_TIMEOUT_MS)
            page.goto(server, wait_until="domcontentloaded")
            page.wait_for_selector(MESSAGE_TEXT)
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
        finally:
            browser.close()
    if os.environ.get("MMKV_ARTIFACTS"):
        target = Path(os.environ["MMKV_ARTIFACTS"])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, target / "demo-trajectory.png")

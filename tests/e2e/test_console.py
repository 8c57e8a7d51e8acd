"""The console in a real headless browser: three agents serve a split; the page, opened on an
agent that asks for a key, takes the key in its login form, shows the three peers and the
plan's layer ranges, and a request's time per stage within 2 s of the request. A screenshot is
kept as a test artifact ($MESHAGENT_TEST_ARTIFACTS, default test-artifacts/)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.e2e.agents import invite, wait_for

KEY = "console-key-31"
SMALL = ["--max-memory", "80M", "--slots", "2", "--ctx-size", "1024", "--threads", "1"]
ARTIFACTS = Path(os.environ.get("MESHAGENT_TEST_ARTIFACTS", "test-artifacts"))


def _browser() -> str:
    """The Chromium to drive, or skip saying why there is none."""
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    for name in (os.environ.get("MESHAGENT_CHROMIUM", ""), "chromium", "chromium-browser"):
        found = shutil.which(name) if name else None
        if found:
            return found
    pytest.skip(
        "no Chromium found (install the distribution's `chromium` package, or set "
        "$MESHAGENT_CHROMIUM); .ci/run installs it where it can"
    )


def test_the_console_shows_the_split_and_a_requests_stage_times(spawn_agent, model_id):
    chromium = _browser()
    from playwright.sync_api import expect, sync_playwright

    a = spawn_agent(*SMALL, name="a", wait_model=False)
    token = invite(a)
    b = spawn_agent(*SMALL, "--join", token, "--api-key", KEY, name="b", wait_model=False)
    c = spawn_agent(*SMALL, "--join", token, name="c", wait_model=False)
    auth = {"authorization": f"Bearer {KEY}"}

    def split_served():
        s = httpx.get(f"{b.url}/control/status", headers=auth, timeout=10).json()
        p = s["placement"][model_id]
        return p["routable"] and len(p["stages"]) == 3

    wait_for(split_served, timeout=120)
    status = httpx.get(f"{b.url}/control/status", headers=auth, timeout=10).json()
    ranges = [f"{start}-{end}" for _, start, end in status["placement"][model_id]["stages"]]
    assert len({a.data_dir, b.data_dir, c.data_dir}) == 3

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{b.url}/console")
            # The page holds nothing without the key: it asks for it.
            expect(page.locator("#login")).to_be_visible(timeout=10_000)
            assert "Bearer" not in page.url and KEY not in page.url
            page.fill("#key", KEY)
            page.click("#login button")
            expect(page.locator("#console")).to_be_visible(timeout=10_000)
            expect(page.locator("#peer-count")).to_have_text("(3 peers)", timeout=15_000)
            expect(page.locator("#graph g.node")).to_have_count(3)
            # peers by name, the id after, as `meshagent peers` writes them
            auth = {"Authorization": f"Bearer {KEY}"}
            st = httpx.get(f"{b.url}/control/status", headers=auth, timeout=10).json()
            mine = f"{st['name']} ({st['peer_id'][:12]}) (this agent)"
            expect(page.locator("#peers")).to_contain_text(mine)
            expect(page.locator("#plans td.layers")).to_have_text(ranges, timeout=15_000)
            # The mesh's catalogue: the embedded default, which the first agent pinned.
            catalogued = page.locator(f'#catalogue tr[data-model="{model_id}"]')
            expect(catalogued).to_contain_text("pinned", timeout=15_000)

            client = OpenAI(base_url=f"{b.url}/v1", api_key=KEY, max_retries=0, timeout=120)
            client.chat.completions.create(
                model=model_id,
                messages=[{"role": "user", "content": "Name a river."}],
                max_tokens=16,
            )
            answered = time.monotonic()
            row = page.locator("#requests tr.request").first
            expect(row.locator(".stage-ms")).to_have_count(3, timeout=2_000)
            shown = time.monotonic() - answered
            assert shown <= 2.0, shown
            for i, text in enumerate(row.locator(".stage-ms").all_inner_texts()):
                assert ranges[i] in text and " ms" in text and "- ms" not in text, text
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "console.png"), full_page=True)
            page.emulate_media(color_scheme="dark")
            page.screenshot(path=str(ARTIFACTS / "console-dark.png"), full_page=True)
        finally:
            browser.close()


def test_the_console_says_why_nothing_is_served_and_that_the_agent_is_alone(spawn_agent):
    # Too little memory for the model, and told of a peer where nothing listens: the console
    # says both, in the words `meshagent status` uses.
    chromium = _browser()
    import socket

    from playwright.sync_api import expect, sync_playwright

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{s.getsockname()[1]}"
    agent = spawn_agent("--max-memory", "80M", "--peer", nowhere, wait_model=False)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(f"{agent.url}/console")
            expect(page.locator("#models")).to_contain_text("not served: ", timeout=20_000)
            expect(page.locator("#alone")).to_be_visible(timeout=60_000)
            status = httpx.get(f"{agent.url}/control/status", timeout=10).json()
            [p] = status["placement"].values()
            expect(page.locator("#models")).to_contain_text(f"not served: {p['error']}")
            expect(page.locator("#alone")).to_have_text(status["alone"])
            assert nowhere in status["alone"]
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "console-not-served.png"), full_page=True)
        finally:
            browser.close()

"""The live console in a real browser (Debian's chromium, headless, driven by selenium):
sign in with a token, see the four instances with their blocks, the observed TTFT beside the
predicted one and their chart (from the gateways' outcomes on the log), explain a request id,
and a screenshot of what an operator sees.

Needs ``chromium`` and ``chromium-driver`` (apt); deselect with ``-m "not browser"``.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from pydantic import SecretStr

from conductor.admin.api import create_app
from schemas import BlocksStored, Heartbeat, RequestOutcome, RoutingDecision, encode, envelope
from state.redis_view import RedisViewStore
from streams import kafka
from streams.topics import topics

pytestmark = [pytest.mark.integration, pytest.mark.browser]

TOKEN = "console-token-0123456789"
# The demo's cluster: two prefill and two decode emulated instances.
INSTANCES = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode", "decode-1": "decode"}
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
         "--disable-component-update", "--disable-sync", "--window-size=1400,900")


def _browser(profile_dir: Path):
    chromium = shutil.which("chromium")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.fail("the browser test needs Debian's chromium: apt-get install -y chromium chromium-driver "
                    "(or deselect it with -m 'not browser')")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for f in FLAGS:
        opts.add_argument(f)
    opts.add_argument(f"--user-data-dir={profile_dir}")  # empty: no state from any earlier run
    return webdriver.Chrome(service=Service(driver), options=opts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _served(settings, now: int) -> None:
    """Three requests a gateway served, their decisions and outcomes on the log."""
    t = topics(settings.topic_config())
    await kafka.ensure_topics(settings.kafka(), t.all())
    prod = kafka.producer(settings.kafka())
    await prod.start()
    try:
        for i, ttft in enumerate((0.8, 1.2, 1.6)):
            rid = f"served-{i}"
            await prod.send_and_wait(t.dispatch.name, encode(envelope(
                RoutingDecision(request_id=rid, prefill_instance="prefill-0", decode_instance="decode-0",
                                reused_tokens=16, predicted_ttft_s=0.5, predicted_tbt_ms=10, policy="kvcache-centric"),
                producer_id="router", producer_seq=i, ts_ms=now)), key=b"prefill-0")
            await prod.send_and_wait(t.request_outcomes.name, encode(envelope(
                RequestOutcome(request_id=rid, gateway="gw", status=200, prefill_instance="prefill-0",
                               prompt_tokens=500, cached_tokens=16, predicted_ttft_s=0.5, ttft_s=ttft),
                producer_id="gw", producer_seq=i, ts_ms=now)), key=rid.encode())
    finally:
        await prod.stop()


async def test_console_shows_four_instances_with_blocks(settings, tmp_path):
    now = int(time.time() * 1000)
    view = RedisViewStore.connect(settings.redis(), settings.view_namespace)
    records = []
    for i, (node, role) in enumerate(INSTANCES.items()):
        records.append((envelope(Heartbeat(role=role, total_kv_blocks=1000, free_kv_blocks=600, queue_depth=i),
                                 producer_id=node, producer_seq=0, ts_ms=now), None))
        records.append((envelope(BlocksStored(block_keys=list(range(100 * i + 1, 100 * i + 11 + i))),
                                 producer_id=node, producer_seq=1, ts_ms=now), None))
    await view.apply(records)
    await view.close()

    s = settings.model_copy(update={"admin_token": SecretStr(TOKEN), "heartbeat_ttl_s": 3600.0})
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(s), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    (tmp_path / "profile").mkdir()
    browser = _browser(tmp_path / "profile")
    try:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support import expected_conditions as ec
        from selenium.webdriver.support.ui import WebDriverWait

        wait = WebDriverWait(browser, 20)
        while not server.started:
            await asyncio.sleep(0.05)
        browser.get(f"http://127.0.0.1:{port}/")
        # Unauthenticated: the sign-in page, no data.
        wait.until(ec.presence_of_element_located((By.ID, "token"))).send_keys(TOKEN)
        browser.find_element(By.CSS_SELECTOR, "#login button").click()
        wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#nodes tr.node")) == 4)
        # One read of the whole table (the page redraws it every second).
        rows = browser.execute_script(
            "return Array.from(document.querySelectorAll('#nodes tr.node'))"
            ".map(r => [r.dataset.node, Array.from(r.cells).map(c => c.textContent)]);")
        rows = dict(rows)
        assert set(rows) == set(INSTANCES)
        for node, cells in rows.items():
            assert cells[1] == INSTANCES[node] and cells[2] == "yes"
            assert int(cells[7]) > 0, f"{node} shows no HBM blocks: {cells}"
            assert cells[6] == "40.0%"  # KV use from the heartbeat
        assert browser.find_element(By.ID, "live").text == "4 / 4"
        # Observed TTFT from the outcomes (it stayed "-" when the feed did not read them), and the chart.
        await _served(settings, int(time.time() * 1000))
        wait.until(lambda b: b.find_element(By.ID, "ttft").text == "0.50 / 1.20")
        points = browser.execute_script(
            "return ['predicted_ttft_p50_s', 'observed_ttft_p50_s'].map(k => "
            "document.querySelector('#ttft-chart polyline[data-series=' + k + ']').getAttribute('points'));")
        assert all(p.strip() for p in points), points
        headers = browser.execute_script("return Array.from(document.querySelectorAll('#nodes th')).map(h => h.textContent);")
        assert "reuse (tokens)" in headers and "requests with a hit" in headers
        assert browser.find_element(By.ID, "err").text == ""

        browser.find_element(By.ID, "rid").send_keys("no-such-request")
        browser.find_element(By.CSS_SELECTOR, "#explain-form button").click()
        wait.until(lambda b: "no decision" in b.find_element(By.ID, "explain-out").text)

        shot = tmp_path / "console.png"
        assert browser.save_screenshot(str(shot))
        png = shot.read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    finally:
        browser.quit()
        server.should_exit = True
        thread.join(10)

"""The web console in a real headless browser (Debian's chromium, driven by Selenium) against a
running 2-node mesh: the page loads, shows both members and the plan, and a chat message streams
an answer from the mesh; against a node holding two models, it shows each model's plan. A page
from another origin, and one reaching the API through a rebound DNS name, can neither read the
mesh's status nor spend its compute; under a name the operator allows, the console works.

`scripts/setup` installs chromium and its driver where they are missing; without them this
test fails (it does not skip): the console is part of the product.
"""

from __future__ import annotations

import http.server
import pathlib
import re
import secrets
import shutil
import threading
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from meshd.cli.supervisor import settled_plan, stage_budget, started, stop_all, wait_until
from meshd.model.builtin import builtin_model_dir
from tests.node.daemons import SECRET, Daemon
from tests.node.test_several_models import SECOND, second_checkpoint

pytestmark = pytest.mark.slow

# Where Debian's packages put them (`apt-get install chromium chromium-driver`).
CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
DRIVER = "chromedriver"
OPERATORS_NAME = "console.test"


def browser(resolve: dict[str, str] | None = None) -> WebDriver:
    """A headless chromium; fails with the command that installs it when it is missing.

    `resolve`: host names the browser resolves to the given addresses (a DNS rebinding's
    second answer)."""
    binary = next((path for name in CHROMIUM if (path := shutil.which(name))), None)
    driver = shutil.which(DRIVER) or (
        "/usr/lib/chromium/chromedriver"
        if pathlib.Path("/usr/lib/chromium/chromedriver").exists()
        else None
    )
    if binary is None or driver is None:
        pytest.fail("no chromium/chromedriver: run scripts/setup (apt-get install chromium "
                    "chromium-driver)")  # fmt: skip
    options = Options()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1000", "--no-first-run", "--no-proxy-server",
                 # nothing reaches out from here: no background fetches to be refused
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-quic"):  # fmt: skip
        options.add_argument(flag)
    if resolve:
        rules = ", ".join(f"MAP {name} {address}" for name, address in resolve.items())
        options.add_argument(f"--host-resolver-rules={rules}")
        options.add_argument("--disable-features=HttpsUpgrades")  # plain http, as attacked
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Daemon]]:
    tmp = tmp_path_factory.mktemp("console")
    budget = stage_budget(str(builtin_model_dir()), 2)
    # The first also answers to a name of the operator's (resolved by the browser alone).
    named = ("--api-allowed-hosts", OPERATORS_NAME)
    daemons = [Daemon(tmp, i, secret=SECRET, budget=budget, extra=named if i == 120 else ())
               for i in (120, 121)]  # fmt: skip
    try:
        started(daemons)
        wait_until(lambda: settled_plan(daemons) is not None, 60, "a settled plan")
        yield daemons
    finally:
        stop_all(daemons)


def test_the_console_shows_the_mesh_and_streams_a_chat_answer(mesh: list[Daemon]) -> None:
    url = mesh[0].api_url.removesuffix("/v1") + "/"
    names = {d.status()["name"] for d in mesh}
    driver = browser()
    try:
        driver.get(url)
        wait = WebDriverWait(driver, 30)

        def member_rows(d: WebDriver) -> list[str]:
            return [row.text for row in d.find_elements(By.CSS_SELECTOR, "#members tbody tr")]

        # Both members appear, alive, each with its stage, and the plan lists two stages.
        wait.until(lambda d: len(member_rows(d)) == 2)
        rows = member_rows(driver)
        assert all(any(name in row for row in rows) for name in names), rows
        assert all("alive" in row for row in rows), rows
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#plan tbody tr")) == 2)
        assert "2 stage(s)" in driver.find_element(By.ID, "plan-summary").text
        assert driver.find_element(By.ID, "state").text == "serving"

        # A chat message streams an answer: text grows while the request runs, then it ends.
        driver.find_element(By.ID, "prompt").send_keys("Once upon a time")
        driver.find_element(By.ID, "send").click()
        answer = "#transcript .msg.assistant"
        WebDriverWait(driver, 120).until(
            lambda d: d.find_element(By.CSS_SELECTOR, answer).get_attribute("data-done")
        )
        message = driver.find_element(By.CSS_SELECTOR, answer)
        assert message.get_attribute("data-done") == "yes", message.text
        final = message.find_element(By.CSS_SELECTOR, ".text").text
        assert len(final.split()) >= 5, final
        # The page read the answer as a stream: several deltas, each appended as it came. How
        # many depends on how many tokens each verify window committed (speculation's widths
        # move with the load), so the claim is "more than one", not a count.
        stats = message.find_element(By.CSS_SELECTOR, ".stats").text
        chunks = re.match(r"(\d+) chunks in", stats)
        assert chunks is not None and int(chunks.group(1)) >= 2, stats
        # The live tiles count what was generated.
        wait.until(lambda d: d.find_element(By.ID, "generated").text not in ("–", "0"))
    finally:
        driver.quit()


# A page of another site: it tries to read the mesh's status and, with a request a browser sends
# without asking the server first (no-cors, text/plain), to spend the mesh's compute.
ATTACK_PAGE = """<!doctype html><meta charset="utf-8"><pre id="out"></pre><script>
(async () => {
  const api = "%(api)s", out = {};
  try {
    const r = await fetch(api + "/v1/mesh/status");
    out.status = "read " + r.status + ": " + (await r.text()).slice(0, 80);
  } catch (e) { out.status = "failed: " + e.name; }
  const chat = {model: "meshd-builtin", max_tokens: 8, meshd: {ignore_eos: true},
                messages: [{role: "user", content: "spend the mesh's compute"}]};
  try {
    const r = await fetch(api + "/v1/chat/completions", {method: "POST", mode: "no-cors",
      headers: {"Content-Type": "text/plain"}, body: JSON.stringify(chat)});
    out.post = "sent: " + r.type;
  } catch (e) { out.post = "failed: " + e.name; }
  document.getElementById("out").textContent = JSON.stringify(out);
})();
</script>"""


def test_a_page_from_another_origin_can_neither_read_the_mesh_nor_spend_it(
    mesh: list[Daemon],
) -> None:
    api = mesh[0].api_url.removesuffix("/v1")
    page = (ATTACK_PAGE % {"api": api}).encode()

    class Site(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, format: str, *args: object) -> None:
            pass

    # Another origin: another address and port on this machine.
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Site)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    before = _api_counts(api)
    port = api.rsplit(":", 1)[1]
    driver = browser(resolve={"rebound.example": mesh[0].host, OPERATORS_NAME: mesh[0].host})
    try:
        driver.get(f"http://127.0.0.1:{site.server_address[1]}/")
        out = WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "out").text or None)
        # The status read fails in the browser; the POST goes out (opaque), and the server
        # refuses it: 403 for its Origin, nothing generated.
        assert '"status":"failed: TypeError"' in out, out
        assert '"post":"sent: opaque"' in out, out
        after = _api_counts(api)
        assert after["chat 403"] == before["chat 403"] + 1, (before, after)
        assert after["other 403"] == before["other 403"] + 1, (before, after)
        assert after["prompt tokens"] == before["prompt tokens"], (before, after)

        # DNS rebinding: the attacker's name now resolves to the API, so the page is
        # same-origin with it; the API refuses the name.
        driver.get(f"http://rebound.example:{port}/")
        assert "host_not_allowed" in driver.find_element(By.TAG_NAME, "body").text
        status = driver.execute_async_script(
            "const done = arguments[0];"
            "fetch('/v1/mesh/status').then(r => done(r.status), e => done(String(e)));"
        )
        assert status == 403
        assert _api_counts(api)["prompt tokens"] == before["prompt tokens"]

        # A name in api_allowed_hosts serves the console, which reads the mesh from there.
        driver.get(f"http://{OPERATORS_NAME}:{port}/")
        WebDriverWait(driver, 30).until(
            lambda d: len(d.find_elements(By.CSS_SELECTOR, "#members tbody tr")) == 2
        )
    finally:
        driver.quit()
        site.shutdown()
        site.server_close()


def _api_counts(api: str) -> dict[str, float]:
    """Refused chat and other requests, and prompt tokens run, from the node's `/metrics`."""
    counts = {"chat 403": 0.0, "other 403": 0.0, "prompt tokens": 0.0}
    text = httpx.get(f"{api}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "meshd_api_requests_total" and sample.labels["status"] == "403":
                route = "chat" if sample.labels["route"] == "/v1/chat/completions" else "other"
                counts[f"{route} 403"] += sample.value
            elif sample.name == "meshd_api_prompt_tokens_total":
                counts["prompt tokens"] += sample.value
    return counts


def test_the_console_shows_every_models_plan(tmp_path: pathlib.Path) -> None:
    # One node holding two models: the page shows each model's plan and offers both for chat.
    second = second_checkpoint(tmp_path / SECOND)
    budget = 4 * stage_budget(str(second), 1)
    # A mesh of its own: the 2-node mesh of the test above may still run on this machine.
    node = Daemon(tmp_path, 122, secret="console-models-" + secrets.token_hex(8), budget=budget, extra=("--model", "",
                  "--model", str(second)))  # fmt: skip
    try:
        started([node])
        wait_until(lambda: _both_planned(node), 60, "both models planned")
        driver = browser()
        try:
            driver.get(node.api_url.removesuffix("/v1") + "/")
            wait = WebDriverWait(driver, 30)
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#plan tbody tr")) == 1)
            assert "1 stage(s)" in driver.find_element(By.ID, "plan-summary").text
            other = "#other-plans .model-plan"
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, other)) == 1)
            section = driver.find_element(By.CSS_SELECTOR, other)
            assert section.find_element(By.TAG_NAME, "h3").text.startswith(f"{SECOND} (")
            assert "1 stage(s)" in section.text
            assert len(section.find_elements(By.CSS_SELECTOR, "tbody tr")) == 1
            options = driver.find_elements(By.CSS_SELECTOR, "#model option")
            assert {o.text for o in options} == {"meshd-builtin", SECOND}
        finally:
            driver.quit()
    finally:
        stop_all([node])


def _both_planned(node: Daemon) -> bool:
    status = node.try_status()
    return status is not None and len([m for m in status["models"] if m["plan"]]) == 2

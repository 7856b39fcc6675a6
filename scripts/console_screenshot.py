#!/usr/bin/env python3
"""The web console's picture in docs/api.md: two daemons on loopback, one chat, a screenshot.

    .venv/bin/python scripts/console_screenshot.py                 # writes docs/img/console.png
    .venv/bin/python scripts/console_screenshot.py --out /tmp/c.png

Needs Debian's chromium and chromium-driver (`scripts/setup` installs them).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from meshd.cli.supervisor import (
    LoopbackDaemon,
    agreed_plan,
    fresh_secret_file,
    stage_budget,
    started,
    stop_all,
)
from meshd.model.builtin import builtin_model_dir

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img" / "console.png")
    parser.add_argument("--prompt", default="Once upon a time")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="meshd-console-"))
    secret = fresh_secret_file(work)
    budget = stage_budget(str(builtin_model_dir()), 2)
    daemons = [
        LoopbackDaemon(work, f"n{i}", f"127.0.0.{130 + i}", secret, budget, None) for i in (1, 2)
    ]
    options = Options()
    options.binary_location = shutil.which("chromium") or "chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--window-size=1400,1250", "--no-proxy-server",
                 # nothing reaches out from here: no background fetches to be refused
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-quic"):  # fmt: skip
        options.add_argument(flag)
    try:
        started(daemons)
        agreed_plan(daemons, 60, 0.5)
        driver = webdriver.Chrome(
            service=Service(shutil.which("chromedriver") or "chromedriver"), options=options
        )
        try:
            driver.get(daemons[0].api_url.removesuffix("/v1") + "/")
            wait = WebDriverWait(driver, 60)
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#members tbody tr")) == 2)
            driver.find_element(By.ID, "prompt").send_keys(args.prompt)
            driver.find_element(By.ID, "send").click()
            answer = "#transcript .msg.assistant"
            wait.until(lambda d: d.find_element(By.CSS_SELECTOR, answer).get_attribute("data-done"))
            time.sleep(2.5)  # two more polls, so the tokens/s tile shows the chat's rate
            args.out.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(args.out))
            print(f"wrote {args.out}")
        finally:
            driver.quit()
    finally:
        stop_all(daemons)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

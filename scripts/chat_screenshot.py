"""A screenshot of the chat page (README's docs/images/chat.png): serve a checkpoint on a free
loopback port, type the messages into the page in headless Chromium, wait for each streamed reply,
save a PNG.

    python scripts/chat_screenshot.py --checkpoint runs/sft-demo --out docs/images/chat.png \
        --message "HAMLET: To be, or not to be: that is the question: Who speaks next?"
"""

from __future__ import annotations

import argparse
import shutil
import socket
import threading
import time

import uvicorn
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from llm_foundry.serve import load_served
from llm_foundry.serve.app import create_app


def finished(browser) -> int:
    """How many replies the page shows as finished (an error counts: it ends the turn too)."""
    done = browser.find_elements(By.CSS_SELECTOR, ".message.assistant[data-state=done]")
    return len(done) + len(browser.find_elements(By.CSS_SELECTOR, ".message.error"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--message", action="append", required=True, help="repeatable: one per turn")
    ap.add_argument("--temperature", default="0")
    ap.add_argument("--max-tokens", default="", help="empty: to the end of the context")
    ap.add_argument("--size", default="1000,620", help="window width,height")
    args = ap.parse_args()

    served = load_served(args.checkpoint)
    served.engine.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(served), log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    time.sleep(1.0)

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={args.size}"):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        browser.get(f"http://127.0.0.1:{sock.getsockname()[1]}/")
        WebDriverWait(browser, 20).until(
            lambda b: b.find_elements(By.CSS_SELECTOR, "#model option")
        )
        for element_id, value in (("temperature", args.temperature),
                                  ("max-tokens", args.max_tokens)):  # fmt: skip
            field = browser.find_element(By.ID, element_id)
            field.clear()
            field.send_keys(value)
        for n, message in enumerate(args.message, 1):
            box = browser.find_element(By.ID, "input")
            box.send_keys(message)
            box.send_keys(Keys.ENTER)
            WebDriverWait(browser, 120).until(lambda b, n=n: finished(b) == n)
        browser.save_screenshot(args.out)
        print(f"wrote {args.out}")
    finally:
        browser.quit()
        server.should_exit = True
        served.engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

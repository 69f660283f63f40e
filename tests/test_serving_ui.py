"""The playground page at ``/``: its routes over HTTP (open without a key, off with ``--no-ui``), and
the page itself in a real browser, Debian's headless Chromium driven by Selenium, against a real
server on 127.0.0.1 with the tiny model.

Nothing here downloads a browser or a driver: Selenium is pointed at ``/usr/bin/chromedriver``, so
Selenium Manager is never asked; without Chromium the browser tests skip, saying how to install it.
"""

import argparse
import os
import re
import time

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from gptj_flax.serving import settings as serve_settings
from gptj_flax.serving import ui
from gptj_flax.serving.auth import NO_KEY
from tests.test_serving_support import (
    KEYS,
    HeldModel,
    RunningServer,
    no_key_leaks,  # noqa: F401 - the autouse leak scan
    secret,
    tiny_model,
    wait_until,
    write_keys,
)

# The module's first server compiles every serving program of the tiny model before it is healthy (the
# later ones reuse them): that alone can take over 60 s on a busy 2-core machine.
pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
INSTALL = "apt-get install -y chromium chromium-driver"
MAX_BATCH = 2  # every server of the module: one set of compiled programs
PROMPTS = ["def add(a, b):", "class Point", "for i in range(", "import os", "The quick brown fox"]
BEARER = {"Authorization": f"Bearer {KEYS[0]}"}
WAIT_S = 120
STOP_STEP_S = 0.5  # each decode step of the Stop test, held back so that the request is still running


@pytest.fixture(scope="module")
def held():
    return HeldModel(tiny_model())


@pytest.fixture(scope="module")
def server(held):
    with RunningServer(held, max_batch=MAX_BATCH) as running:
        yield running


@pytest.fixture(scope="module")
def keyed(held, tmp_path_factory):
    keys = tmp_path_factory.mktemp("ui-keys") / "keys.txt"
    write_keys(keys)
    with RunningServer(held, max_batch=MAX_BATCH, api_keys_file=str(keys)) as running:
        yield running


# -- the routes, over HTTP ------------------------------------------------------------------------------
def test_the_page_is_open_without_a_key_and_the_api_is_not(keyed):
    with httpx.Client(base_url=keyed.url, timeout=60) as http:
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
        assert page.headers["content-security-policy"] == ui.CONTENT_SECURITY_POLICY
        assert '<script src="ui/playground.js"' in page.text
        for path, (_, media_type) in ui.PAGE_FILES.items():
            assert http.get(path).headers["content-type"] == media_type, path
        assert "http://" not in page.text and "https://" not in page.text  # nothing from elsewhere
        assert http.get("/v1/models").status_code == 401  # the API still needs a key
        assert http.get("/ui/other.js").status_code == 401  # as every unknown path
        assert "/" not in http.get("/openapi.json", headers=BEARER).json()["paths"]
        (card,) = http.get("/v1/models", headers=BEARER).json()["data"]
        assert (card["dtype"], card["quantization"]) == ("float32", None)


def test_no_ui_turns_the_page_off(held, monkeypatch):
    parser = argparse.ArgumentParser()
    serve_settings.add_arguments(parser)
    assert serve_settings.settings_from(parser.parse_args(["--checkpoint", "c", "--no-ui"]), {}).no_ui
    assert serve_settings.settings_from(None, {"GPTJ_FLAX_CHECKPOINT": "c", "GPTJ_FLAX_NO_UI": "1"}).no_ui
    assert not serve_settings.settings_from(None, {"GPTJ_FLAX_CHECKPOINT": "c"}).no_ui
    with RunningServer(held, max_batch=MAX_BATCH, no_ui=True) as off:
        with httpx.Client(base_url=off.url, timeout=60) as http:
            assert [http.get(path).status_code for path in ui.PAGE_FILES] == [404] * len(ui.PAGE_FILES)
            assert http.get("/health").status_code == 200


# -- the page, in Chromium ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        missing = f"no Chromium at {CHROMIUM} with its driver at {CHROMEDRIVER}: install them with `{INSTALL}`"
        if os.environ.get("CI"):  # .ci/run installs them: there the page must be tested
            pytest.fail(missing)
        pytest.skip(missing)
    os.environ["SE_OFFLINE"] = "true"  # were Selenium Manager ever asked, it would not download anything
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,800",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, condition, what: str, timeout_s: float = WAIT_S):
    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.05).until(lambda d: condition())
    except TimeoutException:
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}") from None


def text_of(driver, element_id: str) -> str:
    """An element's text exactly as the page holds it (Selenium's ``.text`` folds white space)."""
    return driver.execute_script("return document.getElementById(arguments[0]).textContent", element_id)


def open_page(driver, url: str, ready: str = "float32") -> None:
    driver.get(url + "/")
    wait_for(driver, lambda: ready in text_of(driver, "model"), f"the model line to say {ready!r}")
    driver.get_log("browser")  # start each test with an empty console


def fill(driver, element_id: str, text: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(text)


def set_greedy(driver, max_tokens: int) -> None:
    driver.find_element(By.ID, "temperature").send_keys(Keys.HOME)  # the slider's lowest value, 0
    assert text_of(driver, "temperature-value") == "0"
    fill(driver, "max-tokens", str(max_tokens))


def finished(driver) -> bool:
    return driver.find_element(By.ID, "generate").is_enabled() and text_of(driver, "stats") != ""


def console_errors(driver) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def greedy(url: str, prompt: str, max_tokens: int) -> dict:
    """The server's greedy choice for ``prompt``, asked over the API as any client would."""
    with httpx.Client(base_url=url, timeout=60) as http:
        answer = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def test_the_page_streams_the_greedy_completion_and_colours_its_tokens(server, browser):
    open_page(browser, server.url)
    prompt = PROMPTS[0]
    fill(browser, "prompt", prompt)
    set_greedy(browser, 12)
    browser.find_element(By.ID, "generate").click()
    wait_for(browser, lambda: finished(browser), "the generation to end")

    assert text_of(browser, "echo") == prompt
    assert text_of(browser, "completion") == greedy(server.url, prompt, 12)["text"]
    assert browser.find_element(By.ID, "error").is_displayed() is False

    # Coloured, each token is a span whose band follows its probability; a hover lists the alternatives.
    browser.find_element(By.ID, "colour").click()
    tokens = browser.find_elements(By.CSS_SELECTOR, "#completion .tok")
    assert len(tokens) >= 1 and "".join(t.get_attribute("textContent") for t in tokens) == text_of(
        browser, "completion"
    )
    assert all(any(f"p{band}" in t.get_attribute("class").split() for band in range(5)) for t in tokens)
    webdriver.ActionChains(browser).move_to_element(tokens[0]).perform()
    tip = browser.find_element(By.ID, "tip")
    wait_for(browser, tip.is_displayed, "the alternatives to show")
    assert len(tip.find_elements(By.CSS_SELECTOR, "tr")) >= 5 and tip.find_elements(By.CSS_SELECTOR, "tr.chosen")

    # Everything the page loaded came from this server, and nothing broke the console.
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(url.startswith(server.url + "/") for url in loaded), loaded
    assert console_errors(browser) == []


def test_stop_mid_stream_frees_the_slot(held, server, browser):
    # A prompt whose greedy completion runs the full 40 tokens: stopped, the page must show less.
    prompt, full = next(
        (p, choice["text"]) for p in PROMPTS if (choice := greedy(server.url, p, 40))["finish_reason"] == "length"
    )
    open_page(browser, server.url)
    fill(browser, "prompt", prompt)
    set_greedy(browser, 40)
    metrics = httpx.Client(base_url=server.url, timeout=60)
    held.step_delay_s = STOP_STEP_S  # run to its end, the request would hold its slot for 40 steps
    try:
        browser.find_element(By.ID, "generate").click()
        wait_for(browser, lambda: text_of(browser, "completion") != "", "the first streamed text")
        assert "gptj_busy_slots 1.0" in metrics.get("/metrics").text
        started = held.decode_calls
        browser.find_element(By.ID, "stop").click()
        # Freed well before the 40 steps could have run out on their own: the page cancelled the request.
        wait_until(lambda: "gptj_busy_slots 0.0" in metrics.get("/metrics").text, 10 * STOP_STEP_S, "the slot freed")
        calls = held.decode_calls
        assert calls - started < 20
        time.sleep(2 * STOP_STEP_S)
        assert held.decode_calls == calls  # nothing runs on for the stopped request
    finally:
        held.step_delay_s = 0.0
        metrics.close()
    wait_for(browser, lambda: finished(browser), "the page to take the stop")
    assert text_of(browser, "stats").endswith("stopped")
    shown = text_of(browser, "completion")
    assert shown and full.startswith(shown) and shown != full


def refusals(http: httpx.Client) -> float:
    """The 401s /v1/completions has answered, as /metrics counts them."""
    found = re.search(
        r'gptj_requests_total\{endpoint="/v1/completions",status="401"\} (\S+)', http.get("/metrics").text
    )
    return float(found.group(1)) if found else 0.0


def test_a_wrong_key_shows_the_401_message_and_the_right_key_works(keyed, browser):
    open_page(browser, keyed.url, ready="needs an API key")  # the page itself needs no key
    assert browser.find_element(By.ID, "key-box").is_displayed()
    error = browser.find_element(By.ID, "error")
    assert not error.is_displayed()
    fill(browser, "prompt", PROMPTS[1])
    set_greedy(browser, 4)
    fill(browser, "key", secret("sk-wrong-0000000000000"))
    http = httpx.Client(base_url=keyed.url, timeout=60)
    before = refusals(http)
    browser.find_element(By.ID, "generate").click()
    wait_for(browser, error.is_displayed, "the refusal")
    assert error.text == f"401: {NO_KEY}" and text_of(browser, "completion") == ""
    wait_until(lambda: refusals(http) == before + 1, 30, "the server to count the page's refused completion")
    http.close()

    fill(browser, "key", KEYS[1] + Keys.TAB)
    wait_for(browser, lambda: "float32" in text_of(browser, "model"), "the model line with the right key")
    browser.find_element(By.ID, "generate").click()
    wait_for(browser, lambda: finished(browser) and text_of(browser, "completion"), "a completion")
    assert not error.is_displayed()
    # The key is kept in memory only: nothing stored, and a reload forgets it.
    assert browser.execute_script("return [localStorage.length, sessionStorage.length, document.cookie]") == [0, 0, ""]
    browser.refresh()
    wait_for(browser, lambda: "needs an API key" in text_of(browser, "model"), "the reloaded page to ask again")
    assert browser.find_element(By.ID, "key").get_attribute("value") == ""


def test_the_page_fits_a_phone(server, browser):
    browser.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride", {"width": 390, "height": 844, "deviceScaleFactor": 1, "mobile": True}
    )
    try:
        open_page(browser, server.url)
        width = browser.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
        assert width[0] <= width[1], width  # nothing scrolls sideways
        generate = browser.find_element(By.ID, "generate").rect
        assert generate["x"] >= 0 and generate["x"] + generate["width"] <= 390 and generate["height"] >= 40
        settings = browser.find_element(By.CSS_SELECTOR, "aside.settings").rect
        assert settings["y"] > generate["y"]  # one column: the settings come under the prompt
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})

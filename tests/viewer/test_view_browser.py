"""``rlhf view`` in a real browser: headless Chromium (the distribution's package, driven by
selenium and chromium-driver) opens the page and checks what a person sees: the curves drawn,
the table filtered, the token view of an agent's two turns with the tool's output, a prompt's
samples run against run at each step, markup from a sample shown as text, the keys, and the
export opened from a file with the network off.
Screenshots go to the test's tmp folder (``<tmp>/shots/*.png``).

Without Chromium these tests are skipped, unless ``RLHF_REQUIRE_BROWSER=1`` (CI sets it, and
installs the browser first: .ci/run), where a missing browser fails them.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from rlhf.viewer.export import export_html
from rlhf.viewer.runs import open_runs
from rlhf.viewer.server import ViewServer
from tests.viewer.synthetic import SCRIPT, write_run

pytestmark = pytest.mark.run

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
ARGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run", "--window-size=1400,1000")


def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    for path, package in ((CHROMIUM, "chromium"), (DRIVER, "chromium-driver")):
        if not Path(path).is_file():
            return f"{path} is missing (apt-get install {package})"
    return None


@pytest.fixture(scope="module")
def browser():
    missing = _browser_missing()
    if missing:
        if os.environ.get("RLHF_REQUIRE_BROWSER"):
            pytest.fail(f"RLHF_REQUIRE_BROWSER is set but {missing}")
        pytest.skip(f"no browser for the viewer's page: {missing}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ARGS:
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture
def shots(tmp_path):
    folder = tmp_path / "shots"
    folder.mkdir()
    return folder


@pytest.fixture
def served(tmp_path):
    runs = [write_run(tmp_path / "run-a", steps=5), write_run(tmp_path / "run-b", steps=4, tokens=False)]
    server = ViewServer(open_runs(runs))
    server.start()
    yield server
    server.shutdown()
    server.server_close()


def wait(driver, condition, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(condition)
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for: {condition}")


def open_page(driver, url):
    driver.get(url)
    assert wait(driver, "return document.body.dataset.ready") == "1", driver.find_element("id", "status").text


def rows(driver):
    return driver.execute_script("return [...document.querySelectorAll('#samples tbody tr[data-index]')]"
                                 ".map(r => Number(r.dataset.index))")


def press(driver, key):
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(driver).send_keys(key).perform()


def test_the_page_draws_the_curves_of_every_run_and_the_last_step(browser, served, shots):
    open_page(browser, served.url)
    browser.save_screenshot(str(shots / "page.png"))
    charts = browser.execute_script("return [...document.querySelectorAll('.chart')].map(c => c.dataset.metric)")
    assert charts[:4] == ["reward/mean", "kl/mean", "response/length_mean", "policy/loss"]
    lines = browser.execute_script("""return [...document.querySelectorAll('.chart[data-metric="reward/mean"] path.line')]
        .map(p => [p.getAttribute('stroke'), p.getTotalLength(), p.getAttribute('d').split('L').length])""")
    assert len(lines) == 2 and all(length > 50 for _, length, _ in lines)  # one drawn line per run
    assert [points for *_, points in lines] == [5, 4]
    assert browser.execute_script("return document.querySelectorAll('.chart line.cursor').length") == len(charts)
    assert browser.find_element("id", "step-input").get_attribute("value") == "5"
    assert rows(browser) == [0, 1, 2, 3, 4, 5]
    # a curve added from the picker
    browser.execute_script("const s = document.getElementById('add-metric'); s.value = 'lr';"
                           "s.dispatchEvent(new Event('change'))")
    wait(browser, "return document.querySelector('.chart[data-metric=\"lr\"] path.line')")


def test_markup_in_a_sample_is_shown_as_text(browser, served, shots):
    open_page(browser, served.url)
    browser.find_element("css selector", "#samples tr[data-index='1']").click()
    browser.save_screenshot(str(shots / "script.png"))
    assert browser.execute_script("return window.__pwned") is None
    assert browser.execute_script("return document.querySelectorAll('#detail script, #detail img, #samples img').length") == 0
    assert browser.find_element("id", "completion-text").text == SCRIPT
    assert SCRIPT[:40] in browser.find_element("css selector", "#samples tr[data-index='1']").text


def test_the_table_sorts_and_filters(browser, served):
    open_page(browser, served.url)
    reward_header = browser.find_element("xpath", "//th[starts-with(., 'reward')]")
    reward_header.click()  # highest first
    assert rows(browser) == [0, 5, 4, 3, 2, 1]
    reward_header = browser.find_element("xpath", "//th[starts-with(., 'reward')]")
    reward_header.click()
    assert rows(browser) == [1, 2, 3, 4, 5, 0]
    field = browser.find_element("id", "f-min")
    field.send_keys("0.5")
    assert sorted(rows(browser)) == [0, 3, 4, 5]
    field.clear()
    field.send_keys(" ")
    browser.execute_script("const f = document.getElementById('f-min'); f.value = '';"
                           "f.dispatchEvent(new Event('input'))")
    browser.execute_script("const s = document.getElementById('f-outcome'); s.value = 'failed';"
                           "s.dispatchEvent(new Event('input'))")
    assert rows(browser) == [5]
    browser.execute_script("const s = document.getElementById('f-outcome'); s.value = '';"
                           "s.dispatchEvent(new Event('input'))")
    search = browser.find_element("id", "f-text")
    search.send_keys("answer [24] at")
    assert rows(browser) == []  # plain text: the brackets are characters
    browser.find_element("id", "f-regex").click()
    assert sorted(rows(browser)) == [2, 4]
    assert browser.find_element("id", "f-count").text == "2 of 6"


def test_the_token_view_of_a_multi_turn_sample_shows_its_turns_and_values(browser, served, shots):
    open_page(browser, served.url)
    browser.find_element("css selector", "#samples tr[data-index='0']").click()
    turns = browser.execute_script("return [...document.querySelectorAll('#tokens .turn')].map(t => t.dataset.kind)")
    assert turns == ["policy", "template", "tool", "template", "policy"]
    tool = browser.find_element("css selector", "#tokens .turn.tool")
    assert "42" in tool.text and "TOOL" in tool.text.upper()
    tokens = browser.find_elements("css selector", "#tokens .tok")
    assert len(tokens) == 12
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(browser).move_to_element(tokens[1]).perform()
    info = browser.find_element("id", "token-info").text
    assert '"calc"' in info and "log-prob (policy) -0.2" in info and "log-prob (rollout) -0.15" in info
    assert "advantage 0.5" in info and "origin model" in info and "policy version 4" in info
    colored = browser.execute_script("return [...document.querySelectorAll('#tokens .tok')].map(t => t.style.background)")
    assert all(colored)  # every token has a log-prob here, and a colour for it
    browser.save_screenshot(str(shots / "tokens-logprob.png"))
    for quantity in ("diff", "advantages", "kl", "mask", "origins", "versions"):
        browser.execute_script(f"const s = document.getElementById('quantity'); s.value = '{quantity}';"
                               "s.dispatchEvent(new Event('change'))")
        assert browser.find_element("id", "quantity").get_attribute("value") == quantity
        assert browser.find_elements("css selector", "#tokens .tok[style]"), quantity
    browser.execute_script("const s = document.getElementById('quantity'); s.value = 'origins';"
                           "s.dispatchEvent(new Event('change'))")
    browser.save_screenshot(str(shots / "tokens-origin.png"))


def test_a_plain_grpo_run_offers_the_policy_minus_rollout_colouring(browser, tiny_model_dir, task, tmp_path):
    """A real run without old log-probs or a mismatch correction (plain GRPO): tokens.jsonl has both
    log-prob columns, so the token view colours by their difference."""
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from rlhf.runtime.rl.local import train
    from tests.helpers import small_config

    run = tmp_path / "plain"
    train(small_config(tiny_model_dir, task, run, steps=1, log_tokens=2, max_new_tokens=6), plugins=build_plugin_manager())
    server = ViewServer(open_runs([run]))
    server.start()
    try:
        open_page(browser, server.url)
        browser.find_element("css selector", "#samples tr[data-index='0']").click()
        enabled = browser.execute_script("return [...document.querySelectorAll('#quantity option:not([disabled])')]"
                                         ".map(o => o.value)")
        assert {"logprobs", "rollout_logprobs", "diff"} <= set(enabled), enabled
        browser.execute_script("const s = document.getElementById('quantity'); s.value = 'diff';"
                               "s.dispatchEvent(new Event('change'))")
        assert browser.find_element("id", "quantity").get_attribute("value") == "diff"
        assert browser.find_elements("css selector", "#tokens .tok[style]")  # the policy tokens, coloured
    finally:
        server.shutdown()
        server.server_close()


def test_keys_move_between_samples_steps_and_views(browser, served):
    open_page(browser, served.url)
    press(browser, "j")
    press(browser, "j")
    assert browser.execute_script("return document.querySelector('#samples tr.selected').dataset.index") == "2"
    press(browser, "k")
    assert browser.execute_script("return document.querySelector('#samples tr.selected').dataset.index") == "1"
    press(browser, "[")
    wait(browser, "return document.getElementById('step-input').value === '4'")
    press(browser, "]")
    wait(browser, "return document.getElementById('step-input').value === '5'")
    press(browser, "g")
    wait(browser, "return document.querySelectorAll('#detail .group .card').length === 2")
    press(browser, "a")
    text = wait(browser, "const t = document.getElementById('across'); return t && t.innerText")
    assert "run-a" in text and "run-b" in text  # the same prompt in both runs
    per_run = browser.execute_script("return [0, 1].map(r => document.querySelectorAll("
                                     "`#across td[data-run='${r}'] .across-sample`).length)")
    assert per_run == [5, 4]  # "prompt 0" is sample 1's, once a step


def across_grid(driver):
    """The across view as data: its run columns, and per step row the cells' samples (reward, completion)."""
    return driver.execute_script("""
        const t = document.getElementById('across');
        return {runs: [...t.tHead.querySelectorAll('th[data-run]')].map(h => h.innerText.trim()),
                rows: [...t.tBodies[0].rows].map(r => [Number(r.dataset.step), [...r.querySelectorAll('td.cell')].map(c =>
                  [...c.querySelectorAll('.across-sample')].map(b => [b.querySelector('.reward').innerText,
                                                                      b.querySelector('.completion').textContent]))])};""")


def test_the_across_view_puts_the_runs_side_by_side_step_by_step(browser, served, shots):
    open_page(browser, served.url)
    browser.find_element("css selector", "#samples tr[data-index='2']").click()  # "prompt 1": samples 2 and 3 of each step
    press(browser, "a")
    wait(browser, "return document.querySelector('#across .across-sample')")
    grid = across_grid(browser)
    assert grid["runs"] == ["run-a", "run-b"]  # a column per run
    assert [step for step, _ in grid["rows"]] == [1, 2, 3, 4, 5]  # a row per step
    for step, (run_a, run_b) in grid["rows"]:
        assert run_a == [["0.333", f"answer 2 at step {step}"], ["0.5", f"answer 3 at step {step}"]]
        assert run_b == ([] if step == 5 else run_a)  # run-b stopped at step 4
    assert browser.execute_script("return document.querySelector('#across td.current').dataset.run") == "0"
    # (0.333 + 0.5) / 2 = 0.4165, a double just under it: toFixed(3) gives 0.416
    assert "2 samples · mean reward 0.416" in browser.find_element("css selector", "#across td.cell").text

    # a script in a completion stays text, in the grid too
    browser.find_element("css selector", "#samples tr[data-index='1']").click()
    press(browser, "a")
    wait(browser, "return document.querySelectorAll('#across .across-sample').length === 9")
    grid = across_grid(browser)
    assert grid["rows"][3][1][1] == [["0.167", SCRIPT]]  # run-b's last step
    assert grid["rows"][4][1][0] == [["0.167", SCRIPT]]  # run-a's
    assert browser.execute_script("return document.querySelectorAll('#detail script, #detail img').length") == 0
    assert browser.execute_script("return window.__pwned") is None
    browser.save_screenshot(str(shots / "across.png"))
    browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": "dark"}]})
    browser.save_screenshot(str(shots / "across-dark.png"))
    browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})

    # a click on a cell's sample opens it: the other run, that step, that sample, in the sample view
    browser.execute_script("document.querySelector('#across tr[data-step=\"2\"] td[data-run=\"1\"] .across-sample').click()")
    wait(browser, "return document.getElementById('completion-text')")
    assert browser.find_element("id", "step-input").get_attribute("value") == "2"
    assert browser.find_element("css selector", ".run-chip.active").text == "run-b"
    assert browser.execute_script("return document.querySelector('.tabs button.active').dataset.tab") == "sample"
    assert browser.execute_script("return document.querySelector('#samples tr.selected').dataset.index") == "1"
    assert browser.find_element("id", "completion-text").text == "answer 1 at step 2"
    # and the keys still work from there
    press(browser, "a")
    wait(browser, "const c = document.querySelector('#across td.current'); return c && c.dataset.run === '1'")
    press(browser, "]")
    wait(browser, "return document.getElementById('step-input').value === '3'")


def test_the_page_follows_a_run_that_writes_on(browser, tmp_path):
    run = write_run(tmp_path / "live", steps=2)
    server = ViewServer(open_runs([run]))
    server.start()
    try:
        open_page(browser, server.url)
        browser.find_element("id", "follow").click()
        with open(run / "samples.jsonl", "a") as samples, open(run / "metrics.jsonl", "a") as metrics:
            samples.write('{"step": 3, "group": 0, "prompt": "p", "completion": "a new step", "reward": 2.0}\n')
            metrics.write('{"step": 3, "reward/mean": 2.0}\n')
        wait(browser, "return document.getElementById('step-input').value === '3'", timeout=10)
        assert rows(browser) == [0]
        points = browser.execute_script("return document.querySelector('.chart[data-metric=\"reward/mean\"] path.line')"
                                        ".getAttribute('d').split('L').length")
        assert points == 3
    finally:
        server.shutdown()
        server.server_close()


def test_the_export_opens_from_a_file_with_the_network_off(browser, tmp_path, shots):
    run = write_run(tmp_path / "run", steps=5)
    target = export_html(open_runs([run]), tmp_path / "report.html", [3, 5])
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.emulateNetworkConditions", {"offline": True, "latency": 0,
                                                                  "downloadThroughput": 0, "uploadThroughput": 0})
    try:
        open_page(browser, target.as_uri())
        assert browser.find_element("id", "step-input").get_attribute("value") == "5"
        assert browser.execute_script("return document.querySelector('.chart path.line').getTotalLength()") > 50
        assert rows(browser) == [0, 1, 2, 3, 4, 5]
        browser.find_element("css selector", "#samples tr[data-index='0']").click()
        assert len(browser.find_elements("css selector", "#tokens .turn.tool")) == 1
        press(browser, "[")
        wait(browser, "return document.getElementById('step-input').value === '3'")  # the exported steps only
        browser.save_screenshot(str(shots / "export.png"))
        assert browser.execute_script("return window.__pwned") is None
    finally:
        browser.execute_cdp_cmd("Network.emulateNetworkConditions", {"offline": False, "latency": 0,
                                                                      "downloadThroughput": -1, "uploadThroughput": -1})

"""``rlhf view``'s server, index and export without a browser (rlhf/viewer/): the guards (loopback,
the session's token, no path reaches a file, markup stays text), the lazy index of a step's lines
(appended to, cut back), a 10,000-step run of 100 samples a step answered within the 2 s the
page may take, runs from before tokens.jsonl, and the export's inline data."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf.core.errors import ConfigError
from rlhf.viewer.export import export_data, export_html, parse_steps
from rlhf.viewer.logs import StepLines
from rlhf.viewer.page import script_json
from rlhf.viewer.runs import open_runs
from rlhf.viewer.server import ViewServer
from tests.helpers import run_cli
from tests.viewer.synthetic import SCRIPT, write_large_run, write_run

pytestmark = pytest.mark.unit


@pytest.fixture
def served(tmp_path):
    runs = [write_run(tmp_path / "a"), write_run(tmp_path / "b", steps=3, tokens=False)]
    server = ViewServer(open_runs(runs))
    server.start()
    yield server
    server.shutdown()
    server.server_close()


def get(server, path, *, token=True, host=None, cookie=None):
    """(status, headers, body) of a raw GET (the path is sent as written: no client normalises it)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    if token:
        path += ("&" if "?" in path else "?") + f"token={server.token}"
    headers = {"Host": host or f"127.0.0.1:{server.port}"}
    if cookie:
        headers["Cookie"] = cookie
    connection.request("GET", path, headers=headers)
    answer = connection.getresponse()
    body = answer.read()
    connection.close()
    return answer.status, dict(answer.getheaders()), body


def api(server, path):
    status, _, body = get(server, path)
    assert status == 200, body
    return json.loads(body)


def test_it_listens_on_loopback_only_and_prints_a_url_with_the_token(served):
    assert served.server_address[0] == "127.0.0.1"
    assert served.url == f"http://127.0.0.1:{served.port}/?token={served.token}" and len(served.token) >= 32


def test_without_the_token_nothing_is_served(served):
    for path in ("/", "/api/runs", "/api/step?run=0&step=1", "/api/metrics?run=0"):
        status, _, body = get(served, path, token=False)
        assert status == 403 and b"token" in body and b"reward" not in body
        status, _, _ = get(served, path + "?token=wrong" if "?" not in path else path + "&token=wrong", token=False)
        assert status == 403
    assert get(served, "/api/runs", token=False, cookie="rlhf_view_token=wrong")[0] == 403


def test_the_page_sets_a_cookie_that_then_stands_for_the_token(served):
    status, headers, body = get(served, "/")
    assert status == 200 and b"rlhf view" in body
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    value = cookie.split(";")[0]
    status, _, body = get(served, "/api/runs", token=False, cookie=value)
    assert status == 200 and json.loads(body)["runs"][0]["name"] == "a"


def test_the_page_allows_only_its_own_inline_code(served):
    status, headers, body = get(served, "/")
    policy = headers["Content-Security-Policy"]
    nonce = re.search(r"'nonce-([^']+)'", policy).group(1)
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "unsafe-inline" not in policy
    assert body.count(b"<script") == body.count(f'nonce="{nonce}"'.encode()) - 1  # and the <style>
    assert b"http://" not in body.replace(b"http://www.w3.org/2000/svg", b"") and b"https://" not in body
    assert headers["X-Content-Type-Options"] == "nosniff" and headers["Referrer-Policy"] == "no-referrer"


def test_a_request_for_another_host_is_refused(served):
    """A page on another site that points a DNS name of its own at 127.0.0.1 (DNS rebinding)."""
    status, _, body = get(served, "/api/runs", host=f"evil.example:{served.port}")
    assert status == 403 and b"runs" not in body
    assert get(served, "/api/runs", host=f"localhost:{served.port}")[0] == 200


@pytest.mark.parametrize("path", [
    "/../../../../etc/passwd", "/api/../../../../etc/passwd", "/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
    "/static/../../../../etc/passwd", "/samples.jsonl", "/a/samples.jsonl", "/config.yaml",
    "/api/file?path=/etc/passwd", "/api/step?run=../../etc&step=1", "/api/step?run=/etc/passwd&step=1",
    "/api/step?run=7&step=1", "//etc/passwd", "/api/runs/../../../etc/passwd",
])
def test_no_path_reaches_a_file(served, path):
    status, _, body = get(served, path)
    assert status == 404, (path, status)
    assert b"root:" not in body and b"step" not in body


def test_writes_are_refused(served):
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    connection.request("POST", f"/api/runs?token={served.token}", body=b"x")
    assert connection.getresponse().status == 405


def test_the_api_answers_from_the_runs_logs(served):
    runs = api(served, "/api/runs")["runs"]
    assert [r["name"] for r in runs] == ["a", "b"] and "algo: grpo" in runs[0]["config"]
    assert [r["has_tokens"] for r in runs] == [True, False]
    metrics = api(served, "/api/metrics?run=0&keys=reward/mean,kl/mean")
    assert metrics["rows"] == 5 and metrics["step"] == [0, 1, 2, 3, 4]
    assert metrics["series"]["reward/mean"] == [None, 0.2, 0.4, pytest.approx(0.6), 0.8]
    assert "lr" in metrics["keys"] and "eval/reward/mean" in metrics["keys"]
    assert api(served, "/api/metrics?run=0&from=3&keys=reward/mean")["step"] == [3, 4]
    assert api(served, "/api/steps?run=0")["steps"] == [1, 2, 3, 4]
    step = api(served, "/api/step?run=0&step=2")
    assert len(step["samples"]) == 6 and {s["step"] for s in step["samples"]} == {2}
    assert list(step["tokens"]) == ["0"] and step["tokens"]["0"]["pieces"][5] == "42"
    assert api(served, "/api/step?run=0&step=99") == {"step": 99, "samples": [], "tokens": {}}
    found = api(served, "/api/prompt?prompt=prompt%201")["runs"]
    assert [[r["step"] for r in rows] for rows in found] == [[1, 1, 2, 2, 3, 3, 4, 4], [1, 1, 2, 2, 3, 3]]


def test_a_run_from_before_tokens_and_turns_opens(served):
    """Run b has no tokens.jsonl, and its rows (like every row of an older rlhf) no ``turns``."""
    step = api(served, "/api/step?run=1&step=3")
    assert len(step["samples"]) == 6 and step["tokens"] == {}
    assert "turns" not in step["samples"][1]


def test_a_step_s_lines_are_found_by_binary_search_as_the_file_grows_and_is_cut_back(tmp_path):
    path = tmp_path / "samples.jsonl"
    rows = [{"step": s, "i": i} for s in (1, 1, 2, 4, 4, 4, 7) for i in [0]]
    path.write_text("".join(json.dumps({**r, "n": n}) + "\n" for n, r in enumerate(rows)))
    lines = StepLines(path)
    assert [[r["n"] for r in lines.rows(s)] for s in range(9)] == [[], [0, 1], [2], [], [3, 4, 5], [], [], [6], []]
    with open(path, "a") as handle:  # the run writes on: step 7 gets a row, and half of step 8's
        handle.write(json.dumps({"step": 7, "n": 7}) + "\n" + '{"step": 8, "n": 8')
    assert [r["n"] for r in lines.rows(7)] == [6, 7] and lines.rows(8) == []
    with open(path, "a") as handle:
        handle.write("}\n")
    assert [r["n"] for r in lines.rows(8)] == [8]
    size = len("".join(json.dumps({**r, "n": n}) + "\n" for n, r in enumerate(rows[:3])))
    with open(path, "r+b") as handle:  # --resume cut it back to step 2, and the run goes on
        handle.truncate(size)
        handle.seek(size)
        handle.write(b'{"step": 3, "n": 9}\n')
    assert [r["n"] for r in lines.rows(4)] == [] and [r["n"] for r in lines.rows(3)] == [9]
    assert [r["n"] for r in lines.rows(2)] == [2]


def test_metrics_are_read_again_only_where_appended_and_whole_after_a_cut(tmp_path):
    run = write_run(tmp_path / "run", steps=3)
    [opened] = open_runs([run])
    assert opened.metrics.columns(["reward/mean"])["rows"] == 4
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps({"step": 4, "reward/mean": 9.0}) + "\n")
    assert opened.metrics.columns(["reward/mean"], 4)["series"]["reward/mean"] == [9.0]
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 5.0}) + "\n")
    assert opened.metrics.columns(["reward/mean"])["series"]["reward/mean"] == [5.0]


def test_a_10000_step_run_of_100_samples_a_step_answers_the_first_page_in_under_2_s(tmp_path):
    """What the page asks as it opens: itself, the runs, the curves, the steps and the last step's samples.
    CPU time of this process (the server's threads included), so a busy machine does not decide it."""
    run = write_large_run(tmp_path / "large")
    assert (run / "samples.jsonl").stat().st_size > 100e6
    server = ViewServer(open_runs([run]))
    server.start()
    try:
        started, wall = time.process_time(), time.perf_counter()
        assert get(server, "/")[0] == 200
        api(server, "/api/runs")
        metrics = api(server, "/api/metrics?run=0&keys=reward/mean,kl/mean,response/length_mean,policy/loss")
        steps = api(server, "/api/steps?run=0")["steps"]
        last = api(server, f"/api/step?run=0&step={steps[-1]}")
        cpu = time.process_time() - started
        assert metrics["rows"] == 10_000 and len(steps) == 10_000
        assert len(last["samples"]) == 100 and {s["step"] for s in last["samples"]} == {10_000}
        assert cpu < 2.0, f"{cpu:.2f} s of CPU ({time.perf_counter() - wall:.2f} s wall)"
        started = time.process_time()
        middle = api(server, "/api/step?run=0&step=5000")  # any step, found without reading the file
        assert len(middle["samples"]) == 100 and time.process_time() - started < 0.5
    finally:
        server.shutdown()
        server.server_close()


def test_script_json_cannot_end_its_script_element():
    data = {"text": SCRIPT + "</script><script>alert(1)</script><!-- & \u2028"}
    text = script_json(data)
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    assert json.loads(text) == data


def test_the_export_holds_the_chosen_steps_and_no_markup_from_samples(tmp_path):
    run = write_run(tmp_path / "run", steps=4)
    target = export_html(open_runs([run]), tmp_path / "out" / "report.html", [2, 4])
    html = target.read_text()
    assert html.count("</script>") == 2  # the data's block and the code's: a sample's </script> did not end one
    assert SCRIPT not in html and "<img src=x" not in html
    assert "script-src 'unsafe-inline'" in html and "default-src 'none'" in html  # it loads nothing
    boot = json.loads(re.search(r'<script type="application/json" id="boot">(.*?)</script>', html, re.S).group(1))
    assert boot["exported_steps"] == [2, 4] and sorted(boot["runs"][0]["step_data"]) == ["2", "4"]
    assert boot["runs"][0]["step_data"]["4"]["samples"][1]["completion"] == SCRIPT


def test_the_export_takes_the_last_10_steps_by_default(tmp_path):
    run = write_run(tmp_path / "run", steps=12, samples=2)
    assert export_data(open_runs([run]), None)["exported_steps"] == list(range(3, 13))


def test_steps_are_written_as_numbers_and_ranges():
    assert parse_steps("5") == [5] and parse_steps("1, 5,10-12") == [1, 5, 10, 11, 12]
    for wrong in ("a", "5-2", "1,,2", "-3"):
        with pytest.raises(ConfigError, match="--steps"):
            parse_steps(wrong)
    with pytest.raises(ConfigError, match="too large"):
        parse_steps("1-100000")


def test_the_command_refuses_what_is_no_run_and_exports(tmp_path, plugins):
    (tmp_path / "notes").mkdir()
    result = run_cli(plugins, ["view", str(tmp_path / "notes")])
    assert result.exit_code == 2 and "holds no run logs" in result.output
    run = write_run(tmp_path / "run")
    result = run_cli(plugins, ["view", str(run), "--steps", "1"])
    assert result.exit_code == 2 and "--steps chooses the steps of --export" in result.output
    result = run_cli(plugins, ["view", str(run), "--export", str(tmp_path / "r.html"), "--steps", "1-2"])
    assert result.exit_code == 0 and (tmp_path / "r.html").is_file(), result.output


def test_rlhf_view_imports_no_torch(tmp_path):
    run = write_run(tmp_path / "run")
    code = ("import sys\nfrom rlhf.cli.main import main\ntry:\n"
            f"    main(['view', {str(run)!r}, '--export', {str(tmp_path / 'r.html')!r}])\n"
            "except SystemExit as exc:\n    assert not exc.code, exc.code\n"
            "import rlhf.viewer.server\nprint('torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"

"""The web dashboard in a real browser: Debian's chromium, driven by Playwright, against a daemon on fake
GPUs over TCP with a token. The screenshot lands in test-artifacts/ (CI keeps it)."""

from __future__ import annotations

import http.client
import json
import os
import pwd
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from carma.cli.server import machine_name
from servers import fakejob, free_port

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
WAIT_MS = 30_000


def _unavailable(what: str) -> None:
    """Skip where the browser is not installed, except in CI (.ci/run installs it): there it is a failure."""
    message = f"{what} is not installed (.ci/run installs Debian's chromium and the dev extras bring Playwright)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright")
    if not Path(CHROMIUM).exists():
        _unavailable("chromium")
    args = ["--disable-background-networking", "--disable-component-update", "--no-first-run"]
    if os.geteuid() == 0:
        args.append("--no-sandbox")  # chromium refuses to run as root with its sandbox
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        yield browser
        browser.close()


@pytest.fixture
def served(start_server):  # type: ignore[no-untyped-def]
    """A daemon on two fake GPUs listening on TCP, and its admin token."""
    port = free_port()
    server = start_server("--fake-gpus", "2xA100-40GB", "--time-scale", "20", "--tcp", f"127.0.0.1:{port}")
    link = server.cli("dashboard")  # the address with the caller's token, as a user gets it
    assert link.returncode == 0, link.stderr
    url, _, fragment = link.stdout.strip().partition("#token=")
    assert url == f"http://127.0.0.1:{port}/" and fragment == (server.home / "tokens").read_text().split()[0]
    return server, url.rstrip("/"), fragment


def test_a_task_shows_on_its_gpu_and_timeline_and_leaves_when_cancelled(browser, served):  # type: ignore[no-untyped-def]
    from playwright.sync_api import expect

    server, url, token = served
    page = browser.new_page(viewport={"width": 1280, "height": 1300})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{url}/#token={token}")
    cards = page.locator("[data-gpu]")
    expect(cards).to_have_count(2, timeout=WAIT_MS)
    expect(cards.nth(1)).to_contain_text("A100-40GB")
    expect(page.locator("#summary")).to_contain_text("policy magm", timeout=WAIT_MS)
    assert "token" not in page.url  # the token left the address bar
    expect(page.locator("#mig")).to_be_hidden()  # no MIG layout on a server without dynamic MIG

    task = server.submit(*fakejob(100_000, "512MiB", "--smact", "0.5"), name="resnet-demo", mem="512MiB")
    chip = page.locator(f"[data-gpu] [data-task='{task}']")
    expect(chip).to_contain_text("resnet-demo", timeout=WAIT_MS)
    row = page.locator(f"#queue tr[data-task='{task}']")
    expect(row).to_contain_text("running", timeout=WAIT_MS)
    expect(row.locator("td[title='user']")).to_have_text("512.0 MiB")  # placed with, and why; as `carma queue`
    bar = page.locator(f"#timeline rect[data-task='{task}']")
    expect(bar).to_have_class(re.compile("running"), timeout=WAIT_MS)
    expect(page.locator("[data-chart='smact'] polyline").first).to_be_attached(timeout=WAIT_MS)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

    assert server.cli("cancel", task).returncode == 0
    expect(chip).to_have_count(0, timeout=WAIT_MS)
    expect(row).to_have_count(0, timeout=WAIT_MS)
    expect(bar).to_have_class(re.compile("killed"), timeout=WAIT_MS)  # it stays in the timeline, ended
    assert errors == []
    page.close()


def test_collocated_attempts_get_lanes_of_their_own_in_the_timeline(browser, served):  # type: ignore[no-untyped-def]
    """One row per GPU drew collocated attempts over each other: the last hid the others, and only it could be
    clicked. Cancelled tasks are counted in the header, and a bar's tooltip says the legend's words."""
    from playwright.sync_api import expect

    server, url, token = served
    page = browser.new_page(viewport={"width": 1280, "height": 1300})
    page.goto(f"{url}/#token={token}")
    ids = [server.submit(*fakejob(100_000, "512MiB"), name=f"job{i}", mem="512MiB") for i in range(3)]
    for task in ids:  # two on the idle GPUs, the third beside one of them once its TTFK window has passed
        server.wait_state(task, "running")
    gpus = {i: server.task(i)["attempt_list"][0]["gpus"] for i in ids}
    together = [i for i in ids if gpus[i] == gpus[ids[2]]]
    assert len(together) == 2
    bars = [page.locator(f"#timeline rect[data-task='{i}']") for i in together]
    for bar in bars:
        expect(bar).to_be_visible(timeout=WAIT_MS)
    # measured in one evaluation: the live updates redraw the timeline, and a bar measured apart could be gone
    bar = "(i) => document.querySelector(`#timeline rect[data-task='${i}']`).getBoundingClientRect()"
    first, second = page.evaluate(f"ids => ids.map({bar}).map((r) => ({{y: r.y, height: r.height}}))", together)
    assert first["y"] + first["height"] <= second["y"] or second["y"] + second["height"] <= first["y"], (first, second)
    assert server.cli("cancel", *map(str, ids)).returncode == 0
    expect(page.locator("#summary")).to_contain_text("3 cancelled", timeout=WAIT_MS)
    expect(bars[0].locator("title")).to_contain_text(": cancelled, ", timeout=WAIT_MS)
    page.close()


def test_the_charts_key_every_gpu_of_a_large_server_apart_and_inside_the_chart(browser, start_server):  # type: ignore[no-untyped-def]
    """Beyond eight GPUs the colours repeated (GPU 8 drawn as GPU 0) and the one-line key ran past the chart."""
    from playwright.sync_api import expect

    port = free_port()
    server = start_server("--fake-gpus", "12xA100-40GB", "--time-scale", "20", "--tcp", f"127.0.0.1:{port}")
    link = server.cli("dashboard").stdout.strip()
    page = browser.new_page(viewport={"width": 1000, "height": 1300})
    page.goto(link)
    chart = page.locator("[data-chart='smact']")
    keys = chart.locator(".keys span")
    expect(keys).to_have_count(12, timeout=WAIT_MS)
    # measured in one evaluation: the live updates redraw the key, and a span measured apart could be gone
    (left, width), *spans = chart.evaluate(
        "c => [c, ...c.querySelectorAll('.keys span')].map((e) => e.getBoundingClientRect()).map((r) => [r.x, r.width])"
    )
    assert len(spans) == 12 and all(left <= x and x + w <= left + width for x, w in spans)
    colours = keys.evaluate_all("spans => spans.map((s) => getComputedStyle(s).color)")
    assert len(set(colours)) == 12
    ARTIFACTS.mkdir(exist_ok=True)
    chart.screenshot(path=str(ARTIFACTS / "dashboard-chart-12-gpus.png"))
    page.close()


def test_a_mig_gpus_layout_and_reconfigurations_show_in_the_gpus_and_timeline(browser, start_server):  # type: ignore[no-untyped-def]
    """Each instance a block over its memory slices, with its task; the free slices; a mark in the timeline at
    each reconfiguration, saying what it did."""
    from playwright.sync_api import expect

    port = free_port()
    mig = ("--fake-gpus", "1xA100-40GB", "--fake-mig", "--mig", "dynamic", "--time-scale", "50")
    server = start_server(*mig, "--tcp", f"127.0.0.1:{port}")
    small = server.submit(*fakejob(100_000, "3GiB"), name="small", mem="3GiB")
    large = server.submit(*fakejob(100_000, "15GiB"), name="large", mem="15GiB")
    server.wait_state(small, "running")
    server.wait_state(large, "running")
    page = browser.new_page(viewport={"width": 1280, "height": 1300})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.cli("dashboard").stdout.strip())
    layout = page.locator("#mig [data-mig]")
    expect(layout).to_contain_text("A100-40GB", timeout=WAIT_MS)
    # as `carma gpus` lists it: 4g.20gb@0 (task large), 1g.10gb@6 (task small); free memory slices 4, 5
    expect(layout.locator("[data-slot='4g.20gb@0']")).to_contain_text(f"#{large} large")
    expect(layout.locator("[data-slot='1g.10gb@6']")).to_contain_text(f"#{small} small")
    expect(layout.locator("[data-free]")).to_have_attribute("data-free", "4,5")
    widths = layout.evaluate(  # each block spans its memory slices: 4, 2 and the 2 free ones of 8
        "m => ['[data-slot=\"4g.20gb@0\"]', '[data-slot=\"1g.10gb@6\"]', '[data-free]']"
        ".map((s) => m.querySelector(s).getBoundingClientRect().width)"
    )
    assert widths[0] > 1.8 * widths[1] and abs(widths[1] - widths[2]) < 1, widths
    marks = page.locator("#timeline g.reconfiguration")
    expect(marks).to_have_count(3, timeout=WAIT_MS)  # the whole GPU made at the start, then one per task
    expect(marks.nth(0).locator("title")).to_contain_text("MIG created 7g.40gb@0: done")
    expect(marks.locator("title", has_text="created 4g.20gb@0")).to_contain_text(": done, -")
    expect(page.locator("#legend-mig")).to_be_visible()
    colours = page.locator("[data-chart='smact'] .keys span").evaluate_all("spans => spans.map((s) => s.style.color)")
    assert "" not in colours and len(set(colours)) == len(colours)  # an instance since destroyed, keyed by its id
    page.locator(f"#mig [data-task='{small}']").click()  # a task opens from its instance too
    expect(page.locator("#task")).to_contain_text(f"task {small}: small", timeout=WAIT_MS)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-mig.png"), full_page=True)
    assert server.cli("cancel", str(small), str(large)).returncode == 0
    assert errors == []
    page.close()


def test_a_task_opens_from_its_gpu_card_and_once_ended_from_its_timeline_bar_with_its_reason(browser, served):  # type: ignore[no-untyped-def]
    """Only queue rows opened a task: one that had failed, gone from the queue, could not be looked into."""
    from playwright.sync_api import expect

    server, url, token = served
    running = server.submit(*fakejob(100_000, "512MiB"), name="runner", mem="512MiB")
    failing = server.submit("sh", "-c", "echo 'no such dataset' >&2; exit 3", name="broken", mem="512MiB")
    server.wait_state(failing, "failed")
    page = browser.new_page(viewport={"width": 1280, "height": 1300})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{url}/#token={token}")
    details = page.locator("#task")
    page.locator(f"[data-gpu] [data-task='{running}']").click(timeout=WAIT_MS)
    expect(details).to_contain_text(f"task {running}: runner", timeout=WAIT_MS)
    expect(details).to_contain_text("memory: 512.0 MiB from user")
    page.locator(f"#timeline rect[data-task='{failing}']").click(timeout=WAIT_MS)
    expect(details).to_contain_text(f"task {failing}: broken", timeout=WAIT_MS)
    expect(details.locator(".reason")).to_have_text("reason: exit code 3: no such dataset")
    assert server.cli("cancel", running).returncode == 0
    assert errors == []
    page.close()


# Trains a few steps under CUDA autocast (the estimate gets a note), then idles so that it stays in the queue.
TRAIN = """
import time, torch
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
optimizer = torch.optim.Adam(model.parameters())
for _ in range(5):
    optimizer.zero_grad()
    with torch.autocast("cuda"):
        torch.nn.functional.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,))).backward()
    optimizer.step()
time.sleep(600)
"""


def test_a_tasks_details_show_the_memory_estimate_it_was_placed_with(browser, served, tmp_path):  # type: ignore[no-untyped-def]
    pytest.importorskip("torch")
    from playwright.sync_api import expect

    server, url, token = served
    (tmp_path / "train.py").write_text(TRAIN)
    task = server.submit(sys.executable, "train.py", name="tiny", estimate="xmem", workdir=tmp_path)
    page = browser.new_page(viewport={"width": 1280, "height": 1300})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{url}/#token={token}")
    row = page.locator(f"#queue tr[data-task='{task}']")
    placed = re.compile(r"\d (MiB|GiB)")  # placed with its estimate, a size
    expect(row.locator("td[title='xmem']")).to_contain_text(placed, timeout=2 * WAIT_MS)
    row.click()
    details = page.locator("#task")
    expect(details).to_contain_text(f"task {task}: tiny", timeout=WAIT_MS)
    expect(details).to_contain_text("by xmem for a100-40gb")
    expect(details).to_contain_text("optimizer state")
    expect(details.locator(".note")).to_contain_text("autocast")
    expect(details).to_contain_text("attempt 1 on GPU")
    expect(details).to_contain_text("from xmem")
    ARTIFACTS.mkdir(exist_ok=True)
    details.screenshot(path=str(ARTIFACTS / "dashboard-task.png"))
    details.locator(".close").click()
    expect(details).to_be_hidden()
    assert server.cli("cancel", task).returncode == 0
    assert errors == []
    page.close()


def test_without_a_token_the_page_asks_for_one(browser, served):  # type: ignore[no-untyped-def]
    from playwright.sync_api import expect

    _, url, token = served
    page = browser.new_page()
    page.goto(url)
    page.evaluate("localStorage.clear()")
    page.reload()
    expect(page.locator("#login")).to_be_visible(timeout=WAIT_MS)
    page.fill("#token", "not-a-token")
    page.click("#login button")
    expect(page.locator("#login-error")).to_contain_text("refused", timeout=WAIT_MS)
    page.fill("#token", token)
    page.click("#login button")
    expect(page.locator("[data-gpu]")).to_have_count(2, timeout=WAIT_MS)
    expect(page.locator("#login")).to_be_hidden()
    page.close()


def test_a_link_opened_in_a_tab_already_showing_the_dashboard_signs_in(browser, served):  # type: ignore[no-untyped-def]
    """Only the fragment changes, so the page does not reload: the link was ignored, the login stayed, and the
    token stayed in the address bar and the history."""
    from playwright.sync_api import expect

    _, url, token = served
    page = browser.new_page()
    page.goto(url)
    page.evaluate("localStorage.clear()")
    page.reload()
    page.fill("#token", "not-a-token")
    page.click("#login button")
    expect(page.locator("#login-error")).to_contain_text("refused", timeout=WAIT_MS)
    page.goto(f"{url}/#token={token}")
    expect(page.locator("[data-gpu]")).to_have_count(2, timeout=WAIT_MS)
    expect(page.locator("#login")).to_be_hidden()
    assert "token" not in page.url
    page.close()


def test_a_link_to_a_token_with_url_characters_signs_in(browser, start_server, tmp_path_factory):  # type: ignore[no-untyped-def]
    """A token with '%', '&' or '#' (a tokens file takes any printable one) was printed as it stands: '%zz' made
    the page's decoding throw, so it stayed blank, and '&' cut the token short."""
    from playwright.sync_api import expect

    home = Path(tempfile.mkdtemp(prefix="c", dir="/tmp"))  # short: a unix socket's path is limited
    token = "odd%zz&token#with-chars"
    (home / "tokens").write_text(f"{token} {pwd.getpwuid(os.geteuid()).pw_name} {os.geteuid()} admin\n")
    (home / "tokens").chmod(0o600)
    port = free_port()
    server = start_server("--fake-gpus", "1xA100-40GB", "--tcp", f"127.0.0.1:{port}", home=home)
    link = server.cli("dashboard").stdout.strip()
    assert link == f"http://127.0.0.1:{port}/#token=odd%25zz%26token%23with-chars"
    page = browser.new_page()
    page.goto(link)
    expect(page.locator("[data-gpu]")).to_have_count(1, timeout=WAIT_MS)
    expect(page.locator("#login")).to_be_hidden()
    page.close()
    shutil.rmtree(home, ignore_errors=True)


def test_dashboard_names_the_machine_for_a_wildcard_listener_and_the_server_warns_of_it(start_server):  # type: ignore[no-untyped-def]
    """`--tcp 0.0.0.0:PORT` gave the link http://0.0.0.0:PORT/, which no browser elsewhere opens, and its start
    said nothing of tokens crossing the network in clear."""
    port = free_port()
    server = start_server("--fake-gpus", "1xA100-40GB", "--tcp", f"0.0.0.0:{port}")
    link = server.cli("dashboard").stdout.strip()
    assert link.startswith(f"http://{machine_name()}:{port}/#token=")
    started = (server.home / "test-server.log").read_text()
    assert f"warning: 0.0.0.0:{port} is reachable from other machines, and tokens travel in clear HTTP" in started


@pytest.mark.parametrize(
    ("fqdn", "hostname", "name"),
    [
        ("gpu1.lab.example.org", "gpu1", "gpu1.lab.example.org"),
        ("localhost", "gpu1", "gpu1"),  # a hosts file naming the host beside localhost: the link was localhost's
        ("localhost.localdomain", "gpu1", "gpu1"),
        ("ip6-localhost", "gpu1", "gpu1"),
    ],
)
def test_the_machine_is_named_by_a_name_other_machines_can_use(monkeypatch, fqdn, hostname, name):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(socket, "getfqdn", lambda: fqdn)
    monkeypatch.setattr(socket, "gethostname", lambda: hostname)
    assert machine_name() == name


def test_a_listener_on_port_0_is_named_by_the_port_the_system_chose(start_server):  # type: ignore[no-untyped-def]
    """The start line, `carma status` and `carma dashboard` said port 0, where nothing listens."""
    server = start_server("--fake-gpus", "1xA100-40GB", "--tcp", "127.0.0.1:0")
    address = json.loads(server.cli("status", "--json").stdout)["tcp"]
    port = int(address.removeprefix("127.0.0.1:"))
    assert port > 0 and server.cli("dashboard").stdout.startswith(f"http://127.0.0.1:{port}/#token=")
    assert f", on http://127.0.0.1:{port}; no tasks" in server.cli("status").stdout  # said in --json alone
    assert f"and http://127.0.0.1:{port} (dashboard)" in (server.home / "test-server.log").read_text()
    with socket.create_connection(("127.0.0.1", port), timeout=10):
        pass


def test_the_page_is_public_its_data_is_not(served):  # type: ignore[no-untyped-def]
    """Over TCP the page and assets need no token (they hold no data); timeline, series, live events and
    metrics do."""
    server, url, token = served
    task = server.submit(*fakejob(60, "2GiB"), name="short")
    server.cli("wait", task)
    host, port = url.removeprefix("http://").split(":")

    def get(path: str, auth: bool = True, read: int = -1) -> tuple[int, str, bytes]:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if auth else {})
        response = conn.getresponse()
        body = response.read(read) if read > 0 else response.read()
        conn.close()
        return response.status, response.getheader("Content-Type", ""), body

    status, media_type, page = get("/", auth=False)
    assert (status, media_type) == (200, "text/html; charset=utf-8") and b"{{" not in page
    assert get("/static/index.html", auth=False)[0] == 404  # was the page's template, its version unfilled
    assert get("/static/app.js", auth=False)[0] == 200 and get("/static/nothing.js", auth=False)[0] == 404
    for path in ("/v1/timeline", "/v1/series", "/v1/events", "/metrics"):
        assert get(path, auth=False)[0] == 401, path
    status, _, body = get("/v1/timeline?hours=1")
    (attempt,) = json.loads(body)["attempts"]
    assert status == 200 and (attempt["task_id"], attempt["name"], attempt["outcome"]) == (task, "short", "success")
    assert set(json.loads(get("/v1/series?minutes=60")[2])["gpus"]) == {"0", "1"}
    history = [get(f"/v1/history?hours={h}")[0] for h in ("1", "inf", "nan")]
    assert history == [200, 422, 422]  # finite, as `carma history --hours`; inf was 200
    for nan in ("/v1/timeline?hours=nan", "/v1/series?minutes=nan", "/v1/events?interval=nan"):
        status, _, body = get(nan)  # was "should be less than or equal to 2160", of nan
        assert status == 422 and json.loads(body)["detail"].endswith("= 'nan': Input should be a finite number"), body
    status, media_type, first = get("/v1/events", read=200)
    assert status == 200 and media_type.startswith("text/event-stream") and first.startswith(b"data: {")
    status, _, metrics = get("/metrics")
    assert status == 200 and b'carma_tasks_ended_total{outcome="completed"} 1.0' in metrics


def test_dashboard_without_tcp_says_how_to_get_one(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB")
    result = server.cli("dashboard")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--tcp" in result.stderr


def test_dashboard_of_a_remote_server_is_its_url(start_server):  # type: ignore[no-untyped-def]
    """Under CARMA_URL the address is the user's own (no status call, which a missing token would fail)."""
    server = start_server("--fake-gpus", "1xA100-40GB")
    remote = {"CARMA_URL": "http://gpu-box.invalid:8765/carma"}
    bare = server.cli("dashboard", env=remote)
    assert (bare.returncode, bare.stdout) == (0, "http://gpu-box.invalid:8765/carma/\n")
    assert "sign in on the page with your token" in bare.stderr
    signed = server.cli("dashboard", env={**remote, "CARMA_TOKEN": "tok-1"})
    assert (signed.returncode, signed.stdout) == (0, "http://gpu-box.invalid:8765/carma/#token=tok-1\n")
    local = server.cli("dashboard", "--home", server.home, env=remote)  # was the CARMA_URL one, --home unread
    assert local.returncode == 2 and "the server does not listen on TCP" in local.stderr

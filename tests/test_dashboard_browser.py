"""The dashboard in a real browser: headless Chromium (Debian's chromium and chromium-driver,
which .ci/run installs) driven by Selenium. Each page loads without console errors and is
saved as a screenshot ($TASKRUNNER_SCREENSHOTS, default the test's tmp dir); filters,
live progress under a real runner, retry, cancel, bulk actions and CSRF in the browser."""
import os
import shutil

import pytest

pytest.importorskip("prometheus_client")

from datetime import timedelta  # noqa: E402

from taskrunner.store.models import utcnow

from conftest import databases_required, wait_for  # noqa: E402
from dashboard_helpers import Served  # noqa: E402
from test_dashboard import history  # noqa: E402

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
REBOUND = "rebind.evil.example"
PAGES = {"overview": "/", "runners": "/runners", "tasks": "/tasks", "failures": "/failures",
         "periodic": "/periodic"}


def _missing():
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not shutil.which(path):
            return "%s is missing (apt-get install chromium chromium-driver)" % path
    return None


def chrome(env=None):
    """Headless Chromium through chromedriver (started with `env` when given), or the test
    skipped (failed where the databases are required, as in CI) when either is missing."""
    reason = _missing()
    if reason:
        if databases_required():
            pytest.fail(reason + " (required in CI)")
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1400,1000", "--no-proxy-server",
                     # A DNS rebinding attack's end state: the attacker's name resolves to
                     # this host's loopback address.
                     "--host-resolver-rules=MAP %s 127.0.0.1" % REBOUND):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER, env=env), options=options)
    driver.set_page_load_timeout(60)
    return driver


@pytest.fixture(scope="module")
def browser():
    driver = chrome()
    yield driver
    driver.quit()


@pytest.fixture
def site(sqlite_db):
    queue = sqlite_db.queue()
    served = Served(queue.store)
    served.queue, served.db = queue, sqlite_db
    yield served
    served.stop()
    queue.close()


def console_errors(driver):
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def screenshot(driver, name, tmp_path):
    directory = os.environ.get("TASKRUNNER_SCREENSHOTS") or str(tmp_path)
    os.makedirs(directory, exist_ok=True)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, max(700, min(int(height) + 40, 2400)))
    path = os.path.join(directory, name + ".png")
    driver.save_screenshot(path)
    driver.set_window_size(1400, 1000)
    return path


def by_css(driver, selector):
    from selenium.webdriver.common.by import By
    return driver.find_elements(By.CSS_SELECTOR, selector)


def test_every_page_loads_without_console_errors(browser, site, tmp_path):
    queue = site.queue
    ids = history(queue)
    from taskrunner.periodic import scheduler as periodic
    periodic.add_periodic(queue.store, "nightly-report", "taskrunner.handlers.Echo", "*-*-* 02:00",
                          group="reports", subject="The nightly sales report")
    periodic.add_periodic(queue.store, "every-5-min", "taskrunner.handlers.Echo", "every 5min",
                          group="chores")
    # Two every-minute ones defined two minutes ago, due now: each submits a task, run in
    # this process (statistics to show).
    earlier = utcnow() - timedelta(minutes=2)
    periodic.add_periodic(queue.store, "flaky-sync", "taskrunner.handlers.Fail", "every 1min",
                          group="chores", data={"code": "SyncFailed"}, now=earlier)
    periodic.add_periodic(queue.store, "cache-warmup", "taskrunner.handlers.Echo", "every 1min",
                          group="chores", subject="Keeps the caches warm", now=earlier)
    periodic.PeriodicScheduler(queue.store).run_pending()
    queue.run_pending()
    periodic.set_enabled(queue.store, "every-5-min", False)
    queue.add_task("taskrunner.handlers.Echo", queue="mail")
    queue.pause_queue("mail")
    xss = queue.add_task("taskrunner.handlers.Echo", {"html": "<script>alert('x')</script>"})
    queue.run_pending()
    browser.get_log("browser")
    pages = dict(PAGES, **{"periodic-group": "/periodic?group=chores"})
    pages.update(task="/tasks/%d" % ids["failed"], xss="/tasks/%d" % xss)   # xss: the last
    for name, path in pages.items():
        browser.get(site.url + path)
        assert by_css(browser, "main h1"), name
        if path in ("/", "/runners") or path.startswith("/tasks/"):
            # Wait for one live refresh: the JSON endpoint answered and the part was swapped.
            wait_for(lambda: browser.execute_script(
                "return document.body.getAttribute('data-refreshes')"), timeout=30,
                message="a live refresh of " + name)
        assert console_errors(browser) == [], name
        screenshot(browser, name, tmp_path)
    # The task whose data holds a script: shown as text, never run.
    assert "<script>alert('x')</script>" in browser.find_element("css selector", "main").text
    assert browser.execute_script("return document.querySelectorAll('main script').length") == 0


def test_filters_narrow_the_task_list(browser, site):
    from selenium.webdriver.support.ui import Select
    ids = history(site.queue)
    browser.get(site.url + "/tasks")
    assert len(by_css(browser, "table.tasks tbody tr")) == 6
    Select(browser.find_element("name", "status")).select_by_value("given-up")
    browser.find_element("css selector", "#task-filters button").click()
    wait_for(lambda: "status=given-up" in browser.current_url, message="the filtered URL")
    rows = by_css(browser, "table.tasks tbody tr")
    assert [r.find_element("css selector", "td a").text for r in rows] == [str(ids["failed"])]
    browser.get(site.url + "/tasks?handler=taskrunner.handlers.Fail")
    assert len(by_css(browser, "table.tasks tbody tr")) == 2
    # From the Failures page: the given-up tasks of one handler and error code.
    browser.get(site.url + "/failures")
    browser.find_element("css selector", "a[href*='error=Planned'][href*='given-up']").click()
    wait_for(lambda: "error=Planned" in browser.current_url, message="the failures link")
    rows = by_css(browser, "table.tasks tbody tr")
    assert [r.find_element("css selector", "td a").text for r in rows] == [str(ids["failed"])]
    browser.get(site.url + "/tasks?since=2999-01-01T00:00")
    assert by_css(browser, "table.tasks tbody tr") == []
    assert "no task matches" in browser.find_element("css selector", "main").text
    from test_dashboard import periodic_submission
    submitted = periodic_submission(site.queue)
    browser.get(site.url + "/periodic")
    browser.find_element("link text", "every-minute").click()
    wait_for(lambda: "periodic=every-minute" in browser.current_url, message="the periodic link")
    rows = by_css(browser, "table.tasks tbody tr")
    assert [r.find_element("css selector", "td a").text for r in rows] == [str(submitted[0])]
    browser.get(site.url + "/tasks?since=yesterday")
    assert "invalid since time" in browser.find_element("css selector", "main").text


def live_text(browser, element_id):
    """The text of a live part, or "" while the refresh replaces it."""
    from selenium.common.exceptions import WebDriverException
    try:
        return browser.find_element("id", element_id).text
    except WebDriverException:
        return ""


def test_live_progress_bar_moves_while_a_real_runner_works(browser, site, procs, tmp_path):
    task_id = site.queue.add_task("taskrunner.handlers.Sleep", {"seconds": 8})
    config = site.db.write_config(tmp_path / "c.toml", "[runner]\npoll_interval = 0.2\n")
    procs.spawn("runner", "--burst", config=config, name="runner")
    browser.get_log("browser")
    browser.get(site.url + "/runners")
    browser.execute_script("window.notReloaded = true")

    def percent():
        from selenium.common.exceptions import WebDriverException
        try:        # the live refresh may replace the bar while it is read
            bars = by_css(browser, "#runners-live progress")
            return bars and int(bars[0].get_attribute("value"))
        except WebDriverException:
            return None
    first = wait_for(percent, timeout=60, interval=0.2, message="the runner's progress bar")
    wait_for(lambda: (percent() or 0) >= first + 15, timeout=30, interval=0.2,
             message="the progress bar to move on from %s%%" % first)
    assert browser.execute_script("return window.notReloaded") is True
    assert "task %d" % task_id in browser.find_element("id", "runners-live").text
    screenshot(browser, "runners", tmp_path)
    # The task page's run table is live too.
    browser.get(site.url + "/tasks/%d" % task_id)
    browser.execute_script("window.notReloaded = true")
    wait_for(lambda: "success" in live_text(browser, "task-live"), timeout=30,
             interval=0.2, message="the run to end on the task page")
    assert browser.execute_script("return window.notReloaded") is True
    assert console_errors(browser) == []


def notice(browser, selector=".notice"):
    """The page's notice (or the element of `selector`), or "" while the page that has one
    is still loading (a click's POST and redirect take a moment: finding the element at once
    would fail, not wait)."""
    from selenium.common.exceptions import WebDriverException
    try:
        found = browser.find_elements("css selector", selector)
        return found[0].text if found else ""
    except WebDriverException:      # the old page went away while it was read
        return ""


def click_live(browser, xpath):
    """Click a button of a live part: the part may be swapped between finding and clicking
    (a stale element), then it is found again."""
    from selenium.common.exceptions import StaleElementReferenceException

    def clicked():
        try:
            browser.find_element("xpath", xpath).click()
            return True
        except StaleElementReferenceException:
            return False
    wait_for(clicked, timeout=10, interval=0.1, message="a click on " + xpath)


def test_retry_cancel_and_bulk_actions_change_the_database(browser, site):
    queue = site.queue
    ids = history(queue)
    browser.get(site.url + "/tasks/%d" % ids["failed"])
    browser.find_element("xpath", "//button[text()='Retry']").click()
    wait_for(lambda: "re-armed" in notice(browser))
    assert queue.get_task(ids["failed"]).status == "scheduled"

    browser.get(site.url + "/tasks/%d" % ids["later"])
    browser.find_element("xpath", "//button[text()='Cancel']").click()
    wait_for(lambda: "cancelled" in notice(browser))
    assert queue.get_task(ids["later"]).status == "cancelled"

    # Bulk: cancel every scheduled Echo task, after a confirmation page.
    browser.get(site.url + "/tasks?status=scheduled&handler=taskrunner.handlers.Echo")
    browser.find_element("xpath", "//button[text()='Cancel all…']").click()
    # The click submits a form: the confirmation is the next page, not this one.
    text = wait_for(lambda: notice(browser, ".confirm"), message="the confirmation page")
    assert "Cancel 1 task(s)" in text and "status scheduled" in text
    assert queue.get_task(ids["due"]).status == "scheduled"      # nothing done yet
    browser.find_element("xpath", "//button[starts-with(text(), 'Yes, cancel')]").click()
    wait_for(lambda: "1 task(s) done" in notice(browser))
    assert queue.get_task(ids["due"]).status == "cancelled"

    from taskrunner.periodic import scheduler as periodic
    from taskrunner.reads import records as reads
    periodic.add_periodic(queue.store, "nightly", "taskrunner.handlers.Echo", "*-*-* 02:00")
    browser.get(site.url + "/periodic")
    browser.find_element("xpath", "//button[text()='Disable']").click()
    wait_for(lambda: "disabled" in notice(browser))
    assert [p.enabled for p in reads.list_periodic(queue.store)] == [False]
    browser.find_element("xpath", "//button[text()='Enable']").click()
    wait_for(lambda: [p.enabled for p in reads.list_periodic(queue.store)] == [True])

    # Pause and resume a queue from the overview's queue table.
    queue.add_task("taskrunner.handlers.Echo", queue="mail")

    def paused():
        return {q.name: q.paused for q in reads.queue_stats(queue.store)}
    browser.get(site.url + "/")
    click_live(browser, "//section[@id='queues']//tr[td/a[text()='mail']]//button[text()='Pause']")
    wait_for(lambda: "queue 'mail' paused" in notice(browser))
    assert paused() == {"default": False, "mail": True}
    click_live(browser, "//section[@id='queues']//tr[td/a[text()='mail']]//button[text()='Resume']")
    wait_for(lambda: "resumed" in notice(browser))
    assert paused()["mail"] is False


def test_a_post_without_the_csrf_token_is_refused(browser, site):
    ids = history(site.queue)
    browser.get(site.url + "/tasks/%d" % ids["failed"])
    status = browser.execute_async_script(
        "var done = arguments[arguments.length - 1];"
        "fetch('/tasks/%d/retry', {method: 'POST', body: new URLSearchParams({x: '1'})})"
        ".then(function (r) { done(r.status); });" % ids["failed"])
    assert status == 403
    assert site.queue.get_task(ids["failed"]).status == "given-up"


def test_a_dns_rebinding_page_reads_nothing_and_changes_nothing(browser, site):
    """A page of rebind.evil.example, whose name now resolves to 127.0.0.1, loads the
    dashboard's pages and posts with a CSRF token (one it stole, even): every request names
    its own Host, and gets a refusal without task data."""
    from taskrunner.reads import records as reads
    queue = site.queue
    task_id = queue.add_task("taskrunner.handlers.Echo", {"note": "s3-data"}, queue="mail")
    browser.get(site.url + "/tasks/%d" % task_id)
    token = browser.find_element("css selector", 'input[name="csrf"]').get_attribute("value")
    assert "s3-data" in browser.find_element("css selector", "main").text

    evil = site.url.replace("127.0.0.1", REBOUND)
    browser.get(evil + "/tasks/%d" % task_id)
    text = browser.find_element("css selector", "body").text
    assert "unknown Host" in text and "s3-data" not in text and token not in browser.page_source
    answers = browser.execute_async_script(
        "var done = arguments[arguments.length - 1];"
        "Promise.all([fetch('/api/parts?page=task&id=%d').then(function (r) {"
        "  return r.text().then(function (t) { return [r.status, t]; }); }),"
        " fetch('/queues/pause', {method: 'POST', body: new URLSearchParams("
        "  {csrf: '%s', name: 'mail'})}).then(function (r) { return [r.status, ''] })])"
        ".then(done);" % (task_id, token))
    assert [status for status, _ in answers] == [403, 403], answers
    assert "s3-data" not in answers[0][1]
    assert not any(q.paused for q in reads.queue_stats(queue.store))


OVERFLOW = """
var width = window.innerWidth, problems = [];
if (document.documentElement.scrollWidth > width) {
  problems.push('page scrolls sideways: ' + document.documentElement.scrollWidth);
}
document.querySelectorAll('header nav a').forEach(function (a) {
  var r = a.getBoundingClientRect();
  if (r.width === 0 || r.right > width || r.left < 0) { problems.push('nav cut: ' + a.textContent); }
});
document.querySelectorAll('main table').forEach(function (t) {
  var box = t.parentElement, r = box.getBoundingClientRect();
  if (r.right > width + 1) { problems.push('table box cut: ' + t.className); }
  if (t.scrollWidth > box.clientWidth + 1 && getComputedStyle(box).overflowX !== 'auto') {
    problems.push('table does not scroll in its box: ' + t.className);
  }
});
return problems;
"""


def test_every_page_is_usable_on_a_390_px_phone(browser, site, tmp_path):
    """Nothing cut off: the navigation wraps, a wide table scrolls inside its own box."""
    queue = site.queue
    ids = history(queue)
    from taskrunner.periodic import scheduler as periodic
    periodic.add_periodic(queue.store, "nightly-report", "taskrunner.handlers.Echo",
                          "*-*-* 02:00", group="reports", subject="The nightly sales report")
    queue.add_task("taskrunner.handlers.Echo", queue="mail")
    browser.set_window_size(390, 844)
    try:
        pages = dict(PAGES, task="/tasks/%d" % ids["failed"])
        for name, path in pages.items():
            browser.get(site.url + path)
            assert by_css(browser, "main h1"), name
            assert browser.execute_script(OVERFLOW) == [], name
            directory = os.environ.get("TASKRUNNER_SCREENSHOTS") or str(tmp_path)
            browser.save_screenshot(os.path.join(directory, "phone-%s.png" % name))
    finally:
        browser.set_window_size(1400, 1000)


def test_the_periodic_table_fits_1280_px(browser, site):
    queue = site.queue
    from taskrunner.periodic import scheduler as periodic
    earlier = utcnow() - timedelta(minutes=2)
    periodic.add_periodic(queue.store, "nightly-report-for-every-tenant",
                          "taskrunner.handlers.Echo", "Mon..Fri *-*-* 02:00:00 Europe/Berlin",
                          group="reports", subject="The nightly sales report of each tenant")
    periodic.add_periodic(queue.store, "flaky-sync", "taskrunner.handlers.Fail", "every 1min",
                          group="chores", data={"code": "SyncFailed"}, now=earlier)
    periodic.PeriodicScheduler(queue.store).run_pending()
    queue.run_pending()
    browser.set_window_size(1280, 900)
    try:
        browser.get(site.url + "/periodic")
        fits = browser.execute_script(
            "var t = document.querySelector('table.periodic');"
            "return [t.scrollWidth, t.parentElement.clientWidth,"
            " document.documentElement.scrollWidth, window.innerWidth];")
        assert fits[0] <= fits[1] and fits[2] <= fits[3], fits
    finally:
        browser.set_window_size(1400, 1000)


@pytest.fixture
def kolkata_browser():
    """A browser whose zone is Asia/Kolkata (UTC+5:30, no daylight saving)."""
    driver = chrome(env=dict(os.environ, TZ="Asia/Kolkata"))
    yield driver
    driver.quit()


def test_times_are_shown_in_the_viewers_zone_said_once(kolkata_browser, site):
    from datetime import datetime, timezone
    queue = site.queue
    at = datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    task_id = queue.add_task("taskrunner.handlers.Echo", scheduled_on=at)
    for path in ("/tasks", "/tasks/%d" % task_id):
        kolkata_browser.get(site.url + path)
        texts = [t.text for t in by_css(kolkata_browser, "main time")]
        assert "2030-01-02 08:34:05" in texts, (path, texts)        # 03:04:05 UTC + 5:30
        zone = by_css(kolkata_browser, "#zone")[0].text
        assert "Kolkata" in zone or "Calcutta" in zone, zone
        headers = " ".join(th.text for th in by_css(kolkata_browser, "main th"))
        assert "UTC" not in headers, headers


def test_the_workflow_page_draws_the_graph_and_refreshes(browser, site, tmp_path):
    """A fan-out of three after one task and a fan-in after them: the page draws three levels
    with each task's state and its parents as links, refreshes live without console errors,
    and the task page's workflow link leads there."""
    queue = site.queue
    step = "taskrunner.handlers.Echo"
    wf = queue.add_workflow([{"key": "root", "handler": step}]
                            + [{"key": "b%d" % i, "handler": step, "after": ["root"]}
                               for i in range(3)]
                            + [{"key": "report", "handler": step,
                                "after": ["b0", "b1", "b2"]}], name="<i>fan</i>")
    queue.run_pending(max_runs=2)
    browser.get_log("browser")
    browser.get(site.url + "/tasks/%d" % wf.task_ids[-1])
    link = by_css(browser, 'a[href="/workflows/%d"]' % wf.id)
    assert link, "the task page links to its workflow"
    link[0].click()
    wait_for(lambda: browser.execute_script(
        "return document.body.getAttribute('data-refreshes')"), timeout=30,
        message="a live refresh of the workflow page")
    assert browser.find_element("css selector", "main h1").text == "Workflow %d" % wf.id
    levels = by_css(browser, "ol.graph > li.level")
    assert len(levels) == 3
    assert [len(level.find_elements("css selector", "li.wf-task")) for level in levels] \
        == [1, 3, 1]
    fan_in = browser.find_element("css selector", "#wf-task-%d" % wf.task_ids[-1])
    assert "waiting" in fan_in.text and fan_in.is_displayed()
    assert sorted(a.get_attribute("href").rsplit("/", 1)[1] for a in fan_in.find_elements(
        "css selector", "small a")) == sorted(str(t) for t in wf.task_ids[1:4])
    assert "<i>fan</i>" in browser.find_element("css selector", "main").text
    assert console_errors(browser) == []
    screenshot(browser, "workflow", tmp_path)

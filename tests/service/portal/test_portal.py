"""The portal (services/api/portal) in a real headless browser: the system's Chromium driven by Playwright, against a
running platform (admission, scheduler, simulated executor, metering, audit, API) on real NATS and Postgres.

A newcomer signs in with a team token, submits a PyTorch DDP job from its template, finds it in "my jobs" with its
explanation (why it waits, its position), sees the queues and the team's costs; another team's token sees none of
it. The forms refuse requests without their CSRF token, the token never appears in a page, and what users type
is escaped.

Screenshots: each page is compared with its baseline in screenshots/ (Pillow: the share of pixels that differ must
stay under MAX_DIFF_RATIO), with what changes from run to run (times, waits, figures) masked, so that a broken
layout fails while the clock does not. After a deliberate change of the pages, regenerate the baselines with
    GPUQ_UPDATE_SCREENSHOTS=1 .venv/bin/pytest tests/service/portal
and commit them (look at them first). A failed comparison leaves the page and a diff image in the pytest tmp dir.
GPUQ_PORTAL_SHOWCASE_DIR=DIR also saves every page, unmasked, as DIR/portal-<page>.png.
`make test` installs the browser (scripts/ensure-chromium.sh); without /usr/bin/chromium these tests fail saying so.
"""

from __future__ import annotations

import io
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import pytest
import pytest_asyncio
from PIL import Image, ImageChops
from playwright.async_api import Browser, Page, async_playwright

from services.api import tokens
from services.api.portal.web import csrf_for
from services.stack import Stack, StackSettings
from shared.clock import ScaledClock
from shared.config import parse_cluster, parse_queues
from shared.servers import free_port
from tests.conftest import reset_bus, reset_db

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOTS = Path(__file__).parent / "screenshots"
UPDATE = os.environ.get("GPUQ_UPDATE_SCREENSHOTS") == "1"
SHOWCASE = os.environ.get("GPUQ_PORTAL_SHOWCASE_DIR")  # also save each page there, unmasked
MAX_DIFF_RATIO = 0.002  # share of pixels that may differ (masks a digit wider or narrower); a moved block is more
PIXEL_THRESHOLD = 48  # a channel difference below this is antialiasing, not a difference
VIEWPORT = {"width": 1280, "height": 720}

CLUSTER = parse_cluster({"node_groups": [{"name": "h100", "count": 2, "gpus_per_node": 8, "gpu_model": "H100-80GB",
                                          "cpu_milli": 96000, "memory_mib": 1_000_000, "nodes_per_rack": 2}]},
                        "portal test cluster")
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 8}}},
               {"name": "team-b", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 8}}}],
}, "portal test queues")
LONG = "sim.gpuq.io/duration-s"


@dataclass
class Portal:
    base: str
    tokens: dict[str, str]
    conn: asyncpg.Connection


async def wait_for(check: Callable[[], Awaitable[object]], what: str, timeout: float = 60.0) -> object:
    import asyncio

    deadline = asyncio.get_running_loop().time() + timeout
    while not (value := await check()):
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)
    return value


@pytest_asyncio.fixture
async def portal(nats_url: str, database_url: str) -> AsyncIterator[Portal]:
    await reset_bus(nats_url)
    await reset_db(database_url)
    port = free_port()
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=CLUSTER,
                             services=("admission", "scheduler", "executor", "metering", "audit", "api"),
                             clock=ScaledClock(100.0), api_port=port)
    async with Stack(settings):
        conn = await asyncpg.connect(database_url)
        try:
            issued = {"a": (await tokens.issue(conn, "alice", team="team-a")).token,
                      "b": (await tokens.issue(conn, "mallory", team="team-b")).token,
                      "admin": (await tokens.issue(conn, "ops", team=None, admin=True)).token}
            base = f"http://127.0.0.1:{port}"
            await wait_for(lambda: _healthy(base), "the API listening")
            yield Portal(base, issued, conn)
        finally:
            await conn.close()


async def _healthy(base: str) -> bool:
    try:
        async with httpx.AsyncClient() as c:
            return (await c.get(base + "/healthz")).status_code == 200
    except httpx.HTTPError:
        return False


@pytest_asyncio.fixture
async def browser() -> AsyncIterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/ensure-chromium.sh (apt-get install -y chromium)")
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            await b.close()


async def signed_in(browser: Browser, portal: Portal, who: str) -> Page:
    context = await browser.new_context(viewport=VIEWPORT, device_scale_factor=1, timezone_id="UTC",
                                        locale="en-US")
    page = await context.new_page()
    await page.goto(portal.base + "/ui/")
    assert page.url.endswith("/ui/login")
    await page.fill("#token", portal.tokens[who])
    await page.click("button[type=submit]")
    await page.wait_for_load_state()
    assert page.url.endswith("/ui/jobs"), await page.content()
    return page


async def submit_api(portal: Portal, who: str, job_id: str, gpus: int, duration_s: int) -> None:
    body = {"job_id": job_id, "team": f"team-{who}", "queue": f"team-{who}", "max_runtime_s": 10_000_000,
            "pod_sets": [{"count": 1, "gpus_per_pod": gpus}], "labels": {LONG: str(duration_s)}}
    async with httpx.AsyncClient(base_url=portal.base, timeout=30) as c:
        r = await c.post("/v1/jobs", json=body, headers={"Authorization": f"Bearer {portal.tokens[who]}"})
    assert r.status_code == 202 and r.json()[0]["verdict"] == "queued", r.text


async def running(portal: Portal, job_id: str) -> None:
    await wait_for(lambda: portal.conn.fetchval("SELECT status = 'running' FROM executor.runs WHERE job_id = $1",
                                                job_id), f"{job_id} running")


async def same_as_baseline(page: Page, name: str, tmp_path: Path) -> None:
    """The page (full height, changing content masked) against screenshots/<name>.png."""
    png = await page.screenshot(full_page=True, mask=[page.locator(".dyn")], mask_color="#c8cdd6",
                                animations="disabled", caret="hide")
    if SHOWCASE:  # the pages as people see them, unmasked (for release notes)
        await page.screenshot(path=Path(SHOWCASE) / f"portal-{name}.png", full_page=True)
    baseline = SCREENSHOTS / f"{name}.png"
    if UPDATE or not baseline.exists():
        if not UPDATE:
            pytest.fail(f"no baseline {baseline}: run with GPUQ_UPDATE_SCREENSHOTS=1 to make it, then commit it")
        SCREENSHOTS.mkdir(exist_ok=True)
        baseline.write_bytes(png)
        return
    ratio, diff = difference(Image.open(baseline), Image.open(io.BytesIO(png)))
    print(f"screenshot {name}: {ratio:.4%} of the pixels differ from the baseline")
    if ratio > MAX_DIFF_RATIO:
        (tmp_path / f"{name}.actual.png").write_bytes(png)
        if diff is not None:
            diff.save(tmp_path / f"{name}.diff.png")
        pytest.fail(f"page {name} differs from {baseline.name} in {ratio:.2%} of its pixels (at most "
                    f"{MAX_DIFF_RATIO:.1%}): see {tmp_path}; GPUQ_UPDATE_SCREENSHOTS=1 regenerates the baselines")


def difference(expected: Image.Image, actual: Image.Image) -> tuple[float, Image.Image | None]:
    """The share of pixels that differ noticeably (1.0 when the sizes differ: the layout moved), and where."""
    a, b = expected.convert("RGB"), actual.convert("RGB")
    if a.size != b.size:
        return 1.0, None
    diff = ImageChops.difference(a, b).convert("L").point(lambda v: 255 if v >= PIXEL_THRESHOLD else 0)
    changed = diff.histogram()[255]
    return changed / (a.size[0] * a.size[1]), diff


async def test_newcomer_signs_in_submits_from_a_template_and_follows_the_job(
        portal: Portal, browser: Browser, tmp_path: Path) -> None:
    # team-a's quota (8 GPUs) is taken by a long job, so the one from the portal waits, first in its queue;
    # team-b has a job of its own, which team-a's pages never show
    await submit_api(portal, "a", "a-long", gpus=8, duration_s=10_000_000)
    await submit_api(portal, "b", "b-secret", gpus=8, duration_s=10_000_000)
    await running(portal, "a-long")
    await running(portal, "b-secret")

    page = await signed_in(browser, portal, "a")
    assert await page.text_content("#who") == "alice · team team-a"
    cookie = next(c for c in await page.context.cookies() if c["name"] == "gpuq_portal")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert "b-secret" not in await page.content()
    assert portal.tokens["a"] not in await page.content()

    await page.click("text=Templates")
    await page.wait_for_url("**/ui/templates")
    assert [t.strip() for t in await page.locator("ul.catalogue h2").all_text_contents()] == [
        "PyTorch DDP", "Ray cluster", "MPI", "Notebook"]
    await same_as_baseline(page, "templates", tmp_path)

    await page.click("text=PyTorch DDP")
    await page.fill("#f-name", "ddp-portal")
    await page.fill("#f-pods", "1")
    await page.select_option("#f-gpu_model", "H100-80GB")
    await page.click("button[value=preview]")
    preview = await page.text_content("#preview")
    assert preview is not None
    for line in ("job_id: ddp-portal", "team: team-a", "queue: team-a", "gpus_per_pod: 8", "- H100-80GB",
                 "max_runtime_s: 86400", "- torchrun"):
        assert line in preview, preview
    await same_as_baseline(page, "template-ddp", tmp_path)

    await page.click("button[value=submit]")
    await page.wait_for_selector("section.result")
    assert (await page.text_content("section.result .state")) == "queued"
    # submitted through POST /v1/jobs: admission holds the spec the form made, audited as alice's submission
    spec = await portal.conn.fetchval("SELECT spec FROM admission.jobs WHERE job_id = 'ddp-portal'")
    assert '"gpu_models": ["H100-80GB"]' in spec and '"team": "team-a"' in spec
    assert await portal.conn.fetchval("SELECT actor FROM audit.records WHERE action = 'submit_request' "
                                      "AND job_id = 'ddp-portal'") == "token:alice"

    await page.click("text=See it in my jobs")
    row = page.locator("#job-ddp-portal")
    assert await row.locator(".state").text_content() == "pending"
    explain = await row.locator("pre.explain").text_content()
    assert explain is not None and "position 1 in queue team-a" in explain and "expected start" in explain, explain
    assert "b-secret" not in await page.content()
    await same_as_baseline(page, "jobs", tmp_path)

    await page.click("text=Queues")
    await page.wait_for_url("**/ui/queues")
    team_a = page.locator("#queue-team-a td")
    assert (await team_a.all_text_contents())[2:8] == ["8 H100-80GB", "8 H100-80GB", "-", "-", "1", "1"]
    await same_as_baseline(page, "queues", tmp_path)

    # metering charges the running job: the team's report has team-a's queue, never team-b's
    await wait_for(lambda: _metered(portal, "a-long"), "metering's allocation of a-long")
    await page.click("text=Costs")
    await page.wait_for_url("**/ui/costs")
    assert [t.strip() for t in await page.locator("table.costs tbody td.id").all_text_contents()] == ["team-a"]
    await same_as_baseline(page, "costs", tmp_path)

    # team-b's token: its own job, none of team-a's
    other = await signed_in(browser, portal, "b")
    assert await other.locator("#job-b-secret").count() == 1
    assert "ddp-portal" not in await other.content() and "a-long" not in await other.content()

    # an admin's token: every team's jobs, and the form asks which team a job is for
    admin = await signed_in(browser, portal, "admin")
    assert await admin.text_content("#who") == "ops · platform admin"
    assert {"job-ddp-portal", "job-a-long", "job-b-secret"} <= set(
        await admin.locator("tr.job").evaluate_all("rows => rows.map(r => r.id)"))
    await admin.goto(portal.base + "/ui/templates/notebook")
    assert await admin.input_value("#f-team") == ""


async def _metered(portal: Portal, job_id: str) -> bool:
    return bool(await portal.conn.fetchval("SELECT count(*) > 0 FROM metering.allocations WHERE job_id = $1", job_id))


async def test_forms_need_their_csrf_token_and_pages_escape_what_users_type(portal: Portal, browser: Browser) -> None:
    page = await signed_in(browser, portal, "a")
    cookie = {"gpuq_portal": portal.tokens["a"]}
    async with httpx.AsyncClient(base_url=portal.base, cookies=cookie) as c:
        # a form posted from elsewhere: right cookie, no CSRF token (or a wrong one): refused, nothing submitted
        for csrf in ("", "0" * 64):
            r = await c.post("/ui/templates/notebook", data={"csrf": csrf, "action": "submit", "name": "forged",
                                                             "queue": "team-a"})
            assert r.status_code == 403 and "expired" in r.text
        # the right CSRF token from a page of another origin (a browser says which): refused; from this one: shown
        form = {"csrf": csrf_for(portal.tokens["a"]), "action": "preview", "name": "nb-origin", "queue": "team-a"}
        r = await c.post("/ui/templates/notebook", data=form, headers={"Origin": "http://evil.example"})
        assert r.status_code == 403
        r = await c.post("/ui/templates/notebook", data=form, headers={"Origin": portal.base})
        assert r.status_code == 200 and "job_id: nb-origin" in r.text
        r = await c.post("/ui/login", data={"csrf": "guess", "token": portal.tokens["b"]})
        assert r.status_code == 403 and "gpuq_portal=" not in r.headers.get("set-cookie", "")
        assert r.headers["content-security-policy"].startswith("default-src 'none'")
    assert await portal.conn.fetchval("SELECT count(*) FROM audit.records WHERE job_id = 'forged'") == 0

    # what a user types comes back as text: an image tag in the command is shown, not run or rendered
    await page.goto(portal.base + "/ui/templates/notebook")
    await page.fill("#f-command", "echo <img src=x onerror=alert(1)> '<b>bold</b>'")
    await page.fill("#f-name", "<script>")
    await page.click("button[value=preview]")
    assert "'<script>' is not a valid name" in (await page.text_content("p.error") or "")
    await page.fill("#f-name", "nb-1")
    await page.click("button[value=preview]")
    assert "<b>bold</b>" in (await page.text_content("#preview") or "")
    assert await page.locator("img, b, main script").count() == 0

    # the API's refusals come back on the form in its words: a name taken already (its 409)
    await page.fill("#f-name", "nb-twice")
    await page.click("button[value=submit]")
    assert await page.text_content("section.result .state") == "queued"
    await page.goto(portal.base + "/ui/templates/notebook")
    await page.fill("#f-name", "nb-twice")
    await page.click("button[value=submit]")
    assert "DuplicateJobId: job id nb-twice was already submitted" in (await page.text_content("p.error") or "")

    # a bad token signs nobody in, and the page does not repeat it
    fresh = await browser.new_page()
    await fresh.goto(portal.base + "/ui/login")
    await fresh.fill("#token", "gpuq_nope.secret-typed-by-mistake")
    await fresh.click("button[type=submit]")
    assert "unknown, expired or revoked token" in (await fresh.text_content("p.error") or "")
    assert "secret-typed-by-mistake" not in await fresh.content()

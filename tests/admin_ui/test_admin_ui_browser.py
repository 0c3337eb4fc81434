"""The admin UI in a real browser (Debian's chromium, headless, driven by Playwright) against the
real server on loopback: sign in, upload a PEFT adapter by drag and drop and watch it validate,
bad uploads (file picker) refused with their reason, tenants and keys, a key used by the
``openai`` client and seen on the dashboard, revoked and refused, the playground streaming, a
tenant's own view, and a phone width. Every page is screenshotted (``LORAPLEX_SCREENSHOT_DIR``,
else a temporary folder), and no page may request anything from outside the server.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.admin_ui import LAUNCH_ARGS, chromium_path
from support.gateway import ADAPTER_SPEC, ADMIN, ADMIN_TOKEN, BASE, MAX_LORA_RANK, settings_for, zip_bytes
from support.servers import UIServer, start_ui_server

from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine

pytestmark = pytest.mark.slow

TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def ui_server(tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[UIServer]:
    config = EngineConfig(
        model=str(tiny_dirs["gqa_tied"]),
        dtype="float32",
        num_kv_blocks=128,
        enable_lora=True,
        max_lora_rank=MAX_LORA_RANK,
        max_loras=2,
    )
    tmp = tmp_path_factory.mktemp("ui")
    settings = settings_for(tmp, f"sqlite+aiosqlite:///{tmp / 'g.db'}")
    server = start_ui_server(AsyncEngine(LLMEngine(config)), settings)
    server.store = tmp / "store"  # type: ignore[attr-defined]
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = os.environ.get("LORAPLEX_SCREENSHOT_DIR")
    path = Path(folder) if folder else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _archive(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


@pytest.fixture(scope="module")
def bad_uploads(
    tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, peft_adapter_dir: Path
) -> dict[str, tuple[Path, str]]:
    """Archives the server must refuse, with a word of the reason it must give."""
    from support.adapters import make_peft_adapter

    out = tmp_path_factory.mktemp("bad")
    high = out / "rank16"
    make_peft_adapter(tiny_dirs["gqa_tied"], high, seed=3, spec={**ADAPTER_SPEC, "r": 16, "lora_alpha": 32})
    config = (peft_adapter_dir / "adapter_config.json").read_bytes()
    files = {
        "pickle": _archive({"adapter_config.json": config, "adapter_model.bin": pickle.dumps({"a": 1})}),
        "rank": zip_bytes(high),
        "zip-slip": _archive({"../../evil/adapter_config.json": config, "adapter_model.safetensors": b"x"}),
    }
    reasons = {"pickle": "pickle|safetensors|\\.bin", "rank": "rank", "zip-slip": "outside|path|\\.\\."}
    made = {}
    for name, data in files.items():
        path = out / f"{name}.zip"
        path.write_bytes(data)
        made[name] = (path, reasons[name])
    return made


def _store_files(server: UIServer) -> set[Path]:
    root: Path = server.store  # type: ignore[attr-defined]
    return {p for p in root.rglob("*") if p.is_file() and "staging" not in p.parts}


def test_the_admin_ui_in_a_browser(
    ui_server: UIServer,
    shots: Path,
    peft_adapter_dir: Path,
    bad_uploads: dict[str, tuple[Path, str]],
    tmp_path: Path,
) -> None:
    # playwright is in the dev extra (./dev test installs it): missing, the import fails the test.
    executable = chromium_path()
    import openai
    from playwright.sync_api import Page, expect, sync_playwright

    expect.set_options(timeout=TIMEOUT_MS)  # a loaded machine; the dashboard's chart reads every 10 s
    url = ui_server.url
    outside: list[str] = []

    def watch(page: Page) -> Page:
        page.set_default_timeout(TIMEOUT_MS)
        page.on(
            "request",
            lambda r: None if r.url.startswith((url, "data:", "blob:")) else outside.append(r.url),
        )
        page.on("dialog", lambda d: d.accept())
        return page

    def nav(page: Page, name: str) -> Any:
        return page.get_by_role("navigation", name="Main").get_by_role("link", name=name)

    def shot(page: Page, name: str) -> None:
        page.screenshot(path=str(shots / f"admin-{name}.png"), full_page=True)

    archive = tmp_path / "adapter.zip"
    archive.write_bytes(zip_bytes(peft_adapter_dir))

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(executable), headless=True, args=LAUNCH_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 860})
        page = watch(context.new_page())

        # -- sign in: a wrong credential, then the admin token ------------------------------------
        page.goto(f"{url}/admin")
        expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
        shot(page, "signin")
        page.get_by_label("Admin token or API key").fill("lpx-not-a-key")
        page.get_by_role("button", name="Sign in").click()
        expect(page.locator("#signin-error")).to_contain_text("neither the admin token")
        page.get_by_label("Admin token or API key").fill(ADMIN_TOKEN)
        page.get_by_role("button", name="Sign in").click()
        expect(page).to_have_url(f"{url}/admin/dashboard")
        expect(page.locator("#live-state")).to_contain_text("live")
        shot(page, "dashboard-empty")

        # -- tenants: a bad quota is shown at its field, then the tenant is created ---------------
        nav(page, "Tenants").click()
        page.get_by_label("Name", exact=True).fill("acme")
        page.get_by_label("Requests per minute").fill("lots")
        page.get_by_role("button", name="Create tenant").click()
        expect(page.locator("#d-rpm")).to_contain_text("whole number")
        shot(page, "tenants-error")
        page.get_by_label("Requests per minute").fill("600")
        page.get_by_role("button", name="Create tenant").click()
        expect(page).to_have_url(f"{url}/admin/tenants/acme")
        page.get_by_label("Tokens per minute").fill("100000")
        page.get_by_role("button", name="Save quotas").click()
        expect(page.get_by_text("Quotas saved.")).to_be_visible()

        # -- a key, shown once ------------------------------------------------------------------
        page.get_by_label("Label").fill("browser-test")
        page.get_by_label("Expires in (days)").fill("soon")
        page.get_by_role("button", name="Create key").click()
        expect(page.locator("#d-key-days")).to_contain_text("number of days")
        page.get_by_label("Label").fill("browser-test")
        page.get_by_label("Expires in (days)").fill("30")
        page.get_by_role("button", name="Create key").click()
        key = page.locator("#new-key").input_value()
        assert key.startswith("lpx-")
        expect(page.locator("table").last).to_contain_text("browser-test")
        assert page.locator("table").last.locator("tbody tr td").nth(5).inner_text() != "-"  # expires
        shot(page, "tenant-new-key")
        nav(page, "Tenants").click()
        expect(page.get_by_role("link", name="acme")).to_be_visible()
        shot(page, "tenants")

        # -- upload a real PEFT adapter: progress, the validation answer, the list ----------------
        nav(page, "Adapters").click()
        page.get_by_label("Tenant", exact=True).first.fill("acme")
        page.get_by_label("Name", exact=True).fill("sql")
        # dropped onto the drop zone, as a user drags it from a file manager
        dropped = page.evaluate_handle(
            """(b64) => {
                const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
                const data = new DataTransfer();
                data.items.add(new File([bytes], "adapter.zip", { type: "application/zip" }));
                return data;
            }""",
            base64.b64encode(archive.read_bytes()).decode(),
        )
        page.dispatch_event("#drop", "drop", {"dataTransfer": dropped})
        expect(page.locator("#file-list")).to_contain_text("adapter.zip")
        page.get_by_role("button", name="Upload").click()
        result = page.locator("#upload-result .result")
        expect(result).to_contain_text("Stored acme/sql")
        expect(result).to_contain_text("q_proj")
        expect(result).to_contain_text(str(ADAPTER_SPEC["r"]))
        expect(page.locator("#adapter-table")).to_contain_text("sql")
        assert page.locator("#u-progress").evaluate("p => p.value") == 100
        shot(page, "adapters")
        stored = _store_files(ui_server)

        # -- bad uploads: each reason shown, nothing stored ----------------------------------------
        for name, (path, reason) in bad_uploads.items():
            page.get_by_label("Name", exact=True).fill(f"bad-{name}")
            page.set_input_files("#u-file", str(path))
            page.get_by_role("button", name="Upload").click()
            refusal = page.locator("#e-file")
            expect(refusal).to_be_visible()
            expect(refusal).to_contain_text("Refused")
            expect(refusal).to_contain_text(re.compile(reason, re.IGNORECASE))
            shot(page, f"upload-refused-{name}")
            assert _store_files(ui_server) == stored, name
        listed = httpx.get(f"{url}/admin/api/adapters", headers=ADMIN).json()["data"]
        assert [a["name"] for a in listed] == ["sql"]

        # -- the key with the openai client, on the adapter; the dashboard counts it ---------------
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        done = client.completions.create(model="sql", prompt="Hello", max_tokens=4, temperature=0)
        assert done.usage is not None and done.usage.completion_tokens == 4
        nav(page, "Dashboard").click()
        expect(page.locator('[data-k="requests"]')).not_to_have_text(re.compile(r"^(–|0)$"))
        expect(page.locator("#tenant-table")).to_contain_text("acme")
        expect(page.locator("#kv-tiers")).to_contain_text("accelerator")
        expect(page.locator("#adapter-tiers")).to_contain_text("accelerator")
        expect(page.locator("#tenant-chart")).to_contain_text("acme")
        nav(page, "Adapters").click()
        expect(page.locator("#adapter-table")).to_contain_text("accelerator slot")  # it just ran
        row = page.locator("#adapter-table tbody tr").first
        expect(row.locator("td").nth(8)).to_have_text("1")  # one request on it today
        shot(page, "adapters-served")
        nav(page, "Dashboard").click()
        client.completions.create(model=BASE, prompt="Hello again", max_tokens=8, temperature=0)
        expect(page.locator('[data-k="rps"]')).not_to_have_text("–")  # two polls: a rate
        expect(page.locator('[data-k="ttft"]')).to_have_text(re.compile(r"^[\d.,]+ / [\d.,]+ ms$"))
        page.wait_for_timeout(4500)  # a few points on the requests-per-second line
        shot(page, "dashboard")

        # -- the playground streams; two models side by side ---------------------------------------
        nav(page, "Playground").click()
        page.get_by_label("Run as tenant").fill("acme")
        page.get_by_role("button", name="Open playground").click()
        page.get_by_label("Model B").fill("sql")
        page.get_by_label("Max tokens").fill("8")
        with page.expect_response(lambda r: r.url.endswith("/admin/ui/completions?tenant=acme")) as streamed:
            page.get_by_role("button", name="Run").click()
        assert streamed.value.headers["content-type"].startswith("text/event-stream")
        expect(page.locator("#out-a")).not_to_be_empty()
        expect(page.locator("#out-b")).not_to_be_empty()
        expect(page.locator("#err-a")).to_be_hidden()
        shot(page, "playground")

        nav(page, "Usage").click()
        expect(page.locator("table")).to_contain_text("sql")
        shot(page, "usage")

        # -- revoke the key: the client gets 401 -----------------------------------------------------
        nav(page, "Tenants").click()
        page.get_by_role("link", name="acme").click()
        page.get_by_role("button", name="Revoke").click()
        expect(page.locator("table").last).to_contain_text("revoked")
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="sql", prompt="Hello", max_tokens=2)

        # -- a tenant signs in with its own key and sees only its own --------------------------------
        tenant_key = httpx.post(f"{url}/admin/api/tenants/acme/keys", json={}, headers=ADMIN).json()["key"]
        httpx.post(f"{url}/admin/api/tenants", json={"name": "beta"}, headers=ADMIN)
        tenant_context = browser.new_context(viewport={"width": 1280, "height": 860})
        tenant = watch(tenant_context.new_page())
        tenant.goto(f"{url}/admin")
        tenant.get_by_label("Admin token or API key").fill(tenant_key)
        tenant.get_by_role("button", name="Sign in").click()
        expect(tenant.locator(".badge")).to_have_text("acme")
        expect(nav(tenant, "Tenants")).to_have_count(0)
        nav(tenant, "Adapters").click()
        expect(tenant.locator("#adapter-table")).to_contain_text("sql")
        shot(tenant, "tenant-adapters")
        nav(tenant, "Keys").click()
        shot(tenant, "tenant-keys")
        assert "beta" not in tenant.content()
        forbidden = tenant.goto(f"{url}/admin/tenants")
        assert forbidden is not None and forbidden.status == 403
        tenant.goto(f"{url}/admin/dashboard")
        tenant.get_by_role("button", name="Sign out").click()
        expect(tenant.get_by_role("heading", name="Sign in")).to_be_visible()

        # -- a phone -----------------------------------------------------------------------------
        phone = watch(browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True).new_page())
        phone.goto(f"{url}/admin")
        phone.get_by_label("Admin token or API key").fill(ADMIN_TOKEN)
        phone.get_by_role("button", name="Sign in").click()
        expect(phone.locator("#live-state")).to_contain_text("live")
        width = phone.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"the dashboard is {width}px wide on a 390px phone"
        shot(phone, "dashboard-phone")
        for where in ("adapters", "tenants/acme", "usage"):
            phone.goto(f"{url}/admin/{where}")
            width = phone.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, (
                f"/admin/{where} is {width}px wide on a 390px phone (wide tables scroll inside)"
            )
        phone.goto(f"{url}/admin/adapters")
        shot(phone, "adapters-phone")
        # keyboard: the sign-out button is reachable with Tab from the top of the page
        phone.keyboard.press("Tab")
        focused: Any = phone.evaluate("document.activeElement.textContent")
        assert "Skip" in json.dumps(focused)
        browser.close()

    assert outside == [], f"pages requested something outside the server: {outside}"

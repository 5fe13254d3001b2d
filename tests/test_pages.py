"""The pages, in a real browser (headless Chromium through Playwright): the five panels you can
play, a run's live page following a run as it goes, a sweep's page; and what the page server will
and will not serve."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from browser import browser
from rich.console import Console
from run_helpers import checked, recipe_dict, run_metrics

from orbit.pages.live import LivePage, watching
from orbit.run.lifecycle import train

pytestmark = pytest.mark.slow


def _bench_recipe(model: Path, out: Path):
    return checked(recipe_dict(model, out, engine={"backend": "embedded"}))


@pytest.fixture(scope="module")
def bench_dir(tiny_llama, tmp_path_factory) -> Path:
    from orbit.measure.bench import run_bench

    out = tmp_path_factory.mktemp("bench")
    run_bench(
        _bench_recipe(tiny_llama, out / "x"), out, steps=3, warmup=1, console=Console(quiet=True)
    )
    return out / "embedded"


def test_the_panels_page_opens_offline_has_five_panels_and_plays(bench_dir):
    """panels.html is one file with its script inside: it opens with the network off, shows the five
    modes on one clock with their figures, a hover names a request's group and versions, and play
    moves the clock."""
    html = bench_dir / "panels.html"
    assert "cdn.plot.ly" not in html.read_text()[:2000]  # the script is inside, not fetched
    with browser(offline=True) as page:
        page.goto(html.as_uri())
        page.wait_for_function("document.getElementById('orbit-panels')?.layout !== undefined")
        layout = "document.getElementById('orbit-panels').layout"
        titles = page.evaluate(f"{layout}.annotations.map(a => a.text)")
        for mode in ("sync", "sync-adapter", "async-full", "async-adapter", "double-buffer"):
            assert any(
                t.startswith(f"<b>{mode} (") and "tok/s" in t and "floor" in t for t in titles
            ), mode
        assert (
            page.evaluate(f"Object.keys({layout}).filter(k => k.startsWith('yaxis')).length") == 5
        )
        hover = page.evaluate(
            "document.getElementById('orbit-panels').data.find(t => "
            "t.name.startsWith('version')).hovertemplate"
        )
        assert (
            "group" in hover
            and "versions" in hover
            and "spanned a flip" in hover
            and "aborted" in hover
        )
        before = page.evaluate(f"{layout}.shapes[0].x0")
        clock = "document.querySelector('.slider-container .slider-label').textContent"
        page.get_by_text("▶ play").click()
        page.wait_for_function(f"{layout}.shapes[0].x0 !== {before}", timeout=10_000)
        shown = []
        for _ in range(10):  # the clock reads a time on every frame, not only every 20th
            shown.append(page.evaluate(clock))
            time.sleep(0.1)
        moved = page.evaluate(f"{layout}.shapes[0].x0")
        page.get_by_text("❚❚ pause").click()
        assert moved != before
        assert all(re.fullmatch(r"clock: \d+\.\d\d s", text) for text in shown), shown
        assert len(set(shown)) > 1, shown  # and it moves


def _run(model: Path, out: Path, steps: int, **patch) -> dict:
    return recipe_dict(
        model,
        out,
        trainer={"steps": steps, "save_every": 1000},
        mode="double-buffer",
        rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 24},
        **patch,
    )


@pytest.mark.alone  # a time bound: no other test beside it
@pytest.mark.timeout(240)
def test_a_live_page_follows_a_run(tiny_llama, tmp_path):
    """While a run goes, its page shows each new step within a few seconds of its metrics line; its
    lanes have the run's engines; a hover on a request shows its version; the latest groups show
    their completions."""
    out = tmp_path / "run"
    recipe = checked(_run(tiny_llama, out, steps=60, engine={"replicas": 2}))
    page_server = LivePage(out).start()
    runner = threading.Thread(target=train, args=(recipe,), kwargs={"live": False}, daemon=True)
    try:
        with browser() as page:
            page.goto(page_server.url)
            runner.start()
            delays = []
            seen = 0
            while runner.is_alive() or seen < 60:
                lines = len(run_metrics(out)) if (out / "metrics.jsonl").exists() else 0
                if lines > seen:  # a new line: how long until the page says so
                    t0, seen = time.time(), lines
                    page.wait_for_function(
                        f"document.getElementById('step').textContent.startsWith('step {seen} ') "
                        "|| Number(document.getElementById('step').textContent.split(' ')[1]) >= "
                        f"{seen}",
                        timeout=10_000,
                    )
                    delays.append(time.time() - t0)
                time.sleep(0.05)
            print(
                f"\nlive page: a step shows {max(delays):.2f} s at most after its metrics line "
                f"(median {sorted(delays)[len(delays) // 2]:.2f} s, {len(delays)} steps)"
            )
            assert max(delays) < 5.0
            ticks = page.evaluate("document.getElementById('lanes').layout.yaxis.ticktext")
            assert {"engine 0", "engine 1", "trainer"} <= set(ticks)
            trace = page.evaluate(
                "document.getElementById('lanes').data.findIndex(t => t.name.startsWith('version'))"
            )
            page.evaluate(f"Plotly.Fx.hover('lanes', [{{curveNumber: {trace}, pointNumber: 0}}])")
            page.wait_for_selector("#lanes .hoverlayer .hovertext", timeout=5_000)
            assert "versions" in page.text_content("#lanes .hoverlayer")
            cards = page.locator("#groups .group")
            assert cards.count() >= 1 and "reward" in cards.first.text_content()
            assert page.locator("#groups .sample").count() >= 4  # a whole group, side by side
            shot = Path(os.environ.get("ORBIT_SCREENSHOTS", tmp_path)) / "live-page.png"
            page.screenshot(path=str(shot), full_page=True)
    finally:
        runner.join(timeout=120)
        page_server.stop()


@pytest.mark.timeout(240)
def test_a_sweeps_page_lists_every_run(tiny_llama, tmp_path):
    from orbit.sweep.plan import plan_sweep, preflight_sweep
    from orbit.sweep.run import sweep

    path = tmp_path / "recipe.yaml"
    import yaml

    path.write_text(yaml.safe_dump(_run(tiny_llama, tmp_path / "sweep", steps=4)))
    plan, _ = preflight_sweep(plan_sweep(path, ["trainer.lr=0.01,0.02,0.04"]))
    sweep(plan, live=False, console=Console(quiet=True))
    with LivePage(tmp_path / "sweep").start() as server, browser() as page:
        page.goto(server.url)
        page.wait_for_function("document.querySelectorAll('#runs-table tbody tr').length === 3")
        page.wait_for_function(
            "document.querySelector('#runs-table tbody').textContent.includes('done')"
        )
        names = page.eval_on_selector_all(
            "#runs-table tbody tr", "rows => rows.map(r => r.dataset.run)"
        )
        assert sorted(names) == sorted(p.name for p in plan.runs)
        assert page.evaluate("document.getElementById('curves').data.length") == 3
        page.click(f"text={names[0]}")  # a run's page, one click away
        page.wait_for_function("document.getElementById('step').textContent.startsWith('step 4')")


def test_the_page_serves_only_its_runs_files(tiny_llama, tmp_path):
    out = tmp_path / "run"
    train(checked(_run(tiny_llama, out, steps=2)), live=False)
    (out / "run.log").write_text("2026-01-01 WARNING an engine left the pool\n")
    with LivePage(out).start() as server:
        ok = httpx.get(
            f"{server.url}/api/run/run", params={"metrics": 0, "timeline": 0, "samples": 0}
        ).json()
        assert len(ok["metrics"]["rows"]) == 2 and ok["log"] == [
            "2026-01-01 WARNING an engine left the pool"
        ]
        assert "api_key" not in str(ok) and "recipe" not in ok
        for bad in (
            "/api/run/..%2F..%2Fetc",
            "/api/run/%2Fetc%2Fpasswd",
            "/run/..%2Frun",
            "/api/run/../run",
            "/static/../live.py",
            "/run.log",
            "/recipe.yaml",
        ):
            assert httpx.get(server.url + bad).status_code == 404, bad
        assert httpx.get(f"{server.url}/plotly.min.js").status_code == 200
    assert server.server.host == "127.0.0.1"


def test_a_page_that_cannot_start_says_so_and_the_run_trains(tiny_llama, tmp_path):
    import socket

    console = Console(record=True, width=200)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with watching(tmp_path / "run", True, port, console):
            train(checked(_run(tiny_llama, tmp_path / "run", steps=2)), live=False)
    said = console.export_text()
    assert (
        "the live page did not start" in said
        and "Address already in use" in said
        and "training goes on" in said
    )
    assert len(run_metrics(tmp_path / "run")) == 2

"""The live page of a run or a sweep: `orbit train ... --watch`, `orbit sweep ... --watch`, `orbit
watch DIR`.

A small web server (FastAPI on uvicorn, 127.0.0.1 and a free port unless told otherwise) that reads
what a run already writes and hands it to the page, which draws it with Plotly (the `plotly`
package's own script, served from here: nothing is fetched from the web). Nothing is computed twice:
the page's figures are the files'.

- `/`: the run's page, or a sweep's (every run: the live table, the reward curves of all runs in one
  chart, each
  run's page one click away at `/run/NAME`);
- `/api/runs`: the runs this server shows (their names);
- `/api/run/NAME?metrics=B&timeline=B&samples=B`: what each file gained past byte offset B (whole
  lines only),
  the new offsets, eval.json and the warnings of run.log;
- `/plotly.min.js`.

Only those files of the run directories it was given are ever read (a run is named, never a path:
`../` and absolute paths are not names), and the recipe is not served (a key's environment variable
name is in it).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import HTMLResponse, Response

from orbit.host.net import ThreadServer

FILES = ("metrics.jsonl", "timeline.jsonl", "samples.jsonl")
LOG_LINES = 50
CHUNK = 4 << 20  # bytes of a file returned at once (a long run's timeline comes in a few polls)


def runs_in(directory: Path) -> dict[str, Path]:
    """The runs a directory holds: itself (a run), or each run directory of a sweep."""
    directory = Path(directory)
    if (directory / "metrics.jsonl").exists() or (directory / "recipe.yaml").exists():
        return {directory.name or "run": directory}
    return {
        d.name: d
        for d in sorted(directory.iterdir())
        if d.is_dir() and (d / "recipe.yaml").exists()
    }


def read_from(path: Path, offset: int) -> tuple[list[dict], int]:
    """The whole JSON lines of `path` past byte `offset` (a line being written waits for the next
    poll), and the offset after them."""
    if not path.is_file():
        return [], 0
    with path.open("rb") as f:
        size = f.seek(0, 2)
        if offset > size:  # the file was replaced (a run started again): from the top
            offset = 0
        f.seek(offset)
        data = f.read(CHUNK)
    end = data.rfind(b"\n") + 1
    rows = []
    for line in data[:end].splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows, offset + end


def _about(run_dir: Path) -> dict:
    """What the page says of the run besides its files: mode, steps, model, task (not the whole
    recipe)."""
    import yaml

    path = run_dir / "recipe.yaml"
    if not path.is_file():
        return {}
    r = yaml.safe_load(path.read_text()) or {}
    return {
        "mode": r.get("mode"),
        "steps": (r.get("trainer") or {}).get("steps"),
        "model": Path(str(r.get("model", ""))).name,
        "task": (r.get("task") or {}).get("name"),
        "algorithm": (r.get("algorithm") or {}).get("preset") or "default",
    }


def _state(run_dir: Path, offsets: dict[str, int | None]) -> dict:
    out: dict = {"now": time.time(), "run": _about(run_dir)}
    for name in FILES:
        offset = offsets[name]
        if offset is None:
            continue
        rows, end = read_from(run_dir / name, offset)
        out[name.removesuffix(".jsonl")] = {"rows": rows, "offset": end}
    report = run_dir / "eval.json"
    out["eval"] = json.loads(report.read_text()) if report.is_file() else None
    log = run_dir / "run.log"
    out["log"] = log.read_text(errors="replace").splitlines()[-LOG_LINES:] if log.is_file() else []
    return out


def app_for(runs: dict[str, Path], sweep: bool) -> FastAPI:
    app = FastAPI(title="orbit live page", docs_url=None, redoc_url=None, openapi_url=None)
    page = resources.files("orbit.pages").joinpath("static")

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        return page.joinpath("sweep.html" if sweep else "run.html").read_text()

    @app.get("/run/{name}", response_class=HTMLResponse)
    def run_page(name: str) -> str:
        if name not in runs:
            raise HTTPException(404, f"no run {name!r} here")
        return page.joinpath("run.html").read_text()

    @app.get("/plotly.min.js")
    def plotly_js() -> Response:
        from plotly.offline import get_plotlyjs

        return Response(
            get_plotlyjs(),
            media_type="application/javascript",
            headers={"Cache-Control": "max-age=3600"},
        )

    @app.get("/api/runs")
    def names() -> dict:
        return {"sweep": sweep, "runs": list(runs)}

    @app.get("/api/run/{name}")
    def state(
        name: str,
        metrics: int = Query(0, ge=0),
        timeline: int | None = Query(None, ge=0),
        samples: int | None = Query(None, ge=0),
    ) -> dict:
        """A file left out of the query is not read (a sweep's table needs only the metrics)."""
        if name not in runs:
            raise HTTPException(404, f"no run {name!r} here")
        return _state(
            runs[name],
            {"metrics.jsonl": metrics, "timeline.jsonl": timeline, "samples.jsonl": samples},
        )

    return app


class LivePage:
    """The page's server for a run or sweep directory, on a thread of this process."""

    def __init__(
        self,
        directory: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        runs: dict[str, Path] | None = None,
    ) -> None:
        """`runs`: a sweep's runs by name (before their directories exist); default: what
        `directory` holds, or a run about to start in it."""
        self.directory = Path(directory)
        sweep = runs is not None
        if runs is None:
            runs = runs_in(self.directory) if self.directory.exists() else {}
            sweep = bool(runs) and self.directory not in runs.values()
        if not runs:  # a run about to start: it is the directory itself
            runs = {self.directory.name or "run": self.directory}
        self.server = ThreadServer(app_for(runs, sweep), host, port, name="orbit-live-page")

    def start(self) -> LivePage:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    def __enter__(self) -> LivePage:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return self.server.url


@contextmanager
def watching(
    directory: Path, watch: bool, port: int | None, console, runs: dict[str, Path] | None = None
):
    """`orbit train --watch`: the live page while the block runs. One that cannot start (its port
    taken) says so in one line, and the run goes on without it."""
    if not watch:
        yield
        return
    try:
        page = LivePage(directory, port=port, runs=runs).start()
    except OSError as err:
        console.print(
            f"the live page did not start ({err}); training goes on without it", highlight=False
        )
        yield
        return
    console.print(f"live page: {page.url}", highlight=False)
    try:
        yield
    finally:
        page.stop()


def serve(directory: Path, host: str, port: int | None, console) -> None:
    """`orbit watch DIR`: the page until Ctrl-C."""
    page = LivePage(directory, host=host, port=port).start()
    console.print(f"live page of {directory}: {page.url} (Ctrl-C to stop)", highlight=False)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        page.stop()

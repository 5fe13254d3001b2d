"""The service's page: `orbit serve RECIPE --watch`. Every tenant's training clients (their steps,
their losses, how many of their requests wait), the engines and what each slot holds, each inflight
target's version on each engine, the packs (how many requests share a pass over the base), and
each kind of request's latency; refreshed every two seconds, drawn with Plotly (the `plotly`
package's own script: nothing is fetched from the web).

It listens on 127.0.0.1 only, on a port of its own, whatever `--host` the API has: it names every
tenant's clients, so it is for whoever runs the service. Tenants appear as their key's digest
(keys.py): no key is on it.
"""

from __future__ import annotations

import statistics
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from orbit.host.net import ThreadServer
from orbit.serve.service import Service

PACKS_SHOWN = 60


def _quantile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1]


def state(service: Service) -> dict[str, Any]:
    """What the page shows, now."""
    waiting = service.futures.waiting()
    trainers = service.live()
    clients = []
    for row in service.store.clients():
        trainer = trainers.get(row.id)
        clients.append(
            {
                "tenant": row.tenant,
                "id": row.id,
                "rank": row.rank,
                "alive": trainer is not None,
                "steps": trainer.steps if trainer else None,
                "losses": list(trainer.losses) if trainer else [],
                "queued": service.turns.pending(row.id),
            }
        )
    latency = service.futures.latencies()
    caches = [
        (f"{(base.public_names() or [f'base {b}'])[0]} #{i}", cache)
        for b, base in enumerate(service.bases)
        for i, cache in enumerate(base.sampler.caches)
    ]
    serving = [cache.serving() for _, cache in caches]
    return {
        "tenants": {t: {"waiting": n} for t, n in sorted(waiting.items())},
        "clients": clients,
        "engines": [
            {
                "name": name,
                "slots": list(cache.held),
                "versions": list(cache.versions),
                "running": list(cache.running),
                "load": cache.load(),
                "flips": cache.flips,
            }
            for name, cache in caches
        ],
        "targets": [
            {
                "id": t.model_id,
                "version": t.newest().version,
                "engines": {
                    name: found.get(t.key) for (name, _), found in zip(caches, serving, strict=True)
                },
            }
            for t in service.sessions.targets()
        ],
        "packs": _packs(service),
        "latency": {
            kind: {
                "count": len(v),
                "p50": _quantile(v, 0.5),
                "p99": _quantile(v, 0.99),
            }
            for kind, v in sorted(latency.items())
        },
    }


def _packs(service: Service) -> dict[str, Any]:
    """The newest packs (training.py): how many, their requests and tokens on average, the last
    PACKS_SHOWN of them."""
    packs = list(service.turns.packs)
    return {
        "bound": service.turns.pack_tokens,
        "count": len(packs),
        "clients": statistics.fmean(p.clients for p in packs) if packs else 0.0,
        "tokens": statistics.fmean(p.tokens for p in packs) if packs else 0.0,
        "largest": max((p.clients for p in packs), default=0),
        "recent": [{"clients": p.clients, "tokens": p.tokens} for p in packs[-PACKS_SHOWN:]],
    }


def watch_app(service: Service) -> FastAPI:
    app = FastAPI(title="orbit serve: the page")

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        return resources.files("orbit.pages").joinpath("static/serve.html").read_text()

    @app.get("/api/state")
    def current() -> dict[str, Any]:
        return state(service)

    @app.get("/plotly.min.js")
    def plotly_js() -> Response:
        from plotly.offline import get_plotlyjs

        return Response(get_plotlyjs(), media_type="application/javascript")

    return app


def watch(service: Service, port: int | None = None) -> ThreadServer:
    """The page's server, started, on 127.0.0.1."""
    return ThreadServer(watch_app(service), "127.0.0.1", port, name="orbit serve page").start()

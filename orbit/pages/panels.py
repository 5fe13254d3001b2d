"""The five panels as a page you can play: `panels.html`, one self-contained file (Plotly's script
inside it, from the `plotly` package; nothing fetched), written by `orbit bench` beside
`panels.png`.

Each run (a mode, or a flip of the pool bench) is a panel on one shared clock: the trainer's lane
above its engines' lanes, each request a bar coloured by the adapter version it started on (hover:
its prompt group, start and end version, tokens, whether it spanned a flip or was aborted), the
trainer's wait / train / push / save, pauses as red marks on the trainer lane and flips as red
lines, the floor's pace as dotted green lines. Each panel's title carries its headline figures. Zoom
and pan are Plotly's; play / pause and the time slider move a clock across every panel at once, the
future greyed.
"""

from __future__ import annotations

import json
from pathlib import Path

from orbit.metrics.gantt import PAUSE_COLOR, TRAINER_COLORS, engine_bands

VERSION_COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)  # matplotlib's tab10, as panels.png
FLOOR_COLOR = "#2ca02c"
FRAMES = 120


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "timeline.jsonl").read_text().splitlines()]


def _flips(events: list[dict]) -> list[tuple[float, int]]:
    """When each engine flipped (a pause's end: the new slot active), as (time, engine)."""
    return sorted(
        (e["t1"], e.get("engine", 0))
        for e in events
        if e["actor"] == "engine" and e["kind"] == "paused"
    )


def panel_traces(events: list[dict], t0: float, t1: float, show_legend: bool) -> tuple[list, dict]:
    """One panel's traces (plotly graph objects) and its y axis (tick values and labels)."""
    import plotly.graph_objects as go

    requests = sorted(
        (e for e in events if e["kind"] == "request" and e["t1"] > t0 and e["t0"] < t1),
        key=lambda e: e["t0"],
    )
    updated = {
        e.get("engine", 0) for e in events if e["actor"] == "engine" and e["kind"] == "update"
    }
    lanes, bands = engine_bands(requests, updated)
    trainer_y = max((hi for _, _, hi in bands), default=1) + 1
    flips = _flips(events)
    traces = []
    by_version: dict[int, list] = {}
    for r, lane in zip(requests, lanes, strict=True):
        by_version.setdefault(r["version"] % len(VERSION_COLORS), []).append((r, lane))
    for v, items in sorted(by_version.items()):
        spanned = [
            any(r["t0"] < t < r["t1"] and e == r.get("engine", 0) for t, e in flips)
            for r, _ in items
        ]
        aborted = [r.get("finish") == "abort" for r, _ in items]
        traces.append(
            go.Bar(
                orientation="h",
                base=[r["t0"] - t0 for r, _ in items],
                x=[r["t1"] - r["t0"] for r, _ in items],
                y=[lane + 0.5 for _, lane in items],
                width=0.8,
                name=f"version {v} (mod 10)",
                legendgroup=f"v{v}",
                showlegend=show_legend,
                marker={
                    "color": ["white" if a else VERSION_COLORS[v] for a in aborted],
                    "line": {
                        "color": ["black" if a else VERSION_COLORS[v] for a in aborted],
                        "width": 0.5,
                    },
                },
                customdata=[
                    [
                        r.get("group", "-"),
                        r["version"],
                        r.get("version_end", r["version"]),
                        r.get("tokens", 0),
                        "yes" if s else "no",
                        "yes" if a else "no",
                        r.get("engine", 0),
                        r.get("slot", "-"),
                    ]
                    for (r, _), s, a in zip(items, spanned, aborted, strict=True)
                ],
                hovertemplate=(
                    "request of group %{customdata[0]}<br>versions %{customdata[1]} → "
                    "%{customdata[2]}<br>%{customdata[3]} tokens, %{x:.3f} s<br>spanned a flip: "
                    "%{customdata[4]}<br>aborted: %{customdata[5]}<br>engine %{customdata[6]}, "
                    "slot %{customdata[7]}<extra></extra>"
                ),
            )
        )
    for kind, color in TRAINER_COLORS.items():
        spans = [
            e
            for e in events
            if e["actor"] == "trainer" and e["kind"] == kind and e["t1"] > t0 and e["t0"] < t1
        ]
        traces.append(
            go.Bar(
                orientation="h",
                base=[e["t0"] - t0 for e in spans],
                x=[e["t1"] - e["t0"] for e in spans],
                y=[trainer_y + 0.5] * len(spans),
                width=0.9,
                marker={"color": color},
                name=f"trainer {kind}",
                legendgroup=f"trainer-{kind}",
                showlegend=show_legend,
                customdata=[[e.get("version")] for e in spans],
                hovertemplate=f"trainer {kind}, version %{{customdata[0]}}<br>%{{x:.3f}} "
                "s<extra></extra>",
            )
        )
    pauses = [
        e
        for e in events
        if e["actor"] == "engine" and e["kind"] == "paused" and e["t1"] > t0 and e["t0"] < t1
    ]
    traces.append(
        go.Bar(
            orientation="h",
            base=[e["t0"] - t0 for e in pauses],
            x=[max(e["t1"] - e["t0"], 1e-3) for e in pauses],
            y=[trainer_y + 0.5] * len(pauses),
            width=0.35,
            marker={"color": PAUSE_COLOR},
            name="engine paused / flip",
            legendgroup="pause",
            showlegend=show_legend,
            customdata=[[e.get("engine", 0), e.get("mode", "")] for e in pauses],
            hovertemplate="engine %{customdata[0]} paused (%{customdata[1]}), %{x:.3f} "
            "s<extra></extra>",
        )
    )
    xs, ys = [], []
    for t, _ in flips:
        if t0 < t < t1:
            xs += [t - t0, t - t0, None]
            ys += [0, trainer_y, None]
    traces.append(
        go.Scatter(
            x=xs,
            y=ys,
            mode="lines",
            line={"color": PAUSE_COLOR, "width": 1, "dash": "dash"},
            name="flip",
            legendgroup="flip",
            showlegend=show_legend,
            hoverinfo="skip",
        )
    )
    ticks = [((lo + hi) / 2, f"engine {i}") for i, lo, hi in bands] + [(trainer_y + 0.5, "trainer")]
    return traces, {
        "tickvals": [y for y, _ in ticks],
        "ticktext": [t for _, t in ticks],
        "range": [-0.3, trainer_y + 1.3],
    }


def floor_trace(floor_s: float, span: float, top: float, show_legend: bool):
    import plotly.graph_objects as go

    xs, ys = [], []
    for k in range(1, int(span / floor_s) + 1):
        xs += [k * floor_s, k * floor_s, None]
        ys += [0, top, None]
    return go.Scatter(
        x=xs,
        y=ys,
        mode="lines",
        line={"color": FLOOR_COLOR, "width": 1, "dash": "dot"},
        name="a step at the floor's pace",
        legendgroup="floor",
        showlegend=show_legend,
        hoverinfo="skip",
    )


def write_panels_html(
    bench_dir: Path,
    windows: dict[str, tuple[float, float]],
    path: Path,
    floors: dict[str, float] | None = None,
    headlines: dict[str, str] | None = None,
    title: str | None = None,
    titles: dict[str, str] | None = None,
) -> Path:
    """One panel per run (bench_dir/<key>) on one clock (seconds from each run's first measured
    step)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    keys = list(windows)
    span = max(t1 - t0 for t0, t1 in windows.values())
    names = [f"<b>{(titles or {}).get(k, k)}</b>   {(headlines or {}).get(k, '')}" for k in keys]
    fig = make_subplots(
        rows=len(keys), cols=1, shared_xaxes=True, vertical_spacing=0.045, subplot_titles=names
    )
    for row, key in enumerate(keys, start=1):
        t0, t1 = windows[key]
        traces, yaxis = panel_traces(_events(bench_dir / key), t0, t1, show_legend=row == 1)
        for trace in traces:
            fig.add_trace(trace, row=row, col=1)
        if floors and floors.get(key):
            fig.add_trace(
                floor_trace(floors[key], t1 - t0, yaxis["range"][1], row == 1), row=row, col=1
            )
        fig.update_yaxes(**yaxis, row=row, col=1, fixedrange=False)
    fig.update_xaxes(range=[0, span])
    fig.update_xaxes(
        title_text="seconds since the first measured step (one clock for every panel)",
        row=len(keys),
        col=1,
    )
    steps = [span * i / FRAMES for i in range(FRAMES + 1)]
    fig.frames = [go.Frame(name=f"{t:.3f}", layout={"shapes": _clock(t, span)}) for t in steps]
    play = {
        "frame": {"duration": 80, "redraw": True},
        "fromcurrent": True,
        "transition": {"duration": 0},
    }
    height = 230 * len(keys) + 200
    fig.update_layout(
        title={"text": title or "orbit bench", "x": 0.01, "y": 0.995, "yanchor": "top"},
        barmode="overlay",
        height=height,
        shapes=_clock(span, span),
        hovermode="closest",
        bargap=0,
        legend={"orientation": "h", "y": -0.06},
        margin={"l": 70, "r": 20, "t": 110, "b": 40},
        updatemenus=[
            {
                "type": "buttons",
                "direction": "left",
                "x": 0.01,
                "y": 1.0 + 60 / height,
                "xanchor": "left",
                "yanchor": "bottom",
                "buttons": [
                    {"label": "▶ play", "method": "animate", "args": [None, play]},
                    {
                        "label": "❚❚ pause",
                        "method": "animate",
                        "args": [
                            [None],
                            {"frame": {"duration": 0, "redraw": False}, "mode": "immediate"},
                        ],
                    },
                ],
            }
        ],
        # Every step carries its time as its label: Plotly shows the active step's label as the
        # clock. The labels themselves would crowd the slider, so they are drawn transparent (the x
        # axis has the ticks).
        sliders=[
            {
                "active": FRAMES,
                "x": 0.16,
                "len": 0.84,
                "y": 1.0 + 60 / height,
                "yanchor": "bottom",
                "pad": {"t": 0},
                "ticklen": 0,
                "minorticklen": 0,
                "currentvalue": {"prefix": "clock: ", "suffix": " s", "font": {"color": "#222"}},
                "font": {"color": "rgba(0,0,0,0)"},
                "steps": [
                    {
                        "label": f"{t:.2f}",
                        "method": "animate",
                        "args": [
                            [f"{t:.3f}"],
                            {"frame": {"duration": 0, "redraw": True}, "mode": "immediate"},
                        ],
                    }
                    for t in steps
                ],
            }
        ],
    )
    fig.write_html(
        path,
        include_plotlyjs=True,
        full_html=True,
        div_id="orbit-panels",
        auto_play=False,
        config={"scrollZoom": True, "displaylogo": False},
    )
    return path


def _clock(t: float, span: float) -> list[dict]:
    """The clock at `t`: a line across every panel and the future greyed."""
    return [
        {
            "type": "line",
            "xref": "x",
            "yref": "paper",
            "x0": t,
            "x1": t,
            "y0": 0,
            "y1": 1,
            "line": {"color": "#222", "width": 2},
            "name": "clock",
        },
        {
            "type": "rect",
            "xref": "x",
            "yref": "paper",
            "x0": t,
            "x1": span,
            "y0": 0,
            "y1": 1,
            "fillcolor": "white",
            "opacity": 0.6,
            "line": {"width": 0},
            "layer": "above",
        },
    ]

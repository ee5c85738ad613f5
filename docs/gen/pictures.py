"""Draw the docs' pictures as SVG from their sources, with no drawing library:

- `docs/images/architecture.svg`: the components of one DisaggServing and what flows between
  them (the layout is written here; the component names are the operator's roles);
- `docs/images/dashboard.svg`: the Grafana dashboard the chart ships, panel by panel, from its
  JSON (titles, grid positions, units and the series each panel plots).

    python docs/gen/pictures.py [--check]
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from html import escape
from pathlib import Path

from generated import write_or_check

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "docs" / "images"
DASHBOARD = ROOT / "charts" / "disagg-operator" / "dashboards" / "disagg-serving.json"
FONT = "font-family='Helvetica, Arial, sans-serif'"


def _svg(width: int, height: int, body: list[str]) -> str:
    return "\n".join([
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' {FONT}>",
        "<defs><marker id='arrow' viewBox='0 0 10 10' refX='9' refY='5' markerWidth='7' "
        "markerHeight='7' orient='auto-start-reverse'><path d='M0,0 L10,5 L0,10 z' "
        "fill='#444'/></marker></defs>",
        f"<rect width='{width}' height='{height}' fill='white'/>",
        *body, "</svg>", ""])


def _text(x: float, y: float, text: str, size: int = 13, weight: str = "normal",
          anchor: str = "middle", color: str = "#222") -> str:
    return (f"<text x='{x:.0f}' y='{y:.0f}' font-size='{size}' font-weight='{weight}' "
            f"text-anchor='{anchor}' fill='{color}'>{escape(text)}</text>")


@dataclass(frozen=True)
class Box:
    x: int
    y: int
    w: int
    h: int
    title: str
    lines: tuple[str, ...] = ()
    fill: str = "#eef3fb"

    def draw(self) -> list[str]:
        out = [f"<rect x='{self.x}' y='{self.y}' width='{self.w}' height='{self.h}' rx='8' "
               f"fill='{self.fill}' stroke='#4a6fa5' stroke-width='1.5'/>",
               _text(self.x + self.w / 2, self.y + 22, self.title, 14, "bold")]
        out += [_text(self.x + self.w / 2, self.y + 42 + 16 * i, line, 11, color="#444")
                for i, line in enumerate(self.lines)]
        return out

    def side(self, where: str) -> tuple[float, float]:
        return {"left": (self.x, self.y + self.h / 2), "right": (self.x + self.w,
                                                                  self.y + self.h / 2),
                "top": (self.x + self.w / 2, self.y),
                "bottom": (self.x + self.w / 2, self.y + self.h)}[where]


def _arrow(start: tuple[float, float], end: tuple[float, float], label: str = "",
           dashed: bool = False, both: bool = False, dy: int = -6, dx: int = 0,
           anchor: str = "middle") -> list[str]:
    (x1, y1), (x2, y2) = start, end
    style = " stroke-dasharray='5,4'" if dashed else ""
    marks = "marker-end='url(#arrow)'" + (" marker-start='url(#arrow)'" if both else "")
    out = [f"<line x1='{x1:.0f}' y1='{y1:.0f}' x2='{x2:.0f}' y2='{y2:.0f}' stroke='#444' "
           f"stroke-width='1.5'{style} {marks}/>"]
    if label:
        out.append(_text((x1 + x2) / 2 + dx, (y1 + y2) / 2 + dy, label, 11, anchor=anchor,
                         color="#333"))
    return out


def architecture() -> str:
    client = Box(20, 170, 120, 60, "Client", ("OpenAI API",), "#f5f5f5")
    proxy = Box(200, 150, 170, 100, "Proxy", ("routes each request:", "prefill, then decode;",
                                              "store-aware routing"))
    prefill = Box(450, 40, 190, 110, "Prefill (X)", ("vLLM + kvhelper", "computes the prompt,",
                                                    "saves its KV pages"))
    decode = Box(450, 250, 190, 110, "Decode (Y)", ("vLLM + kvhelper", "loads the pages,",
                                                   "generates tokens"))
    store = Box(730, 130, 200, 140, "Mooncake store", ("master (HA: leader via etcd)",
                                                       "memory lent by vLLM pods", "and store pods",
                                                       "MLA: one page per block"), "#fff5e6")
    etcd = Box(200, 400, 170, 70, "etcd", ("registry, metadata",), "#eef7ee")
    operator = Box(730, 400, 200, 70, "disagg-operator", ("DisaggServing -> Deployments,",
                                                          "Services, ConfigMap"), "#f3eefb")
    body = [_text(475, 24, "One DisaggServing: X prefill, Y decode, one proxy, a Mooncake store",
                  15, "bold")]
    for box in (client, proxy, prefill, decode, store, etcd, operator):
        body += box.draw()
    body += _arrow(client.side("right"), proxy.side("left"), "request")
    body += _arrow((370, 175), prefill.side("left"), "1: prompt", dy=-8)
    body += _arrow((370, 225), decode.side("left"), "2: prompt + KV location", dy=30, dx=-60)
    body += _arrow((640, 95), (730, 165), "save pages", dy=-6)
    body += _arrow((730, 235), (640, 305), "load pages", dy=22)
    body += _arrow((285, 400), proxy.side("bottom"), "discovers instances", dashed=True, dy=4,
                   dx=8, anchor="start")
    body += _arrow((450, 345), (370, 430), "register", dashed=True, dy=4, dx=10,
                   anchor="start")
    body.append(_text(930, 492, "it renders every object above, applies it, watches it, "
                      "and writes the status", 11, anchor="end", color="#333"))
    return _svg(950, 505, body)


def dashboard() -> str:
    board = json.loads(DASHBOARD.read_text())
    cell_w, cell_h, margin, top = 40, 28, 10, 60
    width = 24 * cell_w + 2 * margin
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"])
    height = top + bottom * cell_h + margin
    body = [_text(margin, 28, f"Grafana: {board['title']}", 17, "bold", "start"),
            _text(margin, 48, "Variables: " + ", ".join(
                v.get("label", v["name"]) for v in board.get("templating", {}).get("list", [])) +
                f"; {len(board['panels'])} panels, drawn from the chart's dashboard JSON "
                "(the lines are schematic, not data)",
                12, anchor="start", color="#555")]
    for panel in board["panels"]:
        grid = panel["gridPos"]
        x, y = margin + grid["x"] * cell_w, top + grid["y"] * cell_h
        w, h = grid["w"] * cell_w - 6, grid["h"] * cell_h - 6
        unit = ((panel.get("fieldConfig") or {}).get("defaults") or {}).get("unit", "")
        body += [f"<rect x='{x}' y='{y}' width='{w}' height='{h}' rx='4' fill='#181b1f' "
                 "stroke='#2c3235'/>",
                 _text(x + 10, y + 20, panel["title"], 13, "bold", "start", "#d8d9da")]
        if unit:
            body.append(_text(x + w - 10, y + 20, f"unit: {unit}", 11, anchor="end",
                              color="#8e8e8e"))
        # Axes and one faint line per series, with its legend below.
        series = [t.get("legendFormat") or t.get("refId", "") for t in panel.get("targets", [])]
        plot_top, plot_bottom = y + 34, y + h - 24 - 14 * ((len(series) + 1) // 2)
        body.append(f"<line x1='{x + 10}' y1='{plot_bottom}' x2='{x + w - 10}' "
                    f"y2='{plot_bottom}' stroke='#3d4246'/>")
        palette = ("#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9")
        for i, name in enumerate(series):
            color = palette[i % len(palette)]
            level = plot_top + (plot_bottom - plot_top) * (0.25 + 0.5 * ((i * 37) % 10) / 10)
            points = " ".join(f"{x + 10 + step * (w - 20) / 12:.0f},"
                              f"{level + 8 * ((step * (i + 3)) % 5 - 2):.0f}"
                              for step in range(13))
            body.append(f"<polyline points='{points}' fill='none' stroke='{color}' "
                        "stroke-width='1.5' opacity='0.8'/>")
            col, row = i % 2, i // 2
            body.append(_text(x + 10 + col * (w - 20) / 2, plot_bottom + 16 + 14 * row,
                              f"- {name}", 10, anchor="start", color=color))
    return _svg(width, height, body)


PICTURES = {"architecture.svg": architecture, "dashboard.svg": dashboard}


def main() -> int:
    return write_or_check((__doc__ or "").splitlines()[0], IMAGES, PICTURES)


if __name__ == "__main__":
    sys.exit(main())

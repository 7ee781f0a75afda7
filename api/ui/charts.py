"""Utilisation over time as server-rendered SVG (no JavaScript; the page's CSP allows no inline styles, so the
drawing uses SVG presentation attributes only)."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup, escape

COLOURS = {"sm": "#2563eb", "mem": "#16a34a", "enc": "#d97706", "dec": "#9333ea", "jpg": "#64748b", "ofa": "#0891b2"}
W, H, PAD_L, PAD_B, PAD_T = 560, 140, 34, 18, 6


def _span(points: list[tuple[float, dict[str, int]]], now: float, span: float) -> float:
    """The time the chart shows: the last hour once there is an hour of samples, until then what there is
    (at least a minute), so a young history is not a sliver at the right edge."""
    oldest = min((t for t, _ in points), default=now)
    return min(span, max(60.0, now - oldest))


def _ago(seconds: float) -> str:
    return "now" if seconds < 0.5 else (f"-{seconds / 60:.0f} min" if seconds >= 120 else f"-{seconds:.0f} s")


def chart(points: list[tuple[float, dict[str, int]]], now: float, span: float = 3600.0,
          engines: tuple[str, ...] = ("sm", "mem", "enc", "dec"), title: str = "") -> Markup:
    """One chart: a line per engine, percent (0-100) over the last `span` seconds (or less: see _span)."""
    span = _span(points, now, span)
    iw, ih = W - PAD_L - 4, H - PAD_B - PAD_T

    def x(t: float) -> float:
        return PAD_L + iw * (1 - min(span, max(0.0, now - t)) / span)

    def y(v: float) -> float:
        return PAD_T + ih * (1 - v / 100)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
             f'role="img" aria-label="{escape(title)}">', f"<title>{escape(title)}</title>",
             f'<rect x="{PAD_L}" y="{PAD_T}" width="{iw}" height="{ih}" fill="#f8fafc" stroke="#cbd5e1"/>']
    for pct in (0, 50, 100):
        parts.append(f'<line x1="{PAD_L}" x2="{PAD_L + iw}" y1="{y(pct):.1f}" y2="{y(pct):.1f}" stroke="#e2e8f0"/>'
                     f'<text x="{PAD_L - 4}" y="{y(pct) + 4:.1f}" font-size="10" text-anchor="end" '
                     f'fill="#475569">{pct}%</text>')
    for k in range(5):
        ago = span * (4 - k) / 4
        anchor = "start" if k == 0 else ("end" if k == 4 else "middle")
        parts.append(f'<text x="{x(now - ago):.1f}" y="{H - 4}" font-size="10" text-anchor="{anchor}" '
                     f'fill="#475569">{_ago(ago)}</text>')
    for e in engines:
        pts = [(x(t), y(v[e])) for t, v in points if now - t <= span]
        if len(pts) == 1:
            pts.append((pts[0][0] + 1, pts[0][1]))
        if pts:
            coords = " ".join(f"{px:.1f},{py:.1f}" for px, py in pts)
            parts.append(f'<polyline data-engine="{e}" points="{coords}" fill="none" stroke="{COLOURS[e]}" '
                         f'stroke-width="1.5"/>')
    lx = PAD_L + 6
    for e in engines:
        parts.append(f'<rect x="{lx}" y="{PAD_T + 4}" width="8" height="8" fill="{COLOURS[e]}"/>'
                     f'<text x="{lx + 11}" y="{PAD_T + 12}" font-size="10" fill="#0f172a">{e}</text>')
        lx += 44
    parts.append("</svg>")
    return Markup("".join(parts))


def latest(points: list[tuple[float, dict[str, int]]]) -> dict[str, Any]:
    return points[-1][1] if points else {}


def share_chart(rows: list[dict[str, Any]], title: str = "") -> Markup:
    """One GPU's vGPU scheduler at work: per VM a bar of the share of GPU time it got (from the scheduler's log)
    and a mark at the share its policy promises (none for best effort)."""
    bar_h, gap, label_w, iw = 14, 6, 150, W - 150 - 50
    h = PAD_T * 2 + max(1, len(rows)) * (bar_h + gap) + 14
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart share-chart" viewBox="0 0 {W} {h}" width="{W}" '
             f'height="{h}" role="img" aria-label="{escape(title)}">', f"<title>{escape(title)}</title>"]
    for k, r in enumerate(rows):
        sch = r.get("scheduler") or {}
        y = PAD_T + k * (bar_h + gap)
        share, want = sch.get("share") or 0.0, sch.get("expected")
        parts.append(f'<text x="{label_w - 6}" y="{y + bar_h - 3}" font-size="10" text-anchor="end" '
                     f'fill="#0f172a">{escape(r.get("vm") or r.get("vm_uuid") or "?")}</text>'
                     f'<rect x="{label_w}" y="{y}" width="{iw}" height="{bar_h}" fill="#f8fafc" stroke="#cbd5e1"/>'
                     f'<rect data-vm="{escape(r.get("vm") or "")}" data-share="{share:.4f}" x="{label_w}" y="{y}" '
                     f'width="{iw * min(1.0, share):.1f}" height="{bar_h}" fill="{COLOURS["sm"]}"/>'
                     f'<text x="{label_w + iw + 4}" y="{y + bar_h - 3}" font-size="10" fill="#0f172a">'
                     f'{share * 100:.0f}%</text>')
        if want is not None:
            wx = label_w + iw * min(1.0, want)
            parts.append(f'<line data-expected="{want:.4f}" x1="{wx:.1f}" x2="{wx:.1f}" y1="{y - 2}" '
                         f'y2="{y + bar_h + 2}" stroke="#dc2626" stroke-width="2"/>')
    parts.append(f'<text x="{label_w}" y="{h - 4}" font-size="10" fill="#475569">bar: share of GPU time got; '
                 f'red mark: share promised</text></svg>')
    return Markup("".join(parts))

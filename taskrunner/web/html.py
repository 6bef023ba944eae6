"""HTML building blocks of the dashboard: escaping, the page frame, times, progress bars,
tables and the inline SVG charts.

Escaping is the default, not a duty: HTML is a `Markup` (``H('<b>%s</b>') % value``), and a
`Markup` escapes every value put into it — by ``%``, ``+`` or ``join`` — unless that value
is a `Markup` itself (numbers pass as they are). `table` cells and a `page`'s body that are
not `Markup` are escaped too. A page that forgets to mark its HTML shows it as text; it
cannot emit a value unescaped (task data and results are shown as text, never as markup)."""
import json
from datetime import datetime, timezone
from html import escape
from typing import Any, Iterable, List, Optional, Sequence
from urllib.parse import urlencode

NAV = (("/", "Overview"), ("/runners", "Runners"), ("/tasks", "Tasks"),
       ("/workflows", "Workflows"), ("/failures", "Failures"), ("/periodic", "Periodic tasks"))
STATUS_COLOURS = {"scheduled": "#6c8ebf", "running": "#2f80ed", "retrying": "#f2994a",
                  "given-up": "#d64545", "success": "#27ae60", "cancelled": "#9b9b9b",
                  "error": "#d64545", "timeout": "#d64545", "requeued": "#b07cc6",
                  "waiting": "#8e7cc3"}


class Markup(str):
    """Text that is HTML already. What goes into it is escaped unless it is a Markup."""

    __slots__ = ()

    def __mod__(self, args: Any) -> "Markup":
        values = args if isinstance(args, tuple) else (args,)
        return Markup(str.__mod__(self, tuple(
            v if isinstance(v, (Markup, int, float)) else e(v) for v in values)))

    def __add__(self, other: Any) -> "Markup":
        return Markup(str.__add__(self, e(other)))

    def __radd__(self, other: Any) -> "Markup":
        return Markup(str.__add__(e(other), self))

    def join(self, parts: Iterable[Any]) -> "Markup":
        return Markup(str.join(self, [e(p) for p in parts]))


H = Markup


def e(value: Any) -> Markup:
    """`value` as HTML: escaped text, or itself when it is a Markup already."""
    if isinstance(value, Markup):
        return value
    return Markup(escape("" if value is None else str(value), quote=True))


def query(**params: Any) -> str:
    """'?a=1&b=2' from the parameters that are set."""
    given = {k: v for k, v in params.items() if v not in (None, "")}
    return "?" + urlencode(given) if given else ""


def now() -> datetime:
    return datetime.now(timezone.utc)


def when(value: Optional[datetime]) -> str:
    """A time in a <time> element ('' for none): UTC text, which the page's script turns
    into the viewer's local time (the zone said once, in the header)."""
    if value is None:
        return ""
    return H('<time datetime="%s">%s</time>') % (e(value.isoformat()),
                                               e(value.strftime("%Y-%m-%d %H:%M:%S")))


def span(seconds: Optional[float]) -> str:
    """A duration as '850 ms', '12 s', '3 min 4 s', '2 h 5 min', '3 d 4 h'."""
    if seconds is None:
        return ""
    if seconds < 1:
        return "%d ms" % round(seconds * 1000)
    if seconds < 60:
        return "%.1f s" % seconds if seconds < 10 else "%d s" % seconds
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return "%d min %d s" % (minutes, secs)
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return "%d h %d min" % (hours, minutes)
    return "%d d %d h" % divmod(hours, 24)


def ago(value: Optional[datetime], at: Optional[datetime] = None) -> str:
    if value is None:
        return ""
    seconds = ((at or now()) - value).total_seconds()
    return span(seconds) + " ago" if seconds >= 0 else "in " + span(-seconds)


def status(name: Optional[str]) -> str:
    if not name:
        return ""
    return H('<span class="status status-%s">%s</span>') % (e(name), e(name))


def progress(percent: Optional[int]) -> str:
    if percent is None:
        return ""
    return H('<progress max="100" value="%d" title="%d%%"></progress> <span class="pct">%d%%'
             '</span>') % (percent, percent, percent)


def pretty(value: Any) -> str:
    """JSON data or results, indented, as escaped text."""
    if value is None:
        return H('<span class="muted">none</span>')
    return H("<pre>%s</pre>") % e(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False))


def short(value: Any, width: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return e(text if len(text) <= width else text[:width - 1] + "…")


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], empty: str = "nothing here",
          css: str = "", labelled: bool = False) -> str:
    """A table of cells (escaped unless Markup), in a box of its own that scrolls sideways
    when the table is wider than the screen (a phone), so the page itself never does.
    `labelled`: each cell names its column (``data-label``), for a stylesheet that shows the
    rows as cards on a phone, their cells reordered and labelled."""
    rows = list(rows)
    if not rows:
        return H('<p class="muted empty">%s</p>') % empty
    head = H("").join(H("<th>%s</th>") % h for h in headers)
    if labelled:
        body = H("").join(H("<tr>%s</tr>") % H("").join(
            H('<td data-label="%s">%s</td>') % (h, c) for h, c in zip(headers, row))
            for row in rows)
    else:
        body = H("").join(H("<tr>%s</tr>") % H("").join(H("<td>%s</td>") % c for c in row)
                          for row in rows)
    return H('<div class="scroll"><table class="%s"><thead><tr>%s</tr></thead><tbody>%s'
             '</tbody></table></div>') % (css, head, body)


def csrf_form(action: str, token: str, button: str, fields: Optional[dict] = None,
              css: str = "") -> str:
    hidden = H("").join(H('<input type="hidden" name="%s" value="%s">') % (k, v)
                        for k, v in (fields or {}).items() if v not in (None, ""))
    return (H('<form method="post" action="%s" class="inline"><input type="hidden" '
              'name="csrf" value="%s">%s<button type="submit" class="%s">%s</button></form>')
            % (action, token, hidden, css, button))


def page(title: str, path: str, body: str, notice: Optional[str] = None,
         parts: Optional[str] = None, read_only: bool = False) -> str:
    """The frame around a page: navigation, an optional notice, the live-parts endpoint.
    `body`: escaped unless Markup."""
    nav = H("").join(H('<a href="%s"%s>%s</a>') % (href, H(' class="active"') if (
        path == href or (href != "/" and path.startswith(href))) else "", label)
        for href, label in NAV)
    flash = H('<p class="notice" role="status">%s</p>') % notice if notice else ""
    live = H(' data-parts="%s"') % parts if parts else ""
    badge = H('<span class="badge">read-only</span>') if read_only else ""
    return H("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            "<title>%s · taskrunner</title><link rel=\"icon\" href=\"data:,\">"
            "<link rel=\"stylesheet\" href=\"/static/app.css\">"
            "<script src=\"/static/app.js\" defer></script></head>"
            "<body%s><header><span class=\"brand\">taskrunner</span><nav>%s</nav>%s"
            "<span class=\"refreshed\" id=\"refreshed\"></span>"
            "<span class=\"zone\" id=\"zone\">times in UTC</span></header>"
            "<main><h1>%s</h1>%s%s</main></body></html>") % (
                title, live, nav, badge, title, flash, body)


# -- pictures -------------------------------------------------------------------------------

def status_bar(counts: dict) -> str:
    """One horizontal bar split by the share of each status (SVG)."""
    total = sum(counts.values())
    if not total:
        return H("")
    x, parts = 0.0, []
    for name, n in counts.items():
        if not n:
            continue
        width = 1000.0 * n / total
        parts.append(H('<rect x="%.2f" y="0" width="%.2f" height="18" fill="%s"><title>%s: %d'
                       '</title></rect>') % (x, max(width, 1.5), STATUS_COLOURS.get(name, "#999"),
                                          e(name), n))
        x += width
    return H('<svg class="statusbar" viewBox="0 0 1000 18" preserveAspectRatio="none" '
             'role="img" aria-label="tasks by status">%s</svg>') % H("").join(parts)


def minute_chart(minutes: List[Any]) -> str:
    """Runs finished per minute, succeeded stacked under failed, as SVG bars."""
    width, height, left, bottom = 720, 180, 40, 22
    peak = max([m.succeeded + m.failed for m in minutes] + [1])
    scale = (height - bottom - 8) / peak
    step = (width - left) / max(len(minutes), 1)
    bars = []
    for i, m in enumerate(minutes):
        x = left + i * step
        ok_h, bad_h = m.succeeded * scale, m.failed * scale
        base = height - bottom
        label = "%s UTC: %d succeeded, %d failed" % (m.minute.strftime("%H:%M"), m.succeeded,
                                                      m.failed)
        bars.append(H('<g><title>%s</title><rect x="%.1f" y="%.1f" width="%.1f" '
                      'height="%.1f" fill="#27ae60"/><rect x="%.1f" y="%.1f" width="%.1f" '
                      'height="%.1f" fill="#d64545"/></g>') % (
            e(label), x, base - ok_h, step * 0.8, ok_h, x, base - ok_h - bad_h, step * 0.8,
            bad_h))
    ticks = []
    for i in range(0, len(minutes), 10):
        ticks.append(H('<text x="%.1f" y="%d" class="tick">%s</text>') % (
            left + i * step, height - 6, e(minutes[i].minute.strftime("%H:%M"))))
    axis = (H('<text x="%d" y="14" class="tick" text-anchor="end">%d</text>'
              '<text x="%d" y="%d" class="tick" text-anchor="end">0</text>'
              '<line x1="%d" y1="%d" x2="%d" y2="%d" class="axis"/>')
            % (left - 6, peak, left - 6, height - bottom, left, height - bottom, width,
               height - bottom))
    return H('<svg class="chart" viewBox="0 0 %d %d" role="img" aria-label="runs finished per '
             'minute">%s%s%s</svg>') % (width, height, axis, H("").join(bars), H("").join(ticks))

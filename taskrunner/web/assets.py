"""The dashboard's stylesheet and script, served from /static/ (the Content-Security-Policy
allows no inline script or style)."""

CSS = """
:root { --fg: #1d2330; --muted: #6b7280; --line: #e3e6ec; --bg: #f6f7fa; --accent: #2f80ed; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
       color: var(--fg); background: var(--bg); }
header { display: flex; flex-wrap: wrap; align-items: center; gap: 6px 18px; padding: 10px 24px;
         background: #1d2330; color: #fff; }
header .brand { font-weight: 700; letter-spacing: .02em; }
header nav { display: flex; flex-wrap: wrap; gap: 2px 14px; }
header nav a { color: #c9d2e3; text-decoration: none; padding: 4px 0; white-space: nowrap; }
header nav a.active, header nav a:hover { color: #fff; border-bottom: 2px solid var(--accent); }
header .refreshed { margin-left: auto; color: #8d97aa; font-size: 12px; }
header .zone { color: #8d97aa; font-size: 12px; }
.badge { background: #f2994a; color: #1d2330; border-radius: 4px; padding: 1px 6px;
         font-size: 12px; }
main { padding: 16px 24px 40px; max-width: 1400px; }
h1 { font-size: 20px; margin: 4px 0 14px; }
h2 { font-size: 15px; margin: 14px 0 8px; }
h2 small { color: var(--muted); font-weight: 400; margin-left: 8px; }
a { color: var(--accent); }
.muted { color: var(--muted); }
.notice { background: #fff7e0; border: 1px solid #f2d28b; padding: 8px 12px; border-radius: 6px; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 4px 16px 14px;
        margin-bottom: 16px; }
.cols { display: flex; gap: 16px; flex-wrap: wrap; }
.cols .card { flex: 1 1 260px; min-width: 0; }
.cols .card.wide { flex: 3 1 560px; }
.tiles { display: flex; gap: 10px; flex-wrap: wrap; margin-bottom: 10px; }
.tile { flex: 1 1 120px; background: #fff; border: 1px solid var(--line); border-left-width: 5px;
        border-radius: 8px; padding: 8px 12px; color: var(--fg); text-decoration: none; }
.tile .n { display: block; font-size: 24px; font-weight: 700; }
.tile-scheduled { border-left-color: #6c8ebf; } .tile-running { border-left-color: #2f80ed; }
.tile-retrying { border-left-color: #f2994a; } .tile-given-up { border-left-color: #d64545; }
.tile-waiting { border-left-color: #8e7cc3; }
.tile-success { border-left-color: #27ae60; } .tile-cancelled { border-left-color: #9b9b9b; }
.statusbar { width: 100%; height: 14px; display: block; margin: 4px 0 16px; border-radius: 4px; }
.chart { width: 100%; height: auto; }
.chart .tick { font-size: 11px; fill: var(--muted); }
.chart .axis { stroke: #c5cad3; }
.big { font-size: 26px; font-weight: 700; margin: 4px 0 0; }
.scroll { overflow-x: auto; max-width: 100%; }
table { width: 100%; border-collapse: collapse; background: #fff; }
th, td { text-align: left; padding: 6px 8px; border-bottom: 1px solid var(--line);
         vertical-align: top; }
th { font-weight: 600; color: var(--muted); font-size: 12px; text-transform: uppercase; }
tbody tr:hover { background: #f9fafc; }
pre { margin: 0; white-space: pre-wrap; word-break: break-word; font-size: 12px;
      max-height: 320px; overflow: auto; }
pre.error { color: #8a1f1f; }
pre.traceback { max-height: none; font-family: ui-monospace, monospace; color: #3b1f1f;
                background: #fbf7f7; padding: 8px; border-radius: 6px; }
h3 { font-size: 13px; margin: 10px 0 6px; }
.err { color: #b42318; font-weight: 600; font-family: ui-monospace, monospace; font-size: 12px; }
.status { display: inline-block; border-radius: 10px; padding: 0 8px; font-size: 12px;
          background: #eef1f5; white-space: nowrap; }
ol.graph { list-style: none; padding: 0; margin: 0; display: flex; flex-wrap: wrap; gap: 12px; }
ol.graph li.level { flex: 1 1 220px; min-width: 0; border-left: 3px solid var(--line);
                    padding-left: 10px; }
ol.graph .level-name { color: var(--muted); font-size: 12px; }
ol.graph ol.tasks { list-style: none; padding: 0; margin: 4px 0 0; max-height: 480px;
                    overflow-y: auto; }
ol.graph li.wf-task { padding: 3px 0; border-bottom: 1px solid var(--line);
                      overflow-wrap: anywhere; }
.status-success { background: #dcf5e6; color: #146c3b; }
.status-running { background: #dbe9fd; color: #1c4f9c; }
.status-scheduled { background: #e5ecf6; color: #38527a; }
.status-waiting { background: #ece6f6; color: #4b3a7a; }
.status-error, .status-timeout, .status-given-up { background: #fde2e2; color: #962020; }
.status-retrying { background: #fdebd8; color: #8a4a10; }
.status-stopping { background: #fdebd8; color: #8a4a10; }
.status-paused { background: #fdebd8; color: #8a4a10; }
.status-active { background: #dcf5e6; color: #146c3b; }
.ok { color: #146c3b; }
.nowrap { white-space: nowrap; }
a.queue { display: inline-block; background: #eef1f5; border-radius: 4px; padding: 0 6px;
          margin: 0 4px 2px 0; font-size: 12px; text-decoration: none; }
details summary { cursor: pointer; color: var(--muted); font-size: 12px; }
progress { width: 120px; height: 12px; vertical-align: middle; }
.pct { font-size: 12px; color: var(--muted); }
form.inline { display: inline; margin-right: 6px; }
input.limit { width: 4em; }
details.alter form { display: flex; flex-direction: column; gap: 4px; margin-top: 4px; }
details.alter label { display: flex; flex-direction: column; font-size: 12px; color: var(--muted); }
button { font: inherit; padding: 3px 12px; border-radius: 6px; border: 1px solid #b8c1d1;
         background: #fff; cursor: pointer; }
button:hover { border-color: var(--accent); }
button.danger { border-color: #e3a3a3; color: #962020; }
.filters { display: flex; flex-wrap: wrap; gap: 10px; align-items: end; margin-bottom: 12px;
           background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 10px; }
.filters label { display: flex; flex-direction: column; font-size: 12px; color: var(--muted); }
.filters input, .filters select { font: inherit; padding: 3px 6px; }
.bulk { margin: 0 0 10px; color: var(--muted); }
.pager { display: flex; justify-content: space-between; }
dl.facts { display: grid; grid-template-columns: max-content minmax(0, 1fr); gap: 4px 16px;
           background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 12px 16px; }
dl.facts dt { color: var(--muted); } dl.facts dd { margin: 0; overflow-wrap: anywhere; }
.empty { padding: 8px 0; }
code, time { white-space: nowrap; }
code.wrap { white-space: normal; }
/* A phone (390 px): narrower margins; cards one under the other; tables scroll in .scroll. */
@media (max-width: 700px) {
  header { padding: 8px 12px; }
  header .refreshed { margin-left: 0; }
  main { padding: 12px 10px 32px; }
  .card { padding: 4px 10px 12px; }
  .cols .card, .cols .card.wide { flex-basis: 100%; }
  dl.facts { grid-template-columns: minmax(0, 1fr); padding: 10px; }
  dl.facts dd { margin-bottom: 6px; }
  /* The task list as cards, one per task, each cell labelled by its column (data-label):
     the status first, where the eye lands, then the task and the rest. */
  table.tasks thead { display: none; }
  table.tasks tr { display: flex; flex-wrap: wrap; border-bottom: 1px solid var(--line); }
  table.tasks td { flex: 1 1 45%; min-width: 0; border: 0; padding: 3px 8px;
                   overflow-wrap: anywhere; }
  table.tasks td::before { content: attr(data-label); display: block; font-size: 11px;
                           color: var(--muted); text-transform: uppercase; }
  table.tasks td[data-label="Status"] { order: -1; flex-basis: 100%; }
  table.tasks td[data-label="Status"]::before { display: none; }
}
"""

JS = """
(function () {
  'use strict';
  // Times: the server writes UTC; shown in the viewer's zone, said once in the header.
  function pad(n) { return (n < 10 ? '0' : '') + n; }
  function localize(root) {
    var today = new Date().toDateString();
    root.querySelectorAll('time[datetime]').forEach(function (element) {
      var at = new Date(element.getAttribute('datetime'));
      if (isNaN(at.getTime())) { return; }
      var clock = pad(at.getHours()) + ':' + pad(at.getMinutes()) + ':' + pad(at.getSeconds());
      element.title = element.getAttribute('datetime');
      element.textContent = at.toDateString() === today ? clock : at.getFullYear() + '-' +
        pad(at.getMonth() + 1) + '-' + pad(at.getDate()) + ' ' + clock;
    });
  }
  var zone = document.getElementById('zone');
  if (zone && window.Intl) {
    zone.textContent = 'times in ' + Intl.DateTimeFormat().resolvedOptions().timeZone;
  }
  localize(document);
  var url = document.body.getAttribute('data-parts');
  var stamp = document.getElementById('refreshed');
  if (!url) { return; }
  function swap(parts) {
    Object.keys(parts).forEach(function (id) {
      var element = document.getElementById(id);
      if (element) { element.innerHTML = parts[id]; localize(element); }
    });
    if (stamp) { stamp.textContent = 'live · updated ' + new Date().toLocaleTimeString(); }
    document.body.setAttribute('data-refreshes',
      String(Number(document.body.getAttribute('data-refreshes') || 0) + 1));
  }
  function tick() {
    fetch(url, {headers: {'Accept': 'application/json'}, credentials: 'same-origin'})
      .then(function (response) { return response.ok ? response.json() : null; })
      .then(function (parts) { if (parts) { swap(parts); } })
      .catch(function () { if (stamp) { stamp.textContent = 'offline, retrying'; } })
      .then(function () { window.setTimeout(tick, 1500); });
  }
  window.setTimeout(tick, 1500);
})();
"""

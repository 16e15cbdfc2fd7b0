"""The HTML report's style sheet and script, inlined into every report (no network access).

The script does three things only: sort the reshard table on a header click (or from the URL:
``plan.html#sort=time``), show a tooltip for timeline and pipeline boxes, and mark the page
``data-ready="1"`` once it ran (the browser test reads that, and ``data-js-errors`` if any).
"""

from __future__ import annotations

AXIS_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948")
"""One colour per mesh axis, in mesh order (Tableau 10: distinct for colour-blind readers)."""

MEMORY_COLOURS = {
    "parameters": "#4e79a7",
    "parameter_copies": "#a0cbe8",
    "gradients": "#f28e2b",
    "optimizer_states": "#59a14f",
    "activations": "#e15759",
    "inputs": "#b07aa1",
}
"""Memory categories; another category gets ``OTHER_COLOUR``."""
OTHER_COLOUR = "#bab0ac"

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1400px; }
h1 { font-size: 22px; margin: 0 0 8px; } h2 { font-size: 17px; margin: 28px 0 8px; }
table { border-collapse: collapse; } td, th { padding: 2px 8px; text-align: left; }
th { background: #f3f3f3; } tr:nth-child(even) td { background: #fafafa; }
.summary td:first-child { color: #666; padding-right: 16px; }
.num { text-align: right; font-variant-numeric: tabular-nums; }
.dim { display: inline-block; min-width: 64px; margin: 1px; padding: 1px 4px;
       border: 1px solid #ccc; border-radius: 3px; font-size: 12px; background: #fff; }
.axis { display: inline-block; padding: 0 4px; margin-left: 2px; border-radius: 3px;
        color: #fff; font-size: 11px; }
.legend span { margin-right: 12px; }
.bar { display: flex; height: 22px; border: 1px solid #999; position: relative; }
.bar div { height: 100%; }
.limit { position: absolute; top: -4px; bottom: -4px; border-left: 2px dashed #000; }
svg text { font-size: 11px; fill: #333; }
#tooltip { position: fixed; pointer-events: none; background: #222; color: #fff;
           padding: 4px 6px; border-radius: 3px; font-size: 12px; display: none; }
th.sortable { cursor: pointer; } th.sorted-desc::after { content: " \\25BC"; }
th.sorted-asc::after { content: " \\25B2"; }
.note { color: #666; font-size: 12px; }
"""

JS = """
(function () {
  var body = document.body;
  window.addEventListener('error', function (e) {
    body.dataset.jsErrors = (body.dataset.jsErrors || '') + e.message + ';';
  });
  var tip = document.getElementById('tooltip');
  document.querySelectorAll('[data-tip]').forEach(function (el) {
    el.addEventListener('mousemove', function (e) {
      tip.textContent = el.getAttribute('data-tip');
      tip.style.display = 'block';
      tip.style.left = (e.clientX + 12) + 'px';
      tip.style.top = (e.clientY + 12) + 'px';
    });
    el.addEventListener('mouseleave', function () { tip.style.display = 'none'; });
  });
  function sortTable(table, column, descending) {
    var rows = Array.prototype.slice.call(table.tBodies[0].rows);
    var numeric = table.tHead.rows[0].cells[column].dataset.type === 'number';
    rows.sort(function (a, b) {
      var x = a.cells[column].dataset.value, y = b.cells[column].dataset.value;
      var order = numeric ? parseFloat(x) - parseFloat(y) : (x < y ? -1 : x > y ? 1 : 0);
      return descending ? -order : order;
    });
    rows.forEach(function (row) { table.tBodies[0].appendChild(row); });
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, i) {
      th.classList.remove('sorted-asc', 'sorted-desc');
      if (i === column) { th.classList.add(descending ? 'sorted-desc' : 'sorted-asc'); }
    });
    table.dataset.sortedBy = table.tHead.rows[0].cells[column].dataset.key;
  }
  document.querySelectorAll('table.sortable').forEach(function (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, i) {
      th.classList.add('sortable');
      th.addEventListener('click', function () {
        sortTable(table, i, !th.classList.contains('sorted-desc'));
      });
    });
  });
  var wanted = /sort=([a-z]+)/.exec(window.location.hash);
  var reshards = document.getElementById('reshards');
  if (wanted && reshards) {
    Array.prototype.forEach.call(reshards.tHead.rows[0].cells, function (th, i) {
      if (th.dataset.key === wanted[1]) { sortTable(reshards, i, th.dataset.type === 'number'); }
    });
  }
  body.dataset.ready = '1';
})();
"""

__all__ = ["AXIS_COLOURS", "CSS", "JS", "MEMORY_COLOURS", "OTHER_COLOUR"]

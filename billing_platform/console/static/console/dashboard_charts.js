// The dashboard's charts, drawn by charts.js (loaded before this file).
//   data: {"type": "bar"|"line", "labels": [...], "stacked": bool,
//          "datasets": [{"label": "...", "data": ["12.50", null, ...],
//                        "dashed": bool (a forecast), "flat": bool (a limit line)}]}
// The canvas keeps the spec it was drawn from (canvas.spec) so a test can compare it with
// /api/v1/usage.
"use strict";

window.TollgateCharts.drawAll((spec, canvas) => {
  canvas.spec = spec;
  return {
    datasets: spec.datasets.map((set, i) => {
      const color = set.flat ? "#c92a2a" : window.TollgateCharts.color(i);
      return {
        label: set.label,
        data: set.data.map(window.TollgateCharts.number),
        backgroundColor: color,
        borderColor: color,
        borderDash: set.dashed || set.flat ? [6, 4] : [],
        pointRadius: spec.type === "line" ? (set.flat ? 0 : 2) : undefined,
        spanGaps: false,
      };
    }),
  };
});

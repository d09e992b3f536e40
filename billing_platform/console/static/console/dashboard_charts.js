// The dashboard's charts (Chart.js, vendored under vendor/chartjs/). No inline script: the
// page puts each chart's data in a `json_script` block (type application/json, never run) and
// a <canvas data-chart="ID"> names it; this file draws them once the page has loaded.
//   data: {"type": "bar"|"line", "labels": [...], "stacked": bool,
//          "datasets": [{"label": "...", "data": ["12.50", null, ...],
//                        "dashed": bool (a forecast), "flat": bool (a limit line)}]}
// Amounts come as decimal strings (exact, as the API gives them); a chart only needs them as
// numbers to draw, and the canvas keeps the spec it was drawn from (canvas.spec) so a test
// can compare it with /api/v1/usage. Chart.js sizes the canvas through the CSSOM, which the
// Content-Security-Policy allows (it forbids style attributes and <style> blocks).
"use strict";

const DASHBOARD_PALETTE = ["#3b5bdb", "#f08c00", "#2b8a3e", "#c92a2a", "#7048e8", "#1098ad",
  "#e64980", "#5c940d"];

function dashboardChart(canvas) {
  const source = document.getElementById(canvas.dataset.chart);
  if (!source || typeof window.Chart === "undefined") return;
  const spec = JSON.parse(source.textContent);
  const datasets = spec.datasets.map((set, i) => {
    const color = set.flat ? "#c92a2a" : DASHBOARD_PALETTE[i % DASHBOARD_PALETTE.length];
    return {
      label: set.label,
      data: set.data.map((v) => (v === null ? null : Number(v))),
      backgroundColor: color,
      borderColor: color,
      borderDash: set.dashed || set.flat ? [6, 4] : [],
      pointRadius: spec.type === "line" ? (set.flat ? 0 : 2) : undefined,
      spanGaps: false,
    };
  });
  canvas.spec = spec;
  canvas.chart = new window.Chart(canvas, {
    type: spec.type,
    data: {labels: spec.labels, datasets},
    options: {
      animation: false,
      responsive: true,
      maintainAspectRatio: false,
      scales: {x: {stacked: !!spec.stacked}, y: {stacked: !!spec.stacked, beginAtZero: true}},
      plugins: {legend: {position: "bottom"}},
    },
  });
  canvas.dataset.drawn = "true";
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("canvas[data-chart]").forEach(dashboardChart);
});

// The finance pages' charts (Chart.js, vendored under vendor/chartjs/). No inline script: the
// page puts each chart's data in a `json_script` block (type application/json, never run) and
// a <canvas data-chart="ID"> names it; this file draws them once the page has loaded.
//   data: {"type": "bar"|"line", "labels": [...], "stacked": bool,
//          "datasets": [{"label": "...", "data": ["12.50", ...]}]}
// Amounts come as decimal strings (exact in the table beside the chart); a chart only needs
// them as numbers to draw. Chart.js sets the canvas's size through the CSSOM, which the
// Content-Security-Policy allows (it forbids style attributes and <style> blocks).
"use strict";

const PALETTE = ["#3b5bdb", "#f08c00", "#2b8a3e", "#c92a2a", "#7048e8", "#1098ad", "#e64980",
  "#5c940d"];

function drawChart(canvas) {
  const source = document.getElementById(canvas.dataset.chart);
  if (!source || typeof window.Chart === "undefined") return;
  const spec = JSON.parse(source.textContent);
  const datasets = spec.datasets.map((set, i) => ({
    label: set.label,
    data: set.data.map((v) => (v === null ? null : Number(v))),
    backgroundColor: PALETTE[i % PALETTE.length],
    borderColor: PALETTE[i % PALETTE.length],
  }));
  const horizontal = spec.type === "hbar";
  canvas.chart = new window.Chart(canvas, {
    type: horizontal ? "bar" : spec.type,
    data: {labels: spec.labels, datasets},
    options: {
      indexAxis: horizontal ? "y" : "x",
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
  document.querySelectorAll("canvas[data-chart]").forEach(drawChart);
});

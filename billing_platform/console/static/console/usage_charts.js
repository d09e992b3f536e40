// The usage explorer's chart (Chart.js, vendored under vendor/chartjs/). No inline script: the
// page puts the chart's data in a `json_script` block (type application/json, never run) and
// <canvas data-chart="ID"> names it; this file draws it once the page has loaded.
//   data: {"type": "bar", "stacked": bool, "metric": "total_tokens"|"amount"|...,
//          "labels": [...], "datasets": [{"label": "...", "data": ["12", "0.0031", ...]}]}
// Numbers come as decimal strings, the exact values of the table beside the chart; a chart
// only needs them as numbers to draw, and its tooltips show the exact strings. The canvas
// keeps the Chart object (`canvas.chart`) and the exact strings (`canvas.exact`), so a test
// can read what was drawn.
"use strict";

const USAGE_PALETTE = ["#3b5bdb", "#f08c00", "#2b8a3e", "#c92a2a", "#7048e8", "#1098ad",
  "#e64980", "#5c940d", "#862e9c", "#d9480f"];

function drawUsageChart(canvas) {
  const source = document.getElementById(canvas.dataset.chart);
  if (!source || typeof window.Chart === "undefined") return;
  const spec = JSON.parse(source.textContent);
  canvas.exact = spec.datasets.map((set) => set.data);
  const datasets = spec.datasets.map((set, i) => ({
    label: set.label,
    data: set.data.map(Number),
    backgroundColor: USAGE_PALETTE[i % USAGE_PALETTE.length],
    borderColor: USAGE_PALETTE[i % USAGE_PALETTE.length],
  }));
  canvas.chart = new window.Chart(canvas, {
    type: spec.type,
    data: {labels: spec.labels, datasets},
    options: {
      animation: false,
      responsive: true,
      maintainAspectRatio: false,
      scales: {x: {stacked: !!spec.stacked}, y: {stacked: !!spec.stacked, beginAtZero: true}},
      plugins: {
        legend: {position: "bottom"},
        tooltip: {
          callbacks: {
            label: (item) => `${item.dataset.label}: ` +
              `${canvas.exact[item.datasetIndex][item.dataIndex]}`,
          },
        },
      },
    },
  });
  canvas.dataset.drawn = "true";
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("canvas[data-chart]").forEach(drawUsageChart);
});

// The residency page's chart, drawn by charts.js (loaded before this file): requests per
// region (left axis) and tokens per region (right axis), the numbers of the table below it.
//   data: {"type": "bar", "labels": ["us-east", ...],
//          "datasets": [{"label": "Requests", "data": [12, ...], "axis": "y"},
//                       {"label": "Tokens (input + output)", "data": [...], "axis": "tokens"}]}
// The canvas keeps the spec it was drawn from (canvas.spec), so a test can compare it with
// the table.
"use strict";

window.TollgateCharts.drawAll((spec, canvas) => {
  canvas.spec = spec;
  return {
    datasets: spec.datasets.map((set, i) => ({
      label: set.label,
      data: set.data.map(window.TollgateCharts.number),
      yAxisID: set.axis,
      backgroundColor: window.TollgateCharts.color(i),
      borderColor: window.TollgateCharts.color(i),
    })),
    options: {
      scales: {
        x: {},
        y: {beginAtZero: true, position: "left", ticks: {precision: 0}, title: {display: true, text: "Requests"}},
        tokens: {beginAtZero: true, position: "right", ticks: {precision: 0}, grid: {drawOnChartArea: false},
          title: {display: true, text: "Tokens"}},
      },
    },
  };
});

// The usage explorer's chart, drawn by charts.js (loaded before this file).
//   data: {"type": "bar", "stacked": bool, "metric": "total_tokens"|"amount"|...,
//          "labels": [...], "datasets": [{"label": "...", "data": ["12", "0.0031", ...]}]}
// The numbers are the exact values of the table beside the chart, and its tooltips show the
// exact strings. The canvas keeps them (`canvas.exact`) beside the Chart object
// (`canvas.chart`), so a test can read what was drawn.
"use strict";

window.TollgateCharts.drawAll((spec, canvas) => {
  canvas.exact = spec.datasets.map((set) => set.data);
  return {
    datasets: spec.datasets.map((set, i) => ({
      label: set.label,
      data: set.data.map(Number),
      backgroundColor: window.TollgateCharts.color(i),
      borderColor: window.TollgateCharts.color(i),
    })),
    options: {
      plugins: {
        tooltip: {
          callbacks: {
            label: (item) => `${item.dataset.label}: ` +
              `${canvas.exact[item.datasetIndex][item.dataIndex]}`,
          },
        },
      },
    },
  };
});

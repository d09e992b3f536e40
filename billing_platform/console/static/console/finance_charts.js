// The finance pages' charts, drawn by charts.js (loaded before this file).
//   data: {"type": "bar"|"hbar"|"line", "labels": [...], "stacked": bool,
//          "datasets": [{"label": "...", "data": ["12.50", ...]}]}
// An "hbar" is a bar chart along the y axis.
"use strict";

window.TollgateCharts.drawAll((spec) => {
  const horizontal = spec.type === "hbar";
  return {
    type: horizontal ? "bar" : spec.type,
    datasets: spec.datasets.map((set, i) => ({
      label: set.label,
      data: set.data.map(window.TollgateCharts.number),
      backgroundColor: window.TollgateCharts.color(i),
      borderColor: window.TollgateCharts.color(i),
    })),
    options: {indexAxis: horizontal ? "y" : "x"},
  };
});

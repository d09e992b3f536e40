// The Reservations page's charts, drawn by charts.js (loaded before this file).
//   data: {"type": "bar", "stacked": bool, "labels": [...],
//          "datasets": [{"label": "...", "data": [12, 0, ...], "flat": bool (the reserved
//                        capacity, drawn as a line beside the stacked bars)}]}
// The canvas keeps the spec it was drawn from (canvas.spec) so a test can compare it with the
// table of the same figures.
"use strict";

window.TollgateCharts.drawAll((spec, canvas) => {
  canvas.spec = spec;
  return {
    datasets: spec.datasets.map((set, i) => {
      const color = set.flat ? "#c92a2a" : window.TollgateCharts.color(i);
      return {
        type: set.flat ? "line" : "bar",
        stack: set.flat ? "reserved" : "demand",
        label: set.label,
        data: set.data.map(window.TollgateCharts.number),
        backgroundColor: color,
        borderColor: color,
        borderDash: set.flat ? [6, 4] : [],
        pointRadius: set.flat ? 0 : undefined,
        stepped: set.flat ? "middle" : false,
      };
    }),
  };
});

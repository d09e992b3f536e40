// What the console's and the finance pages' charts share (Chart.js, vendored under
// vendor/chartjs/). No inline script: a page puts each chart's data in a `json_script` block
// (type application/json, never run) and a <canvas data-chart="ID"> names it; the page's own
// script (dashboard_charts.js, usage_charts.js, finance_charts.js), loaded after this one,
// calls TollgateCharts.drawAll with what makes its charts its own, and this file draws them
// once the page has loaded. Numbers come as decimal strings (exact, as the API and the tables
// give them); a chart only needs them as numbers to draw. Chart.js sizes the canvas through
// the CSSOM, which the Content-Security-Policy allows (it forbids style attributes and
// <style> blocks).
"use strict";

window.TollgateCharts = (() => {
  const PALETTE = ["#3b5bdb", "#f08c00", "#2b8a3e", "#c92a2a", "#7048e8", "#1098ad",
    "#e64980", "#5c940d", "#862e9c", "#d9480f"];

  // the i-th series' colour
  const color = (i) => PALETTE[i % PALETTE.length];

  // a decimal string as a number to draw; a gap (null) stays a gap
  const number = (v) => (v === null ? null : Number(v));

  // Draw one canvas: build(spec, canvas) returns {datasets, type (else the spec's), options
  // (merged over the shared ones; its plugins over the shared plugins)}. The canvas keeps
  // the Chart object (canvas.chart) and says data-drawn="true" once drawn.
  function draw(canvas, build) {
    const source = document.getElementById(canvas.dataset.chart);
    if (!source || typeof window.Chart === "undefined") return;
    const spec = JSON.parse(source.textContent);
    const own = build(spec, canvas);
    const extra = own.options || {};
    canvas.chart = new window.Chart(canvas, {
      type: own.type || spec.type,
      data: {labels: spec.labels, datasets: own.datasets},
      options: {
        animation: false,
        responsive: true,
        maintainAspectRatio: false,
        scales: {x: {stacked: !!spec.stacked}, y: {stacked: !!spec.stacked, beginAtZero: true}},
        ...extra,
        plugins: {legend: {position: "bottom"}, ...(extra.plugins || {})},
      },
    });
    canvas.dataset.drawn = "true";
  }

  // Draw every canvas[data-chart] of the page once it has loaded.
  function drawAll(build) {
    document.addEventListener("DOMContentLoaded", () => {
      document.querySelectorAll("canvas[data-chart]").forEach((canvas) => draw(canvas, build));
    });
  }

  return {color, number, drawAll};
})();

// The console's charts: uPlot (vendor/uplot, MIT) over the API's per-minute metrics
// (GET v1/queues/{queue}/metrics, GET v1/metrics). Plain JavaScript, no build step. Each chart is a
// <figure> whose caption says, in words, what the lines show over the window (totals, the latest
// depth, the percentiles), so nothing is told only by the canvas.
'use strict';

window.RdqCharts = function RdqCharts({ el, api, seg, every, showError }) {
  const REFRESH_MS = 30000;
  const COLORS = { succeeded: '#116329', retried: '#9a6700', dead_lettered: '#a40e26', cancelled: '#57606a',
    pending: '#1f4e79', in_flight: '#8250df', dead: '#a40e26', age: '#bc4c00',
    p50: '#1f4e79', p95: '#9a6700', p99: '#a40e26', failure: '#a40e26' };
  const WINDOWS = [['hour', 'Last hour'], ['day', 'Last day']];
  const FILLED_BY = 'The maintenance pass (rdq dev, rdq reaper, or the deployed reaper function) counts each '
    + 'minute once it has closed: charts fill in a minute at a time.';

  const lastOf = (values) => { for (let i = values.length - 1; i >= 0; i -= 1) if (values[i] !== null && values[i] !== undefined) return values[i]; return null; };
  const count = (n) => (n === null || n === undefined ? '—' : String(Math.round(n * 10) / 10));
  const ms = (n) => (n === null || n === undefined ? '—' : (n >= 1000 ? `${(n / 1000).toFixed(n >= 10000 ? 0 : 1)} s` : `${Math.round(n)} ms`));
  const seconds = (n) => (n === null || n === undefined ? '—' : (n >= 120 ? `${Math.round(n / 60)} min` : `${Math.round(n)} s`));
  // One unit along a whole axis: seconds, or minutes once the ticks reach ten minutes.
  seconds.axis = (ticks) => {
    const minutes = Math.max(0, ...ticks) >= 600;
    return ticks.map((t) => (minutes ? `${Math.round(t / 60)} min` : `${Math.round(t)} s`));
  };
  const percent = (n) => (n === null || n === undefined ? '—' : `${Math.round(n * 1000) / 10} %`);

  // One chart: a figure with its caption; the plot is made (or resized) once the figure has a width.
  function lineChart(title, unitFormat, captionText) {
    const caption = el('figcaption', {}, el('strong', {}, title), el('span', { class: 'chart-summary' }));
    const plotBox = el('div', { class: 'chart-plot' });
    const figure = el('figure', { class: 'chart' }, caption, plotBox);
    let plot = null;
    let resizer = null;
    function draw(minutes, series, summary) {
      caption.querySelector('.chart-summary').textContent = summary || captionText || '';
      const data = [minutes, ...series.map((s) => s.values)];
      const width = Math.max(240, Math.floor(plotBox.clientWidth || figure.clientWidth || 320));
      if (plot && plot.series.length === series.length + 1) {
        plot.setData(data);
        return;
      }
      if (plot) plot.destroy();
      plot = new window.uPlot({
        width, height: 180,
        scales: { x: { time: true } },
        legend: { live: true },
        cursor: { drag: { x: false, y: false } },
        series: [{ label: 'Time' }, ...series.map((s) => ({
          label: s.label, stroke: s.color, width: 2, spanGaps: Boolean(s.spanGaps),
          value: (u, v) => unitFormat(v),
        }))],
        axes: [{ stroke: '#57606a' }, { stroke: '#57606a', size: 64, values: (u, ticks) => (unitFormat.axis ? unitFormat.axis(ticks) : ticks.map(unitFormat)) }],
      }, data, plotBox);
      keyboardLegend(plot, plotBox);
      if (!resizer && window.ResizeObserver) {
        resizer = new ResizeObserver(() => {
          const w = Math.floor(plotBox.clientWidth);
          if (plot && w > 0 && Math.abs(w - plot.width) > 4) plot.setSize({ width: Math.max(240, w), height: 180 });
        });
        resizer.observe(plotBox);
      }
    }
    return { figure, draw };
  }

  // A click on a legend entry shows or hides its line: the same by keyboard (Tab, then Enter or
  // Space), with the state announced as a toggle button's.
  function keyboardLegend(plot, box) {
    const entries = [...box.querySelectorAll('.u-legend tr.u-series th')];
    entries.forEach((entry, i) => {
      if (i === 0) return; // the time column
      const sync = () => entry.setAttribute('aria-pressed', String(plot.series[i].show !== false));
      entry.setAttribute('tabindex', '0');
      entry.setAttribute('role', 'button');
      entry.setAttribute('aria-label', `Show ${plot.series[i].label}`);
      sync();
      entry.addEventListener('click', () => setTimeout(sync));
      entry.addEventListener('keydown', (event) => {
        if (event.key !== 'Enter' && event.key !== ' ') return;
        event.preventDefault();
        entry.click();
      });
    });
  }

  function windowSwitch(current, onChange) {
    const buttons = WINDOWS.map(([value, label]) => el('button', {
      type: 'button', class: 'secondary', 'aria-pressed': String(value === current), 'data-window': value,
    }, label));
    buttons.forEach((button) => button.addEventListener('click', () => {
      buttons.forEach((b) => b.setAttribute('aria-pressed', String(b === button)));
      onChange(button.dataset.window);
    }));
    return el('div', { class: 'buttons window-switch', role: 'group', 'aria-label': 'Chart window' }, buttons);
  }

  // The queue page's charts: throughput, depth, oldest pending age, and per handler its latency
  // percentiles and failure rate (a table of every handler, a chart of the one chosen).
  function queueCharts(ctx, queue) {
    let span = ctx.params.get('window') === 'day' ? 'day' : 'hour';
    const throughput = lineChart('Finished per minute', count);
    const depth = lineChart('Depth', count);
    const oldest = lineChart('Oldest pending task', seconds);
    const latency = lineChart('Duration per attempt', ms);
    const failures = lineChart('Failure rate per attempt', percent);
    const choose = el('select', { id: 'chart-handler', name: 'handler' });
    const handlerRows = el('tbody');
    const handlerTable = el('div', { class: 'table-wrap', role: 'region', 'aria-label': 'Handlers', tabindex: '0' },
      el('table', { class: 'data handlers' }, el('caption', {}, 'Handlers over the window'),
        el('thead', {}, el('tr', {}, ['Handler', 'Attempts', 'Failure rate', 'p50', 'p95', 'p99'].map((h) => el('th', { scope: 'col' }, h)))),
        handlerRows));
    const note = el('p', { class: 'muted chart-note' }, FILLED_BY);
    let latest = null;
    const section = el('section', { class: 'charts', 'aria-labelledby': 'charts-title', 'data-charts': queue },
      el('div', { class: 'charts-head' }, el('h2', { id: 'charts-title' }, 'Activity'),
        windowSwitch(span, (value) => { span = value; load(); })),
      note,
      el('div', { class: 'charts-grid' }, throughput.figure, depth.figure, oldest.figure),
      el('h3', {}, 'Handlers'), handlerTable,
      el('div', { class: 'field chart-handler' }, el('label', { for: 'chart-handler' }, 'Handler charted'), choose),
      el('div', { class: 'charts-grid' }, latency.figure, failures.figure));
    choose.addEventListener('change', () => latest && drawHandler(latest));

    function drawHandler(data) {
      const handler = (data.handlers || []).find((h) => h.handler === choose.value);
      if (!handler) {
        const at = data.minutes;
        latency.draw(at, [{ label: 'p50', color: COLORS.p50, values: at.map(() => null) }], ' No attempt finished in this window.');
        failures.draw(at, [{ label: 'Failure rate', color: COLORS.failure, values: at.map(() => null) }], ' No attempt finished in this window.');
        return;
      }
      const s = handler.summary;
      const at = data.minutes;
      latency.draw(at, [
        { label: 'p50', color: COLORS.p50, values: handler.p50_ms },
        { label: 'p95', color: COLORS.p95, values: handler.p95_ms },
        { label: 'p99', color: COLORS.p99, values: handler.p99_ms },
      ], ` ${handler.handler}: p50 ${ms(s.p50_ms)}, p95 ${ms(s.p95_ms)}, p99 ${ms(s.p99_ms)} over ${s.attempts} attempt(s).`);
      failures.draw(at, [{ label: 'Failure rate', color: COLORS.failure, values: handler.failure_rate }],
        ` ${handler.handler}: ${percent(s.failure_rate)} of ${s.attempts} attempt(s) failed (${s.failures}).`);
    }

    function render(data) {
      latest = data;
      const m = data.minutes;
      const t = data.totals;
      throughput.draw(m, [
        { label: 'Succeeded', color: COLORS.succeeded, values: data.succeeded },
        { label: 'Retried', color: COLORS.retried, values: data.retried },
        { label: 'Dead-lettered', color: COLORS.dead_lettered, values: data.dead_lettered },
        { label: 'Cancelled', color: COLORS.cancelled, values: data.cancelled },
      ], ` In the ${span === 'day' ? 'last day (a point every 5 minutes, its per-minute average)' : 'last hour'}: `
        + `${t.succeeded} succeeded, ${t.retried} retried, ${t.dead_lettered} dead-lettered, ${t.cancelled} cancelled.`);
      depth.draw(m, [
        { label: 'Pending', color: COLORS.pending, values: data.pending, spanGaps: true },
        { label: 'In flight', color: COLORS.in_flight, values: data.in_flight, spanGaps: true },
        { label: 'Dead', color: COLORS.dead, values: data.dead, spanGaps: true },
      ], lastOf(data.pending) === null ? ' No depth sample in this window yet.'
        : ` Latest: ${count(lastOf(data.pending))} pending, ${count(lastOf(data.in_flight))} in flight, ${count(lastOf(data.dead))} dead.`);
      const ages = data.oldest_pending_age_seconds;
      const peak = Math.max(0, ...ages.filter((v) => v !== null));
      oldest.draw(m, [{ label: 'Oldest pending', color: COLORS.age, values: ages, spanGaps: true }],
        lastOf(ages) === null ? ' No depth sample in this window yet.' : ` Latest ${seconds(lastOf(ages))}; at most ${seconds(peak)}.`);
      const names = (data.handlers || []).map((h) => h.handler);
      const before = choose.value;
      choose.replaceChildren(...(names.length ? names : ['—']).map((name) => el('option', { value: names.length ? name : '' }, name)));
      choose.value = names.includes(before) ? before : (names[0] || '');
      choose.disabled = !names.length;
      handlerRows.replaceChildren(...(names.length ? data.handlers.map((h) => el('tr', { 'data-handler': h.handler },
        el('th', { scope: 'row' }, el('span', { class: 'clip', title: h.handler }, h.handler)),
        el('td', { class: 'num', 'data-label': 'Attempts' }, h.summary.attempts),
        el('td', { class: 'num', 'data-label': 'Failure rate' }, percent(h.summary.failure_rate)),
        el('td', { class: 'num', 'data-label': 'p50' }, ms(h.summary.p50_ms)),
        el('td', { class: 'num', 'data-label': 'p95' }, ms(h.summary.p95_ms)),
        el('td', { class: 'num', 'data-label': 'p99' }, ms(h.summary.p99_ms))))
        : [el('tr', {}, el('td', { colspan: '6' }, 'No attempt finished in this window.'))]));
      drawHandler(data);
      section.dataset.loaded = span;
    }

    async function load() {
      try {
        const data = await api('GET', `v1/queues/${seg(queue)}/metrics?window=${span}`);
        if (ctx.alive()) render(data);
      } catch (error) {
        if (ctx.alive()) showError(error);
      }
    }
    return { node: section, load: () => { load(); every(REFRESH_MS, load); } };
  }

  // The queues page's chart: every queue's finished tasks per minute over the last hour.
  function overviewChart(ctx) {
    const chart = lineChart('All queues, finished per minute (last hour)', count);
    const section = el('section', { class: 'charts overview', 'aria-labelledby': 'overview-title', 'data-charts': '*' },
      el('h2', { id: 'overview-title', class: 'visually-hidden' }, 'Activity over the last hour'), chart.figure);
    async function load() {
      try {
        const data = await api('GET', 'v1/metrics?window=hour');
        if (!ctx.alive()) return;
        chart.draw(data.minutes, [
          { label: 'Succeeded', color: COLORS.succeeded, values: data.succeeded },
          { label: 'Retried', color: COLORS.retried, values: data.retried },
          { label: 'Dead-lettered', color: COLORS.dead_lettered, values: data.dead_lettered },
          { label: 'Cancelled', color: COLORS.cancelled, values: data.cancelled },
        ], ` ${data.totals.succeeded} succeeded, ${data.totals.retried} retried, ${data.totals.dead_lettered} dead-lettered, `
          + `${data.totals.cancelled} cancelled. ${FILLED_BY}`);
        section.dataset.loaded = 'hour';
      } catch (error) {
        if (ctx.alive()) showError(error);
      }
    }
    return { node: section, load: () => { load(); every(REFRESH_MS, load); } };
  }

  return { queueCharts, overviewChart };
};

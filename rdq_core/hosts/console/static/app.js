// The rdq operator console: plain JavaScript, no build step, nothing loaded from elsewhere.
// Every API call is relative ("v1/..."), so the console works under any path prefix. Text from
// the API (payloads, error messages, stacks) is only ever inserted as text nodes, never as HTML.
'use strict';

(function () {
  const TOKEN_KEY = 'rdq-console-token';
  const STATUSES = ['PENDING', 'IN_FLIGHT', 'DEAD', 'SUCCEEDED', 'CANCELLED'];
  const QUEUES_REFRESH_MS = 3000;
  const TASK_REFRESH_MS = 1500;
  const PAGE_SIZE = 50;

  // Every route change starts a new generation; answers that arrive for an older one are dropped.
  let generation = 0;
  let timers = [];
  let firstRoute = true;

  // -- DOM helpers -------------------------------------------------------------------------
  const BOOLEAN_PROPS = new Set(['hidden', 'disabled', 'checked', 'required', 'open']);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined) continue;
      if (name === 'class') node.className = value;
      else if (name.startsWith('on') && typeof value === 'function') node.addEventListener(name.slice(2), value);
      else if (BOOLEAN_PROPS.has(name)) node[name] = Boolean(value);
      else node.setAttribute(name, String(value));
    }
    node.append(...nodes(children));
    return node;
  }

  // Children as nodes: nested arrays flattened, null/undefined/false dropped, everything else
  // a text node (strings are never parsed as HTML).
  function nodes(children) {
    return children.flat(Infinity)
      .filter((child) => child !== null && child !== undefined && child !== false)
      .map((child) => (child instanceof Node ? child : document.createTextNode(String(child))));
  }

  function setChildren(node, ...children) {
    node.replaceChildren(...nodes(children));
  }

  const $ = (id) => document.getElementById(id);
  const seg = (value) => encodeURIComponent(value);

  function qs(params) {
    const pairs = Object.entries(params)
      .filter(([, value]) => value !== undefined && value !== null && value !== '')
      .map(([name, value]) => `${encodeURIComponent(name)}=${encodeURIComponent(value)}`);
    return pairs.length ? `?${pairs.join('&')}` : '';
  }

  function hashLink(path, params) {
    const search = new URLSearchParams();
    for (const [name, value] of Object.entries(params || {})) if (value) search.set(name, value);
    const text = search.toString();
    return `#${path}${text ? `?${text}` : ''}`;
  }

  let fieldCounter = 0;
  function field(labelText, control, hint) {
    const id = control.id || `f${++fieldCounter}`;
    control.id = id;
    const parts = [el('label', { for: id }, labelText), control];
    if (hint) {
      const hintNode = el('small', { id: `${id}-hint`, class: 'hint' }, hint);
      control.setAttribute('aria-describedby', `${id}-hint`);
      parts.push(hintNode);
    }
    return el('div', { class: 'field' }, parts);
  }

  function table(captionText, headers) {
    const body = el('tbody');
    const caption = el('caption', {}, captionText);
    const node = el('table', { class: 'data' }, caption,
      el('thead', {}, el('tr', {}, headers.map((h) => el('th', { scope: 'col' }, h)))), body);
    return { node, body, caption, wrap: el('div', { class: 'table-wrap', tabindex: '0', role: 'region', 'aria-label': captionText }, node) };
  }

  // Each body cell names its column (data-label): at phone width a row is shown as a card with
  // those names, so no column is cut off.
  function labelCells(list) {
    const names = [...list.node.querySelectorAll('thead th')].map((th) => th.textContent.trim());
    for (const row of list.body.rows) {
      [...row.cells].forEach((cell, i) => { if (names[i] && cell.colSpan === 1) cell.dataset.label = names[i]; });
    }
  }

  // Long text in a table cell: cut to fit (an ellipsis, or a few lines), the whole of it on hover
  // and to assistive technology (title, and the text itself stays in the DOM).
  function clip(text, lines) {
    const value = text === null || text === undefined ? '' : String(text);
    return el('span', { class: lines ? 'clamp' : 'clip', title: value }, value);
  }

  function timeNode(iso) {
    if (!iso) return '—';
    const date = new Date(iso);
    if (Number.isNaN(date.getTime())) return String(iso);
    const pad = (n, w = 2) => String(n).padStart(w, '0');
    const text = `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} `
      + `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
    return el('time', { datetime: iso, title: iso }, text);
  }

  function age(seconds) {
    if (seconds === null || seconds === undefined) return '—';
    let s = Math.max(0, Math.round(Number(seconds)));
    if (s < 60) return `${s} s`;
    const d = Math.floor(s / 86400); s -= d * 86400;
    const h = Math.floor(s / 3600); s -= h * 3600;
    const m = Math.floor(s / 60); s -= m * 60;
    if (d) return `${d} d ${h} h`;
    if (h) return `${h} h ${m} min`;
    return `${m} min ${s} s`;
  }

  function duration(startIso, endIso) {
    if (!startIso || !endIso) return '—';
    const ms = new Date(endIso).getTime() - new Date(startIso).getTime();
    if (!Number.isFinite(ms)) return '—';
    if (ms < 1000) return `${Math.max(0, Math.round(ms))} ms`;
    if (ms < 60000) return `${(ms / 1000).toFixed(2)} s`;
    return age(ms / 1000);
  }

  function json(value) {
    return JSON.stringify(value, null, 2);
  }

  function statusBadge(status) {
    return el('span', { class: `badge status-${String(status).toLowerCase()}` }, status);
  }

  // -- messages ----------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, title, detail, field) {
      super(detail || title || `HTTP ${status}`);
      this.status = status;
      this.title = title;
      this.detail = detail;
      this.field = field;
    }
  }

  function describe(error) {
    if (error instanceof ApiError) {
      const head = error.status ? `${error.status} ${error.title || ''}`.trim() : (error.title || 'Error');
      const fieldNote = error.field ? ` (field: ${error.field})` : '';
      return `${head}: ${error.detail || 'no detail given'}${fieldNote}`;
    }
    return error && error.message ? error.message : String(error);
  }

  function showError(error) {
    $('error-text').textContent = describe(error);
    $('error-box').hidden = false;
  }

  function clearError() {
    $('error-box').hidden = true;
    $('error-text').textContent = '';
  }

  // A message for the operator; ``carry``: it stays through the next route change (an action
  // that navigates, e.g. enqueue, then the task page).
  let carried = '';
  function say(text, carry) {
    $('status-line').textContent = text;
    carried = carry ? text : '';
  }

  // -- the API -----------------------------------------------------------------------------
  function token() {
    try { return sessionStorage.getItem(TOKEN_KEY) || ''; } catch (e) { return ''; }
  }

  function refreshTokenButton() {
    $('forget-token').hidden = !token();
  }

  async function api(method, path, body) {
    const headers = { Accept: 'application/json' };
    if (body !== undefined) headers['Content-Type'] = 'application/json';
    const bearer = token();
    if (bearer) headers.Authorization = `Bearer ${bearer}`;
    let response;
    try {
      response = await fetch(path, {
        method, headers, body: body === undefined ? undefined : JSON.stringify(body),
        credentials: 'omit', cache: 'no-store', redirect: 'error',
      });
    } catch (e) {
      throw new ApiError(0, 'Network error', `the console could not reach its server (${e.message})`);
    }
    const text = await response.text();
    let data = null;
    try { data = text ? JSON.parse(text) : null; } catch (e) { data = null; }
    if (!response.ok) {
      const problem = data && typeof data === 'object' ? data : {};
      const challenge = (response.headers.get('WWW-Authenticate') || '').toLowerCase();
      if (response.status === 401 && challenge.startsWith('bearer')) askForToken();
      throw new ApiError(response.status, problem.title || response.statusText,
        typeof problem.detail === 'string' ? problem.detail : (text.slice(0, 300) || response.statusText),
        typeof problem.field === 'string' ? problem.field : undefined);
    }
    return data;
  }

  let tokenDialogOpen = false;
  function askForToken() {
    const dialog = $('token-dialog');
    if (tokenDialogOpen) return;
    tokenDialogOpen = true;
    const before = document.activeElement;
    $('token-input').value = '';
    dialog.showModal();
    $('token-input').focus();
    dialog.addEventListener('close', () => {
      tokenDialogOpen = false;
      const value = $('token-input').value.trim();
      $('token-input').value = '';
      if (dialog.returnValue === 'save' && value) {
        try { sessionStorage.setItem(TOKEN_KEY, value); } catch (e) { /* storage disabled: nothing to keep */ }
        refreshTokenButton();
        route();
      } else if (before && before.focus) {
        before.focus();
      }
    }, { once: true });
  }

  // A real in-page dialog; resolves true only when the operator chose the confirming button.
  function confirmDialog(title, text, okLabel, danger) {
    const dialog = $('confirm-dialog');
    const before = document.activeElement;
    $('confirm-title').textContent = title;
    $('confirm-text').textContent = text;
    $('confirm-ok').textContent = okLabel;
    $('confirm-ok').className = danger ? 'danger' : '';
    dialog.returnValue = '';
    return new Promise((resolve) => {
      dialog.addEventListener('close', () => {
        if (before && before.focus && document.contains(before)) before.focus();
        resolve(dialog.returnValue === 'confirm');
      }, { once: true });
      dialog.showModal();
      (danger ? $('confirm-cancel') : $('confirm-ok')).focus();
    });
  }

  // A bulk action: ask the API how many tasks match (dry_run), show that number in the dialog,
  // act only on confirmation. Resolves to the count acted on, or null when nothing was done.
  async function confirmedBulk({ path, body, title, describe, okVerb, danger, resultKey }) {
    const dry = await api('POST', path, { ...body, dry_run: true });
    if (!dry || typeof dry.matched !== 'number') {
      throw new ApiError(0, 'Unexpected answer', 'the API did not answer the dry run with a count of matching tasks');
    }
    if (dry.matched === 0) {
      say('No task matches: nothing was changed.');
      return null;
    }
    if (!await confirmDialog(title, describe(dry.matched), `${okVerb} ${dry.matched}`, danger)) return null;
    const done = await api('POST', path, body);
    if (done && done.operation) return followOperation(done.operation);
    return done[resultKey];
  }

  // A selection too large for one request (or a rate-limited one) runs as a background
  // operation: the API answers 202 with it. Show its progress until it is finished.
  async function followOperation(operation) {
    let current = operation;
    while (current.status === 'RUNNING') {
      say(`Operation ${current.id}: ${current.action} in progress, ${current.done} of ${current.matched} done…`);
      await new Promise((resolve) => setTimeout(resolve, 1000));
      current = await api('GET', `v1/operations/${seg(current.id)}`);
    }
    if (current.status !== 'SUCCEEDED') {
      say(`Operation ${current.id} was ${current.status.toLowerCase()} after ${current.done} of ${current.matched}.`);
    }
    return current.done;
  }

  // -- routing -----------------------------------------------------------------------------
  function every(ms, fn) {
    const id = setInterval(fn, ms);
    timers.push(id);
  }

  function parseHash() {
    const raw = location.hash.replace(/^#/, '');
    const at = raw.indexOf('?');
    const path = at < 0 ? raw : raw.slice(0, at);
    const params = new URLSearchParams(at < 0 ? '' : raw.slice(at + 1));
    let parts;
    try {
      parts = path.split('/').filter(Boolean).map(decodeURIComponent);
    } catch (e) {
      parts = ['?'];
    }
    return { parts, params };
  }

  function heading(text) {
    return el('h1', { tabindex: '-1', id: 'view-title' }, text);
  }

  function route() {
    generation += 1;
    timers.forEach(clearInterval);
    timers = [];
    clearError();
    $('status-line').textContent = carried;
    carried = '';
    const view = $('view');
    view.replaceChildren();
    const { parts, params } = parseHash();
    const gen = generation;
    const ctx = { view, params, alive: () => gen === generation };
    let section = '';
    if (parts.length === 0 || (parts[0] === 'queues' && parts.length === 1)) {
      section = 'queues'; queuesView(ctx);
    } else if (parts[0] === 'queues' && parts.length === 3 && parts[2] === 'tasks') {
      section = 'queues'; tasksView(ctx, parts[1]);
    } else if (parts[0] === 'queues' && parts.length === 3 && parts[2] === 'dlq') {
      section = 'queues'; dlqView(ctx, parts[1]);
    } else if (parts[0] === 'tasks' && parts.length === 2) {
      taskView(ctx, parts[1]);
    } else if (parts[0] === 'enqueue' && parts.length === 1) {
      section = 'enqueue'; enqueueView(ctx);
    } else if (parts[0] === 'audit' && parts.length === 1) {
      section = 'audit'; auditView(ctx);
    } else if (parts[0] === 'operations' && parts.length === 1) {
      section = 'operations'; operationsView(ctx);
    } else if (parts[0] === 'schedules' && parts.length === 1) {
      section = 'schedules'; schedulesView(ctx);
    } else {
      view.append(heading('Not found'), el('p', {}, 'No such page. ', el('a', { href: '#/queues' }, 'Back to the queues')));
      document.title = 'Not found · rdq console';
    }
    for (const link of document.querySelectorAll('[data-nav]')) {
      if (link.dataset.nav === section) link.setAttribute('aria-current', 'page');
      else link.removeAttribute('aria-current');
    }
    const title = $('view-title');
    if (title) {
      document.title = `${title.textContent} · rdq console`;
      if (!firstRoute) title.focus();
    }
    firstRoute = false;
  }

  // A list with a filter form, pages by cursor, and a table.
  function pagedList(ctx, options) {
    const list = table(options.caption, options.headers);
    const pageInfo = el('p', { class: 'muted' });
    const empty = el('p', { class: 'empty', hidden: true }, options.emptyText);
    const first = el('button', { type: 'button', disabled: true }, 'First page');
    const next = el('button', { type: 'button', disabled: true }, 'Next page');
    const state = { cursor: null, nextCursor: null, page: 1, items: [] };

    async function load() {
      next.disabled = true;
      try {
        const data = await options.fetchPage(state.cursor);
        if (!ctx.alive()) return;
        state.items = data[options.key] || [];
        state.nextCursor = data.next_cursor || null;
        setChildren(list.body, state.items.map(options.row));
        labelCells(list);
        empty.hidden = state.items.length > 0;
        list.caption.textContent = `${options.caption} (page ${state.page})`;
        pageInfo.textContent = `Page ${state.page}: ${state.items.length} shown${state.nextCursor ? ', more on the next page' : ''}.`;
        next.disabled = !state.nextCursor;
        first.disabled = state.page === 1;
        if (options.loaded) options.loaded(state);
      } catch (error) {
        if (ctx.alive()) showError(error);
      }
    }

    next.addEventListener('click', () => {
      if (!state.nextCursor) return;
      state.cursor = state.nextCursor;
      state.page += 1;
      load();
    });
    first.addEventListener('click', () => {
      state.cursor = null;
      state.page = 1;
      load();
    });
    const node = el('div', { class: 'paged' }, list.wrap, empty,
      el('div', { class: 'pager', role: 'group', 'aria-label': 'Pages' }, first, next, pageInfo));
    return { node, load, state };
  }

  function filterForm(ctx, path, fields, extra) {
    const controls = {};
    const items = fields.map((spec) => {
      let control;
      if (spec.options) {
        control = el('select', { name: spec.name },
          el('option', { value: '' }, spec.any || 'Any'),
          spec.options.map((option) => el('option', { value: option }, option)));
      } else {
        control = el('input', { name: spec.name, autocomplete: 'off', type: 'text' });
      }
      control.value = ctx.params.get(spec.name) || '';
      controls[spec.name] = control;
      return field(spec.label, control);
    });
    const form = el('form', { class: 'filters', 'aria-label': 'Filters' }, items,
      el('div', { class: 'buttons' }, el('button', { type: 'submit' }, 'Apply filters'),
        el('a', { href: hashLink(path, extra), class: 'button-link' }, 'Clear')));
    form.addEventListener('submit', (event) => {
      event.preventDefault();
      const values = { ...(extra || {}) };
      for (const [name, control] of Object.entries(controls)) values[name] = control.value.trim();
      const target = hashLink(path, values);
      if (location.hash === target) route(); else location.hash = target;
    });
    return form;
  }

  // The charts (charts.js, over vendor/uplot): made once the page's helpers exist.
  let charts = null;
  function chartsModule() {
    if (!charts) charts = window.RdqCharts({ el, api, seg, every, showError });
    return charts;
  }

  // -- views -------------------------------------------------------------------------------
  function queuesView(ctx) {
    // State and its button come first: at phone width they stay in view, the counts scroll.
    const list = table('Queues, refreshed every 3 seconds',
      ['Queue', 'State', 'Pending', 'In flight', 'Dead', 'Oldest pending', 'Succeeded', 'Cancelled']);
    const empty = el('p', { class: 'empty', hidden: true }, 'No queue holds a task yet. ',
      el('a', { href: '#/enqueue' }, 'Enqueue one'), '.');
    const updated = el('p', { class: 'muted', id: 'queues-updated' });
    const overview = chartsModule().overviewChart(ctx);
    ctx.view.append(heading('Queues'), list.wrap, empty, updated, overview.node);
    overview.load();
    const rows = new Map();
    let loadFailed = false;

    function makeRow(queue) {
      const button = el('button', { type: 'button', class: 'pause' });
      button.addEventListener('click', () => toggle(queue, button));
      const cell = (name, cls) => el('td', { class: cls, 'data-col': name });
      const badge = el('span');
      const deadLink = el('a', { href: `#/queues/${seg(queue)}/dlq` });
      const cells = {
        state: el('td', { class: 'state', 'data-col': 'state' }, badge, ' ', button),
        pending: cell('pending', 'num'), in_flight: cell('in_flight', 'num'),
        dead: el('td', { class: 'num', 'data-col': 'dead' }, deadLink),
        oldest: cell('oldest', ''), succeeded: cell('succeeded', 'num'), cancelled: cell('cancelled', 'num'),
      };
      const tr = el('tr', { 'data-queue': queue },
        el('th', { scope: 'row' }, el('a', { href: `#/queues/${seg(queue)}/tasks` }, clip(queue))),
        cells.state, cells.pending, cells.in_flight, cells.dead, cells.oldest, cells.succeeded, cells.cancelled);
      return { tr, cells, button, badge, deadLink };
    }

    function fill(row, q) {
      row.cells.pending.textContent = q.pending;
      row.cells.in_flight.textContent = q.in_flight;
      row.deadLink.textContent = q.dead;
      row.deadLink.setAttribute('aria-label', `${q.dead} dead: the dead-letter queue of ${q.queue}`);
      row.cells.succeeded.textContent = q.succeeded;
      row.cells.cancelled.textContent = q.cancelled;
      row.cells.oldest.textContent = q.pending ? age(q.oldest_pending_age_seconds) : '—';
      const paused = q.paused === true;
      row.badge.className = paused ? 'badge paused' : 'badge active';
      row.badge.textContent = paused ? 'paused' : 'active';
      row.button.dataset.paused = String(paused);
      row.button.textContent = paused ? 'Resume' : 'Pause';
      row.button.setAttribute('aria-label', `${paused ? 'Resume' : 'Pause'} queue ${q.queue}`);
    }

    async function load() {
      try {
        const data = await api('GET', 'v1/queues');
        if (!ctx.alive()) return;
        if (loadFailed) { clearError(); loadFailed = false; }
        const queues = data.queues || [];
        const order = queues.map((q) => q.queue);
        const same = order.length === rows.size && order.every((name, i) => list.body.rows[i] && list.body.rows[i].dataset.queue === name);
        for (const q of queues) {
          if (!rows.has(q.queue)) rows.set(q.queue, makeRow(q.queue));
          fill(rows.get(q.queue), q);
        }
        for (const name of [...rows.keys()]) if (!order.includes(name)) rows.delete(name);
        if (!same) {
          const focused = document.activeElement;
          setChildren(list.body, order.map((name) => rows.get(name).tr));
          labelCells(list);
          if (focused && list.body.contains(focused)) focused.focus();
        }
        empty.hidden = queues.length > 0;
        updated.textContent = `Updated ${new Date().toLocaleTimeString()}.`;
      } catch (error) {
        if (ctx.alive()) { loadFailed = true; showError(error); }
      }
    }

    async function toggle(queue, button) {
      if (button.getAttribute('aria-busy') === 'true') return;
      const resume = button.dataset.paused === 'true';
      button.setAttribute('aria-busy', 'true');
      try {
        const answer = await api('POST', `v1/queues/${seg(queue)}:${resume ? 'resume' : 'pause'}`, {});
        say(`Queue ${queue} ${answer && answer.paused ? 'paused' : 'resumed'}.`);
      } catch (error) {
        showError(error);
      } finally {
        button.removeAttribute('aria-busy');
      }
      await load();
    }

    load();
    every(QUEUES_REFRESH_MS, load);
  }

  function whenOf(task) {
    switch (task.status) {
      case 'PENDING': return ['due', task.next_attempt_at];
      case 'IN_FLIGHT': return ['lease until', task.lease_expires_at];
      case 'DEAD': return ['dead', task.dead_at];
      default: return ['updated', task.updated_at];
    }
  }

  // This life's attempts (of the maximum); the one running counts, as on the task's page.
  function attemptsCell(task) {
    const used = task.attempt_count + (task.status === 'IN_FLIGHT' ? 1 : 0);
    const text = task.max_attempts ? `${used} / ${task.max_attempts}` : String(used);
    return task.status === 'IN_FLIGHT' ? `${text}, running` : text;
  }

  function tasksView(ctx, queue) {
    const path = `/queues/${seg(queue)}/tasks`;
    const filters = filterForm(ctx, path, [
      { name: 'status', label: 'Status', options: STATUSES, any: 'Any status' },
      { name: 'handler', label: 'Handler' },
      { name: 'error_type', label: 'Error type' },
    ]);
    const list = pagedList(ctx, {
      caption: `Tasks in ${queue}`,
      headers: ['Task', 'Status', 'Handler', 'Attempts', 'When', 'Last error'],
      key: 'tasks',
      emptyText: 'No task matches.',
      fetchPage: (cursor) => api('GET', `v1/queues/${seg(queue)}/tasks${qs({
        status: ctx.params.get('status'), handler: ctx.params.get('handler'),
        error_type: ctx.params.get('error_type'), limit: PAGE_SIZE, cursor,
      })}`),
      row: (task) => {
        const [label, at] = whenOf(task);
        return el('tr', { 'data-task': task.id },
          el('th', { scope: 'row' }, el('a', { href: `#/tasks/${seg(task.id)}` }, clip(task.id))),
          el('td', {}, statusBadge(task.status)),
          el('td', {}, clip(task.handler)),
          el('td', { class: 'num' }, attemptsCell(task)),
          el('td', { class: 'when' }, `${label} `, timeNode(at)),
          el('td', { class: 'wrap' }, task.last_error
            ? [task.status === 'SUCCEEDED' ? el('span', { class: 'muted' }, 'earlier: ') : null,
              el('code', { class: 'error-type' }, clip(task.last_error.type)), ' ', clip(task.last_error.message, 2)] : '—'));
      },
    });
    const cancelButton = el('button', { type: 'button', class: 'danger', 'aria-describedby': 'tasks-cancel-scope' },
      'Cancel pending…');
    const handlerName = ctx.params.get('handler') || '';
    const errorType = ctx.params.get('error_type') || '';
    const cancelScope = [handlerName && `handler ${handlerName}`, errorType && `error type ${errorType}`].filter(Boolean);
    const scopeText = cancelScope.length ? `every PENDING task with ${cancelScope.join(' and ')}` : `every PENDING task in ${queue}`;
    let cancelling = false;
    cancelButton.addEventListener('click', async () => {
      if (cancelling) return;
      cancelling = true;
      try {
        const body = cancelScope.length ? { handler: handlerName || undefined, error_type: errorType || undefined } : { all: true };
        const count = await confirmedBulk({
          path: `v1/queues/${seg(queue)}/tasks:cancel`, body, title: 'Cancel pending tasks', okVerb: 'Cancel',
          danger: true, resultKey: 'cancelled',
          describe: (n) => `${n} task(s) match: ${scopeText}. Cancel them? They will not run.`,
        });
        if (count !== null) {
          say(`Cancelled: ${count} task(s).`);
          list.state.cursor = null;
          list.state.page = 1;
          await list.load();
        }
      } catch (error) {
        showError(error);
      } finally {
        cancelling = false;
      }
    });
    const queueCharts = chartsModule().queueCharts(ctx, queue);
    const bulkBar = el('div', { class: 'bulk', role: 'group', 'aria-label': 'Bulk actions' },
      el('p', { class: 'scope', id: 'tasks-cancel-scope' }, `Cancel applies to ${scopeText}.`),
      el('div', { class: 'buttons' }, cancelButton));
    ctx.view.append(heading(`Tasks in ${queue}`),
      el('p', { class: 'links' }, el('a', { href: `#/queues/${seg(queue)}/dlq` }, 'Dead-letter queue'), ' · ',
        el('a', { href: hashLink('/enqueue', { queue }) }, 'Enqueue to this queue'), ' · ',
        el('a', { href: hashLink('/audit', { queue }) }, 'Audit log of this queue')),
      queueCharts.node, filters, bulkBar, list.node);
    list.load();
    queueCharts.load();
  }

  function errorBlock(error, label) {
    if (!error) return null;
    return el('div', { class: 'error-info' },
      el('p', {}, el('strong', {}, `${label}: `), el('code', { class: 'error-type' }, error.type), ' ',
        el('span', { class: 'error-message' }, error.message)),
      error.stack ? el('details', {}, el('summary', {}, 'Stack trace'), el('pre', { class: 'stack' }, error.stack)) : null);
  }

  // Where the task's current life starts in its history: the trailing attempt_count budgeted
  // attempts are this life's (a redrive resets the count; a snooze spends none).
  function lifeStart(task) {
    const attempts = task.attempts || [];
    let budgeted = 0;
    let index = attempts.length;
    while (index > 0) {
      if (attempts[index - 1].outcome !== 'SNOOZED') {
        if (budgeted >= task.attempt_count) break;
        budgeted += 1;
      }
      index -= 1;
    }
    return index;
  }

  function taskView(ctx, id) {
    const body = el('div');
    ctx.view.append(heading(`Task ${id}`), body);
    let shown = '';

    // The budget of this life, then the whole history: one story, told once.
    function budgetText(task, running) {
      const used = task.attempt_count + (running ? 1 : 0);
      const of = task.max_attempts ? ` of ${task.max_attempts}` : '';
      const verb = running ? `attempt ${used}${of} running` : `${used}${of} attempt(s) used`;
      return task.redrive_count ? `${verb} since its last redrive` : verb;
    }

    function attemptItem(a, firstOfLife, redriven) {
      return el('li', { class: `attempt outcome-${String(a.outcome).toLowerCase()}`, 'data-attempt': a.attempt_no },
        firstOfLife && redriven ? el('p', { class: 'life-break' }, 'Redriven: a fresh budget starts with this attempt.') : null,
        el('h3', {}, `Attempt ${a.attempt_no}: `, el('span', { class: 'outcome' }, a.outcome)),
        el('dl', { class: 'inline' },
          el('dt', {}, 'Started'), el('dd', {}, timeNode(a.started_at)),
          el('dt', {}, 'Finished'), el('dd', {}, timeNode(a.finished_at)),
          el('dt', {}, 'Duration'), el('dd', { class: 'duration' }, duration(a.started_at, a.finished_at))),
        errorBlock(a.error, 'Error'));
    }

    function render(task) {
      const attempts = task.attempts || [];
      const running = task.status === 'IN_FLIGHT';
      const life = lifeStart(task);
      const rows = [
        ['Queue', el('a', { href: `#/queues/${seg(task.queue)}/tasks` }, task.queue)],
        ['Handler', task.handler],
        ['Status', statusBadge(task.status)],
        ['Budget', budgetText(task, running)],
        ['History', `${attempts.length + (running ? 1 : 0)} attempt(s) in all, below`],
        ['Redrives', task.redrive_count],
        ['Created', timeNode(task.created_at)],
        ['Updated', timeNode(task.updated_at)],
      ];
      if (task.status === 'PENDING') rows.push(['Next attempt', timeNode(task.next_attempt_at)]);
      if (task.status === 'DEAD') rows.push(['Dead at', timeNode(task.dead_at)]);
      const summary = el('dl', { class: 'summary' }, rows.map(([name, value]) => [el('dt', {}, name), el('dd', {}, value)]));
      const actions = el('div', { class: 'buttons' });
      if (task.status === 'PENDING') {
        actions.append(el('button', { type: 'button', class: 'danger', onclick: () => cancel(task) }, 'Cancel task'));
      }
      if (task.status === 'DEAD') {
        actions.append(el('button', { type: 'button', onclick: (event) => redrive(task, event.currentTarget) }, 'Redrive…'),
          el('a', { class: 'button-link', href: `#/queues/${seg(task.queue)}/dlq` }, 'Open the dead-letter queue'));
      }
      // The attempt running now: what the store knows of it (the claim's time and the lease).
      const runningNow = running ? el('section', { class: 'running', 'aria-labelledby': 'running-title' },
        el('h2', { id: 'running-title' }, `Running now: attempt ${attempts.length + 1}`),
        el('dl', { class: 'inline' },
          el('dt', {}, 'Started'), el('dd', {}, timeNode(task.claimed_at)),
          el('dt', {}, 'Lease expires'), el('dd', {}, timeNode(task.lease_expires_at))),
        el('p', { class: 'muted' }, 'A worker holds this attempt\'s claim until the lease expires; it extends the lease while the handler runs. '
          + 'If the worker stops, the reaper ends the attempt as LEASE_EXPIRED once the lease has run out.')) : null;
      // The error that matters now: why it is dead, or why it waits to retry. Once it succeeded
      // (or was cancelled), earlier errors are history, told in the timeline.
      let errorNow = null;
      if (task.last_error && task.status === 'DEAD') {
        errorNow = [el('h2', {}, 'Why it is dead'), errorBlock(task.last_error, 'Last error')];
      } else if (task.last_error && (task.status === 'PENDING' || running) && attempts.length) {
        errorNow = [el('h2', {}, 'Last attempt failed'), errorBlock(task.last_error, 'Error')];
      }
      const failedBefore = attempts.filter((a) => a.error).length;
      const earlier = !errorNow && failedBefore
        ? el('p', { class: 'earlier-errors' }, `${failedBefore} earlier attempt(s) failed before it ${task.status === 'SUCCEEDED' ? 'succeeded' : 'was ' + task.status.toLowerCase()}: their errors are in the history below.`)
        : null;
      const items = attempts.map((a, i) => attemptItem(a, i === life, task.redrive_count > 0 && life > 0));
      if (running) {
        items.push(el('li', { class: 'attempt outcome-running', 'data-attempt': attempts.length + 1 },
          life === attempts.length && life > 0 ? el('p', { class: 'life-break' }, 'Redriven: a fresh budget starts with this attempt.') : null,
          el('h3', {}, `Attempt ${attempts.length + 1}: `, el('span', { class: 'outcome' }, 'RUNNING')),
          el('dl', { class: 'inline' }, el('dt', {}, 'Started'), el('dd', {}, timeNode(task.claimed_at)),
            el('dt', {}, 'Lease expires'), el('dd', {}, timeNode(task.lease_expires_at)))));
      }
      const timeline = el('ol', { class: 'timeline', 'aria-label': 'Attempt history' }, items);
      setChildren(body, summary, actions, runningNow, errorNow, earlier,
        el('h2', {}, 'Payload'), el('pre', { class: 'payload' }, json(task.payload)),
        Object.keys(task.headers || {}).length ? [el('h2', {}, 'Headers'), el('pre', {}, json(task.headers))] : null,
        task.result !== null && task.result !== undefined ? [el('h2', {}, 'Result'), el('pre', { class: 'result' }, json(task.result))] : null,
        el('h2', { id: 'attempts-title' }, `History: ${items.length} attempt(s)`),
        items.length ? timeline : el('p', { class: 'empty' }, 'Not run yet: it waits for a worker to claim it.'));
    }

    async function redrive(task, button) {
      if (button.getAttribute('aria-busy') === 'true') return;
      button.setAttribute('aria-busy', 'true');
      try {
        const count = await confirmedBulk({
          path: `v1/queues/${seg(task.queue)}/dlq:redrive`, body: { ids: [task.id] }, title: 'Redrive dead tasks',
          okVerb: 'Redrive', danger: false, resultKey: 'redriven',
          describe: (n) => `${n} task(s) match: task ${task.id}. Redrive them? Each goes back to PENDING with a fresh retry budget.`,
        });
        if (count !== null) say(`Redrive: ${count} task(s) redriven.`);
      } catch (error) {
        showError(error);
      } finally {
        button.removeAttribute('aria-busy');
      }
      shown = '';
      load();
      if (!timers.length) every(TASK_REFRESH_MS, load);
    }

    async function load() {
      try {
        const task = await api('GET', `v1/tasks/${seg(id)}`);
        if (!ctx.alive()) return;
        const key = `${task.status}|${task.updated_at}|${(task.attempts || []).length}|${task.lease_expires_at}`;
        if (key !== shown) { shown = key; render(task); }
        if (!['PENDING', 'IN_FLIGHT'].includes(task.status)) {
          timers.forEach(clearInterval);
          timers = [];
        }
      } catch (error) {
        if (ctx.alive()) { showError(error); timers.forEach(clearInterval); timers = []; }
      }
    }

    async function cancel(task) {
      const ok = await confirmDialog('Cancel task', `Cancel task ${task.id}? It will not run.`, 'Cancel task', true);
      if (!ok) return;
      try {
        await api('DELETE', `v1/tasks/${seg(task.id)}`);
        say(`Task ${task.id} cancelled.`);
      } catch (error) {
        showError(error);
      }
      load();
    }

    load();
    every(TASK_REFRESH_MS, load);
  }

  function dlqView(ctx, queue) {
    const path = `/queues/${seg(queue)}/dlq`;
    const errorType = ctx.params.get('error_type') || '';
    const handlerName = ctx.params.get('handler') || '';
    const filters = filterForm(ctx, path, [
      { name: 'error_type', label: 'Error type' },
      { name: 'handler', label: 'Handler' },
    ]);
    const selected = new Set();
    const selectAll = el('input', { type: 'checkbox', id: 'dlq-select-all' });
    const scope = el('p', { class: 'scope', id: 'dlq-scope' });
    const redrive = el('button', { type: 'button', 'aria-describedby': 'dlq-scope' }, 'Redrive…');
    const purge = el('button', { type: 'button', class: 'danger', 'aria-describedby': 'dlq-scope' }, 'Purge…');

    function selection() {
      if (selected.size) return { body: { ids: [...selected] }, text: `the ${selected.size} selected task(s)` };
      const body = {};
      const parts = [];
      if (errorType) { body.error_type = errorType; parts.push(`error type ${errorType}`); }
      if (handlerName) { body.handler = handlerName; parts.push(`handler ${handlerName}`); }
      if (parts.length) return { body, text: `every dead task with ${parts.join(' and ')}` };
      return { body: { all: true }, text: `every dead task in ${queue}` };
    }

    function updateScope() {
      scope.textContent = `Bulk actions apply to ${selection().text}.`;
      const boxes = [...document.querySelectorAll('input[data-select]')];
      selectAll.checked = boxes.length > 0 && boxes.every((box) => box.checked);
    }

    const list = pagedList(ctx, {
      caption: `Dead tasks in ${queue}`,
      headers: [el('span', {}, el('label', { for: 'dlq-select-all', class: 'visually-hidden' }, 'Select every task on this page'), selectAll),
        'Task', 'Handler', 'Error type', 'Message', 'Attempts', 'Dead at'],
      key: 'tasks',
      emptyText: 'No dead task matches.',
      fetchPage: (cursor) => api('GET', `v1/queues/${seg(queue)}/dlq${qs({
        error_type: errorType, handler: handlerName, limit: PAGE_SIZE, cursor,
      })}`),
      row: (task) => {
        const box = el('input', { type: 'checkbox', 'data-select': task.id, id: `select-${task.id}`, checked: selected.has(task.id) });
        box.addEventListener('change', () => {
          if (box.checked) selected.add(task.id); else selected.delete(task.id);
          updateScope();
        });
        const error = task.last_error || {};
        return el('tr', { 'data-task': task.id },
          el('td', {}, el('label', { for: `select-${task.id}`, class: 'visually-hidden' }, `Select task ${task.id}`), box),
          el('th', { scope: 'row' }, el('a', { href: `#/tasks/${seg(task.id)}` }, clip(task.id))),
          el('td', {}, clip(task.handler)),
          el('td', {}, el('code', {}, clip(error.type || '—'))),
          el('td', { class: 'wrap' }, clip(error.message || '', 2)),
          el('td', { class: 'num' }, (task.attempts || []).length || task.attempt_count),
          el('td', {}, timeNode(task.dead_at)));
      },
      loaded: () => updateScope(),
    });
    selectAll.addEventListener('change', () => {
      for (const box of document.querySelectorAll('input[data-select]')) {
        box.checked = selectAll.checked;
        if (box.checked) selected.add(box.dataset.select); else selected.delete(box.dataset.select);
      }
      updateScope();
    });

    let busy = false;
    async function bulk(action, button) {
      // Not disabled while busy: a disabled button would drop the keyboard focus.
      if (busy) return;
      busy = true;
      button.setAttribute('aria-busy', 'true');
      const verb = action === 'redrive' ? 'Redrive' : 'Purge';
      const chosen = selection();
      try {
        const count = await confirmedBulk({
          path: `v1/queues/${seg(queue)}/dlq:${action}`, body: chosen.body, title: `${verb} dead tasks`, okVerb: verb,
          danger: action === 'purge', resultKey: action === 'redrive' ? 'redriven' : 'purged',
          describe: (n) => (action === 'redrive'
            ? `${n} task(s) match: ${chosen.text}. Redrive them? Each goes back to PENDING with a fresh retry budget.`
            : `${n} task(s) match: ${chosen.text}. Purge them? They are deleted for good.`),
        });
        if (count === null) return;
        say(`${verb}: ${count} task(s) ${action === 'redrive' ? 'redriven' : 'purged'}.`);
        selected.clear();
        list.state.cursor = null;
        list.state.page = 1;
        await list.load();
      } catch (error) {
        showError(error);
      } finally {
        busy = false;
        button.removeAttribute('aria-busy');
      }
    }

    redrive.addEventListener('click', () => bulk('redrive', redrive));
    purge.addEventListener('click', () => bulk('purge', purge));
    ctx.view.append(heading(`Dead-letter queue of ${queue}`),
      el('p', { class: 'links' }, el('a', { href: `#/queues/${seg(queue)}/tasks` }, 'All tasks of this queue')),
      filters,
      el('div', { class: 'bulk', role: 'group', 'aria-label': 'Bulk actions' }, scope, el('div', { class: 'buttons' }, redrive, purge)),
      list.node);
    updateScope();
    list.load();
  }

  function enqueueView(ctx) {
    const queue = el('input', { id: 'enqueue-queue', name: 'queue', required: true, autocomplete: 'off' });
    queue.value = ctx.params.get('queue') || '';
    const handlerInput = el('input', { id: 'enqueue-handler', name: 'handler', required: true, autocomplete: 'off' });
    const payload = el('textarea', { id: 'enqueue-payload', name: 'payload', rows: '8', spellcheck: 'false' });
    payload.value = '{}';
    const payloadError = el('p', { id: 'enqueue-payload-error', class: 'field-error', hidden: true });
    const delay = el('input', { id: 'enqueue-delay', name: 'delay_seconds', type: 'number', min: '0', step: 'any', inputmode: 'decimal' });
    const attempts = el('input', { id: 'enqueue-max-attempts', name: 'max_attempts', type: 'number', min: '1', step: '1', inputmode: 'numeric' });
    const taskId = el('input', { id: 'enqueue-id', name: 'id', autocomplete: 'off' });
    const priority = el('input', { id: 'enqueue-priority', name: 'priority', type: 'number', min: '0', max: '9', step: '1', inputmode: 'numeric' });
    const concurrencyKey = el('input', { id: 'enqueue-concurrency-key', name: 'concurrency_key', autocomplete: 'off' });
    const rateKey = el('input', { id: 'enqueue-rate-key', name: 'rate_key', autocomplete: 'off' });
    const group = el('input', { id: 'enqueue-group', name: 'group', autocomplete: 'off' });
    const controls = { queue, handler: handlerInput, payload, delay_seconds: delay, max_attempts: attempts, id: taskId,
      priority, concurrency_key: concurrencyKey, rate_key: rateKey, group };

    function checkPayload() {
      try {
        JSON.parse(payload.value.trim() || 'null');
        payload.removeAttribute('aria-invalid');
        payload.setAttribute('aria-describedby', 'enqueue-payload-hint');
        payloadError.hidden = true;
        payloadError.textContent = '';
        return true;
      } catch (e) {
        payload.setAttribute('aria-invalid', 'true');
        payload.setAttribute('aria-describedby', 'enqueue-payload-hint enqueue-payload-error');
        payloadError.textContent = `The payload is not valid JSON: ${e.message}`;
        payloadError.hidden = false;
        return false;
      }
    }
    payload.addEventListener('input', checkPayload);

    const form = el('form', { class: 'enqueue', 'aria-labelledby': 'view-title', novalidate: true },
      field('Queue', queue),
      field('Handler', handlerInput),
      el('div', { class: 'field' }, el('label', { for: 'enqueue-payload' }, 'Payload (JSON)'), payload,
        el('small', { id: 'enqueue-payload-hint', class: 'hint' }, 'Any JSON value; {} when there is nothing to pass.'), payloadError),
      field('Delay in seconds (optional)', delay),
      field('Max attempts (optional)', attempts, 'Empty: the queue\'s policy.'),
      field('Task id (optional)', taskId, 'Empty: one is generated. An existing id on this queue returns that task.'),
      field('Priority (optional)', priority, '0 to 9, lower runs first. Empty: 0.'),
      field('Concurrency key (optional)', concurrencyKey, 'Counts against the queue\'s concurrency limit.'),
      field('Rate key (optional)', rateKey, 'Counts against the queue\'s rate limit.'),
      field('Group (optional)', group, 'The tenant, for a queue that claims fairly across groups.'),
      el('div', { class: 'buttons' }, el('button', { type: 'submit' }, 'Enqueue')));
    payload.setAttribute('aria-describedby', 'enqueue-payload-hint');

    form.addEventListener('submit', async (event) => {
      event.preventDefault();
      for (const control of Object.values(controls)) if (control !== payload) control.removeAttribute('aria-invalid');
      clearError();
      const missing = [queue, handlerInput].filter((c) => !c.value.trim());
      missing.forEach((c) => c.setAttribute('aria-invalid', 'true'));
      if (missing.length) {
        showError(new Error(`Fill in: ${missing.map((c) => (c === queue ? 'queue' : 'handler')).join(', ')}.`));
        missing[0].focus();
        return;
      }
      if (!checkPayload()) { payload.focus(); return; }
      const body = { handler: handlerInput.value.trim(), payload: JSON.parse(payload.value.trim() || 'null') };
      if (delay.value !== '') body.delay_seconds = Number(delay.value);
      if (attempts.value !== '') body.max_attempts = Number(attempts.value);
      if (taskId.value.trim()) body.id = taskId.value.trim();
      if (priority.value !== '') body.priority = Number(priority.value);
      for (const [name, control] of [['concurrency_key', concurrencyKey], ['rate_key', rateKey], ['group', group]]) {
        if (control.value.trim()) body[name] = control.value.trim();
      }
      const button = form.querySelector('button[type=submit]');
      button.disabled = true;
      try {
        const task = await api('POST', `v1/queues/${seg(queue.value.trim())}/tasks`, body);
        say(task.created === false ? `Task ${task.id} already existed on ${task.queue}.` : `Task ${task.id} enqueued on ${task.queue}.`, true);
        location.hash = `#/tasks/${seg(task.id)}`;
      } catch (error) {
        const control = error instanceof ApiError && error.field ? controls[error.field] : null;
        if (control) { control.setAttribute('aria-invalid', 'true'); control.focus(); }
        showError(error);
      } finally {
        button.disabled = false;
      }
    });
    ctx.view.append(heading('Enqueue a task'), form);
  }

  function auditView(ctx) {
    const queue = ctx.params.get('queue') || '';
    const filters = filterForm(ctx, '/audit', [{ name: 'queue', label: 'Queue' }]);
    const list = pagedList(ctx, {
      caption: queue ? `Audit log of ${queue}, newest first` : 'Audit log, newest first',
      headers: ['Time', 'Actor', 'Action', 'Queue', 'Selection', 'Count'],
      key: 'entries',
      emptyText: 'No entry.',
      fetchPage: (cursor) => api('GET', `v1/audit${qs({ queue, limit: PAGE_SIZE, cursor })}`),
      row: (entry) => el('tr', { 'data-entry': entry.id },
        el('td', {}, timeNode(entry.at)),
        el('td', {}, clip(entry.actor)),
        el('td', {}, entry.action),
        el('td', {}, entry.queue ? el('a', { href: `#/queues/${seg(entry.queue)}/tasks` }, entry.queue) : '—'),
        el('td', { class: 'wrap' }, el('code', {}, clip(entry.selection ? JSON.stringify(entry.selection) : '—', 2))),
        el('td', { class: 'num' }, entry.count === null || entry.count === undefined ? '—' : entry.count)),
    });
    ctx.view.append(heading('Audit log'), filters, list.node);
    list.load();
  }

  // Background bulk operations (redrive, purge, cancel) with their progress, refreshed while any
  // runs; a running one can be stopped.
  function operationsView(ctx) {
    const queue = ctx.params.get('queue') || '';
    const filters = filterForm(ctx, '/operations', [{ name: 'queue', label: 'Queue' }]);
    const list = table(queue ? `Operations on ${queue}, newest first` : 'Operations, newest first',
      ['Started', 'Action', 'Queue', 'Status', 'Done', 'Matched', 'Rate', 'Actor', 'Actions']);
    async function stop(operation, button) {
      if (button.getAttribute('aria-busy') === 'true') return;
      button.setAttribute('aria-busy', 'true');
      try {
        const stopped = await api('POST', `v1/operations/${seg(operation.id)}:cancel`, {});
        say(`Operation ${stopped.id} cancelled after ${stopped.done} of ${stopped.matched}.`);
      } catch (error) {
        showError(error);
      } finally {
        button.removeAttribute('aria-busy');
      }
      await load();
    }
    async function load() {
      if (!ctx.alive()) return;
      let answer;
      try {
        answer = await api('GET', `v1/operations${qs({ queue, limit: PAGE_SIZE })}`);
      } catch (error) {
        showError(error);
        return;
      }
      if (!ctx.alive()) return;
      const operations = (answer && answer.operations) || [];
      list.body.replaceChildren(...operations.map((op) => el('tr', { 'data-operation': op.id },
        el('td', {}, timeNode(op.started_at)),
        el('td', {}, op.action),
        el('td', {}, el('a', { href: `#/queues/${seg(op.queue)}/tasks` }, op.queue)),
        el('td', {}, el('span', { class: `badge ${String(op.status).toLowerCase()}` }, op.status)),
        el('td', { class: 'num' }, op.done),
        el('td', { class: 'num' }, op.matched),
        el('td', { class: 'num' }, op.rate_per_second ? `${op.rate_per_second}/s` : '—'),
        el('td', {}, clip(op.actor)),
        el('td', {}, op.status === 'RUNNING'
          ? el('button', { type: 'button', 'aria-label': `Cancel operation ${op.id}`,
            onclick: (event) => stop(op, event.currentTarget) }, 'Cancel')
          : '—'))));
      labelCells(list);
      if (!operations.length) {
        list.body.append(el('tr', {}, el('td', { colspan: '9', class: 'wrap' },
          'No operation yet. A redrive, purge or cancel runs here as a background operation when it selects more than '
          + '1,000 tasks or is given a rate; start one from a queue\'s dead-letter queue or its "Cancel pending".')));
      }
    }
    ctx.view.append(heading('Operations'), filters, list.wrap);
    load();
    every(QUEUES_REFRESH_MS, load);
  }

  // Every schedule (rdq_core/engine/schedules.py) with its next fire time; they are managed with
  // `rdq schedules` or POST/DELETE v1/schedules.
  function schedulesView(ctx) {
    const list = table('Schedules by name', ['Name', 'Expression', 'Time zone', 'Queue', 'Handler', 'Next fire']);
    const empty = el('p', { class: 'empty', hidden: true },
      'No schedule yet. A schedule enqueues a task on a rate or cron expression; add one with ',
      el('code', {}, "rdq schedules add NAME 'rate(5 minutes)' --queue Q --handler H"), ' or POST v1/schedules.');
    ctx.view.append(heading('Schedules'), list.wrap, empty);
    api('GET', 'v1/schedules').then((answer) => {
      if (!ctx.alive()) return;
      const schedules = (answer && answer.schedules) || [];
      setChildren(list.body, schedules.map((one) => el('tr', { 'data-schedule': one.name },
        el('th', { scope: 'row' }, el('span', { class: 'clip', title: one.name }, one.name)),
        el('td', {}, el('code', {}, one.expression)),
        el('td', {}, one.timezone || 'UTC'),
        el('td', {}, el('a', { href: `#/queues/${seg(one.queue)}/tasks` }, one.queue)),
        el('td', {}, one.handler),
        el('td', {}, timeNode(one.next_fire_at)))));
      labelCells(list);
      empty.hidden = schedules.length > 0;
      list.wrap.hidden = schedules.length === 0;
    }).catch((error) => { if (ctx.alive()) showError(error); });
  }

  // -- start -------------------------------------------------------------------------------
  function start() {
    $('error-dismiss').addEventListener('click', clearError);
    $('forget-token').addEventListener('click', () => {
      try { sessionStorage.removeItem(TOKEN_KEY); } catch (e) { /* nothing stored */ }
      refreshTokenButton();
      say('The token is forgotten.');
    });
    $('find-task').addEventListener('submit', (event) => {
      event.preventDefault();
      const id = $('find-task-id').value.trim();
      if (id) location.hash = `#/tasks/${seg(id)}`;
    });
    $('skip-link').addEventListener('click', (event) => {
      event.preventDefault();
      const title = $('view-title');
      (title || $('view')).focus();
    });
    window.addEventListener('hashchange', route);
    takeTokenFromUrl();
    refreshTokenButton();
    if (!location.hash) history.replaceState(null, '', '#/queues');
    route();
  }

  // ``rdq console`` prints this page's address with ``?token=…``: keep the token in this tab's
  // session storage (it is sent as a bearer token) and take it out of the address bar and history.
  function takeTokenFromUrl() {
    const params = new URLSearchParams(location.search);
    const given = params.get('token');
    if (given === null) return;
    if (given) {
      try { sessionStorage.setItem(TOKEN_KEY, given); } catch (e) { /* storage disabled: the dialog asks */ }
    }
    params.delete('token');
    const rest = params.toString();
    history.replaceState(null, '', `${location.pathname}${rest ? `?${rest}` : ''}${location.hash}`);
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
}());

// The rdq operator console: plain JavaScript, no build step, nothing loaded from elsewhere.
// Every API call is relative ("v1/..."), so the console works under any path prefix. Text from
// the API (payloads, error messages, stacks) is only ever inserted as text nodes, never as HTML.
// The pages themselves are in view-queues.js, view-task.js and view-actions.js; this file holds
// what they share (DOM helpers, messages, the API, dialogs, routing) and starts the page.
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

  // The current view's refreshes: all stopped on the next route, or by the view once nothing
  // it shows can change any more.
  function stopRefreshing() {
    timers.forEach(clearInterval);
    timers = [];
  }

  function refreshing() {
    return timers.length > 0;
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
    stopRefreshing();
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
      section = 'queues'; views.queuesView(ctx);
    } else if (parts[0] === 'queues' && parts.length === 3 && parts[2] === 'tasks') {
      section = 'queues'; views.tasksView(ctx, parts[1]);
    } else if (parts[0] === 'queues' && parts.length === 3 && parts[2] === 'dlq') {
      section = 'queues'; views.dlqView(ctx, parts[1]);
    } else if (parts[0] === 'tasks' && parts.length === 2) {
      views.taskView(ctx, parts[1]);
    } else if (parts[0] === 'enqueue' && parts.length === 1) {
      section = 'enqueue'; views.enqueueView(ctx);
    } else if (parts[0] === 'audit' && parts.length === 1) {
      section = 'audit'; views.auditView(ctx);
    } else if (parts[0] === 'operations' && parts.length === 1) {
      section = 'operations'; views.operationsView(ctx);
    } else if (parts[0] === 'schedules' && parts.length === 1) {
      section = 'schedules'; views.schedulesView(ctx);
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

  // -- the views ------------------------------------------------------------------------
  // Each view-*.js (loaded before this file) adds a function that takes these helpers and returns
  // its views; route() calls them from here.
  const views = {};
  const ui = {
    STATUSES, QUEUES_REFRESH_MS, TASK_REFRESH_MS, PAGE_SIZE, el, setChildren, seg, qs, hashLink,
    field, table, labelCells, clip, timeNode, age, duration, json, statusBadge, ApiError, describe,
    showError, clearError, say, api, confirmDialog, confirmedBulk, every, stopRefreshing,
    refreshing, heading, pagedList, filterForm, chartsModule
  };
  for (const makeViews of window.RdqConsoleViews || []) Object.assign(views, makeViews(ui));

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

// The console's pages for acting and for what was done: enqueue a task, bulk operations,
// schedules, and the audit log of operator actions.
// Plain JavaScript, no build step: app.js (loaded after this file) calls the function below with
// its helpers and routes to the views it returns.
'use strict';

window.RdqConsoleViews = window.RdqConsoleViews || [];
window.RdqConsoleViews.push(function actionPages(ui) {
  const {
    QUEUES_REFRESH_MS, PAGE_SIZE, el, setChildren, seg, qs, field, table, labelCells, clip,
    timeNode, ApiError, showError, clearError, say, api, every, heading, pagedList, filterForm
  } = ui;

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

  return { enqueueView, auditView, operationsView, schedulesView };
});

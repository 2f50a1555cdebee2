// The console's queue pages: every queue (counts, pause and resume, the overview chart), a
// queue's tasks, and its dead-letter queue (redrive and purge).
// Plain JavaScript, no build step: app.js (loaded after this file) calls the function below with
// its helpers and routes to the views it returns.
'use strict';

window.RdqConsoleViews = window.RdqConsoleViews || [];
window.RdqConsoleViews.push(function queuePages(ui) {
  const {
    STATUSES, QUEUES_REFRESH_MS, PAGE_SIZE, el, setChildren, seg, qs, hashLink, table, labelCells,
    clip, timeNode, age, statusBadge, describe, showError, clearError, say, api, confirmedBulk,
    every, heading, pagedList, filterForm, chartsModule
  } = ui;

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

  return { queuesView, tasksView, dlqView };
});

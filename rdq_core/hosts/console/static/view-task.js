// The console's task page: one task, its attempts, its result or error, and what can be
// done to it.
// Plain JavaScript, no build step: app.js (loaded after this file) calls the function below with
// its helpers and routes to the views it returns.
'use strict';

window.RdqConsoleViews = window.RdqConsoleViews || [];
window.RdqConsoleViews.push(function taskPage(ui) {
  const {
    TASK_REFRESH_MS, el, setChildren, seg, timeNode, duration, json, statusBadge, describe,
    showError, say, api, confirmDialog, confirmedBulk, every, stopRefreshing, refreshing, heading
  } = ui;

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
      // The attempt running now: what the store knows of it (the claim's time, the lease, and the
      // worker that holds it, as that worker named itself; a worker of an older version names none).
      const workerNode = task.claimed_by
        ? el('code', { class: 'worker' }, task.claimed_by)
        : el('span', { class: 'muted' }, 'not recorded');
      const runningNow = running ? el('section', { class: 'running', 'aria-labelledby': 'running-title' },
        el('h2', { id: 'running-title' }, `Running now: attempt ${attempts.length + 1}`),
        el('dl', { class: 'inline' },
          el('dt', {}, 'Started'), el('dd', {}, timeNode(task.claimed_at)),
          el('dt', {}, 'Lease expires'), el('dd', {}, timeNode(task.lease_expires_at)),
          el('dt', {}, 'Worker'), el('dd', { class: 'claimed-by' }, workerNode)),
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
      if (!refreshing()) every(TASK_REFRESH_MS, load);
    }

    async function load() {
      try {
        const task = await api('GET', `v1/tasks/${seg(id)}`);
        if (!ctx.alive()) return;
        const key = `${task.status}|${task.updated_at}|${(task.attempts || []).length}|${task.lease_expires_at}`;
        if (key !== shown) { shown = key; render(task); }
        if (!['PENDING', 'IN_FLIGHT'].includes(task.status)) {
          stopRefreshing();
        }
      } catch (error) {
        if (ctx.alive()) { showError(error); stopRefreshing(); }
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

  return { taskView };
});
